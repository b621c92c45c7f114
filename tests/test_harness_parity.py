"""`HarnessModel` (and so `jaxformer eval-tasks`) scores as lm-evaluation-harness 0.4.13's HFLM scores.

Before: a (context, continuation) pair past the window kept one token less context than HFLM (the row cut to
max_len tokens, not max_len + 1 with the last one only a target); rolling windows predicted max_len - 1 tokens
(HFLM's predict max_len); requests of different max_gen_toks all generated the largest; acc_norm divided by UTF-8
bytes (the harness's acc_bytes; its acc_norm divides by characters).

Default lane (cheap, no model): each rule on a stand-in LM whose log P(target | inputs) is a hash of every input
token it sees and the target (a token of context more or less, or a target skipped, changes the sum), against
the harness's rule: `lm_eval.utils.get_rolling_token_windows` + `make_disjoint_window` themselves, and HFLM's
`_loglikelihood_tokens` / `generate_until` cuts as written there. Slow lane: a tiny Llama-shaped jaxformer LM
with a byte-level BPE tokenizer, exported (`save_pretrained`), loaded in transformers and driven by HFLM itself
(max_length 16): every request's answer equal within 1e-4, with a tokenizer without a BOS (GPT-2's way: the
end-of-text token is HFLM's prefix) and one whose post-processor adds <s> (Llama's: HFLM's rolling windows then
score that <s> after the prefix <s>, and a long prompt loses its <s> to the left cut).
"""
from __future__ import annotations

import re
import types
import zlib

import numpy as np
import pytest
from flax import nnx

from jaxformer.arch.lm import LanguageModel
from jaxformer.data.text import corpus_path
from jaxformer.errors import DataError
from jaxformer.inference.restore import LoadedModel
from jaxformer.inference.tasks import HarnessModel, _Request, extract, score_multiple_choice

L = 16                          # the window: model.max_len and HFLM's max_length
TOL = 1e-4
TEXT = corpus_path("builtin:alice").read_text(encoding="utf-8")[:20000]
BOS, EOS = 1, 2


# ----------------------------------------------------------------------------- acc, acc_norm, acc_bytes

class _Scored:
    """A stand-in for HarnessModel whose loglikelihood answers the given log-likelihoods in order."""

    def __init__(self, lls):
        self.lls = list(lls)

    def loglikelihood(self, requests):
        return [(self.lls.pop(0), False) for _ in requests]


# docs where the pick per character (acc_norm) and per byte (acc_bytes) differ: "é" is 1 character, 2 bytes
NON_ASCII = [({"context": "x", "choices": [" café", " cafe"], "answer": 0}, [-10.0, -9.0]),
             ({"context": "x", "choices": ["é", "ab"], "answer": 1}, [-1.1, -2.0]),
             ({"context": "x", "choices": [" é", " e", " ee"], "answer": 2}, [-3.0, -2.9, -3.5]),
             ({"context": "x", "choices": ["e", "é"], "answer": 1}, [-1.0, -1.5])]      # per byte: the 2nd


@pytest.mark.parametrize("doc, lls", NON_ASCII)
def test_acc_norm_divides_by_characters_and_acc_bytes_by_bytes(doc, lls):
    """lm_eval/api/task.py, ConfigurableTask.process_results: pred_norm = argmax(lls / len(choice)),
    pred_byte = argmax(lls / len(choice.encode("utf-8"))). Before: acc_norm was the per-byte pick, no acc_bytes."""
    metrics, (pred,) = score_multiple_choice(_Scored(lls), [doc])
    chars = np.array([len(c) for c in doc["choices"]], float)
    nbytes = np.array([len(c.encode("utf-8")) for c in doc["choices"]], float)
    want = {"acc": np.argmax(lls), "acc_norm": np.argmax(np.array(lls) / chars),
            "acc_bytes": np.argmax(np.array(lls) / nbytes)}
    assert want["acc_norm"] != want["acc_bytes"]                       # the doc tells the two apart
    assert {k: v["value"] for k, v in metrics.items()} == {k: float(p == doc["answer"]) for k, p in want.items()}
    assert (pred["pick"], pred["pick_norm"], pred["pick_bytes"]) == tuple(want.values())
    assert pred["answer"] == doc["answer"] and pred["loglikelihoods"] == lls


