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
    ASCII digits 0-9) or an empty one.

    Args:
      tokenizer: the run's tokenizer (a `DigitTokenizer` reads each character as a digit).
      prompt: the text.

    Returns:
      [n] int32 token ids (no BOS or EOS added).

    Raises:
      DataError: an empty prompt; for a digit-task run, any character but 0-9; characters the tokenizer cannot
        encode.

    Examples:
      >>> from jaxformer.data import CharTokenizer, DigitTokenizer
      >>> from jaxformer.inference import prompt_ids
      >>> prompt_ids(DigitTokenizer(), "714"), prompt_ids(CharTokenizer("abc"), "cab")
      (array([10,  4,  7], dtype=int32), array([3, 1, 2], dtype=int32))
      >>> prompt_ids(DigitTokenizer(), "7a")
      Traceback (most recent call last):
      ...
      jaxformer.errors.DataError: prompt '7a': a digit-task run takes strings of digits 0-9
    """
    if isinstance(tokenizer, DigitTokenizer):
        if not prompt or not all(c in "0123456789" for c in prompt):
            raise DataError(f"prompt {prompt!r}: a digit-task run takes strings of digits 0-9")
        return tokenizer.encode([int(c) for c in prompt])
    if not prompt:
        raise DataError("an empty prompt: a character LM needs at least one character to continue")
    return tokenizer.encode(prompt)


def default_prompts(run: LoadedModel) -> list[str]:
    """Three held-out inputs of the run's task (an LM gets their first half): what `jaxformer generate` prompts
    with when given no --prompt.

    Args:
      run: a `LoadedModel` (its data section builds the task: the run's data must be readable).

    Returns:
      Three prompts, as text.

    Raises:
      DataError: the run's data cannot be read.

    Examples:
      >>> from jaxformer.config import Config, replaced
      >>> from jaxformer.data import resolve
      >>> from jaxformer.inference import LoadedModel, default_prompts
      >>> from jaxformer.nn import build_model
      >>> cfg, task = resolve(replaced(Config(), model__vocab_size=13, model__d_model=16, model__d_ff=32,
      ...                              model__num_heads=2, model__num_encoder_layers=1,
      ...                              model__num_decoder_layers=1, model__max_len=16))   # digit reversal
      >>> run = LoadedModel(cfg, task.tokenizer, build_model(cfg.model, seed=0), step=0, which="latest")
      >>> default_prompts(run)
      ['45580', '5428', '03817']
    """
    task = build_task(run.cfg.data, run.tokenizer)
    return architecture(run.cfg.model.arch).default_prompts(task)


def generate_text(run: LoadedModel, prompts: list[str], *, max_new: int | None = None, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, beam: int = 1, seed: int = 0,
                  kv_cache: str = "auto") -> list[str]:
    """Decode a batch of text prompts in one compiled call. Seq2seq runs: the answer to each prompt (up to
    EOS; default max_new = longest prompt + 1, enough for reversal/copy). LM runs: each prompt's continuation
    (default max_new = min(200, room left under model.max_len)).

    Args:
      run: a `LoadedModel` (`load_model`).
      prompts: the prompts, as text (`prompt_ids`).
      max_new: the most tokens to generate (None: the default above).
      temperature: 0 decodes greedily; > 0 samples at that temperature.
      top_k: sample among the k likeliest tokens (0: all).
      top_p: sample within the smallest set of tokens of probability >= top_p (1: all).
      beam: beam width; > 1: beam search (seq2seq only).
      seed: the sampling key's seed, an int in [0, 2**32).
      kv_cache: the decoding cache's storage, "auto" (the model's dtype) or "int8".

    Returns:
      One string per prompt: its answer (seq2seq) or continuation (LM), special tokens left out.

    Raises:
      DataError: no prompts, an empty prompt or one the tokenizer cannot read (`prompt_ids`).
      ConfigError: beam not an integer in [1, V] (> 1 for an LM run), seed not an integer in [0, 2**32),
        temperature < 0, top_k outside [0, V], top_p outside (0, 1], max_new < 1 or past model.max_len.

    Examples:
      >>> from jaxformer.config import Config, replaced
      >>> from jaxformer.data import resolve
      >>> from jaxformer.inference import LoadedModel, generate_text
      >>> from jaxformer.nn import build_model
      >>> cfg, task = resolve(replaced(Config(), model__vocab_size=13, model__d_model=16, model__d_ff=32,
      ...                              model__num_heads=2, model__num_encoder_layers=1,
      ...                              model__num_decoder_layers=1, model__max_len=16))   # digit reversal
      >>> run = LoadedModel(cfg, task.tokenizer, build_model(cfg.model, seed=0), step=0, which="latest")
      >>> answers = generate_text(run, ["123", "908172"])          # untrained: its answers mean nothing yet
      >>> len(answers), all(set(a) <= set("0123456789") for a in answers)
      (2, True)
      >>> generate_text(run, ["123"], beam=0)
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: beam=0 must be an integer >= 1 (1 = greedy or sampled decoding)
    """
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
