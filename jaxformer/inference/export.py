"""`jaxformer export-hf --workdir RUN --out DIR`: a run's model as a Hugging Face checkpoint folder."""
from __future__ import annotations

from pathlib import Path

from jaxformer.data.tokenizers import HFTokenizer, SentencePieceTokenizer


def export_run(workdir: str | Path, out: str | Path, *, which: str = "best", dtype: str = "float32",
               family: str | None = None, weights: str = "trained", adapter: bool = False) -> dict:
    """A run's model (its best or latest checkpoint; weights: `load_model`'s) as a Hugging Face checkpoint
    folder (low-rank adapters merged into the weights), with tokenizer.json when the run's tokenizer is a HF
    one (tokenizer.model for a pretrained SentencePiece one). -> the config.json written. adapter=True: only the run's adapters (model.lora), as a PEFT adapter folder
    over the model it started from (`hf.adapters`) -> the adapter_config.json written."""
    from jaxformer.hf.checkpoint import save_pretrained
    from jaxformer.inference.restore import load_model
    loaded = load_model(workdir, which, weights=weights)
    if adapter:
        from jaxformer.hf.adapters import save_adapter
        return save_adapter(loaded.model, out, base=loaded.cfg.train.init_from)
    tok = loaded.tokenizer
    ids = {"eos_token_id": tok.eod_id} if getattr(tok, "eod_id", None) is not None else {}
    if getattr(tok, "bos_id", None) is not None:
        ids["bos_token_id"] = tok.bos_id
    if getattr(tok, "pad_id", -1) >= 0:
        ids["pad_token_id"] = tok.pad_id
    written = save_pretrained(loaded.model, out, family=family, dtype=dtype, token_ids=ids)
    if isinstance(tok, HFTokenizer):
        tok.tok.save(str(Path(out) / "tokenizer.json"))
    elif isinstance(tok, SentencePieceTokenizer) and tok.offset == 0:       # a pretrained model's own ids
        (Path(out) / "tokenizer.model").write_bytes(tok.proto)
    return written