def test_examples_scored_together_are_each_scored_alone():
    """One loglikelihood call for every choice of every example: each example reads its own choices' scores."""
    together, preds = score_multiple_choice(_Scored([x for _, lls in NON_ASCII for x in lls]),
                                            [d for d, _ in NON_ASCII])
    alone = [score_multiple_choice(_Scored(lls), [d]) for d, lls in NON_ASCII]
    assert preds == [p for _, (p,) in alone]
    for metric, stat in together.items():
        assert stat["value"] == np.mean([m[metric]["value"] for m, _ in alone]) and stat["n"] == len(NON_ASCII)


@pytest.mark.parametrize("pattern, text", [
    (r"#### (\-?[0-9\.\,]+)", "so #### 42 and #### 7"),       # the harness's default: the first match's group
    (r"(\d\d+)|(\d)", "it is 5 or 12"),                       # the first group that took part
    (r"\d+", "a 12 b"),                                       # no group: the whole match
    (r"(a)?(c)?b", "xb"),                                     # groups, none took part: nothing
    (r"answer: (\w+)", "no answer here"),                     # no match
    (r"answer:(.*)", "answer:  yes  ")])                      # stripped
def test_extraction_is_lm_evals_regex_filter(pattern, text):
    """`extract` against lm_eval.filters.extraction.RegexFilter (group_select 0): its fallback is our None."""
    extraction = pytest.importorskip("lm_eval.filters.extraction", reason="lm-evaluation-harness (the test extra)")
    want = extraction.RegexFilter(pattern, 0, fallback="[invalid]").apply([[text]], None)[0][0]
    assert extract(re.compile(pattern), text) == (None if want == "[invalid]" else want)
    assert extract(None, f" {text} ") == text.strip()


@pytest.mark.slow           # lm_eval.api.task imports datasets and pandas (~1 s); the formula is pinned above
def test_acc_metrics_equal_lm_evals_own_process_results():
    """The same docs through lm_eval's ConfigurableTask.process_results itself (a task over them in memory)."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness (the test extra) checks its own formula")
    import datasets
    from lm_eval.api.task import ConfigurableTask
    docs = [d for d, _ in NON_ASCII]
    task = ConfigurableTask(config={
        "task": "non_ascii", "custom_dataset": lambda **kw: {"test": datasets.Dataset.from_list(docs)},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "context", "doc_to_choice": "choices",
        "doc_to_target": "answer", "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                                                   for m in ("acc", "acc_norm", "acc_bytes")]})
    for doc, lls in NON_ASCII:
        metrics, _ = score_multiple_choice(_Scored(lls), [doc])
        assert {k: v["value"] for k, v in metrics.items()} == task.process_results(doc, [(x, False) for x in lls])


# ----------------------------------------------------------------------------- the rules, on a stand-in LM

class _Bytes:
    """UTF-8 bytes as ids 3.. with <s> = 1 (opening prompts and texts when bos) and </s> = 2 (end of document)."""

    def __init__(self, bos: bool):
        self.bos_id, self.eod_id = (BOS if bos else None), EOS

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + 3

    def decode(self, ids) -> str:
        return bytes(int(i) - 3 for i in ids if int(i) >= 3).decode("utf-8", errors="replace")


def _lp(seen, target) -> float:
    """The stand-in's log P(target | the inputs seen): a hash of all of them, in (-11, -1]."""
    return -1.0 - zlib.crc32(np.asarray([*seen, -1, target], np.int64).tobytes()) % 1000 / 100.0


