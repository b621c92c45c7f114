"""Downstream evaluation of a run's language model on local task files, scored as lm-evaluation-harness scores them
(`jaxformer eval-tasks --workdir RUN --tasks FILE ...`; nothing is downloaded).

A task file is JSONL, one example per line; its kind is read from the first line's keys:
  multiple choice  {"context": str, "choices": [str, ...], "answer": int}     (ARC, HellaSwag, PIQA converted)
      each choice scored by its log-likelihood given the context, summed over its tokens (`loglikelihood`);
      acc: the highest-scoring choice is the answer; acc_norm: the highest score per character of the choice
      (its text as written, a leading space included); acc_bytes: per UTF-8 byte of it (lm-evaluation-harness's
      three metrics: `ConfigurableTask.process_results` divides by len(choice) for acc_norm, by its UTF-8 length
      for acc_bytes; they differ only on non-ASCII choices).
  generation       {"prompt": str, "answer": str}                             (GSM8K style)
      the greedy continuation (`generate_until`: up to --max-new tokens, cut at the first stop string, default
      "\\n\\n"), exact_match: it equals the answer (a JSON number: its text) after stripping whitespace (and,
      with --answer-regex, after taking the first match of that regex in each, its first non-empty group if it
      has groups: GSM8K's "#### 42"; an output without a match is wrong, an answer without one refused).
Every metric is a mean over examples with its standard error, sqrt(p(1 − p) / (n − 1)) (the sample standard
deviation of the per-example scores / sqrt(n), as lm-evaluation-harness reports it). Results and per-example
predictions are written whole to RUN/eval_tasks/NAME.json, NAME the file's stem (with the folders that tell
apart two files of one stem: `task_names`) as each task finishes; a stop signal ends the run at the next batch.

`HarnessModel` implements lm-evaluation-harness's model API (`loglikelihood`, `loglikelihood_rolling`,
`generate_until`, each over requests with `.args`), so that its task library can drive a jaxformer model where a
user has lm_eval and the data: `lm_eval.evaluator.simple_evaluate(model=HarnessModel(run), tasks=[...])`.

Tokenization and windows follow lm-evaluation-harness 0.4's HFLM (`tests/test_harness_parity.py` runs it on the
same weights): trailing whitespace of a context moves to its continuation; the model reads the context encoded
alone, then the continuation's tokens: those of the whole pair's encoding after as many as the context's
(lm-eval's `_encode_pair`; where the tokenizer merges across the boundary, the two are not the whole's encoding);
the run's BOS opens each row where its tokenizer has one (a pretrained model's), else its end-of-document token
opens a row whose context is empty. A pair is scored on the last max_len + 1 tokens of context + continuation: the model
reads the first max_len of them and the continuation's last token is only a target (HFLM's
`(context + continuation)[-(max_length + 1):][:-1]`); a continuation longer than max_len tokens is refused.
`loglikelihood_rolling` scores a text in HFLM's disjoint windows (`get_rolling_token_windows` with
context_len=1, `make_disjoint_window`): the first predicts the text's first max_len tokens after the BOS (or
end-of-document) token, each next one the next max_len tokens after as many tokens before them as make max_len
inputs (a tokenizer with a BOS also opens the text with it, so that BOS is scored after the first, as HFLM scores
it). A generation prompt (its BOS included) keeps its last model.max_len - max_gen_toks tokens (HFLM's left
truncation, with a warning), and requests are generated in groups of one max_gen_toks (default 256, HFLM's).
Scoring is batched in rows padded to a power of two up to max_len (few compiled shapes), one jitted forward.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer.arch import architecture
from jaxformer.errors import ConfigError, DataError, Interrupted
from jaxformer.inference.generate import prompt_ids
from jaxformer.inference.restore import LoadedModel
from jaxformer.inference.task_files import read_task, task_names
from jaxformer.signals import Held

log = logging.getLogger("jaxformer")


MAX_GEN_TOKS = 256                     # lm-evaluation-harness's max_gen_toks where a request names none


@functools.partial(jax.jit, static_argnums=0)
def _token_scores(graph, state, tokens, targets, seg):
    """tokens, targets, seg [B,T] -> (log P(targets[:, i] | tokens[:, ..i]) [B,T], whether it is the argmax [B,T])
    of the model (graph, state)."""
    logits = nnx.merge(graph, state)(tokens, segment_ids=seg)[0].astype(jnp.float32)
    lp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(lp, targets[..., None], -1)[..., 0], lp.argmax(-1) == targets


class HarnessModel:
    """A loaded run as an lm-evaluation-harness model (its LM API, duck-typed: lm_eval is not a dependency).
    batch_rows: scoring rows per compiled call. before_batch: called before each compiled call (a stop check)."""

    def __init__(self, run: LoadedModel, batch_rows: int = 32, before_batch=lambda: None):
        if run.cfg.model.arch != "decoder_only":
            raise ConfigError(f"eval-tasks scores language models; {run.cfg.model.arch!r} runs are evaluated by "
                              f"`jaxformer eval`")
        self.run, self.tok, self.rows, self.before_batch = run, run.tokenizer, batch_rows, before_batch
        self.task = None                # what warnings name the requests by (eval-tasks: the task file)
        self.max_len = run.cfg.model.max_len
        graph, self._state = nnx.split(run.model)
        self._scores = functools.partial(_token_scores, graph)       # compiled once per model and shape

    def _opening(self) -> list[int]:
        bos = getattr(self.tok, "bos_id", None)
        return [] if bos is None else [int(bos)]

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(prefix ids, continuation ids) as lm-evaluation-harness encodes a pair (`TemplateLM._encode_pair`, causal):
        the context encoded alone, the continuation the whole's tokens after as many as the context's (where the
        tokenizer merges across the boundary, prefix + continuation is not the whole's encoding: lm-eval's rule)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = [int(t) for t in self.tok.encode(context + continuation)] if context + continuation else []
        ctx = [int(t) for t in self.tok.encode(context)] if context else []
        prefix = self._opening() + ctx                   # the context encoded alone, as lm-eval's _encode_pair
        if not prefix:
            eod = getattr(self.tok, "eod_id", None)
            if eod is None:
                raise DataError("an empty context with a tokenizer that has neither a BOS nor an end-of-document "
                                "token: nothing to condition the first token on")
            prefix = [int(eod)]
        return prefix, whole[len(ctx):]

    def _score_rows(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log P(continuation | prefix), whether greedy decoding gives the continuation) per pair (a continuation
        of max_len tokens at most), batched. A row is the last max_len + 1 tokens of prefix + continuation, as
        lm-evaluation-harness cuts it: the model reads all but its last token and predicts all but its first."""
        out = []
        for i in range(0, len(pairs), self.rows):
            self.before_batch()
            chunk = pairs[i:i + self.rows]
            rows = [(p + c)[-(self.max_len + 1):] for p, c in chunk]
            width = min(self.max_len, 1 << max(1, math.ceil(math.log2(max(1, *(len(r) - 1 for r in rows))))))
            b = 1 << max(0, math.ceil(math.log2(len(rows))))
            tokens, targets, seg = (np.zeros((b, width), np.int32) for _ in range(3))
            for j, r in enumerate(rows):
                tokens[j, :len(r) - 1], targets[j, :len(r) - 1], seg[j, :len(r) - 1] = r[:-1], r[1:], 1
            lp, greedy = (np.asarray(x) for x in self._scores(self._state, jnp.asarray(tokens), jnp.asarray(targets),
                                                              jnp.asarray(seg)))
            for j, ((p, c), r) in enumerate(zip(chunk, rows)):
                n = len(c)
                sl = slice(len(r) - 1 - n, len(r) - 1)                 # predictions of the continuation's tokens
                out.append((float(lp[j, sl].sum()), bool(greedy[j, sl].all())))
        return out

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """requests with .args = (context, continuation) -> [(log-likelihood, is_greedy)]. DataError: a
        continuation longer than model.max_len tokens (lm-evaluation-harness scores a continuation in one
        window)."""
        pairs = [self._pair(*r.args) for r in requests]
        for r, (_, c) in zip(requests, pairs):
            if len(c) > self.max_len:
                raise DataError(f"{self.task + ': ' if self.task else ''}the continuation {r.args[1][:60]!r} is "
                                f"{len(c)} tokens, longer than model.max_len={self.max_len}: it cannot be scored "
                                f"in one window")
        return self._score_rows(pairs)

    def loglikelihood_rolling(self, requests) -> list[float]:
        """requests with .args = (text,) -> the text's log-likelihood over lm-evaluation-harness's disjoint
        rolling windows (`_windows`): every token scored once; the first after the run's BOS or end-of-document
        token (HFLM's prefix token), else unscored. A tokenizer with a BOS opens the text with it too (HFLM's
        tok_encode adds it), so that BOS is scored after the prefix BOS, as HFLM scores it."""
        eod = getattr(self.tok, "eod_id", None)
        head = self._opening() or ([int(eod)] if eod is not None else [])
        out = []
        for r in requests:
            pairs = self._windows(head + self._opening() + [int(t) for t in self.tok.encode(r.args[0])])
            out.append(sum(s for s, _ in self._score_rows(pairs)) if pairs else 0.0)
        return out

    def _windows(self, ids: list[int]) -> list[tuple[list[int], list[int]]]:
        """ids [n] -> (prefix, continuation) pairs scoring ids[1:], max_len tokens a window, each continuation
        after as many tokens before it as make max_len inputs: lm_eval.utils.get_rolling_token_windows with
        context_len=1 and prefix ids[0], made disjoint by make_disjoint_window."""
        pairs = []
        for end in range(1, len(ids), self.max_len):
            stop = min(end + self.max_len, len(ids))
            pairs.append((ids[max(0, stop - self.max_len - 1):end], ids[end:stop]))
        return pairs

    def generate_until(self, requests) -> list[str]:
        """requests with .args = (context, {"until": stop string(s), "max_gen_toks": n (default 256)}) -> greedy
        continuations of n tokens at most (batched per n, as lm-evaluation-harness groups requests by their
        generation arguments), each cut at its first stop string."""
        groups: dict[int, list[int]] = {}
        for k, r in enumerate(requests):
            groups.setdefault(int(r.args[1].get("max_gen_toks", MAX_GEN_TOKS)), []).append(k)
        out = [""] * len(requests)
        for n, ks in groups.items():
            for k, text in zip(ks, self._generate([requests[k] for k in ks], n)):
                out[k] = text
        return out

    def _generate(self, requests, n: int) -> list[str]:
        """`generate_until` of requests of one max_gen_toks n. A prompt (its BOS included) longer than
        model.max_len - n tokens keeps its last ones, as lm-evaluation-harness cuts it (one warning line counts
        them)."""
        arch, room = architecture("decoder_only"), prompt_room(self.run, n)
        rows = [arch.prompt_row(self.tok, prompt_ids(self.tok, r.args[0])) for r in requests]
        cut = sum(len(x) > room for x in rows)
        if cut:
            log.warning("%s%d of %d prompts are longer than model.max_len=%d - %d new tokens: each keeps its last "
                        "%d tokens (lm-evaluation-harness's rule)", f"{self.task}: " if self.task else "", cut,
                        len(requests), self.max_len, n, room)
        out = []
        for i in range(0, len(requests), self.rows):
            self.before_batch()
            batch, seg = arch.prompt_batch([x[-room:] for x in rows[i:i + self.rows]], self.run.cfg.model.pad_id)
            new = arch.generate(self.run.model, self.tok, batch, seg, max_new=n, key=jax.random.key(0))
            for r, row in zip(requests[i:i + self.rows], np.asarray(new)):
                text, until = self.tok.decode(row), r.args[1].get("until") or []
                cuts = [text.find(s) for s in ([until] if isinstance(until, str) else until) if s and s in text]
                out.append(text[:min(cuts)] if cuts else text)
        return out


