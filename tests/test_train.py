"""Training: the step learns, pads are inert, weight decay hits matrices only, resume is bitwise (also with the
vocabulary taken from the data), tokens/s is per interval, configs are checked once after all overrides."""
import json
import logging
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import ROOT, records, tiny_lm, tiny_reverse, train_losses

from jaxformer.cli import main as cli_main
from jaxformer.config import ConfigError, OptimConfig, resolve_vocab
from jaxformer.configio import apply_overrides, load_config_file
from jaxformer.data import DataError, build_task
from jaxformer.nn import build_model
from jaxformer.nn.params import matrix_mask
from jaxformer.train import loop, monitor
from jaxformer.train.loop import train
from jaxformer.ops.losses import token_losses
from jaxformer.train.optim import optimizer, schedule
from jaxformer.train.step import forward, init_state, make_train_step


def prepared(cfg):
    task = build_task(cfg.data)
    cfg = resolve_vocab(cfg, task.tokenizer.vocab_size)
    return cfg, task, *init_state(cfg)


def test_step_lowers_loss_and_overfits_a_tiny_batch():
    cfg, task, graphs, state = prepared(tiny_reverse("model.runtime.dropout=0.0", "optim.schedule=constant",
                                                     "optim.lr=3e-3"))
    step = make_train_step(graphs, cfg)
    batch = {k: v[:4] for k, v in task.train.items()}
    losses, accs = [], []
    for i in range(200):
        state, m = step(state, batch, jax.random.key(i))
        losses.append(float(m["loss"]))
        accs.append(float(m["token_accuracy"]))
    assert losses[10] < losses[0]
    # memorised: every target token right, and the loss a small fraction of the start (~ln V) on any machine
    assert accs[-1] == 1.0 and losses[-1] < 0.05 * losses[0], (accs[-1], losses[0], losses[-1])


def test_pad_tokens_change_neither_loss_nor_gradients():
    cfg, task, graphs, state = prepared(tiny_reverse("model.runtime.dropout=0.0"))
    batch = {k: jnp.asarray(v[:8]) for k, v in task.train.items()}
    padded = {k: jnp.pad(v, ((0, 0), (0, 3))) for k, v in batch.items()}  # three more pad columns

    @jax.jit
    def loss_and_grads(model_state, b):
        def loss(m):
            s = token_losses(*forward(m, b)[:2], cfg.model.pad_id)
            return s["nll"] / s["count"]
        return nnx.value_and_grad(loss)(nnx.merge(graphs.model, model_state))

    (l1, g1), (l2, g2) = loss_and_grads(state["model"], batch), loss_and_grads(state["model"], padded)
    np.testing.assert_allclose(l1, l2, rtol=1e-6, atol=1e-7)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mask", ["matrices", "all"])
def test_adamw_weight_decay_applies_to_matrices_only_by_default(mask):
    """With zero gradients AdamW's update is -lr·wd·param: matrices shrink; biases, norm scales and the
    embedding table stay put unless optim.weight_decay_mask='all'."""
    model = build_model(tiny_reverse().model)
    params = nnx.state(model, nnx.Param)
    matrices = matrix_mask(model)
    tx = optimizer(OptimConfig(weight_decay=0.5, lr=0.1, schedule="constant", clip_norm=0.0,
                               weight_decay_mask=mask), 10, matrices)
    updates, _ = jax.jit(lambda p: tx.update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p))(params)
    flat_u, flat_p, flat_m = (dict(nnx.to_flat_state(x)) for x in (updates, params, matrices))
    names = {"/".join(map(str, k)) for k in flat_p}
    assert {"embed/tokens", "decoder/layers/blocks/ffn/b1", "encoder/layers/blocks/res_attn/norm/scale"} <= names
    assert sum(flat_m.values()) >= 8 and not all(flat_m.values())
    # independently of the implementation's own marks: the projections are the matrices, by name
    projections = {"wq", "wk", "wv", "wo", "w1", "w2", "wg", "head", "router"}
    assert {k: flat_m[k] for k in flat_p} == {k: str(k[-1]) in projections for k in flat_p}
    for k, p in flat_p.items():
        decayed = flat_m[k] or mask == "all"
        want = -0.1 * 0.5 * np.asarray(p[...]) if decayed else np.zeros(p.shape)
        np.testing.assert_allclose(np.asarray(flat_u[k][...]), want, rtol=1e-6, atol=1e-8, err_msg=str(k))