def stand_in(bos: bool, max_len: int = L, tok=None) -> HarnessModel:
    """A HarnessModel of the stand-in LM: its _scores gives (log P [B,T], is argmax [B,T]), position i seeing
    tokens[:, :i+1], and refuses inputs longer than max_len as a model of learned or sinusoidal positions does.
    tok: its tokenizer (default `_Bytes(bos)`)."""
    def scores(state, tokens, targets, seg):
        tokens, targets = np.asarray(tokens), np.asarray(targets)
        assert tokens.shape[1] <= max_len, f"sequence length {tokens.shape[1]} exceeds model.max_len={max_len}"
        lp = np.array([[_lp(row[:i + 1], t) for i, t in enumerate(tg)] for row, tg in zip(tokens, targets)])
        return lp, lp > -3.0
    cfg = types.SimpleNamespace(model=types.SimpleNamespace(arch="decoder_only", max_len=max_len, pad_id=0))
    hm = HarnessModel(LoadedModel(cfg, tok or _Bytes(bos), nnx.Linear(1, 1, rngs=nnx.Rngs(0)), 0, "latest"),
                      batch_rows=3)
    hm._scores = scores
    return hm


def harness_pair(context_enc: list[int], continuation_enc: list[int], max_len: int = L) -> tuple[float, bool]:
    """HFLM._loglikelihood_tokens on the stand-in: the model reads (context_enc + continuation_enc)[-(max_length +
    1):][:-1]; the continuation is scored on the last len(continuation_enc) logits."""
    row = (context_enc + continuation_enc)[-(max_len + 1):]
    inp, tgt = row[:-1], row[1:]
    lps = [_lp(inp[:i + 1], tgt[i]) for i in range(len(inp) - len(continuation_enc), len(inp))]
    return sum(lps), all(x > -3.0 for x in lps)


@pytest.mark.parametrize("bos", [False, True])
def test_a_pair_past_the_window_keeps_max_len_tokens_of_context_as_hflm(bos):
    """Before: rows of max_len tokens, so past the window the model read one token less context than HFLM."""
    hm, tok = stand_in(bos), _Bytes(bos)
    opening = [BOS] if bos else []
    pairs = [("abc", "de"), ("", "xyz"), ("a" * 10, "b" * 6), ("abcdefghij" * 3, "kl"), ("q" * 20, "r" * L),
             ("0123456789abcdef", "g")]                  # inside; empty context; at the edge; far; L; just past
    got = hm.loglikelihood([_Request(c, x) for c, x in pairs])
    want = [harness_pair(opening + list(tok.encode(c)) if c else [BOS if bos else EOS], list(tok.encode(x)))
            for c, x in pairs]
    np.testing.assert_allclose([g for g, _ in got], [w for w, _ in want], rtol=0, atol=1e-9)
    assert [g for _, g in got] == [w for _, w in want]
    with pytest.raises(DataError, match=f"is {L + 1} tokens, longer than model.max_len={L}: it cannot be scored"):
        hm.loglikelihood([_Request("a", "b" * (L + 1))])           # HFLM asserts; before: its tail scored silently


def test_rows_are_padded_to_a_power_of_two_no_wider_than_max_len():
    """model.max_len=12 (Alice's char model has 100): a full row is 12 inputs, padded to 12, not 16. Before, a
    row past 64 tokens of a max_len=100 model with sinusoidal or learned positions was padded to 128 and refused
    ("sequence length 128 exceeds model.max_len=100")."""
    hm, tok = stand_in(False, max_len=12), _Bytes(False)
    (got, _), = hm.loglikelihood([_Request("a" * 30, "bc")])
    assert got == pytest.approx(harness_pair(list(tok.encode("a" * 30)), list(tok.encode("bc")), max_len=12)[0])


