"""Issue R5 (item 5, tracebacks -> named errors; item 4, patching): mistakes a user can make in an attention
variant's module, a sliding-window pattern and a patching request, each a named jaxformer error raised before the
work it would spoil (and `jaxformer train` one line and exit 2, no traceback). Before:

- model.attention.kind naming a module that raises on import (RuntimeError in its body), has a syntax error, or a
  class whose `check` asserts or raises a non-jaxformer exception: the exception's traceback out of `train`.
- model.attention.windows with an entry larger than int32 (2**40): an OverflowError traceback while the first step
  traced (after the model was initialised); a float or bool entry was accepted (and compared as a window), a
  string or None entry was a TypeError from validation, a bare int one too.
- patching_grid / attribution_patching: clean and corrupt inputs of other lengths or batch sizes, a metric that
  returns the logits or a [B] vector, a non-callable metric, a bare array or the wrong number of inputs (one to an
  encoder-decoder), a `batch` that is no positive integer: JAX/Python tracebacks from inside the jitted program
  (or, for a [1] metric or clean and corrupt inputs of different arities, a silent answer); token ids outside the
  vocabulary were read as row 0 or the last row (a silent answer); a metric equal on the clean and the corrupted
  input made every normalised cell NaN.
Everything runs in-process and trains nothing (no command below reaches its first step).
"""
from __future__ import annotations

import re
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY_LM, TINY_REVERSE, cli_args

from jaxformer.cli import main as cli_main
from jaxformer.config import ModelConfig, replaced
from jaxformer.errors import ConfigError, DataError
from jaxformer.nn import build_model
from jaxformer.patching import attribution_patching, patching_grid


def train_cli(capsys, tmp_path, config: str, *overrides: str) -> tuple[int, str]:
    """`jaxformer train CONFIG --set ...` in-process -> (exit code, its whole output)."""
    rc = cli_main(["train", *cli_args(config, [*overrides, "train.steps=1"]), "--workdir", str(tmp_path / "run")])
    cap = capsys.readouterr()
    return rc, (cap.out + cap.err).strip()


def one_line(out: str) -> str:
    assert "Traceback" not in out and len(out.splitlines()) == 1, out
    return out


# ----------------------------------------------------------------------------- model.attention.kind

VARIANTS = {
    "raises_on_import": 'raise RuntimeError("no GPU kernel for this machine")\n',
    "bad_syntax": textwrap.dedent('''
        from jaxformer.nn.attention import MultiHeadAttention

        class Broken(MultiHeadAttention)
            pass
        '''),
    "checks": textwrap.dedent('''
        from jaxformer.nn.attention import MultiHeadAttention

        class Asserts(MultiHeadAttention):
            @classmethod
            def check(cls, cfg):
                assert cfg.num_heads == 3, "wants 3 heads"

        class Raises(MultiHeadAttention):
            @classmethod
            def check(cls, cfg):
                raise ValueError("no thanks")

        class NotAClassmethod(MultiHeadAttention):
            def check(self, cfg):
                pass
        '''),
}


