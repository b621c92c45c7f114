"""Named errors for everything a user can cause. The CLI prints the message (no traceback) and exits with the
class's `exit_code`; library callers catch `JaxformerError` or a subclass."""
from __future__ import annotations


class JaxformerError(Exception):
    """Base of the errors a user can cause (bad config, bad flag, bad file, bad run directory)."""
    exit_code = 2
    label = "error"


class ConfigError(JaxformerError, ValueError):
    """A config field, flag or config file is unusable; the message names the field and the value."""
    label = "config error"


class DataError(JaxformerError, ValueError):
    """A data file or example cannot be used; the message says which and why.

    Raised by `jaxformer.data` (text files, tokenizers, tasks, token shards) and by the inference helpers that
    read prompts and data files; the command line prints its message and exits with `exit_code`.

    Attributes:
      label: "data error", the words the command line prints before the message.
      exit_code: 2, the command line's exit status (inherited from `JaxformerError`).

    Examples:
      >>> from jaxformer.data import CharTokenizer, DataError
      >>> try:
      ...     CharTokenizer("abc").encode("abd")
      ... except DataError as e:
      ...     print(f"{e.label}: {e}")
      data error: 1 character(s) outside the tokenizer's vocabulary: 'd'
    """
    label = "data error"


class RunDirError(JaxformerError):
    """A run directory cannot be used: not a directory, not writable, or held by another trainer."""
    label = "run directory error"


class OutputError(JaxformerError):
    """An output cannot be written without losing a file: its folder holds a user's files (or is being written
    by another process); the message names them and what to do instead (`jaxformer.staging`)."""
    label = "output error"


class CheckpointError(JaxformerError):
    """No usable checkpoint: none saved yet, or every saved one is unreadable."""
    label = "checkpoint error"


class IncompatibleCheckpoint(ConfigError):
    """The run directory holds checkpoints of a different config."""


class NonFiniteLoss(JaxformerError, RuntimeError):
    """The training loss became NaN/Inf; the message names the step and the last good checkpoint."""
    exit_code = 3
    label = "training diverged"


class SweepError(JaxformerError):
    """A sweep file cannot be used, a --run names no run of it, or some of its runs did not finish."""
    label = "sweep error"


class BackendError(JaxformerError, ValueError):
    """An attention backend cannot run this call or this machine (platform, dtype, mask or shape); the
    message names the backend and what to use instead."""
    label = "attention backend error"


class Interrupted(JaxformerError):
    """A command other than training was stopped by SIGINT/SIGTERM/SIGHUP at a point where stopping was safe;
    the message says what was kept (training itself saves a checkpoint and returns normally). exit_code: 128 +
    the signal's number (130 SIGINT, 143 SIGTERM, 129 SIGHUP), as a shell reports a process the signal ended."""
    exit_code = 130
    label = "interrupted"

    def __init__(self, message: str, signame: str | None = None):
        super().__init__(message)
        if signame:
            import signal
            self.exit_code = 128 + signal.Signals[signame].value
