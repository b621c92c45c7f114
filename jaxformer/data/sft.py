"""The `chat` task: supervised fine-tuning of a pretrained language model on conversations.

data.path is a JSONL file, one conversation per line: {"messages": [{"role": "system" | "user" | "assistant",
"content": "..."}, ...]}. Each is rendered by the chat template of data.tokenizer's folder exactly as
transformers' `apply_chat_template` renders it (`data.chat`), tokenized with that folder's tokenizer (the
template's special tokens read as special ids, as transformers tokenizes a rendered chat), and trained on with
the loss on the assistant's tokens only: a target counts when its token lies in the text an assistant message
produced (its content and the template's end-of-turn after it, `ChatTemplate.assistant_spans`); every other
target is the tokenizer's pad id (-1 for a pretrained one: never a real token). Conversations are packed in
order into rows of data.block_size tokens, each its own segment (attention never crosses conversations,
positions restart at each: the model derives its masks from the segment ids); one longer than a row is cut
to it. The last data.eval_fraction of the conversations (at least one) are held out. A run starts from a
pretrained one with train.init_from, and resumes like every run (the rows are arrays; the order a seeded
shuffle).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from jaxformer.config import DataConfig
from jaxformer.data import jsonl
from jaxformer.data.chat import ChatTemplate, read_chat_template
from jaxformer.data.tasks import Task, attention_fields
from jaxformer.data.tokenizers import HFTokenizer, pretrained_tokenizer, tokenizer_difference
from jaxformer.errors import DataError


def read_conversations(path: str | Path) -> list[list[dict]]:
    """The conversations of a JSONL file (module docstring). DataError naming the file and line otherwise."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data.path={str(path)!r} is not a file (a JSONL file of {{\"messages\": [...]}})")
    out = []
    for n, obj in jsonl.objects(path):
        messages = obj.get("messages")
        ok = isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)
        if not ok:
            raise DataError(f"{path}:{n}: \"messages\" must be a non-empty list of {{\"role\": str, "
                            f"\"content\": str}} objects")
        out.append(messages)
    return out


def encode_conversation(template: ChatTemplate, tok: HFTokenizer, messages: list[dict]) -> tuple[np.ndarray,
                                                                                                   np.ndarray]:
    """-> (ids [n] int32, assistant [n] bool: the token starts inside an assistant message's span)."""
    text, spans = template.assistant_spans(messages)
    with tok.reading_special_tokens():                  # the template's <|im_start|> etc. are its special ids
        enc = tok.tok.encode(text, add_special_tokens=False)
    starts = np.asarray([o[0] for o in enc.offsets], np.int64)
    mask = np.zeros(len(starts), bool)
    for s, e in spans:
        mask |= (starts >= s) & (starts < e)
    return np.asarray(enc.ids, np.int32), mask


def pack(examples: list[tuple[np.ndarray, np.ndarray]], block: int, ignore: int) -> dict[str, np.ndarray]:
    """Conversations (ids, assistant mask) -> rows {inputs, targets, segment_ids, positions} [R, block], packed
    in order (a conversation goes in the current row if it fits, else starts the next; cut to block + 1
    tokens); targets `ignore` but on assistant tokens."""
    rows, row, used = [], [], 0
    for ids, mask in examples:
        ids, mask = ids[: block + 1], mask[: block + 1]
        if len(ids) < 2:
            continue
        if used + len(ids) - 1 > block:
            rows.append(row)
            row, used = [], 0
        row.append((ids, mask))
        used += len(ids) - 1
    if row:
        rows.append(row)
    inputs = np.zeros((len(rows), block), np.int32)
    targets = np.full((len(rows), block), ignore, np.int32)
    seg = np.zeros((len(rows), block), np.int32)
    for r, convs in enumerate(rows):
        at = 0
        for k, (ids, mask) in enumerate(convs, 1):
            n = len(ids) - 1
            inputs[r, at:at + n] = ids[:-1]
            targets[r, at:at + n] = np.where(mask[1:], ids[1:], ignore)
            seg[r, at:at + n] = k
            at += n
    return {"inputs": inputs, "targets": targets, **attention_fields(seg)}


def chat_task(cfg: DataConfig, tokenizer=None) -> Task:
    """The task of data.task='chat' (module docstring). tokenizer: a run's saved one (resume, eval), which must
    be the folder's."""
    tok = pretrained_tokenizer(cfg.tokenizer)
    if not isinstance(tok, HFTokenizer):
        raise DataError(f"data.tokenizer={cfg.tokenizer!r} has a SentencePiece tokenizer.model only; the chat task "
                        f"reads tokenizer.json (its special tokens and offsets)")
    if tokenizer is not None:
        why = tokenizer_difference(tokenizer, tok)
        if why:
            raise DataError(f"data.tokenizer={cfg.tokenizer!r} is another tokenizer than this run's ({why})")
    template = read_chat_template(cfg.tokenizer)
    if template is None:
        raise DataError(f"data.tokenizer={cfg.tokenizer!r} has no chat template (tokenizer_config.json's "
                        f"chat_template or chat_template.jinja)")
    convs = read_conversations(cfg.path)
    if len(convs) < 2:
        raise DataError(f"{cfg.path}: {len(convs)} conversation(s); data.task='chat' needs at least two (one held "
                        f"out)")
    held = max(1, int(round(len(convs) * cfg.eval_fraction)))
    examples = [encode_conversation(template, tok, m) for m in convs]
    train, evaluation = (pack(part, cfg.block_size, tok.pad_id) for part in (examples[:-held], examples[-held:]))
    for name, arrays in (("training", train), ("held-out", evaluation)):
        if not (arrays["targets"] != tok.pad_id).any():
            raise DataError(f"{cfg.path}: the {name} conversations have no assistant token within "
                            f"data.block_size={cfg.block_size} (nothing to learn or score)")
    digest = hashlib.sha256(Path(cfg.path).read_bytes() + template.template.encode("utf-8")).hexdigest()
    return Task("lm", tok, train, evaluation, digest)
