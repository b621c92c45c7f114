"""Small configs and run-directory readers shared by the training, run-directory and CLI tests."""
from __future__ import annotations

import json
from pathlib import Path

from jaxformer.configio import apply_overrides, load_config_file

# Python's cyclic garbage collector, run less often in the suite's processes (tests/conftest.py and the device
# workers set it): a worker holds ~1M objects after a few files (JAX's caches of traced and compiled programs, the
# models), and the default thresholds (700, 10, 10) spent 10% of a test file's time in thousands of collections, a
# full one taking up to 1.5 s (test_decode.py + test_sites.py + test_patching.py in one process: 5.2 s of 49 s in
# 3,700 collections; with these, 0.7 s in 29; peak memory within 3%).
GC_THRESHOLDS = (50_000, 20, 100)

ROOT = Path(__file__).resolve().parents[1]

# The reversal config shrunk to a 1+1-layer D=32 model on 128 strings: a step costs milliseconds.
TINY_REVERSE = ["model.d_model=32", "model.d_ff=64", "model.num_heads=2", "model.num_encoder_layers=1",
                "model.num_decoder_layers=1", "data.num_train=128", "data.num_eval=32", "data.batch_size=16",
                "train.eval_batch_size=32", "train.num_examples=2"]
# The Alice char-LM config (vocab from the data, the built-in corpus) shrunk likewise; no decoding in its eval.
TINY_LM = ["model.d_model=16", "model.d_ff=32", "model.num_heads=2", "model.num_decoder_layers=1",
           "data.num_chars=2000", "data.batch_size=8", "train.eval_batch_size=64", "train.num_examples=2"]


def tiny_reverse(*extra: str):
    return apply_overrides(load_config_file(ROOT / "configs/reverse.py"), TINY_REVERSE + list(extra))


def tiny_lm(*extra: str):
    return apply_overrides(load_config_file(ROOT / "configs/alice.py"), TINY_LM + list(extra))


def cli_args(config: str, overrides: list[str]) -> list[str]:
    """[config, --set k=v, ...] for `jaxformer train`."""
    return [str(ROOT / config)] + [a for o in overrides for a in ("--set", o)]


def records(workdir, timing: bool = True) -> list[dict]:
    """metrics.jsonl's records; timing=False drops the wall-clock fields (tokens_per_s, mfu)."""
    p = Path(workdir) / "metrics.jsonl"
    rows = [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []
    return rows if timing else [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu")} for r in rows]


def train_losses(workdir) -> dict[int, float]:
    """{step: loss} of the train records; asserts there is at most one record per step."""
    rows = [r for r in records(workdir) if r["split"] == "train"]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"duplicate train steps in metrics.jsonl: {steps}"
    return {r["step"]: r["loss"] for r in rows}


def checkpoint_steps(workdir, kind: str = "latest") -> list[int]:
    d = Path(workdir) / "checkpoints" / kind
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def compiled(model, *args, key=None, **kw):
    """model(*args, **kw) run as one compiled program (eager dispatch of a model's many small ops costs far more
    than compiling them once). key: a dropout key, for a training-mode pass (rngs=nnx.Rngs(dropout=key))."""
    import jax
    from flax import nnx
    graphdef, state = nnx.split(model)

    def f(state, args, key):
        m = nnx.merge(graphdef, state)
        return m(*args, **kw) if key is None else m(*args, rngs=nnx.Rngs(dropout=key), **kw)
    return jax.jit(f)(state, args, key)


def cached_and_full(model, x, prefill: int):
    """x [B,T] (no pad id: every token real): the logits of a `prefill`-token cached prefill followed by one-token
    cached steps, the full forward's logits, and the final cache; one compiled program."""
    import jax.numpy as jnp
    from flax import nnx

    @nnx.jit
    def run(model, x):
        b, t = x.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), x.shape)
        first, out = model(x[:, :prefill], pos[:, :prefill], cache=model.init_cache(b, t), mode="prefill")
        rest, cache = [], out["cache"]
        for i in range(prefill, t):
            lg, out = model(x[:, i:i + 1], pos[:, i:i + 1], cache=cache, mode="decode")
            rest.append(lg)
            cache = out["cache"]
        return jnp.concatenate([first, *rest], 1), model(x)[0], cache
    return run(model, x)


def random_hf_model(config, seed: int = 0):
    """transformers' model of `config` with random weights of std 0.2 (norm weights included), float32, eager."""
    import torch
    import transformers
    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    return m.eval().float()


def edited_config(src, dst, **changes):
    """A copy of checkpoint folder `src` whose config.json has `changes` (None: the key removed)."""
    import shutil
    shutil.copytree(src, dst)
    d = json.loads((Path(dst) / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    (Path(dst) / "config.json").write_text(json.dumps(d))
    return dst


def all_eqns(jaxpr):
    """Every equation of a jaxpr, those of its sub-jaxprs (scan, cond, pjit, custom rules' bodies) included."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from all_eqns(inner)


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def chat_folder(folder, seed: int = 0):
    """A small pretrained-model folder as a chat model's is published: a Llama (D=32, 2 layers, standard init, its
    embeddings and untied head of std 1 so that logits can be confident) saved by transformers, a byte-level BPE
    tokenizer.json of 300 ids trained on the built-in corpus with ChatML's <|im_start|>/<|im_end|> as special
    tokens, and tokenizer_config.json with the ChatML template. -> the transformers model."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from jaxformer.data.text import corpus_path
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([corpus_path("builtin:alice").read_text(encoding="utf-8")],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>",
                                                                                "<|im_end|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, bos_token_id=1, eos_token_id=4)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval().float()
    with torch.no_grad():
        m.lm_head.weight.normal_(0, 1.0)
        m.model.embed_tokens.weight.normal_(0, 1.0)
    m.save_pretrained(folder)
    return m


def attention_pattern(attn, *args, **kw):
    """An attention module's probabilities [B,N,T,S] for one call (args as its own): its `pattern` site,
    captured (the one route to them, `nn.sites`)."""
    from jaxformer.nn.sites import Sites, hooks
    sites = Sites(hooks(("pattern",), None, ("pattern",)))
    attn(*args, sites=sites, **kw)
    return sites.captured["pattern"]


def run_cli(capsys, *argv) -> tuple[int, str]:
    """`jaxformer ARGV` in-process -> (exit code, everything it printed as one line of words)."""
    from jaxformer.cli import main
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, " ".join((cap.out + cap.err).split())


def stop_now(monkeypatch, signame: str = "SIGTERM") -> None:
    """A stop signal held by the command line arrives now (`jaxformer.signals.pending`)."""
    import types

    from jaxformer import signals
    monkeypatch.setattr(signals, "_startup", types.SimpleNamespace(received=signame))


def with_devices(n: int):
    """A test that needs n devices runs where they are: in this process when it has them (the mutation tool
    starts its runs with n fake CPU devices: tests/mutation.toml `devices`, so mutmut sees what the test reaches),
    else as its own node id in a child pytest whose XLA_FLAGS add --xla_force_host_platform_device_count=n."""
    import functools
    import os
    import subprocess
    import sys

    def wrap(test):
        @functools.wraps(test)
        def run(*args, **kwargs):
            import jax
            if jax.device_count() >= n:
                return test(*args, **kwargs)
            node = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
            flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()
            env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")} | {"XLA_FLAGS": flags}
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", node],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, f"{node} on {n} devices:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
        return run
    return wrap
