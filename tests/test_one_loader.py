"""One model loader for every verb (issue 45, V.3): checkpoints hold the weights a run evaluates as model items
("eval": schedule-free AdamW's averaged iterate, "eval_ema": the EMA), and `jaxformer.inference.load_model`
reads them with the model's shapes only. Before: `jaxformer viz` and `export-hf` of a schedule-free run exited 2
("load it with jaxformer.train.weights.load_model", a Python function a CLI user cannot call).

Wrong implementations these catch: the views not saved (or saved for a run that has none), the item read for
the wrong `weights`, a view that is the training weights (schedule-free's y, or the model for "ema"), a verb
that still reads "model", and runs saved before the items existed no longer loading (or loading other weights).
"""
from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from helpers import cli_args, records, TINY_LM
from jaxformer.cli import main as cli_main
from jaxformer.inference import load_model
from jaxformer.inference.weights import item_for
from jaxformer.runs import RunDir

pytestmark = pytest.mark.slow      # three CLI trainings (~12 s) before the first test; plain runs load everywhere

ARMS = {"schedule_free": ["optim.name=schedule_free", "optim.schedule=constant", "optim.lr=3e-3",
                          "optim.warmup_steps=2"],
        "ema": ["optim.ema=0.9", "optim.lr=1e-2"],
        "adamw": []}
LLAMA = ["model.norm.position=pre", "model.norm.type=rmsnorm", "model.positional=rope", "model.activation=swiglu",
         "model.use_bias=false", "model.scale_embeddings=false"]             # a shape export-hf writes (Llama)
STEPS = ["train.steps=4", "train.eval_every=4", "train.log_every=4", "train.checkpoint_every=2",
         "train.num_examples=0", "train.peak_flops=1e9"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One tiny LM run per optimizer arm, trained through the command line."""
    root = tmp_path_factory.mktemp("loader")
    for arm, extra in ARMS.items():
        assert cli_main(["train", *cli_args("configs/alice.py", TINY_LM + LLAMA + extra + STEPS),
                         "--workdir", str(root / arm), "--no-progress"]) == 0
    return root


def _params(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))]


def _items(run, step: int) -> set[str]:
    return {p.name for p in (RunDir(run).path / "checkpoints" / "latest" / str(step)).iterdir() if p.is_dir()}


def test_checkpoints_hold_the_evaluated_weights_as_model_items(runs):
    assert _items(runs / "schedule_free", 4) == {"model", "opt", "data", "eval"}
    assert _items(runs / "ema", 4) == {"model", "opt", "data", "eval_ema"}
    assert _items(runs / "adamw", 4) == {"model", "opt", "data"}
    assert _items(runs / "schedule_free", 2) == {"model", "opt", "data", "eval"}      # a save without an eval too


@pytest.mark.parametrize("arm, weights, split", [("schedule_free", "trained", "eval"), ("ema", "trained", "eval"),
                                                  ("ema", "ema", "eval_ema"), ("adamw", "trained", "eval")])
def test_the_loaded_weights_are_the_ones_the_run_evaluated(runs, arm, weights, split):
    """Evaluating the loaded weights gives the loss the training loop logged for them."""
    from jaxformer.inference import evaluate_run
    logged = next(r for r in records(runs / arm) if r["split"] == split and r["step"] == 4)["loss"]
    np.testing.assert_allclose(evaluate_run(runs / arm, "latest", weights=weights)["eval"]["loss"], logged,
                               rtol=1e-6)


def test_the_views_differ_from_the_training_weights(runs):
    sf_x = load_model(runs / "schedule_free", "latest")
    ema = load_model(runs / "ema", "latest", weights="ema")
    trained = load_model(runs / "ema", "latest")
    for a, b in ((sf_x, None), (ema, trained)):
        if b is None:          # schedule-free: x is not the y the gradients were taken at (the "model" item)
            b_params = _restore_item(runs / "schedule_free", "model", a)
        else:
            b_params = _params(b.model)
        assert max(np.abs(x - y).max() for x, y in zip(_params(a.model), b_params)) > 1e-5


def _restore_item(run, item, like):
    import orbax.checkpoint as ocp
    ckpt = RunDir(run).checkpoints(like.cfg, read_only=True)
    try:
        state = nnx.state(like.model)
        target = {item: jax.tree.map(ocp.utils.to_shape_dtype_struct, state)}
        return _params(nnx.merge(nnx.graphdef(like.model), ckpt.restore(target, ("latest",)).items[item]))
    finally:
        ckpt.close()


@pytest.mark.slow          # five verbs x three weight choices (~25 s)
@pytest.mark.parametrize("arm", ["schedule_free", "ema"])
def test_every_verb_reads_every_run(runs, tmp_path, capsys, arm):
    """eval, eval --data, generate, viz and export-hf: exit 0 on schedule-free and EMA runs, each weights choice."""
    run = str(runs / arm)
    text = tmp_path / "t.txt"
    text.write_text("Alice was beginning to get very tired of sitting by her sister on the bank. " * 3)
    for weights in (["trained", "ema"] if arm == "ema" else ["trained"]):
        w = ["--weights", weights]
        for argv in (["eval", "--workdir", run, *w], ["eval", "--workdir", run, "--data", str(text), *w],
                     ["generate", "--workdir", run, "--prompt", "Alice", "--max-new", "4", *w],
                     ["viz", "--workdir", run, "--prompt", "Alice", "--out", str(tmp_path / f"viz-{weights}"), *w],
                     ["export-hf", "--workdir", run, "--out", str(tmp_path / f"hf-{weights}"), *w]):
            rc = cli_main(argv)
            out = capsys.readouterr()
            assert rc == 0, (argv, out.out[-1500:], out.err[-1500:])
    if arm == "ema":                # the exported EMA is the EMA, not the trained weights
        from safetensors.numpy import load_file
        a, b = (load_file(str(next((tmp_path / f"hf-{w}").glob("*.safetensors")))) for w in ("trained", "ema"))
        assert a.keys() == b.keys() and any(not np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("arm, weights", [("schedule_free", "trained"), ("ema", "ema")])
def test_runs_saved_before_the_items_existed_load_the_same_weights(runs, tmp_path, arm, weights):
    """A checkpoint without its "eval"/"eval_ema" item (as every one saved before this change): the same weights,
    computed from the optimizer state as saved."""
    old = tmp_path / arm
    shutil.copytree(runs / arm, old)
    item = item_for(load_model(old, "latest").cfg.optim, weights)
    for step_dir in (old / "checkpoints").glob("*/*"):
        shutil.rmtree(step_dir / item)
    want, got = load_model(runs / arm, "latest", weights=weights), load_model(old, "latest", weights=weights)
    assert got.step == want.step == 4
    for a, b in zip(_params(got.model), _params(want.model)):
        np.testing.assert_array_equal(a, b)