@pytest.mark.slow          # three trainings; the default lane resumes (with dropout) in tests/test_runs.py
def test_resume_is_bitwise_equal_with_vocab_from_the_data(tmp_path):
    """configs/alice.py (model.vocab_size=0, the built-in corpus): a run interrupted at step 3 and rerun with
    the same command gives the same per-step losses, bit for bit, and one record per step."""
    cfg = tiny_lm("train.steps=6", "train.log_every=1", "train.checkpoint_every=2", "train.eval_every=100")
    assert cfg.model.vocab_size == 0
    full = train(cfg, tmp_path / "full", progress="none")
    part = train(cfg, tmp_path / "resumed", stop_after=3, progress="none")
    assert part["status"] == "interrupted" and part["step"] == 3
    rest = train(cfg, tmp_path / "resumed", progress="none")
    assert full["status"] == rest["status"] == "completed" and rest["step"] == 6
    a, b = train_losses(tmp_path / "full"), train_losses(tmp_path / "resumed")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert all(a[s] == b[s] for s in a), {s: (a[s], b[s]) for s in a if a[s] != b[s]}  # bitwise
    again = train(cfg, tmp_path / "resumed", progress="none")          # a finished run, rerun: nothing to do
    assert again["status"] == "completed" and again["step"] == 6 and train_losses(tmp_path / "resumed") == b
    # each attempt appends its phase timings (make run's wall-time split): which steps, and all phases >= 0
    attempts = [json.loads(line) for line in (tmp_path / "resumed/timings.jsonl").read_text().splitlines()]
    assert [(t["from_step"], t["to_step"]) for t in attempts] == [(0, 3), (3, 6), (6, 6)]
    assert all(t[k] >= 0 for t in attempts for k in loop.TIMINGS) and attempts[0]["first_step"] > 0
    assert rest["timings"] == {k: attempts[1][k] for k in loop.TIMINGS}


