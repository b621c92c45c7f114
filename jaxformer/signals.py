"""Stop signals held until the work in hand is safe to leave: the training loop's checkpoint, import-hf's
step-0 run. Imports nothing heavy, so a command can hold signals before it loads JAX."""
from __future__ import annotations

import signal
import sys

STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


class Held:
    """The first SIGINT/SIGTERM/SIGHUP (Ctrl-C, a scheduler, a closed terminal) sets `received` (its name); the
    holder checks it where stopping is safe (the loop saves a checkpoint at the step it is on and stops). Later
    ones are held (noted on stderr) until then: a stop that was asked for never loses the work. SIGKILL still
    stops at once. `until`: what the holder finishes first, for that note."""

    def __init__(self, until: str = "the checkpoint is written"):
        self.received, self.until = None, until

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


def stderr_line(text: str) -> None:
    try:
        print(f"WARNING: {text}", file=sys.stderr, flush=True)
    except OSError:                     # no terminal left to tell
        pass
