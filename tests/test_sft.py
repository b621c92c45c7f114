"""Supervised fine-tuning on conversations (`jaxformer.data.sft`, data.task='chat'), held-out targets of a
pretrained tokenizer's data, and the fine-tuning recipe end to end (slow): import -> eval-tasks -> LoRA SFT ->
eval-tasks -> export (merged, and as a PEFT adapter) -> transformers' logits.

Wrong implementations these catch: the chat's special tokens encoded as their characters (transformers reads
them as ids); the loss on the user's tokens, or on the assistant's content without its end-of-turn; a target
across two packed conversations; padding or cross-document targets written as token 0, a real token of a
pretrained tokenizer (its pad id is -1); PEFT's lora_A/lora_B transposed.
"""
from __future__ import annotations

import json
import random

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import chat_folder, tiny_lm
from jaxformer.config import ConfigError
from jaxformer.configio import apply_overrides
from jaxformer.data import build_task
from jaxformer.data.chat import read_chat_template
from jaxformer.data.sft import encode_conversation, pack
from jaxformer.data.tokenizers import pretrained_tokenizer
from jaxformer.errors import DataError

CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Colour of the sky?"},
        {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "And grass?"},
        {"role": "assistant", "content": "Green, mostly."}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat") / "base"
    chat_folder(d)
    return d


def chat_cfg(folder, path, *extra):
    return tiny_lm("data.task=chat", f"data.path={path}", f"data.tokenizer={folder}", "data.block_size=48",
                   "model.vocab_size=0", "model.pad_id=-1", "model.positional=rope", "data.batch_size=2",
                   "train.eval_batch_size=4", *extra)


def write_chats(path, convs):
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs), encoding="utf-8")
    return path