def bpe():
    """A 300-id byte-level BPE tokenizer (<unk>, <s>, </s>) trained on TEXT (`tokenizers`, nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


# pairs the BPE merges across: "sh" + "e said" is "s h" alone, "s he Ġs a i d" whole. (No two requests of the
# HFLM test below may share their whole row of tokens: HFLM's logits cache then scores the second continuation on
# the first's positions, e.g. ("the ", "rabbit") and ("the rab", "bit").)
MERGING = [("sh", "e said"), ("Alice wa", "s tired"), ("an", "d the"), ("th", "e rabbit")]


@pytest.mark.parametrize("bos", [False, True])
def test_a_pair_is_encoded_by_lm_evals_own_encode_pair(bos):
    """lm_eval's TemplateLM._encode_pair itself (its causal rule: the context's trailing space moved, the context
    encoded alone, the continuation the whole's tokens after as many as the context's) on a BPE that merges across
    the boundary, each pair scored as HFLM scores (context_enc, continuation_enc) (`harness_pair`). Wrong
    implementations caught: the context's tokens taken from the whole ("s he", where lm-eval conditions on "s h"),
    the continuation encoded alone ("e Ġs a i d", where lm-eval scores "Ġs a i d")."""
    lm = pytest.importorskip("lm_eval.api.model", reason="lm-evaluation-harness (the test extra) encodes the pairs")
    from jaxformer.data.tokenizers import HFTokenizer
    tok = HFTokenizer(bpe(), eod_id=EOS, pad_id=-1, bos_id=BOS if bos else None)
    opening = [BOS] if bos else []          # HFLM's tok_encode with a post-processor adding <s> (Llama's)
    harness = types.SimpleNamespace(backend="causal",
                                    tok_encode=lambda s, **kw: opening + [int(t) for t in tok.encode(s)])
    whole, alone = list(tok.encode("she said")), list(tok.encode("sh"))
    assert whole[:len(alone)] != alone                                 # the pair tells the rules apart
    want = [harness_pair(*lm.TemplateLM._encode_pair(harness, c, x)) for c, x in MERGING]
    got = stand_in(bos, tok=tok).loglikelihood([_Request(c, x) for c, x in MERGING])
    np.testing.assert_allclose([g for g, _ in got], [w for w, _ in want], rtol=0, atol=1e-9)
    assert [g for _, g in got] == [w for _, w in want]


@pytest.mark.parametrize("bos", [False, True])
def test_rolling_windows_are_hflms_disjoint_windows(bos):
    """lm_eval.utils.get_rolling_token_windows(token_list=tok_encode(text), prefix_token=BOS or EOS, max_seq_len=L,
    context_len=1), each made disjoint and scored as a pair. Before: windows of max_len - 1 predictions."""
    utils = pytest.importorskip("lm_eval.utils", reason="lm-evaluation-harness (the test extra) makes the windows")
    hm, tok = stand_in(bos), _Bytes(bos)
    texts = ["", "a", "b" * (L - 1), "c" * L, "d" * (L + 1), "".join(map(chr, range(65, 65 + 3 * L + 5)))]
    got = hm.loglikelihood_rolling([_Request(t) for t in texts])
    want = []
    for t in texts:
        windows = utils.get_rolling_token_windows(token_list=([BOS] if bos else []) + list(tok.encode(t)),
                                                  prefix_token=BOS if bos else EOS, max_seq_len=L, context_len=1)
        want.append(sum(harness_pair(*utils.make_disjoint_window(w))[0] for w in windows))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)


class _Plain(_Bytes):
    """_Bytes with neither a BOS nor an end-of-document token (no `eod_id` at all, as a digit tokenizer)."""

    def __init__(self):
        self.bos_id = None


def test_without_a_prefix_token_the_texts_first_token_is_the_prefix():
    """No BOS and no end-of-document token to open a text with: its first token is the windows' prefix, unscored
    (lm_eval.utils.get_rolling_token_windows of the rest with that prefix); an empty text scores 0."""
    utils = pytest.importorskip("lm_eval.utils", reason="lm-evaluation-harness (the test extra) makes the windows")
    tok = _Plain()
    texts = ["", "a", "e" * (2 * L + 3)]
    got = stand_in(False, tok=tok).loglikelihood_rolling([_Request(t) for t in texts])
    want = [0.0]
    for t in texts[1:]:
        ids = list(tok.encode(t))
        windows = utils.get_rolling_token_windows(token_list=ids[1:], prefix_token=ids[0], max_seq_len=L,
                                                  context_len=1)
        want.append(sum(harness_pair(*utils.make_disjoint_window(w))[0] for w in windows))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)
    with pytest.raises(DataError, match="an empty context with a tokenizer that has neither a BOS nor an end-of-doc"):
        stand_in(False, tok=tok).loglikelihood([_Request("", "ab")])       # nothing to condition "a" on


def test_rows_are_padded_to_power_of_two_widths_and_batches():
    """A batch's rows are padded to the next power of two (at least 2) of its longest row's inputs, no wider
    than max_len, and to a power-of-two number of rows: a handful of program shapes for any task."""
    shapes = []
    hm = stand_in(False, max_len=16)
    scores = hm._scores
    hm._scores = lambda state, tokens, targets, seg: (shapes.append(tokens.shape), scores(state, tokens, targets,
                                                                                             seg))[1]
    for context in ["a", "ab", "abc", "abcdefgh", "abcdefghi", "a" * 20]:
        hm.loglikelihood([_Request(context, "z")])                 # inputs: 1, 2, 3, 8, 9, 16 (cut to max_len)
    hm.loglikelihood([_Request("a", "b")] * 3)
    assert shapes == [(1, 2), (1, 2), (1, 4), (1, 8), (1, 16), (1, 16), (4, 2)]


@pytest.mark.parametrize("bos", [False, True])
def test_a_long_prompt_keeps_its_last_max_len_minus_max_gen_toks_tokens_as_hflm(bos, monkeypatch):
    """HFLM.generate_until: requests grouped by their generation arguments, each prompt (its BOS included, which
    the cut may drop) left-truncated to max_length - max_gen_toks tokens, max_gen_toks new tokens, the text cut at
    each stop string. The stand-in generator echoes a prompt's last max_new tokens. Before: every request got the
    largest max_gen_toks of the batch, and a BOS was kept on top of the last max_len - max_new - 1 tokens."""
    seen = []

    def echo(self, model, tokenizer, prompts, segment_ids=None, *, max_new=None, **kw):
        seen.append((np.asarray(prompts).tolist(), max_new))
        return np.asarray(prompts)[:, -max_new:]
    monkeypatch.setattr(LanguageModel, "generate", echo)
    hm, tok = stand_in(bos), _Bytes(bos)
    reqs = [("abcdefghijklmnopqrstuvwxyz", {"until": ["w"], "max_gen_toks": 5}), ("xy", {"max_gen_toks": 3}),
            ("0123456789" * 2, {"until": "98", "max_gen_toks": 5}), ("ab", {"until": [], "max_gen_toks": 5})]
    got = hm.generate_until([_Request(*r) for r in reqs])
    want, rows = [], {}
    for text, kw in reqs:
        n = kw["max_gen_toks"]
        row = (([BOS] if bos else []) + list(tok.encode(text)))[-(L - n):]        # HFLM's left_truncate_len
        rows.setdefault(n, []).append(row)
        out, until = tok.decode(row[-n:]), kw.get("until", [])
        for stop in [until] if isinstance(until, str) else until:
            out = out.split(stop)[0]                                            # postprocess_generated_text
        want.append(out)
    assert got == want
    assert [(n, [[t for t in r if t != 0] for r in p]) for p, n in seen] == list(rows.items())   # pad id 0


def test_a_request_without_max_gen_toks_generates_hflms_default_and_stops_at_the_tokenizers_eos(monkeypatch):
    """HFLM.generate_until: gen_kwargs without max_gen_toks generate HFLM's max_gen_toks. The generator gets the run's tokenizer: LanguageModel.generate stops a row at its end-of-document
    token (decode's eos_id, tests/test_decode.py), as HFLM cuts at the EOS text."""
    huggingface = pytest.importorskip("lm_eval.models.huggingface", reason="lm-evaluation-harness (the test extra)")
    default = huggingface.HFLM.max_gen_toks.fget(None)                 # HFLM's property: a constant
    seen = []

    def echo(self, model, tokenizer, prompts, segment_ids=None, *, max_new=None, **kw):
        seen.append((max_new, tokenizer))
        return np.asarray(prompts)[:, -max_new:]
    monkeypatch.setattr(LanguageModel, "generate", echo)
    hm = stand_in(False, max_len=default + 8)
    assert hm.generate_until([_Request("ab", {"until": []})]) == ["ab"]
    assert seen == [(default, hm.tok)]


# ----------------------------------------------------------------------------- the same model under HFLM itself

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"plain" | "bos": (HarnessModel, HFLM)} over one model: ours (Llama-shaped, one layer, random weights,
    float32) and its export loaded by transformers, with a 300-id byte-level BPE tokenizer (<unk>, <s>, </s>)
    without, or with, a post-processor adding <s>."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness (the test extra) is the reference")
    transformers = pytest.importorskip("transformers")
    from lm_eval.models.huggingface import HFLM
    from test_export_families import BASE, random_model
    from tokenizers import Tokenizer, processors
    from jaxformer.config import replaced
    from jaxformer.data.tokenizers import HFTokenizer
    from jaxformer.hf import save_pretrained
    tok = bpe()
    cfg = replaced(BASE, vocab_size=tok.get_vocab_size(), max_len=L, num_decoder_layers=1)
    ours = random_model(cfg)
    folder = tmp_path_factory.mktemp("parity") / "hf"
    save_pretrained(ours, folder, token_ids={"bos_token_id": BOS, "eos_token_id": EOS})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    out = {}
    for kind in ("plain", "bos"):
        t = Tokenizer.from_str(tok.to_str())
        if kind == "bos":
            t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(t.to_str()),
                                                    eos_token="</s>", **({"bos_token": "<s>"} if kind == "bos" else {}))
        run = LoadedModel(types.SimpleNamespace(model=cfg), HFTokenizer(t, eod_id=EOS, pad_id=-1,
                                                                        bos_id=BOS if kind == "bos" else None),
                          ours, 0, "latest")
        out[kind] = (HarnessModel(run, batch_rows=4),
                     HFLM(pretrained=theirs, tokenizer=fast, max_length=L, batch_size=4, device="cpu"))
    return out


