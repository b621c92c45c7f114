"""Masks from explicit inputs only (issue V.5): every task's batches carry segment ids and positions made from the
lengths the data has, the model builds every mask from them (never from a token id), and a task without packing
gives each row the logits it has alone, as the old pad-id inference did where it was right.

Wrong implementations these tests are written against: the model still infers padding from model.pad_id when no
segment ids are given; an adapter drops the batch's segment ids or positions; a padded batch fills segment ids
with the pad id instead of 0; positions on the host disagree with the model's own rule.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxformer import ops
from jaxformer.arch import architecture
from jaxformer.config import DataConfig, ModelConfig, replaced
from jaxformer.data import build_task, pad_rows
from jaxformer.data.tasks import pad_batch, positions_of
from jaxformer.data.tokenizers import PAD
from jaxformer.decode import generate_lm, generate_seq2seq
from jaxformer.nn import build_model

SMALL = dict(vocab_size=13, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1, num_decoder_layers=2,
             max_len=32, runtime__dtype="float32")
FIELDS = {"seq2seq": ("src_segment_ids", "src_positions", "tgt_segment_ids", "tgt_positions"),
          "lm": ("segment_ids", "positions")}


def _model(arch="encoder_decoder", **kw):
    return build_model(replaced(ModelConfig(), arch=arch, **{**SMALL, **kw}), seed=1)


@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=9), min_size=1, max_size=4))
def test_host_positions_follow_the_models_rule(rows):
    seg = np.zeros((4, 9), np.int32)                 # one shape for every example: one compile of the model's rule
    for i, r in enumerate(rows):
        seg[i, : len(r)] = r
    np.testing.assert_array_equal(positions_of(seg), np.asarray(_positions(jnp.asarray(seg))))


_positions = jax.jit(ops.positions_from_segments)


def _text(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    return str(p)


@pytest.mark.parametrize("kind", ["digits", "text"])
def test_every_task_batch_carries_segment_ids_and_positions_zero_only_on_padding(kind, tmp_path):
    cfg = DataConfig(num_train=64, num_eval=9) if kind == "digits" else \
        DataConfig(task="text", path=_text(tmp_path), block_size=16)
    task = build_task(cfg)
    fields = FIELDS[task.kind]
    train = next(iter(task.train_dataset(8, seed=0)))
    evals = list(task.eval_batches(4, pad_id=PAD))
    for b in [train, *evals]:
        assert set(fields) <= set(b)
        for side in ("src", "tgt") if task.kind == "seq2seq" else ("",):
            pre = f"{side}_" if side else ""
            tokens = b["src"] if side == "src" else b["tgt_in"] if side == "tgt" else b["inputs"]
            seg, pos = b[f"{pre}segment_ids"], b[f"{pre}positions"]
            # the digit and character tokenizers never give a real token id 0, so the lengths' segments must be
            # exactly the non-pad tokens here (a reference, not how they are made)
            np.testing.assert_array_equal(seg != 0, tokens != PAD)
            np.testing.assert_array_equal(pos, positions_of(seg))
    tail = evals[-1]
    n_real = len(next(iter(task.eval.values()))) % 4 or 4
    assert (tail[fields[0]][n_real:] == 0).all() and (tail[fields[1]][n_real:] == 0).all()


def test_padded_batches_fill_segment_ids_and_positions_with_zero_whatever_the_pad_id():
    b = {"inputs": np.ones((1, 3), np.int32), "segment_ids": np.ones((1, 3), np.int32),
         "positions": np.arange(3, dtype=np.int32)[None]}
    out = pad_batch(b, 3, pad_id=7)
    assert (out["inputs"][1:] == 7).all() and (out["segment_ids"][1:] == 0).all() and (out["positions"][1:] == 0).all()


def test_a_digit_batch_gives_each_pair_the_logits_it_has_alone():
    """The old inference (tokens != pad_id) was right here: the explicit segment ids give the same logits on
    every real target, checked against each pair run alone, unpadded, with no mask input at all."""
    task = build_task(DataConfig(num_train=16, num_eval=8, min_len=1, max_len=5))
    batch = {k: v[:8] for k, v in task.eval.items()}
    model = _model()
    logits = np.asarray(architecture("encoder_decoder").forward(model, batch)[0])
    for i in range(8):
        n_src, n_tgt = int(batch["src_segment_ids"][i].sum()), int(batch["tgt_segment_ids"][i].sum())
        alone = np.asarray(model(batch["src"][i:i + 1, :n_src], batch["tgt_in"][i:i + 1, :n_tgt])[0])[0]
        np.testing.assert_allclose(logits[i, :n_tgt], alone, rtol=2e-5, atol=2e-5)


def test_the_model_never_reads_the_pad_id():
    """A token equal to model.pad_id is a real token unless the segment ids say padding; changing pad_id changes
    no logit."""
    tokens = jnp.asarray([[5, PAD, 6, 7]], jnp.int32)
    base = _model("decoder_only")
    other = _model("decoder_only", pad_id=5)
    np.testing.assert_array_equal(np.asarray(base(tokens)[0]), np.asarray(other(tokens)[0]))
    masked = np.asarray(base(tokens, segment_ids=jnp.asarray([[1, 0, 1, 1]]))[0])
    assert not np.allclose(np.asarray(base(tokens)[0])[0, 2:], masked[0, 2:], atol=1e-4)   # id 0 was attended


def test_ragged_prompts_decode_as_each_alone_from_their_segment_ids():
    model = _model("decoder_only")
    rows = [np.array([4, 5, 6, 7, 8], np.int32), np.array([9, PAD, 3], np.int32)]     # a real id 0 in row 2
    prompts, seg = pad_rows(rows, PAD, left=True)
    out = np.asarray(generate_lm(model, prompts, max_new=4, segment_ids=seg))
    for i, r in enumerate(rows):
        every = np.ones((1, len(r)), np.int32)              # every token real, the 0 too: said explicitly
        np.testing.assert_array_equal(out[i], np.asarray(generate_lm(model, r[None], max_new=4, segment_ids=every))[0])


def test_padded_sources_decode_as_each_alone_from_their_segment_ids():
    model = _model()
    rows = [np.array([4, 5, 6, 2], np.int32), np.array([9, 2], np.int32)]
    src, seg = pad_rows(rows, PAD, left=False)
    out = np.asarray(generate_seq2seq(model, src, max_new=4, bos_id=1, eos_id=None, segment_ids=seg))
    for i, r in enumerate(rows):
        alone = generate_seq2seq(model, r[None], max_new=4, bos_id=1, eos_id=None)
        np.testing.assert_array_equal(out[i], np.asarray(alone)[0])


def test_a_token_shard_batch_carries_its_fields_in_both_packings(tmp_path):
    from jaxformer.data.prepare import prepare
    raw = tmp_path / "docs.jsonl"
    raw.write_text("".join(f'{{"text": "document {i} says hello world"}}\n' for i in range(60)))
    prepare([raw], tmp_path / "shards", tokenizer="byte", eval_fraction=0.2, progress=False)
    for packing in ("windows", "documents"):
        task = build_task(DataConfig(task="tokens", path=str(tmp_path / "shards"), block_size=16, packing=packing))
        train = next(iter(task.train_dataset(4, seed=0)))
        last = list(task.eval_batches(64, pad_id=PAD))[-1]
        for b in (train, last):
            assert {"segment_ids", "positions"} <= set(b)
            np.testing.assert_array_equal(b["positions"], positions_of(b["segment_ids"]))
            np.testing.assert_array_equal(b["segment_ids"] != 0, b["inputs"] != PAD)   # byte ids start at 1
        if packing == "windows":
            assert (train["segment_ids"] == 1).all()


def test_no_module_of_the_model_or_decoding_compares_tokens_with_the_pad_id():
    """The rule in the source: masks come from segment ids and positions, so no model or decoding file compares
    a token with pad_id (the pad id fills: decoded output, batches, ignored targets)."""
    from pathlib import Path
    import jaxformer
    root = Path(jaxformer.__file__).parent
    for f in [*sorted((root / "nn").glob("*.py")), root / "decode.py"]:
        src = f.read_text()
        for bad in ("!= cfg.pad_id", "!= pad", "== pad)", "!= self.cfg.pad_id", "tokens != "):
            assert bad not in src, f"{f.name} infers padding from a token id ({bad!r})"


def test_padding_inside_a_document_never_restarts_its_positions():
    """Positions derived from segment ids run on across padding within one id, so a query never sees a later
    column: causality by position stays causality by column (a restart after the gap would let column 1 see
    column 3 at position 0)."""
    seg = jnp.asarray([[1, 0, 1, 1, 0, 2, 2], [0, 0, 3, 3, 0, 3, 0]])
    np.testing.assert_array_equal(np.asarray(ops.positions_from_segments(seg)),
                                  [[0, 0, 2, 3, 0, 0, 1], [0, 0, 0, 1, 0, 3, 0]])
    model = _model("decoder_only")
    a = jnp.asarray([[4, PAD, 5, 6, PAD, 7, 8]])
    b = a.at[0, 3:].set(9)
    ids = jnp.asarray([[1, 0, 1, 1, 0, 1, 1]])
    la, lb = (np.asarray(model(x, segment_ids=ids)[0]) for x in (a, b))
    np.testing.assert_allclose(la[0, :3], lb[0, :3], rtol=0, atol=1e-6)        # the future never reaches back


@pytest.mark.parametrize("arch", ["decoder_only", pytest.param("encoder_decoder", marks=pytest.mark.slow)])  # ~5 s
def test_the_adapters_prompt_batch_decodes_each_prompt_as_alone(arch):
    """What `jaxformer generate` runs: prompts of different lengths, padded by the adapter, whose segment ids
    reach the decoder."""
    from types import SimpleNamespace
    tok = SimpleNamespace(eod_id=None, bos_id=1, eos_id=2)
    model, ad = _model(arch), architecture(arch)
    rows = [np.array([4, 5, 6, 7, 8], np.int32), np.array([9, 3], np.int32)]
    batch, seg = ad.prompt_batch(rows, PAD)
    out = np.asarray(ad.generate(model, tok, batch, seg, max_new=3))
    for i, r in enumerate(rows):
        np.testing.assert_array_equal(out[i], np.asarray(ad.generate(model, tok, r[None], max_new=3))[0])
