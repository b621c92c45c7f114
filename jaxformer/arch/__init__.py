"""One place that decides encoder-decoder vs decoder-only: a small object per architecture, named by
model.arch (`architecture(model.arch)`; "adapter" names LoRA's adapters only). It knows its batches (batch ->
logits and targets), its prompts (text -> a batch), how it
generates, its default prompts and decoded examples, and its attention maps; nothing else in the package branches
on the architecture. A third architecture (e.g. a prefix LM) is one more file here and one entry in ARCHITECTURES.

Batches: seq2seq {"src" [B,S], "tgt_in" [B,T], "tgt_out" [B,T]}; LM {"inputs" [B,T], "targets" [B,T]}.
"""
from __future__ import annotations

from jaxformer.arch.lm import LanguageModel
from jaxformer.arch.seq2seq import Seq2Seq
from jaxformer.errors import ConfigError

ARCHITECTURES = {a.arch: a for a in (Seq2Seq(), LanguageModel())}


def architecture(arch: str):
    """The architecture object of model.arch `arch` (`LanguageModel` or `Seq2Seq`)."""
    if arch not in ARCHITECTURES:
        raise ConfigError(f"model.arch={arch!r} is not one of {tuple(ARCHITECTURES)}")
    return ARCHITECTURES[arch]


__all__ = ["ARCHITECTURES", "architecture", "LanguageModel", "Seq2Seq"]