@pytest.mark.slow          # a throughput bookkeeping check: ~7 s of training
def test_tokens_per_second_measures_the_last_interval_only(tmp_path, monkeypatch):
    """A fake clock advancing 10 s per reading: each train record's tokens_per_s must be that interval's
    tokens / 10 s (an LM batch holds exactly B·T target tokens), not the average since the start."""
    clock = iter(np.arange(1000.0) * 10.0)
    monkeypatch.setattr(monitor, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    cfg = tiny_lm("train.steps=6", "train.log_every=2", "train.eval_every=100", "train.checkpoint_every=100")
    train(cfg, tmp_path, progress="none")
    rates = [r["tokens_per_s"] for r in records(tmp_path) if r["split"] == "train"]
    per_interval = 2 * cfg.data.batch_size * cfg.data.block_size
    assert rates == [per_interval / 10.0] * 3, rates


def test_schedules():
    noam = schedule(OptimConfig(lr=1.0, schedule="noam", warmup_steps=100), 1000)
    assert float(noam(49)) == pytest.approx(0.5) and float(noam(99)) == pytest.approx(1.0)
    assert float(noam(399)) == pytest.approx(0.5)
    cos = schedule(OptimConfig(lr=1.0, schedule="warmup_cosine", warmup_steps=10), 110)
    assert float(cos(0)) == 0.0 and float(cos(10)) == pytest.approx(1.0) and float(cos(110)) < 1e-6
    assert float(schedule(OptimConfig(lr=0.3, schedule="constant"), 10)(7)) == pytest.approx(0.3)
    assert isinstance(optimizer(OptimConfig(name="sgd"), 10), optax.GradientTransformation)


# ----------------------------------------------------------------------------- configs

@pytest.mark.parametrize("override, key", [
    ("model.d_modl=64", "model.d_modl"),            # unknown key
    ("optim.lr=fast", "optim.lr"),                  # wrong type
    ("model.d_model=33", "model.d_model=33"),       # impossible value (not a multiple of heads)
    ("data.task=sort", "data.task"),
    ("train.best_metric=bleu", "train.best_metric"),
    ("model.max_len=4", "model.max_len=4"),         # data needs length 7
    ("optim.weight_decay_mask=some", "optim.weight_decay_mask"),
])
def test_bad_overrides_are_rejected_naming_the_key(override, key, capsys):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_reverse(override)
    assert cli_main(["train", str(ROOT / "configs/reverse.py"), "--set", override]) == 2
    assert key in capsys.readouterr().out.replace("\n", "")


def test_overrides_are_validated_once_after_all_of_them_in_any_order():
    base = load_config_file(ROOT / "configs/alice.py")
    a = apply_overrides(base, ["data.block_size=5000", "model.max_len=10000"])   # invalid in between
    b = apply_overrides(base, ["model.max_len=10000", "data.block_size=5000"])
    assert a == b and a.data.block_size == 5000 and a.model.max_len == 10000
    with pytest.raises(ConfigError, match=r"model\.max_len=100"):
        apply_overrides(base, ["data.block_size=5000"])                          # invalid at the end


def test_the_builtin_alice_is_the_file_project_gutenberg_distributes():
    """Shipped byte for byte (BOM, CRLF, header and licence; sha256 from ../shared/data/README.md), so that
    `jaxformer train configs/alice.py` works on a fresh clone and reads the text the seeds read."""
    import hashlib

    from jaxformer.data.text import corpus_path, load_text
    raw = corpus_path("builtin:alice").read_bytes()
    assert hashlib.sha256(raw).hexdigest() == "f00b287e63f5ae3442dc5b9c4bf18650adaf3b7f5034f7be5460089b934a0752"
    assert raw.startswith(b"\xef\xbb\xbf") and b"\r\n" in raw
    assert load_text("builtin:alice").startswith("ALICE'S ADVENTURES IN WONDERLAND")
    with pytest.raises(DataError, match="unknown built-in corpus 'builtin:bob'.*builtin:alice"):
        load_text("builtin:bob")


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.py")), ids=lambda p: p.name)
def test_every_config_file_loads_and_builds(path, request):
    """Every shipped config builds its data and model: the built-in corpus, or (for a corpus read by path) the
    file of that name in the real-corpora folder (token shards: prepared from it here), skipped with a reason
    where that folder is absent."""
    cfg = load_config_file(path)
    if cfg.data.task == "text" and not cfg.data.path.startswith("builtin:"):
        folder = request.getfixturevalue("data_dir")
        cfg = apply_overrides(cfg, [f"data.path={folder / Path(cfg.data.path).name}"])
    if cfg.data.task == "tokens":             # shards of the real corpus, prepared as the config's docstring says
        from jaxformer.data.prepare import prepare
        out = request.getfixturevalue("tmp_path") / "shards"
        prepare([request.getfixturevalue("data_dir") / "tiny_shakespeare.txt"], out, tokenizer="bpe",
                vocab_size=512, progress=False)
        cfg = apply_overrides(cfg, [f"data.path={out}"])
    cfg = resolve_vocab(cfg, build_task(cfg.data).tokenizer.vocab_size)
    abstract = nnx.eval_shape(lambda: build_model(cfg.model))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param))) > 0
    assert cfg.data.task != "text" or not Path(load_config_file(path).data.path).is_absolute()


@pytest.mark.slow          # default-lane budget (~10 s)
def test_train_and_eval_steps_compile_once_across_steps_and_after_a_resume(tmp_path, caplog):
    """One compiled train step for the whole run (no retrace from weak types, shardings or donation after the
    first step), the evaluation compiled once per batch shape, and the same again in a resumed run."""
    cfg = tiny_lm("train.steps=8", "train.log_every=2", "train.eval_every=4", "train.checkpoint_every=4")

    def compiles():
        text = caplog.text
        caplog.clear()
        return {name: text.count(f"Compiling jit({name})") for name in ("train_step", "eval_step", "_track")}

    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        train(cfg, tmp_path, stop_after=4, progress="none")          # 4 steps, an eval, a checkpoint
        first = compiles()
        train(cfg, tmp_path, progress="none")                         # resumes at 4: 4 more steps, 1 more eval
        second = compiles()
    assert first["train_step"] == 1 and second["train_step"] == 1, (first, second)
    assert 1 <= first["eval_step"] <= 2 and second["eval_step"] == first["eval_step"], (first, second)
    assert first["_track"] <= 1 and second["_track"] == 0, (first, second)


