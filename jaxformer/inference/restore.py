"""Restoring a trained model for inference: the model (no training data, no optimizer) from a run directory's
config.json, tokenizer.json and best (or latest) checkpoint, optionally quantized."""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxformer.config import Config, ModelConfig, flat_items, resolve_vocab
from jaxformer.errors import CheckpointError, ConfigError
from jaxformer.inference.weights import evaluated, item_for
from jaxformer.nn import build_model
from jaxformer.nn.lora import merged
from jaxformer.parallel import Plan, abstract_with_shardings, no_mesh
from jaxformer.runs import RunDir

log = logging.getLogger("jaxformer")


@dataclasses.dataclass
class LoadedModel:
    """A restored run's model with what reading it needs: its config and tokenizer (what `load_model` returns;
    `generate_text`, `default_prompts` and `jaxformer.inference.tasks` take it).

    Attributes:
      cfg: the run's `Config`, resolved (model.vocab_size filled in from the tokenizer).
      tokenizer: the run's tokenizer (its tokenizer.json).
      model: the model (a `jaxformer.nn` module), in the weights restored.
      step: the restored checkpoint's step.
      which: "best" or "latest": the checkpoint kind it actually came from.

    Examples:
      >>> from jaxformer.config import Config, replaced
      >>> from jaxformer.data import resolve
      >>> from jaxformer.inference import LoadedModel, generate_text
      >>> from jaxformer.nn import build_model
      >>> cfg, task = resolve(replaced(Config(), model__vocab_size=13, model__d_model=16, model__d_ff=32,
      ...                              model__num_heads=2, model__num_encoder_layers=1,
      ...                              model__num_decoder_layers=1, model__max_len=16))   # digit reversal
      >>> run = LoadedModel(cfg, task.tokenizer, build_model(cfg.model, seed=0), step=0, which="latest")
      >>> run.cfg.model.vocab_size, type(run.tokenizer).__name__, type(run.model).__name__
      (13, 'DigitTokenizer', 'Transformer')
      >>> len(generate_text(run, ["123", "4567"]))                  # any model, untrained here
      2
    """
    cfg: Config              # resolved (vocab_size filled in)
    tokenizer: object
    model: nnx.Module
    step: int                # the restored checkpoint's step
    which: str               # "best" | "latest": where it actually came from


def abstract_model(cfg: Config, plan: Plan | None = None):
    """(graphdef, abstract model state) of a resolved config: shapes and dtypes with shardings (the plan's, else
    one device), nothing allocated; the target to restore a model into.

    Args:
      cfg: a resolved `Config` (model.vocab_size filled in: `jaxformer.data.resolve`).
      plan: a `jaxformer.parallel.Plan`: its shardings (else one device).

    Returns:
      (graphdef, state): the model's `nnx.GraphDef` and its `nnx.State` of `jax.ShapeDtypeStruct` leaves, each
        with its sharding; `nnx.merge(graphdef, restored_state)` is the model.

    Examples:
      >>> import jax
      >>> from jaxformer.config import Config, replaced
      >>> from jaxformer.inference import abstract_model
      >>> cfg = replaced(Config(), model__vocab_size=13, model__d_model=16, model__d_ff=32, model__num_heads=2,
      ...                model__num_encoder_layers=1, model__num_decoder_layers=1, model__max_len=16)
      >>> graph, state = abstract_model(cfg)
      >>> leaf = jax.tree.leaves(state)[0]
      >>> type(leaf).__name__, leaf.dtype
      ('ShapeDtypeStruct', dtype('float32'))
    """
    with no_mesh():
        graph, abstract = nnx.split(nnx.eval_shape(lambda: build_model(cfg.model, seed=cfg.train.seed)))
    return graph, abstract_with_shardings(abstract, plan)


