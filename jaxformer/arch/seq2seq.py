"""The encoder-decoder architecture: batches {"src", "tgt_in", "tgt_out"} with each side's segment ids and positions
({src,tgt}_{segment_ids,positions}), answers decoded greedily (or by beam search) from a source prompt + EOS,
exact match as a held-out metric."""
from __future__ import annotations

import numpy as np

from jaxformer import decode
from jaxformer.data import attention_fields, pad_rows


class Seq2Seq:
    arch = "encoder_decoder"
    separator = " -> "                            # between a prompt and its output when printed
    exact_match = True                          # evaluation also decodes and scores whole answers

    def forward(self, model, batch: dict, rngs=None, features: bool = False):
        """-> (logits [B,T,V], targets [B,T], aux) of a teacher-forced batch; features=True: the output head's
        input [B,T,D] in place of the logits. A side without segment ids and positions is one document per row,
        every token real."""
        logits, aux = model(batch["src"], batch["tgt_in"], rngs=rngs, features=features,
                                    **{f"{side}_{k}": batch.get(f"{side}_{k}") for side in ("src", "tgt")
                                       for k in ("positions", "segment_ids")})
        return logits, batch["tgt_out"], aux

    def example_batch(self, rows: int, length: int) -> dict:
        """A batch of ones [rows, length] (a forward pass to check a config)."""
        ones = np.ones((rows, length), np.int32)
        return {"src": ones, "tgt_in": ones, "tgt_out": ones, **attention_fields(ones, "src_"),
                **attention_fields(ones, "tgt_")}

    def targets(self, batch: dict):
        return batch["tgt_out"]

    def prompts(self, batch: dict):
        """What generation starts from: (sources [B,S], their segment ids [B,S] or None)."""
        return batch["src"], batch.get("src_segment_ids")

    def prompt_row(self, tokenizer, ids: np.ndarray) -> np.ndarray:
        """A prompt's ids as the model reads them: the source + EOS."""
        return np.append(ids, tokenizer.eos_id).astype(np.int32)

    def prompt_batch(self, rows: list[np.ndarray], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
        """-> (sources [B,S] right-padded, segment ids [B,S]: 1 on each source's tokens, 0 on its padding)."""
        return pad_rows(rows, pad_id, left=False)

    def generate(self, model, tokenizer, src, segment_ids=None, *, max_new: int | None = None, key=None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, beam: int = 1, kv_cache: str = "auto"):
        """src [B,S] (segment ids [B,S]: 0 on padding; None = every token real) -> answers [B,max_new] (default
        max_new: S, enough for reversal/copy)."""
        max_new = src.shape[1] if max_new is None else max_new
        if beam > 1:
            return decode.beam_search(model, src, max_new=max_new, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                                      beam=beam, kv_cache=kv_cache, segment_ids=segment_ids)
        return decode.generate_seq2seq(model, src, max_new=max_new, bos_id=tokenizer.bos_id,
                                       eos_id=tokenizer.eos_id, key=key, temperature=temperature, top_k=top_k,
                                       top_p=top_p, kv_cache=kv_cache, segment_ids=segment_ids)

    def predict(self, model, tokenizer, src, segment_ids, width: int):
        """Greedy answers [B,width] (what exact match scores) to sources src [B,S] with segment ids [B,S]."""
        return decode.generate_seq2seq(model, src, max_new=width, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                                       segment_ids=segment_ids)

    def default_prompts(self, task) -> list[str]:
        """Three held-out sources."""
        return [task.tokenizer.decode(s) for s in task.eval["src"][:3]]

    def examples(self, model, task, k: int, batch_rows: int = 0) -> list[tuple]:
        """k held-out (input, target, prediction) id rows: greedy answers (decoding batch_rows rows, so the
        program compiled for evaluation serves these too)."""
        ev, rows = task.eval, max(k, batch_rows)
        src, seg = ev["src"][:rows], ev["src_segment_ids"][:rows]
        pred = np.asarray(self.predict(model, task.tokenizer, src, seg, ev["tgt_out"].shape[1]))[:k]
        return list(zip(ev["src"][:k], ev["tgt_out"][:k], pred))

    def attention_inputs(self, model, tokenizer, rows: list[np.ndarray], pad_id: int, max_len: int | None):
        """What heatmaps show: the prompts as sources and, as decoder input, BOS + the model's own greedy answer
        (without its EOS). -> ((model arguments, keywords), per prompt {kind: (query ids, key ids)}, per prompt
        the answer ids)."""
        src, src_seg = self.prompt_batch(rows, pad_id)
        width = src.shape[1]
        max_new = min(width, max_len - 1) if max_len is not None else width
        out = np.asarray(self.predict(model, tokenizer, src, src_seg, max_new))
        answers = [o[: int(np.argmax(o == tokenizer.eos_id))] if (o == tokenizer.eos_id).any() else o for o in out]
        tgts = [np.concatenate([[tokenizer.bos_id], a[a != pad_id]]).astype(np.int32) for a in answers]
        axes = [{"encoder_self": (r, r), "decoder_self": (t, t), "decoder_cross": (t, r)} for r, t in zip(rows, tgts)]
        tgt, tgt_seg = pad_rows(tgts, pad_id, left=False)
        kw = {"src_segment_ids": src_seg, "tgt_segment_ids": tgt_seg}
        return ((src, tgt), kw), axes, [t[1:] for t in tgts]
