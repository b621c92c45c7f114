"""`jaxformer export-hf` loses nothing and writes no wrong model (issue R4).

Before: export-hf checked only for config.json in --out and replaced a user's tokenizer.json or model.safetensors
there (--adapter: only adapter_config.json, replacing a user's adapter_model.safetensors); a failed or interrupted
export left a half-written --out; --adapter of a run trained from scratch wrote base_model_name_or_path "" and
ignored --dtype and --family; the expressibility check compared a fixed list of config keys, so a model field it
did not list (a RoPE field beyond the scaling ones, e.g. model.rope.nope_every) exported silently as another model.

The run is stood in for by `load_model` returning a tiny model built here (the export reads nothing else of it),
so no run is trained; everything goes through `jaxformer.cli.main` in-process.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing

import jax
import pytest
from flax import nnx

from jaxformer import signals
from jaxformer.cli import main as cli
from jaxformer.config import ModelConfig, NormConfig, RopeConfig, replaced
from jaxformer.data.tokenizers import HFTokenizer
from jaxformer.inference import restore
from jaxformer.nn import build_model

V = 40
LLAMA = ModelConfig(arch="decoder_only", vocab_size=V, d_model=16, num_heads=2, num_decoder_layers=1,
                    num_encoder_layers=0, d_ff=32, max_len=16, positional="rope", activation="swiglu",
                    use_bias=False, scale_embeddings=False, norm=NormConfig(position="pre", type="rmsnorm"))


def tokenizer() -> HFTokenizer:
    from tokenizers import Tokenizer, models
    return HFTokenizer(Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0")), eod_id=1)


@pytest.fixture(scope="module")
def models():
    """{"plain": a Llama-shaped model, "lora": the same with adapters on q and v (B nonzero)}."""
    lora = build_model(replaced(LLAMA, lora__rank=2))
    st = nnx.state(lora, nnx.LoRAParam)
    nnx.update(lora, jax.tree.map(lambda x: x + 0.1, st))
    return {"plain": build_model(LLAMA), "lora": lora}


@pytest.fixture
def run(models, monkeypatch):
    """run(kind, init_from="", tok=None) -> a run directory name whose load_model gives that model."""
    def make(kind="plain", init_from="", tok=None, on_load=None):
        def load_model(workdir, which="best", plan=None, quantize=None, weights="trained"):
            if on_load:
                on_load()
            cfg = types.SimpleNamespace(train=types.SimpleNamespace(init_from=init_from))
            return restore.LoadedModel(cfg, tok or tokenizer(), models[kind], 1, which)
        monkeypatch.setattr(restore, "load_model", load_model)
        return "RUN"
    return make


def export(capsys, workdir, out, *extra) -> tuple[int, str]:
    rc = cli(["export-hf", "--workdir", workdir, "--out", str(out), *extra])
    return rc, capsys.readouterr().out


def partial(out):
    return out.with_name(out.name + ".partial")


# 1. nothing lost: a user's file in --out is never replaced; --out is written whole or not at all

@pytest.mark.parametrize("name", ["tokenizer.json", "model.safetensors"])
def test_a_users_file_in_out_is_never_replaced(run, tmp_path, capsys, name):
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_text("mine")
    rc, said = export(capsys, run(), out)
    assert rc == 2 and f"--out {out} is not empty (it holds {name})" in said, said
    assert sorted(p.name for p in out.iterdir()) == [name] and (out / name).read_text() == "mine"
    assert not partial(out).exists()


def test_a_users_adapter_weights_in_out_are_never_replaced(run, tmp_path, capsys):
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "adapter_model.safetensors").write_text("mine")
    rc, said = export(capsys, run("lora", init_from="org/base"), out, "--adapter")
    assert rc == 2 and "is not empty (it holds adapter_model.safetensors)" in said, said
    assert (out / "adapter_model.safetensors").read_text() == "mine" and not partial(out).exists()


def test_an_export_failing_midway_leaves_no_out(run, tmp_path, capsys):
    """The tokenizer is written after the weights and config.json; a full disk there used to leave both."""
    class FullDisk:
        def save(self, path):
            raise OSError(28, "No space left on device")
    tok = tokenizer()
    tok.tok = FullDisk()
    out = tmp_path / "out"
    rc, said = export(capsys, run(tok=tok), out)
    assert rc == 2 and "No space left on device" in said, said
    assert not out.exists() and not partial(out).exists()


def test_an_export_interrupted_while_it_runs_leaves_no_out(run, tmp_path, capsys, monkeypatch):
    """A Ctrl-C held by the command line (signals.pending) while the export ran: exit 130, nothing at --out."""
    def ctrl_c():
        monkeypatch.setattr(signals, "_startup", types.SimpleNamespace(received="SIGINT"))
    out = tmp_path / "out"
    rc, said = export(capsys, run(on_load=ctrl_c), out)
    assert rc == 130 and "nothing was written" in said, said
    assert not out.exists() and not partial(out).exists()


def test_a_killed_exports_partial_folder_is_replaced_and_a_foreign_one_kept(run, tmp_path, capsys):
    """OUT.partial marked as jaxformer's (a killed export) is removed; an unmarked one is refused, untouched. An
    empty --out is fine: it holds exactly the export afterwards."""
    out = tmp_path / "out"
    out.mkdir()
    partial(out).mkdir()
    (partial(out) / "weights.bin").write_text("mine")
    rc, said = export(capsys, run(), out)
    assert rc == 2 and "was not made by jaxformer" in said and (partial(out) / "weights.bin").read_text() == "mine"
    assert list(out.iterdir()) == []
    (partial(out) / "weights.bin").unlink()
    (partial(out) / ".jaxformer-partial").write_text("")
    (partial(out) / "model.safetensors").write_text("half")
    rc, said = export(capsys, run(), out)
    assert rc == 0, said
    assert not partial(out).exists()
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]


# 2. --adapter: a base model to apply to; --dtype and --family apply

def test_adapters_of_a_run_trained_from_scratch_are_refused(run, tmp_path, capsys):
    out = tmp_path / "adapter"
    rc, said = export(capsys, run("lora", init_from=""), out, "--adapter")
    assert rc == 2 and "run directory error" in said and "no base model to apply to" in said, said
    assert "export the merged model" in said and not out.exists()


def test_adapter_dtype_is_the_tensors_dtype(run, tmp_path, capsys):
    from safetensors import safe_open
    out = tmp_path / "adapter"
    rc, said = export(capsys, run("lora", init_from="org/base"), out, "--adapter", "--dtype", "bfloat16")
    assert rc == 0, said
    with safe_open(str(out / "adapter_model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "org/base"


def test_adapter_family_is_checked_against_the_model_and_the_base(run, tmp_path, capsys):
    rc, said = export(capsys, run("lora", init_from="org/base"), tmp_path / "a", "--adapter", "--family", "qwen2")
    assert rc == 2 and "the qwen2 family cannot express this model" in said, said
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "llama"}))
    rc, said = export(capsys, run("lora", init_from=str(base)), tmp_path / "b", "--adapter", "--family", "mistral")
    assert rc == 2 and f"--family mistral: the adapters' base model {base} is a llama checkpoint" in said, said
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# 3. every model field is compared by the export unless classified as changing nothing

def _keys(cls, prefix=""):
    """Every leaf field of a config dataclass as a dotted key, walking the fields typed as sections."""
    hints, out = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        out += _keys(typ, f"{prefix}{f.name}.") if dataclasses.is_dataclass(typ) else [prefix + f.name]
    return out


def test_every_model_config_field_is_classified_at_most_once_for_the_export():
    """A field is respelled, compared where it applies, listed as changing nothing, or (in none of these)
    compared as it is; never two of these, and no table names a field that does not exist."""
    from jaxformer.hf.expressing import APPLIES, RESPELLED, UNCHANGED
    keys = _keys(ModelConfig)
    assert "rope.truncate" in keys and "runtime.moe_dropless" in keys and "lora.base" in keys
    tables = [set(RESPELLED), set(APPLIES), set(UNCHANGED)]
    for k in keys:
        assert sum(k in t for t in tables) <= 1, f"model.{k} is classified {sum(k in t for t in tables)} times"
    assert set().union(*tables) <= set(keys), set().union(*tables) - set(keys)


def test_a_field_the_export_does_not_know_is_refused_away_from_its_default(models, tmp_path, monkeypatch):
    """A RoPE field added later (here `later`, made up) that no family writes: at its default the model exports;
    set, it is refused by name and nothing is written. So is model.rope.nope_every (NoPE layers), which no
    family writes either."""
    from jaxformer.hf import HFError, families, save_pretrained

    @dataclasses.dataclass(frozen=True)
    class LaterRope(RopeConfig):
        later: int = 0
    monkeypatch.setattr(families, "RopeConfig", LaterRope)         # the field exists wherever a config is built

    model = nnx.clone(models["plain"])
    model.cfg = dataclasses.replace(LLAMA, rope=LaterRope())
    assert save_pretrained(model, tmp_path / "default")["model_type"] == "llama"
    for field, rope in (("later", LaterRope(later=2)), ("nope_every", LaterRope(nope_every=2))):
        model.cfg = dataclasses.replace(LLAMA, rope=rope)
        with pytest.raises(HFError, match=rf"model.rope.{field}=2 \(a llama config gives 0\)"):
            save_pretrained(model, tmp_path / "out", family="llama")
        with pytest.raises(HFError, match=rf"the llama family cannot express this model.*rope.{field}=2"):
            save_pretrained(model, tmp_path / "out")                # the family chosen is held to it too
    assert not (tmp_path / "out").exists() and not partial(tmp_path / "out").exists()


def test_a_forced_mistral_writes_its_window_or_none():
    """Mistral's sliding_window is the model's one window, or null (no window: 0 would mask every key), and
    reads back as the same function (`hf.expressing.to_hf_config`; default-lane twin of the families' export)."""
    from jaxformer.hf.expressing import function_of, to_hf_config
    from jaxformer.hf.families import to_model_config
    for windows, want in (((), None), ((8,), 8)):
        cfg = replaced(LLAMA, attention__windows=windows)
        out = to_hf_config(cfg, "mistral")
        assert out["sliding_window"] == want, windows
        assert function_of(to_model_config(out)) == function_of(cfg), windows

