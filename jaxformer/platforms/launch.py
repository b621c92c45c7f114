"""Process start for the command line (`jaxformer ...`, `python -m jaxformer[.cli]`): settings that must be in
place before the process runs any allocation-heavy code, applied by re-executing the process once.

Huge pages for glibc's malloc: XLA:CPU allocates a compiled program's temporaries (one block) at every execution.
Above glibc's mmap threshold (at most 32 MiB) each allocation is a fresh mmap, and the step faults every 4 KiB
page of it in again (the base encoder-decoder's block is hundreds of MiB). glibc's `glibc.malloc.hugetlb=1`
tunable (transparent huge pages through madvise) makes those faults far fewer: benchmarks/step_profile.py runs
the step both ways and counts them (benchmarks/results/step_profile.md, each config's "Memory" line, which names
the step time too). Programs whose block stays under the threshold (the char model's) reuse it. A tunable is read
only when a process starts, hence the re-exec. Linux with glibc only; `JAXFORMER_MALLOC=default` leaves malloc as
it is; a GLIBC_TUNABLES that already sets glibc.malloc.hugetlb is kept.
"""
from __future__ import annotations

import os
import platform
import sys

from jaxformer.signals import block_for_exec

TUNABLE = "glibc.malloc.hugetlb=1"


def malloc_env(env: dict | None = None) -> dict:
    """`env` (default os.environ) with glibc's huge-page tunable added to GLIBC_TUNABLES, unless turned off
    (JAXFORMER_MALLOC=default), already set, or not Linux/glibc: what `hugepage_malloc` re-executes with, and
    what benchmarks give their child processes."""
    env = dict(os.environ if env is None else env)
    tunables = env.get("GLIBC_TUNABLES", "")
    if (env.get("JAXFORMER_MALLOC") == "default" or "glibc.malloc.hugetlb" in tunables
            or not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc"):
        return env
    env["GLIBC_TUNABLES"] = ":".join(filter(None, (tunables, TUNABLE)))
    return env


def hugepage_malloc() -> None:
    """Re-execute this process (same interpreter, same command line) with `malloc_env()`, once; a no-op when that
    environment is already this process's."""
    env = malloc_env()
    if env.get("GLIBC_TUNABLES") != os.environ.get("GLIBC_TUNABLES"):
        sys.stdout.flush()
        sys.stderr.flush()
        block_for_exec()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
