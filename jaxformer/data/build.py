"""The task a config names: the one place that chooses among the tasks (text and digits in `data.tasks`, token
shards in `data.tokens`, conversations in `data.sft`), and the config resolution that follows from its tokenizer."""
from __future__ import annotations

from jaxformer.config import Config, DataConfig, resolve_vocab
from jaxformer.data.tasks import Task, digit_task, text_task
from jaxformer.data.tokens import TokensTask


def build_task(cfg: DataConfig, tokenizer=None) -> Task:
    """The task named by cfg.task. A saved tokenizer (resume, eval) is reused instead of rebuilt (for token
    shards: checked to be the shards' own)."""
    if cfg.task == "tokens":
        return TokensTask(cfg, tokenizer)
    if cfg.task == "chat":
        from jaxformer.data.sft import chat_task
        return chat_task(cfg, tokenizer)
    return text_task(cfg, tokenizer) if cfg.task == "text" else digit_task(cfg)


def resolve(cfg: Config, tokenizer=None) -> tuple[Config, Task]:
    """The one config resolution from data: the task of cfg.data (a saved tokenizer reused) and the config with
    model.vocab_size taken from its tokenizer (0 = from the data), or checked against it; model.pad_id must be
    the tokenizer's."""
    task = build_task(cfg.data, tokenizer)
    return resolve_vocab(cfg, task.tokenizer.vocab_size, task.tokenizer.pad_id), task