@pytest.fixture()
def variants(tmp_path, monkeypatch):
    folder = tmp_path / "variants"
    folder.mkdir()
    for name, text in VARIANTS.items():
        (folder / f"r5_{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    for name in (*VARIANTS, "own"):
        sys.modules.pop(f"r5_{name}", None)


@pytest.mark.parametrize("kind, says", [
    ("r5_raises_on_import:X", r"cannot be imported: RuntimeError: no GPU kernel for this machine"),
    ("r5_bad_syntax:Broken", r"cannot be imported: SyntaxError: expected ':' \(.*r5_bad_syntax\.py, line 4\)"),
    ("r5_checks:Asserts", r"its check\(cfg\) raised AssertionError: wants 3 heads \(.*r5_checks\.py, line 7\)"),
    ("r5_checks:Raises", r"its check\(cfg\) raised ValueError: no thanks"),
    ("r5_checks:NotAClassmethod", r"its check\(cfg\) raised TypeError: .*missing 1 required positional argument"),
    ("r5_no_such_module:X", r"cannot be imported: ModuleNotFoundError: No module named 'r5_no_such_module'")])
def test_an_attention_variant_that_fails_to_load_or_check_is_a_config_error(variants, tmp_path, capsys, kind,
                                                                            says):
    """Before: the RuntimeError / SyntaxError / AssertionError / ValueError / TypeError traceback out of train
    (a missing module was named already: kept)."""
    rc, out = train_cli(capsys, tmp_path, "configs/reverse.py", *TINY_REVERSE, f"model.attention.kind={kind}")
    assert rc == 2 and one_line(out).startswith(f"config error: model.attention.kind='{kind}'"), out
    assert re.search(says, out), out


def test_a_variants_own_config_error_is_kept(variants, tmp_path):
    """A check that raises ConfigError itself is the variant's named error, passed through unchanged."""
    (variants / "r5_own.py").write_text(textwrap.dedent('''
        from jaxformer.errors import ConfigError
        from jaxformer.nn.attention import MultiHeadAttention

        class Own(MultiHeadAttention):
            @classmethod
            def check(cls, cfg):
                raise ConfigError("model.num_heads=4: Own wants 3")
        '''))
    cfg = replaced(ModelConfig(), arch="decoder_only", num_encoder_layers=0, vocab_size=11, d_model=16,
                   num_heads=4, d_ff=16, num_decoder_layers=1, attention__kind="r5_own:Own")
    with pytest.raises(ConfigError, match=r"^model.num_heads=4: Own wants 3"):
        build_model(cfg)


# ----------------------------------------------------------------------------- model.attention.windows

@pytest.mark.parametrize("windows, says", [
    ((2 ** 40,), r"model.attention.windows=\(1099511627776,\): a window must fit int32 \(< 2\*\*31\); got "
                 r"1099511627776 .*0 = global"),
    ((10 ** 30,), r"a window must fit int32"),
    ((1.5,), r"model.attention.windows=\(1.5,\): a window must be an integer; got 1.5 \(float\)"),
    ((True,), r"a window must be an integer; got True \(bool\)"),
    (("4",), r"a window must be an integer; got '4' \(str\)"),
    ((None,), r"a window must be an integer; got None"),
    (4, r"model.attention.windows=4 must be a tuple of windows")])
def test_a_window_pattern_that_is_no_int32_pattern_is_refused_when_configured(windows, says):
    """Before: 2**40 passed validation and overflowed int32 while the first step traced; 1.5 and True were
    accepted; '4', None and a bare 4 were TypeErrors of the validation itself."""
    with pytest.raises(ConfigError, match=says):
        replaced(ModelConfig(), arch="decoder_only", num_encoder_layers=0, num_decoder_layers=1,
                 attention__windows=windows)


def test_train_refuses_a_window_beyond_int32_in_one_line_before_building(tmp_path, capsys):
    """Before: the model was built and initialised, then the OverflowError traceback from `nn.per_layer`."""
    rc, out = train_cli(capsys, tmp_path, "configs/alice.py", *TINY_LM, "model.attention.windows=1099511627776")
    assert rc == 2 and one_line(out).startswith("config error: model.attention.windows=(1099511627776,)"), out
    assert not (tmp_path / "run").exists()


def test_windows_that_fit_int32_are_taken():
    ok = replaced(ModelConfig(), arch="decoder_only", num_encoder_layers=0, num_decoder_layers=2,
                  attention__windows=(4, 2 ** 31 - 1))
    assert ok.layer_windows() == (4, 2 ** 31 - 1)


# ----------------------------------------------------------------------------- patching

T = 6
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, T)))
CORRUPT = TOKENS.at[:, 3].set((TOKENS[:, 3] + 7) % 40)


def metric(logits):
    return jnp.mean(logits[:, -1, 1] - logits[:, -1, 2])


@pytest.fixture(scope="module")
def lm():
    cfg = replaced(ModelConfig(), arch="decoder_only", num_encoder_layers=0, vocab_size=40, d_model=16,
                   num_heads=2, d_ff=16, num_decoder_layers=1, max_len=16, positional="rope", runtime__dropout=0.0,
                   norm__position="pre")
    return build_model(cfg, seed=1)


