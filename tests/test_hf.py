"""Hugging Face checkpoints in and out (`jaxformer.hf`), against transformers itself: every family's model is
built here from a config with random weights and `save_pretrained` (nothing is downloaded). Logits equal
transformers' on batches with token id 0 and ragged (left-padded) prompts; export loads back in transformers
with equal logits; bad checkpoints are named errors."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import edited_config  # noqa: E402
from jaxformer.hf import HFError, from_pretrained, save_pretrained, to_model_config  # noqa: E402

V = 97
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def hf_config(family: str, **kw):
    """A tiny config of each family exercising what sets it apart (GQA everywhere but GPT-2)."""
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4, **kw)
    extra = {"llama": dict(rope_parameters=LLAMA3, attention_bias=False),
             "llama_linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
                                  mlp_bias=True, attention_bias=True, tie_word_embeddings=True),
             "qwen2": dict(), "qwen3": dict(head_dim=16), "mistral": dict(sliding_window=5),
             "gemma": dict(head_dim=16)}[family]
    cls = {"llama": transformers.LlamaConfig, "llama_linear": transformers.LlamaConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "mistral": transformers.MistralConfig, "gemma": transformers.GemmaConfig}[family]
    return cls(**{**COMMON, **extra, **kw})


FAMILIES = ["llama", "llama_linear", "qwen2", "qwen3", "mistral", "gpt2", "gemma"]


def hf_model(family: str, seed: int = 0, **kw):
    """transformers' model of `family` with random weights of std 0.2 (larger than its init: logits that differ
    between plausible wrong conversions) in float32, eager attention."""
    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(hf_config(family, **kw), attn_implementation="eager")
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    return m.eval().float()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (transformers model, its save_pretrained folder)."""
    out = {}
    for family in FAMILIES:
        m = hf_model(family)
        d = tmp_path_factory.mktemp(family)
        m.save_pretrained(d)
        out[family] = (m, d)
    return out


def ragged_batch(rng, lengths, total):
    """Left-padded prompts: ids [B,total] (random, token 0 included; padding written as 0 too), the attention
    mask [B,total] and positions restarting at each prompt's first token."""
    ids = rng.integers(0, V, (len(lengths), total))
    ids[:, -2] = 0                                               # token id 0 is a real token
    mask = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, total - n:] = 1
    ids = np.where(mask == 1, ids, 0)
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    return ids, mask, positions


def hf_logits(m, ids, mask=None, positions=None):
    with torch.no_grad():
        kw = {} if mask is None else dict(attention_mask=torch.tensor(mask), position_ids=torch.tensor(positions))
        return m(torch.tensor(ids), **kw).logits.numpy()


def rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


TOL = 2e-5         # float32: relative to the largest logit (observed ~3e-7; a wrong conversion gives ~1e-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_imported_logits_equal_transformers_on_ragged_batches(saved, family):
    m, d = saved[family]
    ours = from_pretrained(d)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, V, (2, 12))
    ids[0, 3] = 0
    assert rel(ours(jnp.asarray(ids))[0], hf_logits(m, ids)) < TOL
    ids, mask, pos = ragged_batch(rng, [12, 7, 3], 12)
    got = np.asarray(ours(jnp.asarray(ids), segment_ids=jnp.asarray(mask), positions=jnp.asarray(pos))[0])
    ref = hf_logits(m, ids, mask, pos)
    valid = mask.astype(bool)
    assert rel(got[valid], ref[valid]) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_checkpoint_loads_in_transformers_with_equal_logits(saved, family, tmp_path):
    m, d = saved[family]
    ours = from_pretrained(d)
    written = save_pretrained(ours, tmp_path / "out", max_shard_bytes=20_000)      # several files + index
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1 and (tmp_path / "out" / "model.safetensors."
                                                                          "index.json").is_file()
    assert written["model_type"] == m.config.model_type
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    ids = np.random.default_rng(2).integers(0, V, (2, 10))
    assert rel(hf_logits(back, ids), hf_logits(m, ids)) < TOL
    again = from_pretrained(tmp_path / "out")                                  # and back in: the same model
    assert rel(again(jnp.asarray(ids))[0], ours(jnp.asarray(ids))[0]) == 0.0