def prompt_room(run: LoadedModel, max_new: int) -> int:
    """The prompt tokens (a tokenizer's BOS among them) a generation of max_new tokens leaves room for within
    model.max_len: lm-evaluation-harness's max_length - max_gen_toks. ConfigError: none."""
    room = run.cfg.model.max_len - max_new
    if room < 1:
        raise ConfigError(f"--max-new {max_new} leaves no room for a prompt within model.max_len="
                          f"{run.cfg.model.max_len}")
    return room


class _Request:
    def __init__(self, *args):
        self.args = args


def _stat(scores: list[float]) -> dict:
    n = len(scores)
    p = sum(scores) / n
    var = sum((x - p) ** 2 for x in scores) / (n - 1) if n > 1 else float("nan")
    return {"value": p, "stderr": math.sqrt(var / n) if n > 1 else None, "n": n}


def score_multiple_choice(hm: HarnessModel, rows: list[dict]) -> tuple[dict, list[dict]]:
    """Each example's choices scored by `loglikelihood` -> ({"acc", "acc_norm", "acc_bytes"}: `_stat`, per-example
    predictions), as lm-evaluation-harness's ConfigurableTask.process_results picks: the choice of the highest
    log-likelihood (acc), of the highest per character of its text (acc_norm), per UTF-8 byte (acc_bytes)."""
    reqs = [_Request(r["context"], c) for r in rows for c in r["choices"]]
    lls = [s for s, _ in hm.loglikelihood(reqs)]
    scores, preds, k = {"acc": [], "acc_norm": [], "acc_bytes": []}, [], 0
    for r in rows:
        ll = lls[k:k + len(r["choices"])]
        k += len(r["choices"])
        per_char = [s / max(1, len(c)) for s, c in zip(ll, r["choices"])]
        per_byte = [s / max(1, len(c.encode("utf-8"))) for s, c in zip(ll, r["choices"])]
        picks = {"pick": int(np.argmax(ll)), "pick_norm": int(np.argmax(per_char)),
                 "pick_bytes": int(np.argmax(per_byte))}
        for metric, pick in zip(scores, picks.values()):
            scores[metric].append(float(pick == r["answer"]))
        preds.append({"loglikelihoods": ll, **picks, "answer": r["answer"]})
    return {metric: _stat(x) for metric, x in scores.items()}, preds


