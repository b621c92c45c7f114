"""`jaxformer.platforms.lowering.unrolled_threefry`: jax's threefry2x32 lowered on CPU as straight-line code instead of a
5-trip while loop, changing the compiled program but never its bits.

Wrong implementations these tests catch: a rule registered for another platform or not at all (the loop stays
in the compiled program), a hand-written hash or a different counter layout (the bits differ from jax's rolled
lowering), a train step that is built without it (its program keeps the loops), and a choice that changes the
train step's result (dropout masks, key splits).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_reverse
from jaxformer.data import build_task
from jaxformer.config import resolve_vocab, replaced
from jaxformer.platforms.lowering import threefry_is_unrolled, unrolled_threefry
from jaxformer.train.step import init_state, make_train_step


@pytest.fixture(autouse=True)
def _restore():
    yield
    unrolled_threefry()                                            # the state jaxformer's builders leave


def _draws(key):
    k1, k2 = jax.random.split(key)
    return jax.random.bits(k1, (37, 11)), jax.random.bernoulli(k2, 0.9, (5, 64)), jax.random.split(k2, 3)


def _compiled(enable: bool):
    """(compiled HLO text, outputs) of a fresh jit of `_draws` lowered under the given choice."""
    assert unrolled_threefry(enable)
    f = jax.jit(lambda k: _draws(k))                               # a new function: nothing cached
    key = jax.random.key(7)
    return f.lower(key).compile().as_text(), [np.asarray(jax.random.key_data(x) if jnp.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x) for x in f(key)]


def test_unrolled_threefry_removes_the_loops_and_keeps_the_bits():
    rolled_hlo, rolled = _compiled(False)
    assert not threefry_is_unrolled()
    unrolled_hlo, unrolled = _compiled(True)
    assert threefry_is_unrolled()
    assert re.search(r" while\(", rolled_hlo)
    assert not re.search(r" while\(", unrolled_hlo)
    for a, b in zip(rolled, unrolled):
        np.testing.assert_array_equal(a, b)
    assert rolled[0].std() > 0 and 0.8 < rolled[1].mean() < 1.0  # real draws, not constants


def _one_step(graphs, cfg, state, batch, enable: bool | None):
    step = make_train_step(graphs, cfg)                            # the builder makes its choice ...
    if enable is not None:
        unrolled_threefry(enable)                                  # ... overridden before the first lowering
    hlo = step.lower(state, batch, jax.random.key(3)).compile().as_text()
    new, m = step(jax.tree.map(jnp.copy, state), batch, jax.random.key(3))
    return len(re.findall(r" while\(", hlo)), [np.asarray(x) for x in jax.tree.leaves(new["model"])], m


@pytest.mark.slow          # two train steps compiled (~13 s cold); the primitive's bits: the test above
def test_the_train_step_is_built_unrolled_with_the_same_result():
    cfg = tiny_reverse("model.runtime.dropout=0.3", "data.batch_size=8")
    task = build_task(cfg.data)
    cfg = resolve_vocab(cfg, task.tokenizer.vocab_size)
    graphs, state = init_state(cfg)
    batch = {name: jnp.asarray(v[:8]) for name, v in task.train.items()}
    unrolled_threefry(False)
    loops_rolled, params_rolled, m_rolled = _one_step(graphs, cfg, state, batch, enable=False)
    loops, params, m = _one_step(graphs, cfg, state, batch, enable=None)
    assert threefry_is_unrolled()                                  # make_train_step turned it on
    assert loops < loops_rolled                                    # the dropout bits' loops are gone
    assert float(m["loss"]) == float(m_rolled["loss"])
    for a, b in zip(params_rolled, params):
        np.testing.assert_array_equal(a, b)



@pytest.mark.slow          # ~9 s each; the train step's unrolled dropout bits stay in the default lane
@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_the_samplers_lower_unrolled_with_the_same_tokens(arch, monkeypatch):
    """generate_lm / generate_seq2seq make the choice too (their sampling draws bits at every token)."""
    from jaxformer import decode
    from jaxformer.config import ModelConfig
    from jaxformer.nn import build_model
    cfg = replaced(ModelConfig(), arch=arch, vocab_size=17, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48,
                      num_encoder_layers=1, num_decoder_layers=1, runtime__dropout=0.0, max_len=16)
    model = build_model(cfg, seed=0)
    prompts = jnp.arange(2, 8, dtype=jnp.int32).reshape(2, 3)
    if arch == "decoder_only":
        sample = lambda: decode.generate_lm(model, prompts, max_new=6, temperature=2.0,   # noqa: E731
                                            key=jax.random.key(1))
    else:
        sample = lambda: decode.generate_seq2seq(model, prompts, max_new=6, bos_id=1, eos_id=None,   # noqa: E731
                                                 temperature=2.0, key=jax.random.key(1))
    with monkeypatch.context() as m:                               # the sampler without its call: rolled
        m.setattr(decode, "unrolled_threefry", lambda: None)
        unrolled_threefry(False)
        jax.clear_caches()
        rolled = np.asarray(sample())
    unrolled_threefry(False)
    jax.clear_caches()
    tokens = np.asarray(sample())
    assert threefry_is_unrolled()                                  # the sampler turned it on before lowering
    np.testing.assert_array_equal(tokens, rolled)
    assert len(np.unique(tokens)) > 2                              # sampled, not constant


def test_train_compiler_options_only_on_cpu(monkeypatch):
    from jaxformer.platforms import lowering
    assert lowering.train_compiler_options() == lowering.TRAIN_CPU_OPTIONS    # the suite runs on CPU
    assert lowering.TRAIN_CPU_OPTIONS == {"xla_cpu_copy_insertion_use_region_analysis": True}
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert lowering.train_compiler_options() is None                          # XLA's defaults elsewhere


def _copies(hlo: str) -> int:
    return len(re.findall(r"= \S+ copy\(", hlo))


@pytest.mark.slow          # two train steps compiled (~10 s cold)
def test_the_train_step_compiles_with_fewer_copies_and_the_same_result(monkeypatch):
    """make_train_step passes `train_compiler_options()` to jax.jit: its compiled program has fewer copies than
    the same step with XLA's default options, and its result is bit-identical."""
    from jaxformer.platforms import lowering
    cfg = tiny_reverse("data.batch_size=8")
    task = build_task(cfg.data)
    cfg = resolve_vocab(cfg, task.tokenizer.vocab_size)
    graphs, state = init_state(cfg)
    batch = {name: jnp.asarray(v[:8]) for name, v in task.train.items()}
    out = {}
    for name, options in (("default", {}), ("ours", lowering.TRAIN_CPU_OPTIONS)):
        with monkeypatch.context() as m:
            m.setattr(lowering, "TRAIN_CPU_OPTIONS", options)
            step = make_train_step(graphs, cfg)
        hlo = step.lower(state, batch, jax.random.key(3)).compile().as_text()
        new, metrics = step(jax.tree.map(jnp.copy, state), batch, jax.random.key(3))
        out[name] = _copies(hlo), [np.asarray(x) for x in jax.tree.leaves(new["model"])], float(metrics["loss"])
    assert out["ours"][0] < out["default"][0]
    assert out["ours"][2] == out["default"][2]
    for a, b in zip(out["default"][1], out["ours"][1]):
        np.testing.assert_array_equal(a, b)
