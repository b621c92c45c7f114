"""Issue R4: nothing lost, nothing silently wrong on the newest commands. Each case below printed a traceback,
was accepted, or gave a silently wrong result before: a damaged runs CSV behind `report --verdict-only`,
`mup-check` on an encoder-decoder or on equal widths, a huge LoRA rank, a µP base width the heads do not divide,
`viz --plot heads` on a one-token prompt, an old and a new config key set together on the command line, and
zero-padded prompts decoded without segment ids."""
from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import ROOT, cli_args, tiny_lm, tiny_reverse

from jaxformer.cli import main as cli_main
from jaxformer.config import ConfigError, resolve_vocab
from jaxformer.errors import DataError

SWEEP = ROOT / "configs/sweeps/activations.py"


def run_cli(capsys, *argv) -> tuple[int, str]:
    rc = cli_main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, " ".join((cap.out + cap.err).split())


def _abstract(cfg):
    """A model of `cfg` as shapes (nothing allocated or compiled): what checks made before any trace need."""
    from jaxformer.nn import build_model
    return nnx.eval_shape(lambda: build_model(cfg.model))


# ----------------------------------------------------------------------------- 1. a damaged runs CSV

def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def _drop_seed(t):
    return "".join(",".join(c for i, c in enumerate(ln.rstrip("\n").split(",")) if i != 3) + "\n" for ln in _lines(t))


def _cell(t, line, col, value):                        # line 1 is the header; col counts from 0
    ls = _lines(t)
    cells = ls[line - 1].rstrip("\n").split(",")
    cells[col] = value
    ls[line - 1] = ",".join(cells) + "\n"
    return "".join(ls)


DAMAGE = {   # what is done to docs/ablations/activations_runs.csv -> what the error names
    "missing column": (_drop_seed, "has no column 'seed'"),
    "bad seed": (lambda t: _cell(t, 3, 3, "one"), "line 3, column 'seed': 'one' is not an integer"),
    "bad metric": (lambda t: _cell(t, 3, 6, "2.1x"), "line 3, column 'best held-out loss': '2.1x' is not a number"),
    "short row": (lambda t: "".join(ln if i != 3 else ln.rsplit(",", 2)[0] + "\n" for i, ln in enumerate(_lines(t), 1)),
                  "line 3 has 9 fields, the header 11"),
    "NUL byte": (lambda t: _cell(t, 4, 6, "2.19\x00"), "line 4, column 'best held-out loss': a NUL byte"),
    "duplicate run": (lambda t: t + _cell(t, 2, 6, "1.5").splitlines(keepends=True)[1],
                      "lines 2 and 11 are both arm 'relu' seed 0"),
    "dropped row": (lambda t: "".join(ln for i, ln in enumerate(_lines(t), 1) if i != 3),
                    "has no row for arm 'relu' seed 1"),
    "foreign row": (lambda t: t + _cell(t, 2, 0, "tanh").splitlines(keepends=True)[1],
                    "line 11: arm 'tanh' seed 0 is no run of sweep activations"),
}


@pytest.fixture()
def report_copy(tmp_path):
    for name in ("activations.md", "activations_runs.csv"):
        shutil.copy(ROOT / "docs/ablations" / name, tmp_path / name)
    return tmp_path


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_runs_csv_is_named_by_file_line_and_column(report_copy, capsys, case):
    """Before: KeyError / ValueError / TypeError tracebacks, or rc 0 with a verdict from a CSV whose damaged row
    was dropped, kept as text, or silently replaced by its duplicate."""
    damage, message = DAMAGE[case]
    csv = report_copy / "activations_runs.csv"
    csv.write_bytes(damage(csv.read_text(encoding="utf-8")).encode("utf-8"))
    md = (report_copy / "activations.md").read_bytes()
    rc, out = run_cli(capsys, "report", SWEEP, "--verdict-only", "--out", report_copy)
    assert rc == 2 and "Traceback" not in out and "sweep error:" in out, out
    assert str(csv) in out and message in out, out
    assert (report_copy / "activations.md").read_bytes() == md                 # nothing rewritten


def test_a_latin1_runs_csv_is_named_by_file_line_and_column(report_copy, capsys):
    """Before: a UnicodeDecodeError traceback."""
    csv = report_copy / "activations_runs.csv"
    csv.write_bytes(_cell(csv.read_text(encoding="utf-8"), 2, 0, "relu é").encode("latin-1"))
    rc, out = run_cli(capsys, "report", SWEEP, "--verdict-only", "--out", report_copy)
    assert rc == 2 and "Traceback" not in out
    assert f"{csv} line 2, column 'arm': byte 0xe9, not UTF-8" in out, out