@pytest.fixture(scope="module")
def seq2seq():
    cfg = replaced(ModelConfig(), arch="encoder_decoder", vocab_size=40, d_model=16, num_heads=2, d_ff=16,
                   num_encoder_layers=1, num_decoder_layers=1, max_len=16, positional="sinusoidal",
                   runtime__dropout=0.0, norm__position="pre")
    return build_model(cfg, seed=1)


@pytest.fixture(scope="module")
def table_lm():
    """An LM whose positions index a table of model.max_len=8 rows."""
    cfg = replaced(ModelConfig(), arch="decoder_only", num_encoder_layers=0, vocab_size=40, d_model=16,
                   num_heads=2, d_ff=16, num_decoder_layers=1, max_len=8, positional="sinusoidal",
                   runtime__dropout=0.0, norm__position="pre")
    return build_model(cfg, seed=1)


BOTH = pytest.mark.parametrize("fn", [patching_grid, attribution_patching])


@BOTH
@pytest.mark.parametrize("corrupt, says", [
    ((CORRUPT[:, :5],), r"clean input 0 is \[2, 6\] and corrupt input 0 \[2, 5\]"),
    ((CORRUPT[:1],), r"clean input 0 is \[2, 6\] and corrupt input 0 \[1, 6\]")])
def test_clean_and_corrupt_inputs_of_other_shapes_are_named(lm, fn, corrupt, says):
    """Before: 'Incompatible shapes for broadcasting' / a scan carry TypeError from inside the jitted program."""
    with pytest.raises(DataError, match=says):
        fn(lm, (TOKENS,), corrupt, "resid_pre", metric)


@BOTH
def test_an_encoder_decoders_sources_of_other_lengths_are_named(seq2seq, fn):
    """Before: for a decoder site, silently patched; for a cross-attention site, a broadcasting traceback."""
    with pytest.raises(DataError, match=r"clean input 0 is \[2, 6\] and corrupt input 0 \[2, 5\]"):
        fn(seq2seq, (TOKENS, TOKENS), (CORRUPT[:, :5], CORRUPT), "cross_pattern", metric)


@BOTH
@pytest.mark.parametrize("bad, says", [
    (lambda logits: logits, r"metric returned shape \[2, 6, 40\] \(float32\) for logits \[2, 6, 40\]: .*scalar"),
    (lambda logits: logits[:, -1, 1], r"metric returned shape \[2\] \(float32\)"),
    (lambda logits: logits[:1, -1, 1], r"metric returned shape \[1\] \(float32\)"),
    (lambda logits: (logits[0, -1, 1], logits[1, -1, 1]), r"metric returned shape \[2\]"),
    (lambda logits: {"m": logits[0, -1, 1]}, r"metric returned a dict")])
def test_a_metric_that_is_not_a_scalar_is_named(lm, fn, bad, says):
    """Before: a reshape TypeError, 'Gradient only defined for scalar-output functions', or for a [1] metric a
    silent grid."""
    with pytest.raises(ConfigError, match=says):
        fn(lm, (TOKENS,), (CORRUPT,), "resid_pre", bad)


def test_attribution_refuses_an_integer_metric(lm):
    """Before: 'grad requires real-valued outputs' from inside jax.grad."""
    with pytest.raises(ConfigError, match=r"metric returned int32: attribution patching differentiates it"):
        attribution_patching(lm, (TOKENS,), (CORRUPT,), "resid_pre", lambda lg: jnp.argmax(lg[0, -1]))


@BOTH
def test_a_metric_that_is_not_callable_is_named(lm, fn):
    with pytest.raises(ConfigError, match=r"metric=3 is not callable"):
        fn(lm, (TOKENS,), (CORRUPT,), "resid_pre", 3)


