"""model.runtime.param_dtype='bfloat16': parameters stored in bfloat16, the optimizer running on a float32 master copy
(`train.weights.with_master_weights`), the parameters the master rounded once after every step (issue W's
"bf16 parameters with a float32 master copy").

Wrong implementations these catch: no master copy (a bfloat16 parameter then never moves under updates smaller than
half its spacing: training silently stalls); a master copy that is updated but not what the parameters are made
from (they drift apart); constants (the sinusoidal table) rounded with the parameters; a bfloat16-parameter run
that cannot save and resume exactly; the combinations that cannot work accepted silently.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import tiny_lm, train_losses
from jaxformer.config import resolve_vocab
from jaxformer.errors import ConfigError
from jaxformer.train.step import init_state, make_train_step
from jaxformer.train.weights import with_master_weights

BF16 = ("model.runtime.dtype=bfloat16", "model.runtime.param_dtype=bfloat16")


def test_updates_below_bfloat16_spacing_accumulate_in_the_master_copy():
    """SGD steps of 1e-4 on a bfloat16 1.0 (spacing 2⁻⁷ below 1 ... 2⁻⁸ relative): 100 of them move it to
    0.99 through the master copy; applied to the bfloat16 value alone, every one rounds away."""
    params = {"w": jnp.ones((3,), jnp.bfloat16)}
    grads = {"w": jnp.ones((3,), jnp.bfloat16)}
    for tx, want in ((with_master_weights(optax.sgd(1e-4)), 0.99), (optax.sgd(1e-4), 1.0)):
        p, state = params, tx.init(params)
        for _ in range(100):
            u, state = tx.update(grads, state, p)
            p = optax.apply_updates(p, u)
        assert p["w"].dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(p["w"], np.float32), want, atol=2 ** -8)
        if isinstance(state, tuple) and hasattr(state, "master"):
            assert state.master["w"].dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(state.master["w"]), 0.99, rtol=1e-5)   # float32 sums
            np.testing.assert_array_equal(np.asarray(p["w"]), np.asarray(state.master["w"].astype(jnp.bfloat16)))


def _cfg(*extra):
    return resolve_vocab(tiny_lm("model.norm.position=pre", "model.runtime.dropout=0.0", "model.positional=sinusoidal",
                                 *extra), 40)


def test_training_keeps_bfloat16_parameters_as_the_rounded_master_and_tracks_float32_parameters():
    x = jnp.asarray(np.random.default_rng(0).integers(1, 40, (8, 17)), jnp.int32)
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:]}
    losses = {}
    for name, extra in (("f32 params", BF16[:1]), ("bf16 params", BF16)):
        graphs, state = init_state(_cfg(*extra))
        step = make_train_step(graphs, _cfg(*extra))
        losses[name] = []
        for i in range(25):
            state, m = step(state, batch, jax.random.key(i))
            losses[name].append(float(m["loss"]))
    leaves = jax.tree_util.tree_flatten_with_path(state["model"])[0]
    dtypes = {jax.tree_util.keystr(p): v.dtype for p, v in leaves}
    assert dtypes.pop("['embed']['table'].value") == jnp.float32           # a constant, not a parameter
    assert set(dtypes.values()) == {jnp.dtype(jnp.bfloat16)}
    master = state["opt"]["opt_state"]["master"]
    for (path, p), m in zip(jax.tree_util.tree_flatten_with_path(nnx_params(state, graphs))[0],
                            jax.tree.leaves(master)):
        assert m.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(p), np.asarray(m.astype(jnp.bfloat16)),
                                      err_msg=jax.tree_util.keystr(path))
    a, b = np.array(losses["f32 params"]), np.array(losses["bf16 params"])
    assert a[-1] < a[0] - 0.5 and b[-1] < b[0] - 0.5                       # both learn this batch
    np.testing.assert_allclose(b, a, rtol=0.03)                             # bfloat16 rounding of the weights


def nnx_params(state, graphs):
    from flax import nnx
    return nnx.state(nnx.merge(graphs.model, state["model"]), nnx.Param)


@pytest.mark.slow          # three short trainings (~25 s); the state layout itself: the test above, default lane
def test_a_bfloat16_parameter_run_resumes_exactly(tmp_path):
    from jaxformer.train.loop import train
    cfg = tiny_lm(*BF16, "train.steps=4", "train.log_every=1", "train.checkpoint_every=2", "train.eval_every=4",
                  "train.num_examples=1", "optim.ema=0.9")
    train(cfg, tmp_path / "full", progress="none")
    train(cfg, tmp_path / "resumed", stop_after=2, progress="none")
    train(cfg, tmp_path / "resumed", progress="none")
    a, b = train_losses(tmp_path / "full"), train_losses(tmp_path / "resumed")
    assert sorted(a) == [1, 2, 3, 4] and a == b


def test_combinations_that_cannot_work_are_named_errors():
    with pytest.raises(ConfigError, match="model.runtime.param_dtype='bfloat16'.*model.runtime.dtype='bfloat16'"):
        tiny_lm("model.runtime.param_dtype=bfloat16")
    with pytest.raises(ConfigError, match="param_dtype='bfloat16' with optim.name='schedule_free'"):
        tiny_lm(*BF16, "optim.name=schedule_free", "optim.schedule=constant", "optim.warmup_steps=0")
    with pytest.raises(ConfigError, match="model.runtime.param_dtype='float16'"):
        tiny_lm("model.runtime.param_dtype=float16")
