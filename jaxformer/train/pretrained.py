"""`jaxformer import-hf DIR --workdir RUN`: a Hugging Face checkpoint folder as a run directory at step 0: the
training state built with train.init_from=DIR, evaluated, and saved as the step-0 checkpoint.

An imported run is an ordinary run directory at step 0: config.json (the model from DIR's config.json, a
`tokens` task over shards prepared with DIR's tokenizer: the built-in corpus unless --data names prepared
shards, AdamW for fine-tuning), tokenizer.json, metrics.jsonl (the held-out evaluation of the imported weights)
and a checkpoint of step 0 (the weights, a fresh optimizer state, the data pipeline's first state). `eval`,
`generate` and `viz` read it like any run; `jaxformer train RUN/config.json --workdir RUN --set train.steps=N`
fine-tunes it in place; another run (other data or optimizer, a sweep) starts from it with
`--set train.init_from=RUN` (or from DIR itself).
"""
from __future__ import annotations

from pathlib import Path

from jaxformer.errors import Interrupted, RunDirError
from jaxformer.signals import Held


def import_run(source: str | Path, workdir: str | Path, *, data: str | Path | None = None,
               overrides: list[str] | tuple[str, ...] = (), progress: bool = False) -> dict:
    """Make RUN from the checkpoint folder `source` (module docstring). -> the held-out metrics of step 0.

    A RUN with no checkpoint (an earlier import refused or interrupted before its step 0 was saved) is free:
    the import starts it afresh, as `train` does. SIGINT/SIGTERM/SIGHUP are held and acted on between phases:
    Interrupted (exit 130), naming what was kept; a signal during the save lets the save finish first."""
    with Held(until="the import reaches a safe point") as sig:
        def stop_if_asked(kept: str):
            if sig.received:
                raise Interrupted(f"import-hf stopped on {sig.received}: {kept}", sig.received)
        metrics = _import(Path(source).absolute(), workdir, data, overrides, progress, stop_if_asked)
        stop_if_asked(f"the import had finished: {workdir} holds step 0")
    return metrics


def _import(source: Path, workdir, data, overrides, progress: bool, stop_if_asked) -> dict:
    from flax import nnx
    from jaxformer.config import Config, DataConfig, OptimConfig, TrainConfig
    from jaxformer.configio import apply_overrides
    from jaxformer.data.prepare import prepare
    from jaxformer.data.tokenizers import pretrained_tokenizer
    from jaxformer.hf.checkpoint import read_config
    from jaxformer.hf.families import to_model_config
    from jaxformer.inference.evaluate import evaluate
    from jaxformer.inference.weights import checkpoint_items
    from jaxformer.parallel import Plan
    from jaxformer.runs import RunDir
    from jaxformer.train.loop import prepare as prepare_state
    run, nothing = RunDir(workdir), f"nothing was saved; {workdir} is free for the same command"
    model = to_model_config(read_config(source))
    pretrained_tokenizer(source)                                        # refuse an unusable tokenizer before writing
    default_data = run.path / "data"
    block = min(128, model.max_len)
    cfg = Config(model=model, data=DataConfig(task="tokens", path=str(Path(data or default_data).absolute()),
                                              block_size=block, batch_size=8),
                 optim=OptimConfig(name="adamw", lr=1e-5, warmup_steps=0, schedule="constant", weight_decay=0.0),
                 train=TrainConfig(steps=100, eval_every=50, checkpoint_every=50, best_metric="loss",
                                   best_mode="min", eval_batch_size=8, num_examples=3, init_from=str(source)))
    cfg = apply_overrides(cfg, list(overrides))                         # a refused --set writes nothing
    plan = Plan(cfg.parallel)
    with run.lock():
        if run.has_checkpoint():                                        # under the lock: one import wins
            raise RunDirError(f"{run.path} already holds a run (a checkpoint); import into a new --workdir")
        if Path(cfg.data.path) == default_data.absolute() and not (default_data / "index.json").exists():
            from jaxformer.data.text import corpus_path
            prepare([corpus_path("builtin:alice")], default_data, tokenizer=str(source), progress=progress)
        stop_if_asked(f"{nothing} (the data prepared in {default_data} is kept and reused)")
        p = prepare_state(cfg, run, plan)
        try:
            stop_if_asked(nothing)
            with plan.use():
                metrics = evaluate(p.cfg, p.task, nnx.merge(p.graphs.model, p.state["model"]), plan=plan)
            stop_if_asked(nothing)
            rows = p.cfg.data.batch_size
            first = iter(p.task.train_dataset(rows, p.cfg.train.seed, plan.local_rows(rows))).get_state()
            p.ckpt.save(0, checkpoint_items(p.cfg.optim, p.graphs.model, p.state), first, metrics)
            log = run.metrics_log()
            log.write(0, "eval", metrics)
            log.close()
        finally:
            p.ckpt.close()
    return metrics
