"""Decode text prompts with a restored model (`jaxformer generate`): answers for seq2seq runs (e.g. digit
reversal), continuations for language models, with the compiled, KV-cached decoder (`jaxformer.decode`)."""
from __future__ import annotations

import jax
import numpy as np

from jaxformer.arch import architecture
from jaxformer.data import DataError, build_task
from jaxformer.errors import ConfigError
from jaxformer.data.tokenizers import DigitTokenizer
from jaxformer.inference.restore import LoadedModel


def prompt_ids(tokenizer, prompt: str) -> np.ndarray:
    """A text prompt's token ids [n]. DataError for a prompt a digit-task run cannot read (anything but the
    ASCII digits 0-9) or an empty one."""
    if isinstance(tokenizer, DigitTokenizer):
        if not prompt or not all(c in "0123456789" for c in prompt):
            raise DataError(f"prompt {prompt!r}: a digit-task run takes strings of digits 0-9")
        return tokenizer.encode([int(c) for c in prompt])
    if not prompt:
        raise DataError("an empty prompt: a character LM needs at least one character to continue")
    return tokenizer.encode(prompt)


def default_prompts(run: LoadedModel) -> list[str]:
    """Three held-out inputs of the run's task (an LM gets their first half)."""
    task = build_task(run.cfg.data, run.tokenizer)
    return architecture(run.cfg.model.arch).default_prompts(task)


def generate_text(run: LoadedModel, prompts: list[str], *, max_new: int | None = None, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, beam: int = 1, seed: int = 0,
                  kv_cache: str = "auto") -> list[str]:
    """Decode a batch of text prompts in one compiled call. Seq2seq runs: the answer to each prompt (up to
    EOS; default max_new = longest prompt + 1, enough for reversal/copy). LM runs: each prompt's continuation
    (default max_new = min(200, room left under model.max_len)). beam > 1: beam search (seq2seq only).
    kv_cache: the decoding cache's storage, "auto" (the model's dtype) or "int8"."""
    if not prompts:
        raise DataError("no prompts given")
    if isinstance(beam, bool) or not isinstance(beam, int) or beam < 1:
        raise ConfigError(f"beam={beam!r} must be an integer >= 1 (1 = greedy or sampled decoding)")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 32:
        raise ConfigError(f"seed={seed!r} must be an integer in [0, 2**32)")
    tok, arch = run.tokenizer, architecture(run.cfg.model.arch)
    batch, seg = arch.prompt_batch([arch.prompt_row(tok, prompt_ids(tok, p)) for p in prompts], run.cfg.model.pad_id)
    out = arch.generate(run.model, tok, batch, seg, max_new=max_new, key=jax.random.key(seed), temperature=temperature,
                        top_k=top_k, top_p=top_p, beam=beam, kv_cache=kv_cache)
    return [tok.decode(r) for r in np.asarray(out)]
