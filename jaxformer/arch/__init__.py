"""One place that decides encoder-decoder vs decoder-only: a small adapter per architecture, named by
model.arch. An adapter knows its batches (batch -> logits and targets), its prompts (text -> a batch), how it
generates, its default prompts and decoded examples, and its attention maps; nothing else in the package branches
on the architecture. A third architecture (e.g. a prefix LM) is one more file here and one entry in ADAPTERS.

Batches: seq2seq {"src" [B,S], "tgt_in" [B,T], "tgt_out" [B,T]}; LM {"inputs" [B,T], "targets" [B,T]}.
"""
from __future__ import annotations

from jaxformer.arch.lm import LanguageModel
from jaxformer.arch.seq2seq import Seq2Seq
from jaxformer.errors import ConfigError

ADAPTERS = {a.arch: a for a in (Seq2Seq(), LanguageModel())}


def adapter(arch: str):
    """The adapter of model.arch `arch`."""
    if arch not in ADAPTERS:
        raise ConfigError(f"model.arch={arch!r} is not one of {tuple(ADAPTERS)}")
    return ADAPTERS[arch]


__all__ = ["ADAPTERS", "adapter", "LanguageModel", "Seq2Seq"]