@pytest.mark.slow          # ~18 s: two runs and a resume; the default lane resumes in tests/test_runs.py
def test_resume_with_dropout_is_bitwise_equal(tmp_path):
    """Dropout on: the per-step dropout keys must continue, not restart, when a run resumes."""
    cfg = tiny_lm("model.runtime.dropout=0.3", "train.steps=4", "train.log_every=1", "train.checkpoint_every=2",
                  "train.eval_every=100", "train.num_examples=0")
    train(cfg, tmp_path / "full", progress="none")
    train(cfg, tmp_path / "resumed", stop_after=2, progress="none")
    train(cfg, tmp_path / "resumed", progress="none")
    a, b = train_losses(tmp_path / "full"), train_losses(tmp_path / "resumed")
    assert sorted(a) == list(range(1, 5)) and a == b, (a, b)


def test_logged_grad_norm_is_the_unclipped_norm_and_clipping_scales_the_update():
    """SGD lr 1 with optim.clip_norm=c: the logged grad_norm is |g| of the independently computed gradient, and
    the update is -c·g/|g| when |g| > c."""
    cfg, task, graphs, state = prepared(tiny_lm("optim.name=sgd", "optim.lr=1.0", "optim.schedule=constant",
                                                "optim.clip_norm=0.01", "optim.warmup_steps=0",
                                                "model.runtime.dropout=0"))
    batch = {k: jnp.asarray(v[:8]) for k, v in task.train.items()}

    def loss(m):
        logits, targets, _ = forward(m, batch)
        t = token_losses(logits, targets, cfg.model.pad_id)
        return t["objective"] / t["count"]
    params = lambda st: nnx.state(nnx.merge(graphs.model, st), nnx.Param)           # noqa: E731
    before = jax.tree.map(jnp.copy, params(state["model"]))
    g = nnx.jit(nnx.grad(loss))(nnx.merge(graphs.model, state["model"]))           # w.r.t. the parameters
    norm = float(optax.global_norm(g))
    new, m = make_train_step(graphs, cfg)(state, batch, jax.random.key(0))
    assert norm > 0.01 and abs(float(m["grad_norm"]) - norm) <= 1e-5 * norm
    for p0, p1, gi in zip(jax.tree.leaves(before), jax.tree.leaves(params(new["model"])), jax.tree.leaves(g)):
        np.testing.assert_allclose(np.asarray(p1), np.asarray(p0 - 0.01 * gi / norm), rtol=1e-5, atol=1e-7)


@pytest.mark.slow          # two training runs (~11 s)
def test_init_from_starts_a_fresh_run_from_another_runs_weights(tmp_path):
    """train.init_from: the new run's step-0 weights are the source's best weights (not a random init), its
    optimizer state is fresh, and a source with another model is refused naming the fields."""
    from jaxformer.inference import load_model
    steps = ["train.steps=2", "train.eval_every=2", "train.checkpoint_every=2", "train.best_metric=loss",
             "train.best_mode=min", "model.runtime.dropout=0.0"]
    train(tiny_lm(*steps), tmp_path / "a", progress="none")
    source = nnx.state(load_model(tmp_path / "a", "best").model, nnx.Param)
    seen = {}
    cfg = tiny_lm(*steps, f"train.init_from={tmp_path / 'a'}", "optim.lr=1e-4", "train.seed=7",
                  "model.runtime.remat=full")                         # a field that changes no weight may differ
    host = lambda tree: [np.asarray(x) for x in jax.tree.leaves(tree)]          # noqa: E731 (the step donates)
    train(cfg, tmp_path / "b", progress="none", stop_after=1,
          on_start=lambda p: seen.update(model=host(nnx.state(nnx.merge(p.graphs.model, p.state["model"]),
                                                              nnx.Param)), opt=host(p.state["opt"])))
    for a, b in zip(host(source), seen["model"]):
        np.testing.assert_array_equal(a, b)
    moments = [x for x in seen["opt"] if x.ndim > 0]
    assert moments and all((m == 0).all() for m in moments)                    # Adam's moments start at zero
    with pytest.raises(ConfigError, match="holds another model: model.d_ff: 32 there, 48 here"):
        train(tiny_lm(*steps, f"train.init_from={tmp_path / 'a'}", "model.d_ff=48"), tmp_path / "c",
              progress="none")
    with pytest.raises(ConfigError, match="is not a directory"):
        train(tiny_lm(*steps, f"train.init_from={tmp_path / 'nowhere'}"), tmp_path / "d", progress="none")
