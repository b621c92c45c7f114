"""The decoder-only architecture: batches {"inputs", "targets", "segment_ids", "positions"}, prompts continued
(left-padded, so every row's last token is its last column; their segment ids say which tokens are real),
next-token predictions as decoded examples."""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxformer import decode
from jaxformer.data import attention_fields, pad_rows
from jaxformer.errors import ConfigError
from jaxformer.ops.context import zigzag
from jaxformer.parallel import replicate


class LanguageModel:
    arch = "decoder_only"
    separator = ""                            # between a prompt and its output when printed
    exact_match = False

    def forward(self, model, batch: dict, rngs=None, features: bool = False):
        """-> (logits [B,T,V], targets [B,T], aux); features=True: the output head's input [B,T,D] in place of
        the logits. A batch without segment ids and positions is one document per row, every token real."""
        logits, aux = model(batch["inputs"], positions=batch.get("positions"),
                                    segment_ids=batch.get("segment_ids"), rngs=rngs, features=features)
        return logits, batch["targets"], aux

    def balanced(self, model, batch: dict, devices: int) -> dict:
        """The batch's columns in the zigzag order over `devices` (parallel.context_order="zigzag",
        `ops.context.zigzag`), with the positions made explicit first: masks and rotary positions come from them,
        never from where a token sits, and the loss is a sum over tokens, so the step computes the same
        objective and gradients with each device's causal work balanced."""
        positions = batch.get("positions")
        if positions is None:
            positions = model.positions(batch["inputs"], batch.get("segment_ids"))
        t = batch["inputs"].shape[1]
        return {k: zigzag(v, devices) if v.ndim >= 2 and v.shape[1] == t else v
                for k, v in {**batch, "positions": positions}.items()}

    def example_batch(self, rows: int, length: int) -> dict:
        """A batch of ones [rows, length] (a forward pass to check a config)."""
        ones = np.ones((rows, length), np.int32)
        return {"inputs": ones, "targets": ones, **attention_fields(ones)}

    def targets(self, batch: dict):
        return batch["targets"]

    def prompts(self, batch: dict):
        """What generation starts from: (tokens [B,T], segment ids [B,T] or None)."""
        return batch["inputs"], batch.get("segment_ids")

    def prompt_row(self, tokenizer, ids: np.ndarray) -> np.ndarray:
        """A prompt's ids, after the tokenizer's BOS when it has one (a pretrained model's)."""
        bos = getattr(tokenizer, "bos_id", None)
        return np.asarray(([bos] if bos is not None else []) + list(ids), np.int32)

    def prompt_batch(self, rows: list[np.ndarray], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
        """-> (prompts [B,P] left-padded, segment ids [B,P]: 1 on each prompt's tokens, 0 on its padding)."""
        return pad_rows(rows, pad_id, left=True)

    def generate(self, model, tokenizer, prompts, segment_ids=None, *, max_new: int | None = None, key=None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, beam: int = 1, kv_cache: str = "auto"):
        """prompts [B,P] (segment ids [B,P]: 0 on padding; None = every token real) -> continuations [B,max_new]
        (default: up to 200 tokens, within model.max_len)."""
        if beam > 1:
            raise ConfigError(f"beam={beam}: beam search is implemented for encoder-decoder runs only")
        cfg = model.cfg
        max_new = max(1, min(200, cfg.max_len - prompts.shape[1])) if max_new is None else max_new
        return decode.generate_lm(model, prompts, max_new=max_new, key=key, temperature=temperature, top_k=top_k,
                                  top_p=top_p, kv_cache=kv_cache, eos_id=getattr(tokenizer, "eod_id", None),
                                  segment_ids=segment_ids)

    def default_prompts(self, task) -> list[str]:
        """The first half of three held-out blocks."""
        return [task.tokenizer.decode(x[: max(1, len(x) // 2)]) for x in task.eval["inputs"][:3]]

    def examples(self, model, task, k: int, batch_rows: int = 0) -> list[tuple]:
        """k held-out (input, target, next-token predictions) id rows."""
        ev = {a: b[:k] for a, b in task.eval.items()}
        graph, state = nnx.split(model)
        best = jax.jit(lambda st, b: replicate(self.forward(nnx.merge(graph, st), b)[0].argmax(-1)))(state, ev)
        return list(zip(ev["inputs"], ev["targets"], np.asarray(best)))

    def attention_inputs(self, model, tokenizer, rows: list[np.ndarray], pad_id: int, max_len: int | None):
        """What heatmaps show: the causal self-attention over each prompt (right-padded: padding changes no
        visible row). -> ((model arguments, keywords), per prompt {kind: (query ids, key ids)}, answers: None
        each)."""
        tokens, seg = pad_rows(rows, pad_id, left=False)
        return ((tokens,), {"segment_ids": seg}), [{"self": (r, r)} for r in rows], [None] * len(rows)