def test_a_bfloat16_checkpoint_loads(tmp_path):
    m = hf_model("qwen3").to(torch.bfloat16)
    m.save_pretrained(tmp_path / "bf16")
    ours = from_pretrained(tmp_path / "bf16")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    ids = np.random.default_rng(3).integers(0, V, (2, 9))
    assert rel(ours(jnp.asarray(ids))[0], hf_logits(ref, ids)) < TOL            # the bf16 weights, computed in f32
    assert from_pretrained(tmp_path / "bf16", dtype="bfloat16").cfg.runtime.dtype == "bfloat16"


def test_the_families_differ_where_the_mapping_says(saved):
    """The switches each family sets, so a test of one family cannot pass with another's conversion."""
    cfgs = {f: to_model_config(json.loads((d / "config.json").read_text())) for f, (_, d) in saved.items()}
    assert cfgs["qwen2"].biases == ("q", "k", "v") and cfgs["llama"].biases == ()
    assert cfgs["llama_linear"].biases == ("q", "k", "v", "o", "ffn") and cfgs["llama_linear"].tie_embeddings
    assert cfgs["qwen3"].attention.qk_norm and cfgs["qwen3"].head_dim == 16 and cfgs["gemma"].head_dim == 16
    assert cfgs["mistral"].attention.windows == (5,) and cfgs["llama"].rope.scaling == "llama3"
    assert (cfgs["gemma"].activation, cfgs["gemma"].scale_embeddings, cfgs["gemma"].tie_embeddings) == \
        ("geglu_tanh", True, True)
    assert (cfgs["gpt2"].positional, cfgs["gpt2"].activation, cfgs["gpt2"].norm.type) == \
        ("learned", "gelu_tanh", "layernorm")
    assert all(c.pad_id == -1 for c in cfgs.values())                # no token id is padding


