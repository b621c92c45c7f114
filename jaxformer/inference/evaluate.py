"""Held-out evaluation of a model: teacher-forced loss, bits per byte and token accuracy, greedy exact match
where the architecture scores whole answers (seq2seq), decoded examples; `evaluate_run` does it for a run
directory's checkpoint.

Bits per byte (tokenizer-independent, so a character model and a BPE model compare): the summed negative
log-likelihood (nats) of the target tokens that stand for text, over ln 2 times the UTF-8 bytes those tokens
stand for (`tokenizer.token_bytes()`); special tokens (end of document, EOS) carry no bytes and are left out of
both sums, as nanochat does."""
from __future__ import annotations

from pathlib import Path

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer.arch import architecture
from jaxformer.config import Config
from jaxformer.data import Task, attention_fields, build_task
from jaxformer.data.tasks import length_segments, pad_batch
from jaxformer.inference.restore import load_model
from jaxformer.ops.losses import token_losses
from jaxformer.parallel import Plan


def make_eval_step(model_graph: nnx.GraphDef, cfg: Config, plan: Plan | None = None, token_bytes=None):
    """eval_step(model_state, batch) -> sums {nll, correct, count} (teacher forced, no dropout), and with
    token_bytes ([V] int, the tokenizer's) {text_nll, bytes}: the nll of the targets that stand for text and
    their bytes. Jitted (under a plan: the batch sharded by its rows, the sums replicated).

    Args:
      model_graph: the model's graphdef (`nnx.graphdef(model)`).
      cfg: the resolved `Config` (model.pad_id: targets equal to it count nowhere; model.arch: the batch layout).
      plan: a `jaxformer.parallel.Plan`: shard the batch by its rows (None: one device).
      token_bytes: [V] int, the UTF-8 bytes each id stands for (`tokenizer.token_bytes()`), for bits per byte;
        None: no text sums.

    Returns:
      eval_step(model_state, batch) -> {"nll", "correct", "count"} (and "text_nll", "bytes"), float32 scalars
        summed over the batch's target tokens; batch: the task's layout, [B, T] per field.

    Examples:
      >>> from flax import nnx
      >>> from jaxformer.config import Config, replaced
      >>> from jaxformer.data import resolve
      >>> from jaxformer.inference import make_eval_step
      >>> from jaxformer.nn import build_model
      >>> cfg, task = resolve(replaced(Config(), model__vocab_size=13, model__d_model=16, model__d_ff=32,
      ...                              model__num_heads=2, model__num_encoder_layers=1,
      ...                              model__num_decoder_layers=1, model__max_len=16, data__num_train=64,
      ...                              data__num_eval=16, train__eval_batch_size=16))   # digit reversal
      >>> model = build_model(cfg.model, seed=0)
      >>> eval_step = make_eval_step(nnx.graphdef(model), cfg, token_bytes=task.tokenizer.token_bytes())
      >>> sums = eval_step(nnx.state(model), next(task.eval_batches(16)))
      >>> sorted(sums)
      ['bytes', 'correct', 'count', 'nll', 'text_nll']
      >>> int(sums["count"]) - int(sums["bytes"])      # targets: the digits (a byte each) and 16 EOS (no text)
      16
    """
    pad, arch = cfg.model.pad_id, architecture(cfg.model.arch)
    table = None if token_bytes is None else np.asarray(token_bytes, np.float32)

    def eval_step(model_state, batch):
        logits, targets, _ = arch.forward(nnx.merge(model_graph, model_state), batch)
        s = token_losses(logits, targets, pad)
        out = {k: s[k] for k in ("nll", "correct", "count")}
        if table is not None:
            b = jnp.where(targets != pad, jnp.asarray(table)[targets], 0.0)
            text = token_losses(logits, jnp.where(b > 0, targets, pad), pad)      # the text targets alone
            out |= {"text_nll": text["nll"], "bytes": b.sum()}
        return out

    if plan is None:
        return jax.jit(eval_step)
    return jax.jit(eval_step, in_shardings=(None, plan.batch_sharding(2)), out_shardings=plan.replicated)