def extract(pattern: re.Pattern | None, text: str) -> str | None:
    """What exact_match compares: the text stripped; with a pattern, its first match's first group that took part
    and is not empty (lm-evaluation-harness's regex filter), or the whole match if it has no group; None: no
    match (never equal to anything)."""
    if pattern is None:
        return text.strip()
    m = pattern.search(text)
    if m is None:
        return None
    found = [g for g in m.groups() if g] if m.groups() else [m.group(0)]
    return found[0].strip() if found else None


def score_generation(hm: HarnessModel, rows: list[dict], max_new: int, until: list[str],
                     answer_regex: str | None) -> tuple[dict, list[dict]]:
    outs = hm.generate_until([_Request(r["prompt"], {"until": until, "max_gen_toks": max_new}) for r in rows])
    pattern = re.compile(answer_regex) if answer_regex else None
    got = [extract(pattern, o) for o in outs]
    em = [float(g is not None and g == extract(pattern, r["answer"])) for g, r in zip(got, rows)]
    return {"exact_match": _stat(em)}, [{"output": o, "extracted": g or "", "answer": r["answer"]}
                                        for o, g, r in zip(outs, got, rows)]


def as_chat(rows: list[dict], kind: str, folder: str | Path, tok) -> list[dict]:
    """Each example's context (multiple choice) or prompt (generation) rendered by `folder`'s chat template as a
    user turn and the generation prompt. DataError: no template there, or a tokenizer that is not a HF one."""
    from jaxformer.data.chat import read_chat_template
    template = read_chat_template(folder)
    if template is None:
        raise DataError(f"--chat-template {str(folder)!r} has no chat template (tokenizer_config.json's "
                        f"chat_template or chat_template.jinja)")
    if not hasattr(tok, "reading_special_tokens"):
        raise DataError("--chat-template needs a run with a Hugging Face tokenizer (a pretrained model's)")
    key = "context" if kind == "multiple_choice" else "prompt"
    return [{**r, key: template.render([{"role": "user", "content": r[key]}], add_generation_prompt=True)}
            for r in rows]