def load_model(workdir: str | Path, which: str = "best", plan: Plan | None = None,
               quantize: str | None = None, weights: str = "trained") -> LoadedModel:
    """Restore a run's model (no training data, no optimizer) from its `which` checkpoint ("best" or "latest");
    when that kind has no readable step, the other kind is used with a warning, and `which` of the result
    says so. plan: restore straight into that plan's shardings, else onto one device, whatever mesh the run
    was saved from. quantize: "int8" | "int4" | "w8a8" quantizes the restored weights for inference
    (`jaxformer.quantize`). weights: "trained" (what the run's eval/* metrics are of: the model's weights, or
    schedule-free AdamW's averaged iterate) | "ema" (the weights' EMA of a run with optim.ema set, its
    eval_ema/*); checkpoints hold each as a model item (`jaxformer.inference.weights`). Never writes to the
    run directory.

    Args:
      workdir: the run directory (`jaxformer.train.loop.train`'s, or `jaxformer import-hf`'s).
      which: "best" (by train.best_metric) or "latest".
      plan: a `jaxformer.parallel.Plan` to restore into (None: one device).
      quantize: None, or "int8" | "int4" | "w8a8" (`jaxformer.quantize.MODES`).
      weights: "trained" or "ema".

    Returns:
      A `LoadedModel`: the resolved config, the tokenizer, the model, the step and the kind it came from.

    Raises:
      ConfigError: `which`, `weights` or `quantize` not one of its values; `workdir` not a run directory (or
        without tokenizer.json); weights="ema" for a run trained without an EMA.
      CheckpointError: the run has no checkpoint yet, or none readable (the reasons named).

    Examples:
      >>> import tempfile
      >>> from jaxformer.config import Config, replaced
      >>> from jaxformer.inference import load_model
      >>> from jaxformer.train.loop import train
      >>> cfg = replaced(Config(), model__vocab_size=13, model__d_model=16, model__d_ff=32, model__num_heads=2,
      ...                model__num_encoder_layers=1, model__num_decoder_layers=1, model__max_len=16,
      ...                data__num_train=64, data__num_eval=16, data__batch_size=16, train__steps=2,
      ...                train__eval_batch_size=16, train__num_examples=0, train__peak_flops=1e12)
      >>> workdir = tempfile.mkdtemp()
      >>> _ = train(cfg, workdir, progress="none")                  # a digit-reversal run of 2 steps
      >>> run = load_model(workdir)
      >>> run.step, run.which, type(run.tokenizer).__name__
      (2, 'best', 'DigitTokenizer')
      >>> load_model(workdir, "newest")
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: which='newest' must be 'best' or 'latest'
    """
    if which not in ("best", "latest"):
        raise ConfigError(f"which={which!r} must be 'best' or 'latest'")
    if weights not in ("trained", "ema"):
        raise ConfigError(f"weights={weights!r} must be 'trained' or 'ema'")
    if quantize is not None:
        from jaxformer.quantize import MODES           # imported on use: it loads qwix
        if quantize not in MODES:
            raise ConfigError(f"quantize={quantize!r} is not one of {MODES}")
    run = RunDir(workdir)
    if not run.path.is_dir():
        raise ConfigError(f"{str(run.path)!r} is not a run directory")
    cfg = run.read_config()
    if not run.tokenizer_path.exists():
        raise ConfigError(f"{run.path} has no tokenizer.json (not a run directory)")
    tokenizer = run.read_tokenizer()
    cfg = resolve_vocab(cfg, tokenizer.vocab_size, getattr(tokenizer, "pad_id", None))
    if weights == "ema" and not cfg.optim.ema:
        raise ConfigError(f"weights='ema': {run.path} was trained without an EMA (optim.ema=0)")
    graph, abstract = abstract_model(cfg, plan)
    item = item_for(cfg.optim, weights)
    ckpt = run.checkpoints(cfg, read_only=True)
    try:
        errors = []
        for kind in (which, "latest" if which == "best" else "best"):
            restored = _restore_item(ckpt, kind, item, cfg, graph, abstract, errors)
            if restored is not None:
                if kind != which:
                    log.warning("%s has no readable %s checkpoint; using the %s one (step %d)", run.path, which,
                                kind, restored[1])
                model = nnx.merge(graph, restored[0])
                if quantize is not None:
                    from jaxformer.quantize import quantize_model
                    quantize_model(model, quantize)
                return LoadedModel(cfg, tokenizer, model, restored[1], kind)
    finally:
        ckpt.close()
    raise CheckpointError("; ".join(errors) if errors else f"{run.path} has no checkpoint yet (train saves one "
                          f"every train.checkpoint_every={cfg.train.checkpoint_every} steps and at the end)")


