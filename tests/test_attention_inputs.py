"""Explicit attention inputs: packed documents (segment ids, positions restarting per document) give each
document the logits and the cached greedy decoding it has alone, on every attention backend that runs here; a
token equal to the pad id that is not padding attends normally once segment ids say so; sliding-window layers
see exactly their window, cached or not.

Wrong implementations these catch: a mask that ignores segments (documents see each other), positions that do
not restart (absolute encodings shift), segment masks applied only to the queries, a cache that forgets its
slots' documents, a kernel (pallas) that drops the segment ids.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import cached_and_full

from jaxformer import ops
from jaxformer.config import ModelConfig, replaced
from jaxformer.decode import generate_lm
from jaxformer.nn import build_model

V = 13
EPS32 = float(np.finfo(np.float32).eps)
DOCS = ([3, 4, 5, 6], [7, 8, 9], [10, 11, 2, 4, 5])          # three documents of one packed row
SEG = np.concatenate([np.full(len(d), i + 1) for i, d in enumerate(DOCS)])[None].astype(np.int32)   # [1,12]
ROW = np.concatenate(DOCS)[None].astype(np.int32)


def cfg(arch="decoder_only", **kw):
    base = dict(arch=arch, vocab_size=V, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48, num_encoder_layers=1,
                num_decoder_layers=2, runtime__dropout=0.0, max_len=32, norm__position="pre")
    return replaced(ModelConfig(), **(base | kw))


@functools.lru_cache(maxsize=None)
def model(**kw):
    return build_model(cfg(**kw), seed=1)


def tol(ref, ulps=64):
    """Float32 agreement relative to the compared values' scale: a document in a longer row sums the same terms
    plus exact zeros (masked keys), in another order; a leak across documents moves logits by ~0.1."""
    return ulps * EPS32 * max(1.0, float(np.abs(np.asarray(ref)).max()))


def run(m, *args, **kw):
    graphdef, state = nnx.split(m)
    return np.asarray(jax.jit(lambda st, *a: nnx.merge(graphdef, st)(*a, **kw)[0])(state, *args))


@pytest.mark.parametrize("pe,backend", [(pe, "reference") for pe in ("sinusoidal", "learned", "rope", "alibi")]
                         + [("learned", "chunked"), ("alibi", "chunked")])     # absolute and bias-based on tiles
def test_packed_row_equals_each_document_alone(pe, backend):
    m = model(positional=pe, runtime__attention_backend=backend, runtime__attention_block=4)
    packed = run(m, jnp.asarray(ROW), segment_ids=jnp.asarray(SEG))
    alone = np.concatenate([run(m, jnp.asarray([d], jnp.int32)) for d in DOCS], 1)
    assert np.abs(packed - alone).max() <= tol(alone)
    leaky = run(m, jnp.asarray(ROW))                                  # one document: later ones see earlier ones
    assert np.abs(leaky[:, len(DOCS[0]):] - alone[:, len(DOCS[0]):]).max() > 1e-3


def test_positions_restart_per_document_unless_given():
    got = np.asarray(ops.positions_from_segments(jnp.asarray(np.array([[1, 1, 2, 2, 2, 0, 3], [0, 1, 1, 1, 0, 0, 0]]))))
    np.testing.assert_array_equal(got, [[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 0, 0, 0]])
    m = model(positional="learned")
    absolute = run(m, jnp.asarray(ROW), segment_ids=jnp.asarray(SEG),
                   positions=jnp.arange(ROW.shape[1], dtype=jnp.int32)[None])
    alone = run(m, jnp.asarray([DOCS[1]], jnp.int32))
    sl = slice(len(DOCS[0]), len(DOCS[0]) + len(DOCS[1]))
    assert np.abs(absolute[:, sl] - alone).max() > 1e-3              # explicit positions are used as given


def test_pallas_packed_documents_in_interpret_mode():
    """The Pallas GPU kernel (interpret mode on CPU) takes the segment ids as its own."""
    m = model(positional="rope", runtime__attention_backend="pallas")
    row, seg = np.pad(ROW, [(0, 0), (0, 4)]), np.pad(SEG, [(0, 0), (0, 4)])   # 16: the kernel's tile
    packed = run(m, jnp.asarray(row), segment_ids=jnp.asarray(seg))[:, :ROW.shape[1]]
    alone = np.concatenate([run(model(positional="rope"), jnp.asarray([d], jnp.int32)) for d in DOCS], 1)
    assert np.abs(packed - alone).max() <= tol(alone)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention needs an NVIDIA GPU")
def test_cudnn_packed_documents():
    m = model(positional="rope", runtime__attention_backend="cudnn", runtime__dtype="bfloat16")
    packed = run(m, jnp.asarray(ROW), segment_ids=jnp.asarray(SEG))
    alone = np.concatenate([run(m, jnp.asarray([d], jnp.int32)) for d in DOCS], 1)
    assert np.abs(packed - alone).max() <= 64 * float(jnp.finfo(jnp.bfloat16).eps) * np.abs(alone).max()


@pytest.mark.parametrize("backend", ["reference", pytest.param("chunked", marks=pytest.mark.slow)])
def test_cached_greedy_decoding_of_a_packed_row_continues_its_last_document_alone(backend):
    m = model(positional="rope", runtime__attention_backend=backend, runtime__attention_block=4)
    other = np.array([[5, 6, 7, 8, 9, 10, 3, 4, 11, 12, 4, 4]], np.int32)                    # one document
    prompts = np.concatenate([ROW, other])
    segs = np.concatenate([SEG, np.ones_like(other)])
    got = np.asarray(generate_lm(m, prompts, segment_ids=segs, max_new=6))
    last = generate_lm(m, np.asarray([DOCS[-1]], np.int32), max_new=6)
    np.testing.assert_array_equal(got[0], np.asarray(last)[0])
    np.testing.assert_array_equal(got[1], np.asarray(generate_lm(m, other, max_new=6))[0])
    # and the cached step sees only its document: the prefill's logits are the documents' own
    logits, out = nnx.jit(lambda m: m(jnp.asarray(ROW), ops.positions_from_segments(jnp.asarray(SEG)),
                                      segment_ids=jnp.asarray(SEG), cache=m.init_cache(1, 16), mode="prefill"))(m)
    cache = out["cache"]
    alone = np.concatenate([run(m, jnp.asarray([d], jnp.int32)) for d in DOCS], 1)
    assert np.abs(np.asarray(logits) - alone).max() <= tol(alone)
    np.testing.assert_array_equal(np.asarray(cache.segments[:, :12]), SEG)


def test_a_token_equal_to_the_pad_id_attends_normally_with_segment_ids():
    """Token id 0 (the pad id) inside a sequence is an ordinary token, with segment ids of 1 and without any,
    exactly as in the same model whose pad id is another token; only segment id 0 makes a token padding."""
    tokens = jnp.asarray([[3, 0, 5, 6, 0, 7]], jnp.int32)
    m = model(positional="rope")
    other_pad = build_model(cfg(positional="rope", pad_id=12), seed=1)
    nnx.update(other_pad, nnx.state(m))                                # same weights, pad id 12
    want = run(other_pad, tokens)
    got = run(m, tokens, segment_ids=jnp.ones_like(tokens))
    assert np.abs(got - want).max() <= tol(want, 8)
    assert np.abs(run(m, tokens) - want).max() <= tol(want, 8)        # the default: every token is real
    padded = run(m, tokens, segment_ids=jnp.asarray([[1, 0, 1, 1, 0, 1]]), positions=jnp.arange(6)[None])
    assert np.abs(padded - want)[:, 2:].max() > 1e-3                  # segment 0: padding, never seen


@pytest.mark.parametrize("backend", [pytest.param("reference", marks=pytest.mark.slow), "chunked"])   # ~3 s each
def test_packed_seq2seq_pairs_equal_each_pair_alone(backend):
    """Three (source, target) pairs packed in one row each side: cross-attention stays within its pair."""
    m = model(arch="encoder_decoder", positional="sinusoidal", runtime__attention_backend=backend,
              runtime__attention_block=4)
    srcs, tgts = ([3, 4, 2], [5, 6, 7, 2], [8, 2]), ([1, 4, 3], [1, 7, 6, 5], [1, 8])
    seg = lambda parts: np.concatenate([np.full(len(p), i + 1) for i, p in enumerate(parts)])[None]  # noqa: E731
    row = lambda parts: np.concatenate(parts)[None].astype(np.int32)                              # noqa: E731
    packed = run(m, jnp.asarray(row(srcs)), jnp.asarray(row(tgts)), src_segment_ids=jnp.asarray(seg(srcs)),
                 tgt_segment_ids=jnp.asarray(seg(tgts)))
    alone = np.concatenate([run(m, jnp.asarray([s], jnp.int32), jnp.asarray([t], jnp.int32))
                            for s, t in zip(srcs, tgts)], 1)
    assert np.abs(packed - alone).max() <= tol(alone)


# ----------------------------------------------------------------------------- sliding-window attention

def test_window_mask_matches_a_numpy_reference():
    rng = np.random.default_rng(0)
    qp, kp = rng.integers(0, 20, (2, 7)), rng.integers(0, 20, (2, 9))
    for w in (0, 1, 3):
        got = np.asarray(ops.position_causal_mask(jnp.asarray(qp), jnp.asarray(kp), window=jnp.int32(w)))[:, 0]
        d = qp[:, :, None] - kp[:, None, :]
        np.testing.assert_array_equal(got, (d >= 0) & ((d < w) | (w == 0)))


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_windowed_layers_see_exactly_their_receptive_field(backend):
    """Two layers of window 3: position t depends on positions t-4 .. t and on nothing earlier; a pattern (3, 0)
    makes the second layer global again."""
    m = model(positional="rope", attention__windows=(3,), runtime__attention_backend=backend,
              runtime__attention_block=4)
    x = jnp.asarray([[3, 4, 5, 6, 7, 8, 9, 10, 1, 2]], jnp.int32)
    moved = np.abs(run(m, x.at[0, 0].set(11)) - run(m, x)).max(-1)[0]
    assert (moved[:5] > 0).all() and (moved[5:] == 0).all(), moved
    mixed = model(positional="rope", attention__windows=(3, 0))
    assert (np.abs(run(mixed, x.at[0, 0].set(11)) - run(mixed, x)).max(-1)[0] > 0).all()


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_windowed_cached_decoding_equals_the_full_forward(backend):
    m = model(positional="alibi", attention__windows=(2, 0), runtime__attention_backend=backend,
              runtime__attention_block=4)
    x = jnp.asarray(np.random.default_rng(1).integers(1, V, (2, 11)), jnp.int32)
    got, want, _ = cached_and_full(m, x, 4)
    assert np.abs(np.asarray(got) - np.asarray(want)).max() <= tol(want)


def test_windows_are_validated_and_pallas_refuses_them():
    from jaxformer.errors import ConfigError
    with pytest.raises(ConfigError, match="model.attention.windows"):
        cfg(attention__windows=(3, 0, 1))                      # 3 does not divide 2 layers
    with pytest.raises(ConfigError, match="model.attention.windows"):
        cfg(attention__windows=(-1,))
    with pytest.raises(ConfigError, match="sliding window"):
        cfg(attention__windows=(4,), runtime__attention_backend="pallas")