def reading(tok, special: bool):
    """A context in which `tok` encodes special-token text as the ids (special=True), else one that changes
    nothing."""
    import contextlib
    return tok.reading_special_tokens() if special else contextlib.nullcontext()


def _read_all(run: LoadedModel, tasks: list[str], max_new: int, answer_regex: str | None,
              chat_template) -> list[tuple[str, str, str, list[dict]]]:
    """Every task file read and checked before any is scored -> [(name, path, kind, examples)]."""
    try:
        pattern = re.compile(answer_regex) if answer_regex else None
    except re.error as e:
        raise ConfigError(f"--answer-regex {answer_regex!r} is not a regular expression ({e})") from None
    read = [(name, path, *read_task(path)) for name, path in zip(task_names(tasks), tasks)]
    for _, path, kind, rows in read:
        if kind == "generation":
            prompt_room(run, max_new)
            for n, r in enumerate(rows, 1):
                if extract(pattern, r["answer"]) is None:
                    raise DataError(f"{path}: example {n}: --answer-regex {answer_regex!r} finds nothing in its "
                                    f"answer {r['answer'][:80]!r}")
    if chat_template is not None:
        read = [(name, path, kind, as_chat(rows, kind, chat_template, run.tokenizer))
                for name, path, kind, rows in read]
    return read