def test_bad_checkpoints_are_named_errors(saved, tmp_path):
    from safetensors.numpy import load_file, save_file
    _, d = saved["llama"]
    tensors = load_file(str(d / "model.safetensors"))
    missing = tmp_path / "missing"
    edited_config(d, missing)
    save_file({k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}, str(missing / "model.safetensors"))
    corrupt = edited_config(d, tmp_path / "corrupt")
    raw = (d / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(raw[:len(raw) // 2])
    garbage = edited_config(d, tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    cases = [
        (missing, "missing tensor.*model.layers.1.mlp.up_proj.weight"),
        (edited_config(d, tmp_path / "shape", intermediate_size=40), "has shape .* the config implies"),
        (edited_config(d, tmp_path / "yarn", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                            "ramp": "cosine"}), r"rope parameters \['ramp'\]"),
        (edited_config(d, tmp_path / "longrope", rope_parameters={"rope_type": "longrope", "factor": 2.0}),
         "rope type 'longrope'"),
        (edited_config(d, tmp_path / "key", some_new_switch=3), r"some_new_switch \(unknown key\)"),
        (edited_config(d, tmp_path / "act", hidden_act="relu"), "hidden_act='relu'"),
        (edited_config(d, tmp_path / "type", model_type="falcon"), "unsupported model_type 'falcon'"),
        (corrupt, "not a readable safetensors file|is unreadable"),
        (garbage, "not a readable safetensors file"),
        (tmp_path / "nowhere", "has no config.json"),
    ]
    for path, message in cases:
        with pytest.raises(HFError, match=message):
            from_pretrained(path)
    extra = edited_config(d, tmp_path / "extra")
    save_file({**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(4, np.float32)},
              str(extra / "model.safetensors"))
    with pytest.raises(HFError, match="unexpected tensor.*rotary_emb.inv_freq"):
        from_pretrained(extra)


def test_the_mapping_must_write_every_parameter_exactly_once(saved, monkeypatch):
    from jaxformer.hf import checkpoint, mapping
    _, d = saved["qwen2"]
    real = mapping.tensors

    def doubled(cfg, family):                 # layer 1's q bias written from layer 0's tensor as well
        out = real(cfg, family)
        t = next(t for t in out if t.name == "model.layers.0.self_attn.q_proj.bias")
        return out + [mapping.Tensor(t.name.replace(".0.", ".1."), t.shape, t.ours, 1, t.load, t.save)]

    def dropped(cfg, family):
        return [t for t in real(cfg, family) if t.name != "model.layers.1.self_attn.k_proj.bias"]

    monkeypatch.setattr(checkpoint, "tensors", doubled)
    with pytest.raises(HFError, match="written twice|unexpected"):
        from_pretrained(d)
    monkeypatch.setattr(checkpoint, "tensors", dropped)
    with pytest.raises(HFError, match="bk is not written exactly once|unexpected tensor"):
        from_pretrained(d)


def test_models_no_family_expresses_are_refused_on_export(tmp_path):
    from helpers import tiny_lm
    from jaxformer.nn import build_model
    for extra, message in ((("model.norm.position=post",), "norm.position='post'"),
                           (("model.norm.position=pre", "model.positional=alibi"), "positional=.alibi.")):
        cfg = tiny_lm(*extra)
        with pytest.raises(HFError, match=message):
            save_pretrained(build_model(cfg.model), tmp_path / "x")
        assert not (tmp_path / "x" / "config.json").exists()


@pytest.mark.slow          # five families' generate (~18 s)
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gpt2", "gemma"])
def test_greedy_cached_generation_equals_transformers_generate(saved, family):
    """Ragged (left-padded) prompts: our prefill + cached steps give transformers' greedy tokens."""
    from jaxformer.decode import generate_lm
    m, d = saved[family]
    ours = from_pretrained(d)
    ids, mask, _ = ragged_batch(np.random.default_rng(4), [9, 5], 9)
    with torch.no_grad():
        ref = m.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=8, do_sample=False,
                         pad_token_id=0, eos_token_id=None).numpy()[:, 9:]
    got = np.asarray(generate_lm(ours, jnp.asarray(ids), segment_ids=jnp.asarray(mask), max_new=8))
    np.testing.assert_array_equal(got, ref)


@pytest.mark.slow          # a process with 8 fake devices (~15 s)
def test_a_multi_file_checkpoint_loads_onto_8_devices_each_holding_its_share(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    m = hf_model("llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                 num_key_value_heads=8, vocab_size=256)
    m.save_pretrained(tmp_path / "ckpt", max_shard_size="40KB")
    files = sorted((tmp_path / "ckpt").glob("*.safetensors"))
    assert len(files) > 3
    ids = np.random.default_rng(5).integers(0, 256, (2, 8))
    (tmp_path / "ckpt" / "batch.json").write_text(json.dumps(ids.tolist()))
    worker = Path(__file__).with_name("hf_worker.py")
    subprocess.run([sys.executable, str(worker), str(tmp_path / "ckpt"), str(tmp_path / "out.json")], check=True,
                   timeout=300)
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["devices"] == 8
    assert rel(out["logits"], hf_logits(m, ids)) < TOL
    per_device = np.zeros(8)
    for name, p in out["params"].items():
        shards = p["shards"]
        assert len(shards) == 8
        for dev, _, nbytes in shards:
            per_device[dev] += nbytes
        if "fsdp" in p["spec"]:                      # split 8 ways: each device an eighth, no copy of the whole
            assert all(nbytes * 8 == p["bytes"] for _, _, nbytes in shards), name
    total = sum(p["bytes"] for p in out["params"].values())
    sharded = sum(p["bytes"] for p in out["params"].values() if "fsdp" in p["spec"])
    assert sharded > 0.9 * total                                  # the matrices and the embedding are split
    assert per_device.max() < total / 8 + (total - sharded) + 1


def _tokenizer_for(folder, vocab: int = 300):
    """A byte-level BPE tokenizer.json trained on the built-in corpus, with <s> (BOS, added to every encoded
    prompt like Llama's) and </s> (EOS); returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from jaxformer.data.text import corpus_path
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([corpus_path("builtin:alice").read_text(encoding="utf-8")],
                            trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    return tok.get_vocab_size()


@pytest.mark.slow          # the recipe: import, fine-tune, evaluate, generate, export (~40 s)
def test_the_recipe_imports_fine_tunes_evaluates_generates_and_exports(tmp_path, capsys):
    """The README's worked example end to end through the CLI, on a Llama built and saved here."""
    from jaxformer.cli import main as cli_main
    from jaxformer.inference import generate_text, load_model
    src = tmp_path / "llama"
    src.mkdir()
    vocab = _tokenizer_for(src)
    m = hf_model("llama", vocab_size=vocab, bos_token_id=1, eos_token_id=2, max_position_embeddings=128)
    m.save_pretrained(src)
    run = tmp_path / "run"
    assert cli_main(["import-hf", str(src), "--workdir", str(run), "--set", "optim.lr=3e-3",
                     "--set", "train.steps=8", "--set", "train.eval_every=8", "--set", "data.block_size=32"]) == 0
    before = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert before["step"] == 0 and before["split"] == "eval" and before["bits_per_byte"] > 0
    loaded = load_model(run, "latest")
    ids = np.random.default_rng(6).integers(0, vocab, (2, 10))
    assert rel(loaded.model(jnp.asarray(ids))[0], hf_logits(m, ids)) < TOL          # the imported weights, unchanged
    assert loaded.tokenizer.bos_id == 1 and loaded.tokenizer.eod_id == 2 and loaded.tokenizer.pad_id == -1
    out = generate_text(loaded, ["Alice was", "The"], max_new=5)
    assert all(isinstance(o, str) for o in out)

    assert cli_main(["train", str(run / "config.json"), "--workdir", str(run), "--set", "train.steps=8",
                     "--no-progress"]) == 0                                        # fine-tunes in place
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    after = [r for r in recs if r["split"] == "eval" and r["step"] == 8][0]
    assert after["bits_per_byte"] < before["bits_per_byte"]
    assert cli_main(["generate", "--workdir", str(run), "--prompt", "Alice", "--max-new", "4"]) == 0
    assert cli_main(["viz", "--workdir", str(run), "--prompt", "Alice was", "--out", str(tmp_path / "viz")]) == 0
    assert sorted(p.name for p in (tmp_path / "viz").iterdir()) == [".jaxformer-viz", "prompt0-self-layer0.png",
                                                                    "prompt0-self-layer1.png"]
    assert cli_main(["viz", "--workdir", str(run), "--plot", "patching", "--prompt", "Alice was", "--corrupt",
                     "Alice saw", "--out", str(tmp_path / "viz-p")]) == 0               # the instruments, imported
    assert cli_main(["sae", "--workdir", str(run), "--layer", "1", "--steps", "20", "--k", "8",
                     "--out", str(tmp_path / "sae")]) == 0
    assert json.loads((tmp_path / "sae" / "report.json").read_text())["fve"] > 0

    assert cli_main(["export-hf", "--workdir", str(run), "--out", str(tmp_path / "out")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    tuned = load_model(run, "latest").model
    assert rel(hf_logits(back, ids), tuned(jnp.asarray(ids))[0]) < TOL
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert rel(tuned(jnp.asarray(ids))[0], hf_logits(m, ids)) > 1e-3                 # and it did change
    capsys.readouterr()

    fresh = tmp_path / "fresh"                                                    # another run starts from it
    assert cli_main(["train", str(run / "config.json"), "--workdir", str(fresh), "--set",
                     f"train.init_from={tmp_path / 'out'}", "--set", "optim.lr=1e-4", "--set", "train.steps=1",
                     "--no-progress"]) == 0
    assert cli_main(["import-hf", str(src), "--workdir", str(run)]) == 2          # never over a run
    assert "already holds a run" in capsys.readouterr().out


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A small Llama checkpoint folder with a tokenizer (BOS <s>, EOS </s>), as a published one is."""
    src = tmp_path_factory.mktemp("llama_tok")
    vocab = _tokenizer_for(src)
    hf_model("llama", vocab_size=vocab, bos_token_id=1, eos_token_id=2, max_position_embeddings=128).save_pretrained(src)
    return src


def test_a_checkpoint_holding_nan_is_refused_naming_the_tensor(llama_folder, tmp_path, capsys):
    """Before: import-hf of a checkpoint with a NaN tensor exited 0 ("held-out loss nan") and saved it."""
    import shutil

    from safetensors.numpy import load_file, save_file
    from jaxformer.cli import main as cli_main
    src = tmp_path / "nan"
    shutil.copytree(llama_folder, src)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = np.nan
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFError, match=r"'model.layers.1.mlp.down_proj.weight' .* 1 non-finite value.*\(3, 5\)"):
        from_pretrained(src)
    assert cli_main(["import-hf", str(src), "--workdir", str(tmp_path / "run")]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "non-finite" in out and "down_proj" in out and "Traceback" not in out
    assert not (tmp_path / "run" / "checkpoints" / "latest" / "0").exists()


def test_a_refused_or_interrupted_import_leaves_its_workdir_free(llama_folder, tmp_path, capsys, monkeypatch):
    """Before: after a refusal (another model shape through --set) or a SIGINT in its first seconds, the same
    import said "already holds a run"; SIGINT once ended in a segfault (rc 139), once was swallowed (rc 0)."""
    import importlib
    import os
    import signal

    from jaxformer.cli import main as cli_main
    ev = importlib.import_module("jaxformer.inference.evaluate")
    run = tmp_path / "run"
    argv = ["import-hf", str(llama_folder), "--workdir", str(run), "--set", "data.block_size=32"]
    assert cli_main(argv + ["--set", "model.d_ff=64"]) == 2                         # another model: refused
    assert "holds another model" in " ".join(capsys.readouterr().out.split())
    real = ev.evaluate

    def interrupted(*a, **kw):                                                     # Ctrl-C while it evaluates
        os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **kw)
    monkeypatch.setattr(ev, "evaluate", interrupted)
    assert cli_main(argv) == 130
    out = " ".join(capsys.readouterr().out.split())
    assert "interrupted: import-hf stopped on SIGINT: nothing was saved" in out and "Traceback" not in out
    assert not (run / "checkpoints" / "latest" / "0").exists()
    monkeypatch.setattr(ev, "evaluate", real)
    assert cli_main(argv) == 0                                                     # the same command, again
    assert (run / "checkpoints" / "latest" / "0").is_dir()
    assert cli_main(argv) == 2 and "already holds a run" in capsys.readouterr().out   # never over a run


@pytest.mark.slow          # a CLI process interrupted at two points (~20 s)
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_to_an_importing_process_exits_128_plus_signum_and_frees_the_workdir(llama_folder, tmp_path,
                                                                                    signame):
    """A real signal, sent once the import holds its workdir: exit 128 + its number (130, 143) naming it (not a segfault, not rc 0),
    no checkpoint, and the same command then imports."""
    import signal
    import subprocess
    import sys
    import time
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "jaxformer", "import-hf", str(llama_folder), "--workdir", str(run), "--set",
           "data.block_size=32"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.monotonic()
    while not (run / ".lock").exists() and proc.poll() is None and time.monotonic() - t0 < 120:
        time.sleep(0.05)
    proc.send_signal(getattr(signal, signame))
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 128 + getattr(signal, signame).value, out
    assert f"import-hf stopped on {signame}" in " ".join(out.split()) and "Traceback" not in out
    assert not (run / "checkpoints" / "latest" / "0").exists()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