def requests(kind: str, *args) -> list:
    from lm_eval.api.instance import Instance
    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


@pytest.mark.slow           # torch, transformers and lm_eval, an export and two models (~5 s): the rules above
@pytest.mark.parametrize("kind", ["plain", "bos"])
def test_loglikelihood_inside_and_past_the_window_equals_hflm(models, kind):
    ours, theirs = models[kind]
    pairs = [("Alice was", " beginning"), ("the ", "rabbit"), ("", "Alice"),      # inside; a space moved; empty
             (TEXT[:200], " and the"), (TEXT[300:360], " she said to herself"),   # far and just past the window
             (TEXT[:40], TEXT[40:60]),      # a continuation of max_len tokens (the trailing space moved)
             *MERGING]                      # merges across the boundary
    assert len(ours._pair(*pairs[5])[1]) == L and len(ours._pair(*pairs[3])[0]) > 3 * L
    got, want = ours.loglikelihood(requests("loglikelihood", *pairs)), theirs.loglikelihood(
        requests("loglikelihood", *pairs))
    np.testing.assert_allclose([g for g, _ in got], [w for w, _ in want], atol=TOL, rtol=0)
    assert [b for _, b in got] == [b for _, b in want]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["plain", "bos"])
def test_rolling_loglikelihood_equals_hflm(models, kind):
    ours, theirs = models[kind]
    texts = [(TEXT[1000:1100],), (TEXT[500:540],), ("Alice",)]                    # several windows, about two, one
    got = ours.loglikelihood_rolling(requests("loglikelihood_rolling", *texts))
    np.testing.assert_allclose(got, theirs.loglikelihood_rolling(requests("loglikelihood_rolling", *texts)),
                               atol=TOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["plain", "bos"])
def test_generate_until_equals_hflm(models, kind):
    """Greedy, cut at a stop string (a list or one string), contexts past max_length - max_gen_toks, requests of
    two max_gen_toks."""
    ours, theirs = models[kind]

    def args():          # new each time: HFLM appends its EOS to a request's stop list
        return [(TEXT[:20], {"until": ["\n\n"], "max_gen_toks": 6}), (TEXT[:300], {"until": [], "max_gen_toks": 5}),
                (TEXT[100:400], {"until": "e", "max_gen_toks": 5}), (TEXT[:300], {"until": ["o"], "max_gen_toks": 6})]
    assert ours.generate_until(requests("generate_until", *args())) == theirs.generate_until(
        requests("generate_until", *args()))