def evaluate(cfg: Config, task: Task, model: nnx.Module, eval_step=None, plan: Plan | None = None) -> dict:
    """Held-out loss and token accuracy (teacher forced); exact match by greedy decoding for seq2seq.

    Batches have one shape (the last is padded with all-pad rows that count nowhere), so each compiles once;
    under a plan they are global arrays of which this process reads only its rows.

    Args:
      cfg: the resolved `Config` (train.eval_batch_size: the batch rows; model.pad_id).
      task: the `Task` whose held-out set is scored (`task.eval`).
      model: the model to evaluate.
      eval_step: `make_eval_step(nnx.graphdef(model), cfg, plan)`, built once by a caller that evaluates often
        (None: built here).
      plan: a `jaxformer.parallel.Plan` (None: one device).

    Returns:
      {"loss": mean nll per target token, "token_accuracy"} and, where the tokenizer gives each id's bytes,
        "bits_per_byte" (module docstring); a seq2seq task adds "exact_match", the share of held-out answers
        decoded greedily exactly right.

    Examples:
      >>> from jaxformer.config import Config, replaced
      >>> from jaxformer.data import resolve
      >>> from jaxformer.inference import evaluate
      >>> from jaxformer.nn import build_model
      >>> cfg, task = resolve(replaced(Config(), model__vocab_size=13, model__d_model=16, model__d_ff=32,
      ...                              model__num_heads=2, model__num_encoder_layers=1,
      ...                              model__num_decoder_layers=1, model__max_len=16, data__num_train=64,
      ...                              data__num_eval=16, train__eval_batch_size=16))   # digit reversal
      >>> metrics = evaluate(cfg, task, build_model(cfg.model, seed=0))
      >>> sorted(metrics)
      ['bits_per_byte', 'exact_match', 'loss', 'token_accuracy']
      >>> metrics["exact_match"]                                   # an untrained model
      0.0
    """
    arch = architecture(cfg.model.arch)
    graph, state = nnx.split(model)
    bytes_of = getattr(task.tokenizer, "token_bytes", None)
    eval_step = eval_step or make_eval_step(graph, cfg, plan, bytes_of() if bytes_of else None)
    n_eval, pad = len(next(iter(task.eval.values()))), cfg.model.pad_id
    size = min(cfg.train.eval_batch_size, n_eval)
    if plan is not None:
        size = -(-size // plan.batch_shards) * plan.batch_shards
        mine = plan.local_rows(size)
    tot = {"nll": 0.0, "correct": 0.0, "count": 0.0, "text_nll": 0.0, "bytes": 0.0}
    exact, n = 0, 0
    for host in task.eval_batches(size, pad_id=pad):
        batch = host if plan is None else plan.global_batch({k: v[mine] for k, v in host.items()}, size)
        s = eval_step(state, batch)
        for k in s:
            tot[k] += float(s[k])
        if arch.exact_match:           # decoded tokens come back replicated: every process reads them whole
            want = arch.targets(host)
            pred = np.asarray(arch.predict(model, task.tokenizer, *arch.prompts(batch), want.shape[1]))
            real = (want != pad).any(1)
            exact += int((real & (pred == want).all(1)).sum())
            n += int(real.sum())
    out = {"loss": tot["nll"] / tot["count"], "token_accuracy": tot["correct"] / tot["count"]}
    if tot["bytes"] > 0:
        out["bits_per_byte"] = tot["text_nll"] / (math.log(2) * tot["bytes"])
    if arch.exact_match:
        out["exact_match"] = exact / n
    return out


def examples(task: Task, model: nnx.Module, k: int, batch_rows: int = 0) -> list[dict]:
    """k decoded held-out examples: input, target, prediction, ok (greedy answers for seq2seq; next-token
    predictions for a language model).

    Args:
      task: the `Task` whose first held-out rows are decoded (its tokenizer decodes them).
      model: the model.
      k: how many examples (<= 0: none).
      batch_rows: decode that many held-out rows and keep the first k (pass evaluation's batch size, and the
        decoder compiled for evaluation serves these too); 0: k rows.

    Returns:
      k dicts {"input", "target", "prediction": text, "ok": whether the prediction is the target exactly}.

    Examples:
      >>> from jaxformer.config import Config, replaced
      >>> from jaxformer.data import resolve
      >>> from jaxformer.inference import examples
      >>> from jaxformer.nn import build_model
      >>> cfg, task = resolve(replaced(Config(), model__vocab_size=13, model__d_model=16, model__d_ff=32,
      ...                              model__num_heads=2, model__num_encoder_layers=1,
      ...                              model__num_decoder_layers=1, model__max_len=16, data__num_train=64,
      ...                              data__num_eval=16, train__eval_batch_size=16))   # digit reversal
      >>> rows = examples(task, build_model(cfg.model, seed=0), k=2)
      >>> [(r["input"], r["target"]) for r in rows]                  # reversal: the target reads backwards
      [('68925', '52986'), ('160', '061')]
      >>> sorted(rows[0])
      ['input', 'ok', 'prediction', 'target']
    """
    if k <= 0:
        return []
    tok = task.tokenizer
    rows = architecture(model.cfg.arch).examples(model, task, k, batch_rows)
    return [{"input": tok.decode(x), "target": tok.decode(y), "prediction": tok.decode(p), "ok": bool(np.all(p == y))}
            for x, y, p in rows]


def evaluate_run(workdir: str | Path, which: str = "best", quantize: str | None = None,
                 weights: str = "trained") -> dict:
    """Restore a run's best (or latest) model (quantized: see `jaxformer.quantize`; weights: `load_model`) and
    evaluate it on the held-out set (needs the run's data): what `jaxformer eval --workdir RUN` prints.

    Args:
      workdir: the run directory.
      which: "best" or "latest" (`load_model`).
      quantize: None, or "int8" | "int4" | "w8a8": evaluate the quantized model.
      weights: "trained" or "ema" (`load_model`).

    Returns:
      {"step", "which" (the checkpoint actually used), "eval" (`evaluate`'s metrics), "examples" (`examples`'
        train.num_examples decoded rows)}.

    Raises:
      ConfigError: as `load_model` (a bad `which`, `weights` or `quantize`; not a run directory).
      CheckpointError: the run has no readable checkpoint.
      DataError: the run's data cannot be read (a text file moved away, shards deleted).

    Examples:
      >>> import tempfile
      >>> from jaxformer.config import Config, replaced
      >>> from jaxformer.inference import evaluate_run
      >>> from jaxformer.train.loop import train
      >>> cfg = replaced(Config(), model__vocab_size=13, model__d_model=16, model__d_ff=32, model__num_heads=2,
      ...                model__num_encoder_layers=1, model__num_decoder_layers=1, model__max_len=16,
      ...                data__num_train=64, data__num_eval=16, data__batch_size=16, train__steps=2,
      ...                train__eval_batch_size=16, train__num_examples=0, train__peak_flops=1e12)
      >>> workdir = tempfile.mkdtemp()
      >>> _ = train(cfg, workdir, progress="none")                  # a digit-reversal run of 2 steps
      >>> out = evaluate_run(workdir, "latest")
      >>> out["step"], out["which"], sorted(out["eval"]), out["examples"]
      (2, 'latest', ['bits_per_byte', 'exact_match', 'loss', 'token_accuracy'], [])
    """
    loaded = load_model(workdir, which, quantize=quantize, weights=weights)
    task = build_task(loaded.cfg.data, loaded.tokenizer)
    return {"step": loaded.step, "which": loaded.which, "eval": evaluate(loaded.cfg, task, loaded.model),
            "examples": examples(task, loaded.model, loaded.cfg.train.num_examples)}


def strided_windows(ids: np.ndarray, window: int, stride: int, pad_id: int) -> dict[str, np.ndarray]:
    """Sliding-window scoring of a token sequence ids [N]: -> a batch {inputs, targets, segment_ids, positions}
    [n, window], targets pad where nothing is scored, segment 0 on the last window's padding. Window k reads ids[k·stride : k·stride + window] and predicts the next token at each position; it
    scores only the targets no earlier window scored, so every token after the first is scored exactly once,
    each with at least window − stride tokens of context (all of them in the first window)."""
    if not 0 < stride <= window:
        raise ValueError(f"stride={stride} must be in [1, window={window}]")
    n = len(ids)
    starts = list(range(0, max(n - 1 - window, 0) + stride, stride)) if n > 1 else []
    inputs = np.full((len(starts), window), pad_id, np.int32)
    targets, lengths = inputs.copy(), np.zeros(len(starts), np.int32)
    done = 0                                   # targets ids[1 .. done] are scored
    for r, s in enumerate(starts):
        x = ids[s: s + window]
        y = ids[s + 1: s + window + 1]
        inputs[r, : len(x)], lengths[r] = x, len(x)
        first = max(done + 1, s + 1)            # the first target index this window scores
        keep = np.arange(s + 1, s + 1 + len(y)) >= first
        targets[r, : len(y)] = np.where(keep, y, pad_id)
        done = max(done, s + len(y))
    return {"inputs": inputs, "targets": targets, **attention_fields(length_segments(lengths, window))}


def evaluate_text(run, path: str | Path, *, stride: int | None = None, batch_size: int = 32) -> dict:
    """Strided (sliding-window) perplexity and bits per byte of a UTF-8 text file under a loaded LM run
    (`load_model`), with the run's tokenizer and its trained context (data.block_size) as the window; stride
    defaults to half the window. -> {loss, perplexity, bits_per_byte, tokens, bytes, window, stride}."""
    from jaxformer.errors import ConfigError, DataError
    cfg, tok = run.cfg, run.tokenizer
    if cfg.model.arch != "decoder_only":
        raise ConfigError(f"eval --data scores text with a language model; this run is {cfg.model.arch!r}")
    p = Path(path)
    if not p.is_file():
        raise DataError(f"--data {str(p)!r} is not a readable file")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"--data {str(p)!r} is not UTF-8: {e}") from None
    ids = np.asarray(tok.encode(text), np.int32)
    if len(ids) < 2:
        raise DataError(f"--data {str(p)!r} gives {len(ids)} token(s): nothing to predict")
    window = cfg.data.block_size
    stride = max(1, window // 2) if stride is None else stride
    if not 0 < stride <= window:
        raise ConfigError(f"--stride {stride} must be in [1, {window}] (the run's window, data.block_size)")
    rows = strided_windows(ids, window, stride, cfg.model.pad_id)
    graph, state = nnx.split(run.model)
    step = make_eval_step(graph, cfg, None, tok.token_bytes())
    tot = {}
    for i in range(0, len(rows["inputs"]), batch_size):
        b = pad_batch({k: v[i:i + batch_size] for k, v in rows.items()}, batch_size, cfg.model.pad_id)
        for k, v in step(state, b).items():      # one compiled shape: all-pad rows count nowhere
            tot[k] = tot.get(k, 0.0) + float(v)
    loss = tot["nll"] / tot["count"]
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte": tot["text_nll"] / (math.log(2) * tot["bytes"])
            if tot["bytes"] else float("nan"), "tokens": int(tot["count"]), "bytes": int(tot["bytes"]),
            "window": window, "stride": stride}
