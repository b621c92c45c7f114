"""Inference from a run directory: decode text prompts with a restored model.

`jaxformer.runs.load_model` restores the model alone (no optimizer, no training data) from the run's
config.json, tokenizer.json and best (or latest) checkpoint; `generate_text` turns prompts into continuations
with the compiled, KV-cached decoder (`jaxformer.decode`): answers for seq2seq runs (e.g. digit reversal),
continuations for language models.
"""
from __future__ import annotations

import jax
import numpy as np

from jaxformer.config import ConfigError
from jaxformer.data import DataError
from jaxformer.data.tokenizers import DigitTokenizer
from jaxformer.decode import beam_search, generate_lm, generate_seq2seq
from jaxformer.runs import LoadedModel


def prompt_ids(tokenizer, prompt: str) -> np.ndarray:
    """A text prompt's token ids [n]. DataError for a non-digit prompt of a digit-task run or an empty one."""
    if isinstance(tokenizer, DigitTokenizer):
        if not prompt.isdigit():
            raise DataError(f"prompt {prompt!r}: a digit-task run takes strings of digits 0-9")
        return tokenizer.encode([int(c) for c in prompt])
    if not prompt:
        raise DataError("an empty prompt: a character LM needs at least one character to continue")
    return tokenizer.encode(prompt)


def pad_rows(rows: list[np.ndarray], pad_id: int, left: bool) -> np.ndarray:
    """Rows of ids -> one [B, longest] int32 batch, padded on the left (LM prompts) or the right."""
    width = max(len(r) for r in rows)
    out = np.full((len(rows), width), pad_id, np.int32)
    for i, r in enumerate(rows):
        if left:
            out[i, width - len(r):] = r
        else:
            out[i, : len(r)] = r
    return out


def default_prompts(run: LoadedModel) -> list[str]:
    """Three held-out inputs of the run's task (an LM gets their first half)."""
    from jaxformer.data import build_task
    task = build_task(run.cfg.data, run.tokenizer)
    tok = task.tokenizer
    if task.kind == "seq2seq":
        return [tok.decode(s) for s in task.eval["src"][:3]]
    return [tok.decode(x[: max(1, len(x) // 2)]) for x in task.eval["inputs"][:3]]


def generate_text(run: LoadedModel, prompts: list[str], *, max_new: int | None = None, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, beam: int = 1, seed: int = 0) -> list[str]:
    """Decode a batch of text prompts in one compiled call. Seq2seq runs: the answer to each prompt (up to
    EOS; default max_new = longest prompt + 1, enough for reversal/copy). LM runs: each prompt's continuation
    (default max_new = min(200, room left under model.max_len)). beam > 1: beam search (seq2seq only)."""
    if not prompts:
        raise DataError("no prompts given")
    tok, cfg = run.tokenizer, run.cfg.model
    rows = [prompt_ids(tok, p) for p in prompts]
    key = jax.random.key(seed)
    if cfg.arch == "encoder_decoder":
        src = pad_rows([np.append(r, tok.eos_id) for r in rows], tok.pad_id, left=False)
        max_new = src.shape[1] if max_new is None else max_new
        if beam > 1:
            out = beam_search(run.model, src, max_new=max_new, bos_id=tok.bos_id, eos_id=tok.eos_id, beam=beam)
        else:
            out = generate_seq2seq(run.model, src, max_new=max_new, bos_id=tok.bos_id, eos_id=tok.eos_id,
                                   key=key, temperature=temperature, top_k=top_k, top_p=top_p)
    else:
        if beam > 1:
            raise ConfigError(f"beam={beam}: beam search is implemented for encoder-decoder runs only")
        src = pad_rows(rows, cfg.pad_id, left=True)
        max_new = max(1, min(200, cfg.max_len - src.shape[1])) if max_new is None else max_new
        out = generate_lm(run.model, src, max_new=max_new, key=key, temperature=temperature, top_k=top_k,
                          top_p=top_p)
    return [tok.decode(r) for r in np.asarray(out)]
