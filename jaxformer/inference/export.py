"""`jaxformer export-hf --workdir RUN --out DIR`: a run's model as a Hugging Face checkpoint folder.

The folder is written whole or not at all (`jaxformer.hf.staging`): to DIR.partial, renamed to DIR when complete.
DIR must not exist or be an empty folder; one holding anything (a user's files, an earlier export) is refused by
name and left as it is, so an export never replaces a file. An interrupted export leaves no DIR.
"""
from __future__ import annotations

from pathlib import Path

from jaxformer.data.tokenizers import HFTokenizer, SentencePieceTokenizer
from jaxformer.errors import RunDirError


def export_run(workdir: str | Path, out: str | Path, *, which: str = "best", dtype: str = "float32",
               family: str | None = None, weights: str = "trained", adapter: bool = False) -> dict:
    """A run's model (its best or latest checkpoint; weights: `load_model`'s) as a Hugging Face checkpoint
    folder (low-rank adapters merged into the weights), with tokenizer.json when the run's tokenizer is a HF
    one (tokenizer.model for a pretrained SentencePiece one). -> the config.json written. adapter=True: only
    the run's adapters (model.lora), as a PEFT adapter folder over the model it started from (`hf.adapters`;
    dtype: the adapter tensors', family: the base's, checked against the model) -> the adapter_config.json
    written; RunDirError for a run trained from scratch (no train.init_from: no base model to apply them to).
    HFError when `out` is not new or empty (module docstring)."""
    from jaxformer.hf.checkpoint import write_pretrained
    from jaxformer.hf.staging import check_free, staged
    from jaxformer.inference.restore import load_model
    check_free(out)                                 # before the checkpoint is read
    loaded = load_model(workdir, which, weights=weights)
    if adapter:
        from jaxformer.hf.adapters import adapter_config, write_adapter
        base = loaded.cfg.train.init_from
        if not base:
            raise RunDirError(f"{workdir} was trained from scratch (train.init_from is empty): its adapters have no "
                              f"base model to apply to; export the merged model instead (export-hf without "
                              f"--adapter)")
        adapter_config(loaded.model, base, family)  # refused before anything is written
        with staged(out) as folder:
            return write_adapter(loaded.model, folder, base, family=family, dtype=dtype)
    tok = loaded.tokenizer
    ids = {"eos_token_id": tok.eod_id} if getattr(tok, "eod_id", None) is not None else {}
    if getattr(tok, "bos_id", None) is not None:
        ids["bos_token_id"] = tok.bos_id
    if getattr(tok, "pad_id", -1) >= 0:
        ids["pad_token_id"] = tok.pad_id
    with staged(out) as folder:
        written = write_pretrained(loaded.model, folder, family=family, dtype=dtype, token_ids=ids)
        if isinstance(tok, HFTokenizer):
            tok.tok.save(str(folder / "tokenizer.json"))
        elif isinstance(tok, SentencePieceTokenizer) and tok.offset == 0:       # a pretrained model's own ids
            (folder / "tokenizer.model").write_bytes(tok.proto)
    return written