@BOTH
@pytest.mark.parametrize("which, clean, corrupt, says", [
    ("lm", TOKENS, CORRUPT, r"clean must be a tuple of the model's inputs, \(tokens,\) or \(tokens, positions\); "
                            r"got an array \[2, 6\]"),
    ("lm", (TOKENS, TOKENS, TOKENS), (CORRUPT,) * 3,
     r"clean holds 3 input\(s\); model.arch='decoder_only' takes \(tokens,\) or"),
    ("lm", (), (), r"clean holds 0 input\(s\)"),
    ("lm", (TOKENS,), (CORRUPT, jnp.broadcast_to(jnp.arange(T), (2, T))),
     r"clean holds 1 input\(s\) and corrupt 2"),
    ("seq2seq", (TOKENS,), (CORRUPT,), r"clean holds 1 input\(s\); model.arch='encoder_decoder' takes \(src, tgt\)"),
    ("lm", (TOKENS.astype(jnp.float32),), (CORRUPT,), r"clean input 0 is float32 \[2, 6\]: .*integer"),
    ("lm", (TOKENS[0],), (CORRUPT[0],), r"clean input 0 is \[6\]: .*\[batch, length\]"),
    ("lm", (TOKENS + 40,), (CORRUPT,), r"clean input 0 \[2, 6\]: row 0, position 0 holds \d+, outside the "
                                       r"vocabulary \[0, 40\)"),
    ("seq2seq", (TOKENS, TOKENS), (CORRUPT, CORRUPT - 40), r"corrupt input 1 .* outside the vocabulary")])
def test_inputs_the_model_cannot_take_are_named(lm, seq2seq, fn, which, clean, corrupt, says):
    """Before: a bare array split into its rows ('tokens must be an integer [B,T] array; got (6,)'), the model's
    own TypeError for a wrong arity, a plain ValueError for float or 1-D tokens, and out-of-vocabulary ids or
    clean and corrupt inputs of different arities silently computed."""
    with pytest.raises(DataError, match=says):
        fn(lm if which == "lm" else seq2seq, clean, corrupt, "resid_pre", metric)


@BOTH
@pytest.mark.parametrize("shift", [20, -5])
def test_an_lms_positions_outside_its_position_table_are_named(table_lm, fn, shift):
    """Before: under the program's jit the table lookup cannot raise: positions past model.max_len gave NaN
    everywhere (without a word), negative ones read other rows."""
    positions = jnp.broadcast_to(jnp.arange(T), (2, T)) + shift
    with pytest.raises(DataError, match=rf"clean input 1 \[2, 6\]: row 0, position 0 holds {shift}, outside the "
                                        rf"position table \[0, 8\) \(model.max_len\)"):
        fn(table_lm, (TOKENS, positions), (CORRUPT, positions), "resid_pre", metric)


@pytest.mark.parametrize("batch", [0, -1, 1.5, True])
def test_a_batch_that_is_no_positive_integer_is_named(lm, batch):
    """Before: -1 a reshape TypeError, 1.5 'float object cannot be interpreted as an integer' (0 and True ran)."""
    with pytest.raises(ConfigError, match=rf"batch={batch!r} must be None or an integer >= 1"):
        patching_grid(lm, (TOKENS,), (CORRUPT,), "resid_pre", metric, batch=batch)


@BOTH
def test_a_metric_the_corruption_does_not_move_cannot_be_normalised(lm, fn):
    """Before: every cell NaN (0/0) without a word; normalize=False still gives the (zero) effects."""
    says = r"metric\(clean\) = (\S+), metric\(corrupt\) = \1: normalize=True .* normalize=False"
    with pytest.raises(DataError, match=says):
        fn(lm, (TOKENS,), (TOKENS,), "resid_pre", metric)
    np.testing.assert_array_equal(np.asarray(fn(lm, (TOKENS,), (TOKENS,), "resid_pre", metric, normalize=False)),
                                  0.0)


@BOTH
def test_a_metric_that_is_not_finite_is_named(lm, fn):
    """Before: every cell NaN, without a word."""
    with pytest.raises(DataError, match=r"metric\(clean\) = -inf, metric\(corrupt\) = -inf: a metric that is not "
                                        r"finite"):
        fn(lm, (TOKENS,), (CORRUPT,), "resid_pre", lambda logits: jnp.log(0.0 * logits[0, -1, 1]), normalize=False)


@BOTH
@pytest.mark.parametrize("site, over, says", [
    (3, "position", r"activation site 3 does not exist"),
    ("embed", "position", r"'embed' is model-level"),
    ("resid_pre", "head", r"site 'resid_pre' \(2, 6, 16\) has no head axis")])
def test_sites_named_already_stay_named(lm, fn, site, over, says):
    with pytest.raises(ConfigError, match=says):
        fn(lm, (TOKENS,), (CORRUPT,), site, metric, over=over)