def _write_whole(path: Path, record: dict) -> None:
    """A results file written whole or not at all (a temporary file of this process's own, renamed over it; removed
    when writing fails, e.g. on a full disk)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:       # a failed write names no file: say which
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def _check_outputs(out_dir: Path, read: list[tuple]) -> None:
    """DataError where a task's results file (OUT_DIR/NAME.json) is one of the task files read: writing the results
    would replace that task file."""
    inputs = {Path(path).resolve(): path for _, path, _, _ in read}
    for name, path, _, _ in read:
        dest = (out_dir / f"{name}.json").resolve()
        if dest in inputs:
            raise DataError(f"the results of {path} go to {dest}, which is the task file {inputs[dest]}: it would be "
                            f"replaced; move or rename that task file (results are written to {out_dir}/NAME.json)")


def evaluate_tasks(run: LoadedModel, workdir: str | Path, tasks: list[str], *, max_new: int = 64,
                   until: tuple[str, ...] = ("\n\n",), answer_regex: str | None = None,
                   batch_rows: int = 32, chat_template: str | Path | None = None) -> dict:
    """Score each task file with the run's model -> {task name: {kind, metrics, file}}; each task's results and
    per-example predictions written whole to WORKDIR/eval_tasks/NAME.json (`task_names`) as it finishes.
    chat_template: a pretrained folder whose chat template renders each context (prompt) as a user turn
    followed by the assistant's generation prompt, its special tokens read as their ids
    (lm-evaluation-harness's --apply_chat_template). SIGINT/SIGTERM/SIGHUP stop it before the next batch:
    Interrupted (exit 128 + the signal's number), the finished tasks' files kept, the one in hand not written."""
    read = _read_all(run, tasks, max_new, answer_regex, chat_template)
    out_dir = Path(workdir) / "eval_tasks"
    _check_outputs(out_dir, read)
    out_dir.mkdir(exist_ok=True)
    results, doing = {}, None
    with Held(until="the batch in hand is scored") as sig:
        def stop_if_asked():
            if sig.received:
                kept = (f"results of {', '.join(results)} kept in {out_dir}" if results else "no results written")
                where = f"while scoring {doing} (not written)" if doing else "after its last task"
                raise Interrupted(f"eval-tasks stopped on {sig.received} {where}; {kept}", sig.received)
        hm = HarnessModel(run, batch_rows, before_batch=stop_if_asked)
        for name, path, kind, rows in read:
            doing = hm.task = name
            try:
                with reading(run.tokenizer, chat_template is not None):
                    if kind == "multiple_choice":
                        metrics, preds = score_multiple_choice(hm, rows)
                    else:
                        metrics, preds = score_generation(hm, rows, max_new, list(until), answer_regex)
            except DataError as e:             # e.g. a character the tokenizer lacks: which task file it is in
                raise DataError(str(e) if str(e).startswith(f"{name}: ") else f"{path}: {e}") from None
            rec = {"task": name, "file": str(path), "kind": kind, "checkpoint": {"which": run.which,
                   "step": run.step}, "metrics": metrics, "predictions": preds}
            _write_whole(out_dir / f"{name}.json", rec)
            results[name] = {k: rec[k] for k in ("kind", "metrics", "file")}
        doing = None
        stop_if_asked()
    return results