def test_a_conversation_is_tokenized_as_transformers_tokenizes_its_chat(folder):
    import transformers
    tok, template = pretrained_tokenizer(folder), read_chat_template(folder)
    ids, mask = encode_conversation(template, tok, CONV)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                                  chat_template=template.template)
    want = theirs.apply_chat_template(CONV, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert ids.tolist() == list(want)
    im_start = tok.tok.token_to_id("<|im_start|>")
    assert (ids == im_start).sum() == 5                       # one special id per turn, not its characters
    with tok.reading_special_tokens():
        pieces = "".join(tok.tok.decode([int(i)], skip_special_tokens=False) for i in ids[mask])
    assert pieces == "Blue.<|im_end|>\nGreen, mostly.<|im_end|>\n"     # the assistant's turns and their ends


def test_packing_keeps_conversations_apart_and_trains_on_assistant_tokens():
    a = (np.arange(10, 16), np.asarray([0, 0, 0, 1, 1, 1], bool))
    b = (np.arange(20, 24), np.asarray([0, 1, 1, 0], bool))
    c = (np.arange(30, 40), np.asarray([0] * 5 + [1] * 5, bool))
    rows = pack([a, b, c], block=8, ignore=-1)
    np.testing.assert_array_equal(rows["segment_ids"], [[1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(rows["positions"], [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]])
    np.testing.assert_array_equal(rows["inputs"][0], [10, 11, 12, 13, 14, 20, 21, 22])
    np.testing.assert_array_equal(rows["targets"][0], [-1, -1, 13, 14, 15, 21, 22, -1])    # never 15 -> 20
    np.testing.assert_array_equal(rows["targets"][1], [-1, -1, -1, -1, 35, 36, 37, 38])    # cut to 9 tokens


def test_the_chat_task_masks_everything_but_the_assistant(folder, tmp_path):
    convs = [CONV, CONV[1:3], CONV[3:], CONV]
    cfg = chat_cfg(folder, write_chats(tmp_path / "c.jsonl", convs), "data.eval_fraction=0.25",
                   "data.block_size=96")
    task = build_task(cfg.data)
    tok = task.tokenizer
    assert task.kind == "lm" and tok.pad_id == -1
    t = task.train["targets"]
    kept = t[t >= 0]
    with tok.reading_special_tokens():
        text = tok.tok.decode([int(i) for i in kept], skip_special_tokens=False)
    assert text == "Blue.<|im_end|>\nGreen, mostly.<|im_end|>\n" * 2
    np.testing.assert_array_equal(task.train["segment_ids"].max(1), [1, 2])     # in order: CONV; then two
    assert (task.eval["targets"] >= 0).sum() == len(encode_conversation(read_chat_template(folder), tok,
                                                                       CONV)[1].nonzero()[0])


def test_bad_chat_data_are_named_errors(folder, tmp_path):
    bad = tmp_path / "bad.jsonl"
    for text, match in (('{"messages": [{"role": "user"}]}\n', "bad.jsonl:1: \"messages\" must be"),
                        ('not json\n', "bad.jsonl:1: not a JSON line"), ('[1]\n', "bad.jsonl:1: not a JSON object"),
                        (b'{"messages": "\xe9"}\n', "bad.jsonl:1: not UTF-8"),
                        ('{"text": "x"}\n', "bad.jsonl:1: \"messages\" must be a non-empty list")):
        bad.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(DataError, match=match):
            build_task(chat_cfg(folder, bad).data)
    one = write_chats(tmp_path / "one.jsonl", [CONV])
    with pytest.raises(DataError, match="at least two"):
        build_task(chat_cfg(folder, one).data)
    users = write_chats(tmp_path / "users.jsonl", [CONV[:2], CONV[:2]])
    with pytest.raises(DataError, match="no assistant token"):
        build_task(chat_cfg(folder, users).data)
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("tokenizer.json", "config.json"):
        (bare / f).write_bytes((folder / f).read_bytes())
    with pytest.raises(DataError, match="no chat template"):
        build_task(chat_cfg(bare, write_chats(tmp_path / "ok.jsonl", [CONV, CONV])).data)
    with pytest.raises(ConfigError, match="data.tokenizer"):
        apply_overrides(tiny_lm(), ["data.task=chat", f"data.path={one}"])


def test_held_out_padding_of_a_pretrained_tokenizer_is_never_a_target(folder, tmp_path):
    """Before: the last held-out window's padding and cross-document targets were token 0, which a pretrained
    tokenizer's pad id (-1) does not ignore: the held-out loss counted predictions of token 0 there."""
    from jaxformer.data.prepare import prepare
    docs = tmp_path / "d.jsonl"
    docs.write_text("".join(json.dumps({"text": "Alice was beginning to get very tired " * (i % 3 + 1)}) + "\n"
                            for i in range(40)))
    prepare([docs], tmp_path / "shards", tokenizer=str(folder), eval_fraction=0.2, progress=False)
    for packing in ("windows", "documents"):
        cfg = tiny_lm("data.task=tokens", f"data.path={tmp_path / 'shards'}", "data.block_size=50",
                      "model.vocab_size=0", "model.pad_id=-1", f"data.packing={packing}")
        task = build_task(cfg.data)
        rows = next(iter(task.eval_batches(10_000)))
        pad = rows["segment_ids"] == 0
        assert pad.any() and (rows["targets"][pad] == -1).all()
        assert not (rows["targets"] == 0).any() or packing == "windows"
        batch = next(iter(task.train_dataset(4, 0)))
        if packing == "documents":
            crossing = np.diff(batch["segment_ids"], axis=1) != 0
            assert (batch["targets"][:, :-1][crossing] == -1).all()


COLOURS = ["blue", "green", "white", "black", "red", "yellow"]
THINGS = ["sky", "grass", "snow", "coal", "blood", "sun"]


@pytest.mark.slow          # the fine-tuning recipe end to end through the CLI (~60 s)
def test_the_recipe_imports_evaluates_fine_tunes_with_lora_and_exports(tmp_path, capsys):
    import torch
    import transformers
    from safetensors.numpy import load_file
    from jaxformer.cli import main as cli
    from jaxformer.inference import load_model
    from helpers import records
    src, run, sft = tmp_path / "base", tmp_path / "run", tmp_path / "sft"
    base = chat_folder(src)
    rng = random.Random(0)
    facts = dict(zip(THINGS, rng.sample(COLOURS, len(COLOURS))))          # six facts, one colour each
    convs = [[{"role": "user", "content": f"What colour is the {t}?"}, {"role": "assistant", "content": facts[t]}]
             for _ in range(40) for t in THINGS]
    rng.shuffle(convs)
    chats = write_chats(tmp_path / "chat.jsonl", convs)
    task = tmp_path / "colours.jsonl"
    task.write_text("".join(json.dumps({"context": f"What colour is the {t}?", "choices": COLOURS,
                                        "answer": COLOURS.index(facts[t])}) + "\n" for t in THINGS))
    assert cli(["import-hf", str(src), "--workdir", str(run), "--set", "data.block_size=32"]) == 0
    evaluate = ["--tasks", str(task), "--chat-template", str(src)]
    assert cli(["eval-tasks", "--workdir", str(run), *evaluate]) == 0
    before = json.loads((run / "eval_tasks" / "colours.json").read_text())["metrics"]["acc"]["value"]
    sets = ["data.task=chat", f"data.path={chats}", f"data.tokenizer={src}", "data.block_size=64",
            "data.eval_fraction=0.05", "model.lora.rank=8", "model.lora.targets=q,k,v,o,gate,up,down",
            "optim.lr=5e-3", "train.steps=400", "train.eval_every=100", "train.checkpoint_every=200",
            f"train.init_from={run}"]
    argv = ["train", str(run / "config.json"), "--workdir", str(sft), "--no-progress"]
    argv += [a for s in sets for a in ("--set", s)]
    assert cli(argv + ["--set", "train.steps=200"]) == 0                       # stopped at 200 ...
    assert cli(argv) == 0                                                       # ... resumed to 400
    evals = [r for r in records(sft) if r["split"] == "eval"]
    assert [r["step"] for r in evals][-1] == 400 and evals[-1]["loss"] < evals[0]["loss"]
    assert cli(["eval-tasks", "--workdir", str(sft), "--which", "latest", *evaluate]) == 0
    after = json.loads((sft / "eval_tasks" / "colours.json").read_text())["metrics"]["acc"]["value"]
    assert before <= 0.25 and after >= 0.5, (before, after)
    assert cli(["export-hf", "--workdir", str(sft), "--which", "latest", "--out", str(tmp_path / "merged")]) == 0
    assert cli(["export-hf", "--workdir", str(sft), "--which", "latest", "--out", str(tmp_path / "adapter"),
                "--adapter"]) == 0
    ids = np.random.default_rng(6).integers(0, 300, (2, 10))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    with torch.no_grad():
        merged_logits = back(torch.as_tensor(ids)).logits.numpy()
    ours = np.asarray(load_model(sft, "latest").model(jnp.asarray(ids))[0])
    assert np.abs(merged_logits - ours).max() / np.abs(ours).max() < 2e-5
    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    sd = {k: v.clone() for k, v in base.state_dict().items()}
    for k, a in adapter.items():                           # PEFT's rule: W += (alpha / r) · B·A
        if k.endswith("lora_A.weight"):
            b = adapter[k.replace("lora_A", "lora_B")]
            sd[k[len("base_model.model."):-len(".lora_A.weight")] + ".weight"] += torch.as_tensor(
                cfg["lora_alpha"] / cfg["r"] * (b @ a))
    base.load_state_dict(sd)
    with torch.no_grad():
        by_hand = base(torch.as_tensor(ids)).logits.numpy()
    assert np.abs(by_hand - merged_logits).max() / np.abs(ours).max() < 2e-5
    print(json.dumps({"acc_before": before, "acc_after": after}))