# ----------------------------------------------------------------------------- 2 and 4. mup-check

def test_mup_sizes_of_an_encoder_decoder_read_its_decoder_and_encoder_sites():
    """Before: KeyError 'inputs' (the sizes read an LM's batch), a traceback. Traced abstractly: no compile."""
    from jaxformer import mup
    from jaxformer.arch import architecture
    cfg = tiny_reverse()
    graph, state = nnx.split(_abstract(cfg))
    sites = tuple(s for s in mup.SITES if s != mup.LEARNED) + mup.ENCODER_SITES
    out, z = jax.eval_shape(mup._sizes_fn(graph, sites), state, architecture(cfg.model.arch).example_batch(2, 5))
    assert out.shape == (len(sites),) and z.shape == (2, 5)


@pytest.mark.slow          # 2 parametrizations x 2 widths of a 1+1-layer encoder-decoder (~30-70 s on 2 cores)
def test_mup_check_runs_on_an_encoder_decoder():
    from jaxformer import mup
    r = mup.coord_check(tiny_reverse("model.d_model=16", "model.d_ff=32"), (8, 16), steps=1)
    assert r["sites"] == list(mup.SITES + mup.ENCODER_SITES)
    assert all(np.isfinite(v) and (v > 0 or (s == mup.LEARNED and t == 0)) for par in ("sp", "mup")
               for s in r["sites"] for t, row in enumerate(r[par][s]) for v in row)
    assert "from 2 widths" in mup.verdict(r, "mup")


def test_mup_check_refuses_a_repeated_width_before_any_work(capsys, tmp_path):
    """Before: `--widths 32 32` ran the check and printed verdicts from a slope fitted through one width."""
    rc, out = run_cli(capsys, "mup-check", ROOT / "configs/alice.py", "--widths", "32", "32", "--out", tmp_path)
    assert rc == 2 and "config error: mup-check widths=[32, 32]: width 32 is given more than once" in out, out
    assert not (tmp_path / "mup_check.json").exists()
    rc, out = run_cli(capsys, "mup-check", ROOT / "configs/alice.py", "--widths", "32", "--out", tmp_path)
    assert rc == 2 and "at least two distinct widths" in out, out


def test_slopes_need_distinct_widths_and_two_widths_say_they_have_no_interval():
    """Before: equal widths gave a slope (numpy's fit of a vertical line) and a verdict; two widths gave a
    verdict that did not say it rests on a line through two points."""
    from jaxformer.mup import slopes, verdict
    same = {"widths": [32, 32], "sites": ["a"], "sp": {"a": [[1.0, 2.0]]}}
    with pytest.raises(ConfigError, match="width 32 is given more than once"):
        slopes(same, "sp")
    two = {"widths": [32, 64], "sites": ["a"], "sp": {"a": [[1.0, 1.02]]}}
    assert "from 2 widths: a line through two points, with no interval" in verdict(two, "sp")
    three = {"widths": [32, 64, 128], "sites": ["a"], "sp": {"a": [[1.0, 1.02, 1.01]]}}
    assert "no interval" not in verdict(three, "sp")


# ----------------------------------------------------------------------------- 3. a huge LoRA rank

def test_a_huge_lora_rank_is_refused_by_the_size_arithmetic(capsys):
    """Before: XLA's RESOURCE_EXHAUSTED as a traceback (the arithmetic counted no adapter)."""
    rc, out = run_cli(capsys, "params", *cli_args("configs/reverse.py", ["model.lora.rank=1099511627776"]))
    assert rc == 2 and "Traceback" not in out, out
    assert "model.lora.rank=1099511627776) needs at least" in out and "counted before anything is allocated" in out


def test_the_size_arithmetic_counts_each_adapter_parameter():
    """Exactly the adapters' parameters the model gets: every attention (self, cross, the encoder's) and FFN."""
    from jaxformer.memory import min_param_bytes
    cfg = tiny_reverse("model.lora.targets=q,k,v,o,up,down", "model.num_kv_heads=1")
    base = min_param_bytes(cfg.model)[0]
    adapted = tiny_reverse("model.lora.rank=3", "model.lora.targets=q,k,v,o,up,down", "model.num_kv_heads=1")
    model = _abstract(adapted)
    lora = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    assert lora > 0 and min_param_bytes(adapted.model)[0] - base == 4 * lora


# ----------------------------------------------------------------------------- 5. µP's base width

