"""Hugging Face checkpoints as jaxformer runs: `jaxformer import-hf DIR --workdir RUN` and `jaxformer export-hf
--workdir RUN --out DIR`, and a checkpoint's tokenizer as a run's tokenizer.

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

from jaxformer.data.tokenizers import HFTokenizer
from jaxformer.errors import RunDirError
from jaxformer.hf.families import HFError


def hf_tokenizer(path: str | Path) -> HFTokenizer:
    """DIR/tokenizer.json as a run's tokenizer: no token is padding (pad_id -1), the end of a document is the
    model's EOS (config.json's eos_token_id), and prompts start with its BOS when the tokenizer's own
    post-processor adds one (Llama's does, GPT-2's does not)."""
    from tokenizers import Tokenizer
    from jaxformer.hf.checkpoint import read_config
    path = Path(path)
    d = read_config(path)
    file = path / "tokenizer.json"
    if not file.is_file():
        raise HFError(f"{str(path)!r} has no tokenizer.json (a tokenizer in another format is not supported)")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:                  # tokenizers raises a bare Exception with serde's message
        raise HFError(f"{file} does not parse: {str(e)[:300]}") from None
    first = lambda v: v[0] if isinstance(v, list) and v else v          # noqa: E731
    eos, bos = first(d.get("eos_token_id")), first(d.get("bos_token_id"))
    if eos is None:
        vocab = tok.get_vocab(with_added_tokens=True)
        eos = next((vocab[t] for t in ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>") if t in vocab), None)
    if eos is None:
        raise HFError(f"{path}: no end-of-sequence token (config.json's eos_token_id, or </s>, <|endoftext|>)")
    probe = tok.encode("a", add_special_tokens=True).ids
    adds_bos = bos is not None and probe[:1] == [bos] and tok.encode("a", add_special_tokens=False).ids[:1] != [bos]
    return HFTokenizer(tok, int(eos), pad_id=-1, bos_id=int(bos) if adds_bos else None)


def import_run(source: str | Path, workdir: str | Path, *, data: str | Path | None = None,
               overrides: list[str] | tuple[str, ...] = (), progress: bool = False) -> dict:
    """Make RUN from the checkpoint folder `source` (module docstring). -> the held-out metrics of step 0."""
    from flax import nnx
    from jaxformer.config import Config, DataConfig, OptimConfig, TrainConfig
    from jaxformer.configio import apply_overrides
    from jaxformer.data.prepare import prepare
    from jaxformer.hf.checkpoint import read_config
    from jaxformer.hf.families import to_model_config
    from jaxformer.inference.evaluate import evaluate
    from jaxformer.parallel import Plan
    from jaxformer.runs import RunDir
    from jaxformer.train.loop import prepare as prepare_state
    source, run = Path(source).absolute(), RunDir(workdir)
    model = to_model_config(read_config(source))
    hf_tokenizer(source)                                        # refuse an unusable tokenizer before writing
    if run.config_path.exists() or run.checkpoints_path.exists():
        raise RunDirError(f"{run.path} already holds a run; import into a new --workdir")
    if data is None:
        from jaxformer.data.text import corpus_path
        data = run.path / "data"
        if not (data / "index.json").exists():
            prepare([corpus_path("builtin:alice")], data, tokenizer=str(source), progress=progress)
    block = min(128, model.max_len)
    cfg = Config(model=model, data=DataConfig(task="tokens", path=str(Path(data).absolute()), block_size=block,
                                              batch_size=8),
                 optim=OptimConfig(name="adamw", lr=1e-5, warmup_steps=0, schedule="constant", weight_decay=0.0),
                 train=TrainConfig(steps=100, eval_every=50, checkpoint_every=50, best_metric="loss",
                                   best_mode="min", eval_batch_size=8, num_examples=3, init_from=str(source)))
    cfg = apply_overrides(cfg, list(overrides))
    plan = Plan(cfg.parallel)
    with run.lock():
        p = prepare_state(cfg, run, plan)
        try:
            with plan.use():
                metrics = evaluate(p.cfg, p.task, nnx.merge(p.graphs.model, p.state["model"]), plan=plan)
            rows = p.cfg.data.batch_size
            first = iter(p.task.train_dataset(rows, p.cfg.train.seed, plan.local_rows(rows))).get_state()
            p.ckpt.save(0, p.state, first, metrics)
            log = run.metrics_log()
            log.write(0, "eval", metrics)
            log.close()
        finally:
            p.ckpt.close()
    return metrics


def export_run(workdir: str | Path, out: str | Path, *, which: str = "best", dtype: str = "float32",
               family: str | None = None) -> dict:
    """A run's model (its best or latest checkpoint) as a Hugging Face checkpoint folder, with tokenizer.json
    when the run's tokenizer is a HF one. -> the config.json written."""
    from jaxformer.hf.checkpoint import save_pretrained
    from jaxformer.inference import load_model
    loaded = load_model(workdir, which)
    tok = loaded.tokenizer
    ids = {"eos_token_id": tok.eod_id} if getattr(tok, "eod_id", None) is not None else {}
    if getattr(tok, "bos_id", None) is not None:
        ids["bos_token_id"] = tok.bos_id
    if getattr(tok, "pad_id", -1) >= 0:
        ids["pad_token_id"] = tok.pad_id
    written = save_pretrained(loaded.model, out, family=family, dtype=dtype, token_ids=ids)
    if isinstance(tok, HFTokenizer):
        tok.tok.save(str(Path(out) / "tokenizer.json"))
    return written