def _restore_item(ckpt, kind: str, item: str, cfg: Config, graph, abstract, errors: list):
    """-> (model state of `item`, step) from `kind`'s first readable step, or None (reasons appended to errors).
    Steps saved before the evaluated views were items (`jaxformer.inference.weights`) hold them only inside the
    optimizer state: read as saved and computed from it."""
    legacy = item != "model" and not all(ckpt.has_item(kind, s, item) for s in ckpt.steps(kind))
    try:
        restored = ckpt.restore({"model": abstract, "opt": None} if legacy else {item: abstract}, (kind,))
    except CheckpointError as e:
        errors.append(str(e))
        return None
    if restored is None:
        return None
    if legacy:                              # the optimizer state came back as saved: onto the model's shardings
        opt = jax.tree.map(np.asarray, restored.items["opt"])
        views = evaluated(cfg.optim, graph, restored.items["model"], opt)
        return jax.tree.map(lambda a, x: jax.device_put(x, a.sharding), abstract, views[item]), restored.step
    return restored.items[item], restored.step


def pretrained_state(source: str | Path, model: ModelConfig, plan: Plan | None = None,
                     tokenizer=None) -> nnx.State:
    """The model state to start a run from (train.init_from): a Hugging Face checkpoint folder (config.json with
    a model_type) or a jaxformer run directory (its best checkpoint), in the plan's shardings. ConfigError unless
    its model is `model` up to its runtime section (`ModelConfig.function`; naming the fields that differ), or
    when `tokenizer` (the new run's) gives ids other meanings than the source's tokenizer does (a vocabulary of
    the same size is not enough: each id must stand for the same text)."""
    src = Path(source)
    if not src.is_dir():
        raise ConfigError(f"train.init_from={str(source)!r} is not a directory (a Hugging Face checkpoint folder "
                          f"or a jaxformer run directory)")
    hf = (src / "config.json").is_file() and "model_type" in json.loads((src / "config.json").read_text("utf-8"))
    if tokenizer is not None:
        from jaxformer.data.tokenizers import pretrained_tokenizer, tokenizer_difference
        theirs = pretrained_tokenizer(src) if hf else RunDir(src).read_tokenizer()
        why = tokenizer_difference(theirs, tokenizer)
        if why:
            raise ConfigError(f"train.init_from={str(source)!r} was trained with another tokenizer than this run's "
                              f"data uses ({why}); its weights would read these ids as other text" +
                              (f"; prepare the data with its tokenizer: `jaxformer data prepare INPUT --tokenizer "
                               f"{source} --out DIR`" if hf else ""))
    if hf:
        from jaxformer.hf import from_pretrained
        loaded = from_pretrained(src, dtype=model.runtime.dtype, plan=plan)
    else:
        loaded = load_model(src, "best", plan).model
    if loaded.cfg.function() != model.function():
        theirs, ours = flat_items(loaded.cfg.function()), flat_items(model.function())
        diffs = [f"model.{k}: {theirs[k]!r} there, {v!r} here" for k, v in ours.items() if theirs[k] != v]
        raise ConfigError(f"train.init_from={str(source)!r} holds another model: " + "; ".join(diffs))
    return nnx.state(merged(loaded))                       # a run with adapters: its function, adapters folded in