def test_a_mup_base_width_the_heads_do_not_divide_is_refused():
    """Before: accepted (µP's base model would have heads of 9/2 dimensions)."""
    with pytest.raises(ConfigError, match=r"model.base_width=9 is not a multiple of model.num_heads=2"):
        tiny_lm("model.parametrization=mup", "model.base_width=9")
    assert tiny_lm("model.parametrization=mup", "model.base_width=8").model.base_width == 8


# ----------------------------------------------------------------------------- 6. viz --plot heads

def _char_run():
    from jaxformer.data.tokenizers import CharTokenizer
    from jaxformer.inference import LoadedModel
    tok = CharTokenizer("abcdefgh")
    cfg = resolve_vocab(tiny_lm(), tok.vocab_size)
    return LoadedModel(cfg, tok, _abstract(cfg), 0, "best")


def test_viz_heads_refuses_a_one_token_prompt_before_writing(monkeypatch, tmp_path):
    """Before: an all-zero head table was drawn (a one-token prompt predicts nothing)."""
    from jaxformer import viz
    run = _char_run()
    monkeypatch.setattr(viz, "load_model", lambda *a, **k: run)
    with pytest.raises(DataError, match="--plot heads: prompt 'a' is a single token, with no next token to score"):
        viz.write_probes(tmp_path, ["abc", "a"], plots=("heads",), out=tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_head_ablation_refuses_inputs_with_nothing_to_score():
    """Before: a table of zeros."""
    from jaxformer.interpret import head_ablation
    model = _char_run().model
    tokens = np.array([[3, 4]], np.int32)
    with pytest.raises(DataError, match="weights 0 at every position: no token to score"):
        head_ablation(model, tokens, targets=tokens, weights=np.zeros((1, 2), np.float32))


# ----------------------------------------------------------------------------- 7. old and new keys together

def test_an_old_and_a_new_key_together_are_one_error_on_the_command_line_and_in_a_config_json():
    """Before: --set took the last of the two silently, while config.json named both."""
    from jaxformer.config import to_dict
    from jaxformer.configio import from_dict
    want = "model.norm_position='post' and model.norm.position='sandwich': model.norm_position is the old name of " \
           "model.norm.position; keep one"
    for pairs in (["model.norm_position=post", "model.norm.position=sandwich"],
                  ["model.norm.position=sandwich", "model.norm_position=post"]):
        with pytest.raises(ConfigError) as e:
            tiny_lm(*pairs)
        assert str(e.value) == want
    d = to_dict(tiny_lm())
    d["model"]["norm_position"], d["model"]["norm"]["position"] = "post", "sandwich"
    with pytest.raises(ConfigError) as e:
        from_dict(json.loads(json.dumps(d)))
    assert str(e.value) == want
    assert tiny_lm("model.norm_position=post", "model.norm.position=post").model.norm.position == "post"
    d["model"]["norm"]["position"] = "post"
    assert from_dict(d).model.norm.position == "post"                  # the same value twice: one setting


# ----------------------------------------------------------------------------- 8. padded prompts, no segment ids

def test_decoding_refuses_padding_it_would_read_as_tokens():
    """Before: exit 0 with the padding decoded as tokens (other answers than each prompt's own)."""
    from jaxformer import decode
    lm = _abstract(resolve_vocab(tiny_lm(), 12))
    prompts = np.array([[5, 6, 7], [8, 0, 0]], np.int32)                # ragged, right-padded with pad id 0
    with pytest.raises(DataError, match=r"prompts \[2, 3\]: row 1 holds the padding id \(model.pad_id=0\) at "
                                        r"position 1 and no segment_ids are given"):
        decode.generate_lm(lm, prompts, max_new=2)
    s2s = _abstract(tiny_reverse())
    src = np.array([[4, 5, 2], [6, 2, 0]], np.int32)
    for fn in (lambda: decode.generate_seq2seq(s2s, src, max_new=2, bos_id=1, eos_id=2),
               lambda: decode.beam_search(s2s, src, max_new=2, bos_id=1, eos_id=2, beam=2),
               lambda: decode.greedy_naive(s2s, src, 2, bos_id=1, eos_id=2)):
        with pytest.raises(DataError, match=r"src \[2, 3\]: row 1 holds the padding id"):
            fn()
    # traced prompts are not looked at; a model without a padding id has nothing to check
    jax.make_jaxpr(lambda p: decode._check_padding(lm, p, None, "prompts") or p)(prompts)
    none = _abstract(resolve_vocab(tiny_lm("model.pad_id=-1"), 12))
    decode._check_padding(none, prompts, None, "prompts")
