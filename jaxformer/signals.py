"""Stop signals held until the work in hand is safe to leave: the command line's startup, the training loop's
checkpoint, import-hf's step-0 run, data prepare's next piece. Imports nothing heavy, so a command holds
signals before it loads JAX."""
from __future__ import annotations

import contextlib
import signal
import sys

STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


class Held:
    """The first SIGINT/SIGTERM/SIGHUP (Ctrl-C, a scheduler, a closed terminal) sets `received` (its name); the
    holder checks it where stopping is safe (the loop saves a checkpoint at the step it is on and stops). Later
    ones are held (noted on stderr) until then: a stop that was asked for never loses the work. SIGKILL still
    stops at once. `until`: what the holder finishes first, for that note."""

    def __init__(self, until: str = "the checkpoint is written"):
        self.received, self.until = pending(), until       # a signal the process got while starting up counts

    def __enter__(self):
        self.old = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def _handle(self, signum, frame):
        if self.received is None:
            self.received = signal.Signals(signum).name
            return
        stderr_line(f"{signal.Signals(signum).name} received while stopping on {self.received}: held until "
                    f"{self.until} (SIGKILL stops at once)")

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)


_startup: Held | None = None


def hold_from_start() -> None:
    """The command line's first act: from here on a stop signal only sets a flag (`pending`), so that Ctrl-C
    while Python loads JAX or XLA starts never lands inside an extension (an ImportError, a swallowed
    interrupt, a segfault at exit). Each command stops where it safely can: before it starts, between its
    phases, or (training) with a checkpoint."""
    global _startup
    if _startup is None:
        _startup = Held("the command reaches a point where it can stop")
        _startup.__enter__()
        if hasattr(signal, "pthread_sigmask"):      # one blocked across a re-exec (`block_for_exec`) lands now
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def block_for_exec() -> None:
    """Before this process re-executes itself (jaxformer.platforms.launch): stop signals blocked, since the mask and any
    pending signal survive `execve`. A Ctrl-C while the new interpreter starts then waits for its
    `hold_from_start` instead of interrupting Python's own startup ("Fatal Python error: init_import_site"),
    and one already received is raised again, pending, so the new process acts on it. A no-op where signals
    are not held (the new process would not unblock them)."""
    if _startup is None or not hasattr(signal, "pthread_sigmask"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    if pending() is not None:
        signal.raise_signal(signal.Signals[pending()])


@contextlib.contextmanager
def unheld(command: str):
    """For work that writes nothing and cannot stop part-way (one compiled decoding call of `jaxformer generate`):
    while the block runs, a stop signal ends the process at once, by the signal's default action (a shell reports
    128 + its number), instead of being held until the work is done. A signal held before the block is acted on
    first: Interrupted (128 + its number), nothing done."""
    if pending():
        from jaxformer.errors import Interrupted
        raise Interrupted(f"jaxformer {command} stopped on {pending()}; nothing was done", pending())
    old = {s: signal.signal(s, signal.SIG_DFL) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def pending() -> str | None:
    """The stop signal the process received since `hold_from_start` (None: none, or signals not held)."""
    return _startup.received if _startup is not None else None


def stderr_line(text: str) -> None:
    try:
        print(f"WARNING: {text}", file=sys.stderr, flush=True)
    except OSError:                     # no terminal left to tell
        pass
