"""The task a config names: the one place that chooses among the tasks (text and digits in `data.tasks`, token
shards in `data.tokens`, conversations in `data.sft`), and the config resolution that follows from its tokenizer."""
from __future__ import annotations

from jaxformer.config import Config, DataConfig, resolve_vocab
from jaxformer.data.tasks import Task, digit_task, text_task
from jaxformer.data.tokens import TokensTask


def build_task(cfg: DataConfig, tokenizer=None) -> Task:
    """The task named by cfg.task. A saved tokenizer (resume, eval) is reused instead of rebuilt (for token
    shards: checked to be the shards' own).

    Args:
      cfg: the data section of a config: task "reverse" or "copy" (digit strings, drawn from data.seed),
        "text" (a character LM over data.path), "tokens" (prepared token shards in data.path) or "chat"
        (conversations for supervised fine-tuning).
      tokenizer: a saved tokenizer to reuse (`load_tokenizer`); None builds the task's own (a text task's
        `CharTokenizer` is made from the characters it reads).

    Returns:
      The `Task`, its arrays whole in memory ([N, T] per field; token shards are read as they are served).

    Raises:
      DataError: a text file that is missing, empty or not UTF-8 (`load_text`), too little text for one
        training and one held-out block, characters outside a reused tokenizer's vocabulary, more distinct digit
        strings asked for than exist, unusable token shards or conversations (the message says which).

    Examples:
      >>> from jaxformer.config import DataConfig
      >>> from jaxformer.data import build_task
      >>> task = build_task(DataConfig(task="text", path="builtin:alice", num_chars=2000, block_size=16))
      >>> task.kind, task.tokenizer.vocab_size, task.train["inputs"].shape, task.eval["inputs"].shape
      ('lm', 60, (105, 16), (11, 16))
      >>> task.fingerprint[:12]                         # sha256 of the text read: resuming checks it
      'cd863e07ed6f'
      >>> build_task(DataConfig(task="reverse", num_train=8, num_eval=4)).kind
      'seq2seq'
    """
    if cfg.task == "tokens":
        return TokensTask(cfg, tokenizer)
    if cfg.task == "chat":
        from jaxformer.data.sft import chat_task
        return chat_task(cfg, tokenizer)
    return text_task(cfg, tokenizer) if cfg.task == "text" else digit_task(cfg)


def resolve(cfg: Config, tokenizer=None) -> tuple[Config, Task]:
    """The one config resolution from data: the task of cfg.data (a saved tokenizer reused) and the config with
    model.vocab_size taken from its tokenizer (0 = from the data), or checked against it; model.pad_id must be
    the tokenizer's.

    Args:
      cfg: the whole config (its data and model sections are read).
      tokenizer: a saved tokenizer to reuse (resume, eval), as `build_task`'s.

    Returns:
      (the resolved config, the task): model.vocab_size filled in from the tokenizer when it was 0.

    Raises:
      ConfigError: model.vocab_size smaller than the tokenizer's, or model.pad_id not the tokenizer's pad id.
      DataError: the task cannot be built (`build_task`).

    Examples:
      >>> from jaxformer.config import Config, replaced
      >>> from jaxformer.data import resolve
      >>> cfg = replaced(Config(), model__arch="decoder_only", model__vocab_size=0, data__task="text",
      ...                data__path="builtin:alice", data__num_chars=2000, train__best_metric="loss")
      >>> resolved, task = resolve(cfg)
      >>> resolved.model.vocab_size, task.tokenizer.vocab_size     # 0: taken from the data
      (60, 60)
      >>> resolve(replaced(cfg, model__vocab_size=32))
      Traceback (most recent call last):
      ...
      jaxformer.errors.ConfigError: model.vocab_size=32 is smaller than the tokenizer's 60
    """
    task = build_task(cfg.data, tokenizer)
    return resolve_vocab(cfg, task.tokenizer.vocab_size, task.tokenizer.pad_id), task
