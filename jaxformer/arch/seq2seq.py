"""The encoder-decoder adapter: batches {"src", "tgt_in", "tgt_out"}, answers decoded greedily (or by beam
search) from a source prompt + EOS, exact match as a held-out metric."""
from __future__ import annotations

import numpy as np

from jaxformer import decode
from jaxformer.data import pad_rows


class Seq2Seq:
    arch = "encoder_decoder"
    separator = " -> "                            # between a prompt and its output when printed
    exact_match = True                          # evaluation also decodes and scores whole answers

    def forward(self, model, batch: dict, rngs=None):
        """-> (logits [B,T,V], targets [B,T], aux) of a teacher-forced batch."""
        logits, aux = model.forward(batch["src"], batch["tgt_in"], rngs=rngs)
        return logits, batch["tgt_out"], aux

    def example_batch(self, rows: int, length: int) -> dict:
        """A batch of ones [rows, length] (a forward pass to check a config)."""
        ones = np.ones((rows, length), np.int32)
        return {"src": ones, "tgt_in": ones, "tgt_out": ones}

    def targets(self, batch: dict):
        return batch["tgt_out"]

    def inputs(self, batch: dict):
        """What generation starts from: the sources."""
        return batch["src"]

    def prompt_row(self, tokenizer, ids: np.ndarray) -> np.ndarray:
        """A prompt's ids as the model reads them: the source + EOS."""
        return np.append(ids, tokenizer.eos_id).astype(np.int32)

    def prompt_batch(self, rows: list[np.ndarray], pad_id: int) -> np.ndarray:
        return pad_rows(rows, pad_id, left=False)

    def generate(self, model, tokenizer, src, *, max_new: int | None = None, key=None, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, beam: int = 1, kv_cache: str = "auto"):
        """src [B,S] -> answers [B,max_new] (default max_new: S, enough for reversal/copy)."""
        max_new = src.shape[1] if max_new is None else max_new
        if beam > 1:
            return decode.beam_search(model, src, max_new=max_new, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                                      beam=beam, kv_cache=kv_cache)
        return decode.generate_seq2seq(model, src, max_new=max_new, bos_id=tokenizer.bos_id,
                                       eos_id=tokenizer.eos_id, key=key, temperature=temperature, top_k=top_k,
                                       top_p=top_p, kv_cache=kv_cache)

    def predict(self, model, tokenizer, src, width: int):
        """Greedy answers [B,width] (what exact match scores)."""
        return decode.generate_seq2seq(model, src, max_new=width, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)

    def default_prompts(self, task) -> list[str]:
        """Three held-out sources."""
        return [task.tokenizer.decode(s) for s in task.eval["src"][:3]]

    def examples(self, model, task, k: int, batch_rows: int = 0) -> list[tuple]:
        """k held-out (input, target, prediction) id rows: greedy answers (decoding batch_rows rows, so the
        program compiled for evaluation serves these too)."""
        ev = task.eval
        src = ev["src"][:max(k, batch_rows)]
        pred = np.asarray(self.predict(model, task.tokenizer, src, ev["tgt_out"].shape[1]))[:k]
        return list(zip(ev["src"][:k], ev["tgt_out"][:k], pred))

    def attention_inputs(self, model, tokenizer, rows: list[np.ndarray], pad_id: int, max_len: int | None):
        """What heatmaps show: the prompts as sources and, as decoder input, BOS + the model's own greedy answer
        (without its EOS). -> (model inputs, per prompt {kind: (query ids, key ids)}, per prompt the answer ids)."""
        src = self.prompt_batch(rows, pad_id)
        width = src.shape[1]
        max_new = min(width, max_len - 1) if max_len is not None else width
        out = np.asarray(decode.generate_seq2seq(model, src, max_new=max_new, bos_id=tokenizer.bos_id,
                                                 eos_id=tokenizer.eos_id))
        answers = [o[: int(np.argmax(o == tokenizer.eos_id))] if (o == tokenizer.eos_id).any() else o for o in out]
        tgts = [np.concatenate([[tokenizer.bos_id], a[a != pad_id]]).astype(np.int32) for a in answers]
        axes = [{"encoder_self": (r, r), "decoder_self": (t, t), "decoder_cross": (t, r)} for r, t in zip(rows, tgts)]
        return (src, pad_rows(tgts, pad_id, left=False)), axes, [t[1:] for t in tgts]
