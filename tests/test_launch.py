"""Process start (jaxformer/platforms/launch.py): the command line re-executes itself once with glibc's huge-page malloc
tunable, keeps a user's own tunables, can be turned off, and the tunable does what it is there for (a freed and
re-allocated large block is not faulted in again page by page).

Wrong implementations these catch: a re-exec that loops (the marker not seen), one that replaces the user's
GLIBC_TUNABLES instead of extending it, an opt-out that is ignored, a non-glibc platform given the tunable, and
the entry point / `python -m jaxformer.cli` not starting through launch at all."""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from jaxformer.platforms import launch

ROOT = Path(__file__).resolve().parents[1]
GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
PROBE = ("from jaxformer.platforms.launch import hugepage_malloc; hugepage_malloc(); import os; "
         "print(os.environ.get('GLIBC_TUNABLES'))")


def _run(code: str, **env) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "JAXFORMER_MALLOC")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env=base | {"PYTHONPATH": str(ROOT)} | env)
    return out.stdout.split()


@pytest.mark.skipif(not GLIBC, reason="the tunable is glibc's (Linux)")
def test_the_process_reexecutes_once_with_the_tunable_and_keeps_the_users_own():
    assert _run(PROBE) == [launch.TUNABLE]                       # one line: one re-exec, no loop
    assert _run(PROBE, GLIBC_TUNABLES="glibc.malloc.arena_max=2") == [f"glibc.malloc.arena_max=2:{launch.TUNABLE}"]
    assert _run(PROBE, GLIBC_TUNABLES="glibc.malloc.hugetlb=0") == ["glibc.malloc.hugetlb=0"]   # the user decides
    assert _run(PROBE, JAXFORMER_MALLOC="default") == ["None"]


def test_malloc_env_leaves_other_platforms_alone(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert "GLIBC_TUNABLES" not in launch.malloc_env({"PATH": "/bin"})


@pytest.mark.skipif(not GLIBC, reason="the tunable is glibc's (Linux)")
def test_the_entry_points_start_through_launch():
    probe = ("import sys, os; sys.argv = ['jaxformer', '--help']; import jaxformer.__main__ as m; "
             "print(os.environ.get('GLIBC_TUNABLES'), file=sys.stderr); m.main()")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                         env={k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | {"PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and "usage: jaxformer" in out.stdout
    assert out.stderr.split()[-1] == launch.TUNABLE               # printed again after the re-exec
    src = (ROOT / "jaxformer/cli.py").read_text()
    assert src.index("hugepage_malloc()") < src.index("from jaxformer.configio")   # before the heavy imports
    assert 'jaxformer = "jaxformer.__main__:main"' in (ROOT / "pyproject.toml").read_text()


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
FAULTS = ("import ctypes, resource\n"                            # glibc's malloc itself (numpy madvises alone)
          "libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p\n"
          "def faults(n=64 * 2 ** 20):\n"
          "    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
          "    for _ in range(4):\n"
          "        p = libc.malloc(n); ctypes.memset(p, 1, n); libc.free(ctypes.c_void_p(p))\n"
          "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0\n"
          "faults(); print(faults())")


@pytest.mark.skipif(not GLIBC or not THP.exists() or "[never]" in THP.read_text(),
                    reason="needs glibc and transparent huge pages (madvise or always)")
def test_the_tunable_stops_a_large_block_being_faulted_in_again_at_every_allocation():
    plain = int(_run(FAULTS, JAXFORMER_MALLOC="default")[0])
    tuned = int(_run(FAULTS, GLIBC_TUNABLES=launch.TUNABLE)[0])
    assert plain >= 4 * 64 * 2 ** 20 // 4096 * 0.9               # every 4 KiB page of each 64 MiB block, again
    assert tuned * 10 < plain                                     # 65k vs 2k faults measured


# A Ctrl-C while the re-executed interpreter starts: Python's own startup would die of it ("Fatal Python error:
# init_import_site", rc 1, the CI failure of stop 51); blocked across execve it waits for hold_from_start.
SIGNAL_ACROSS_EXEC = """
import os, signal, sys
from jaxformer import signals
if sys.argv[1] == "first":
    signals.hold_from_start()
    if {before}: os.kill(os.getpid(), signal.SIGTERM)    # received before the re-exec: must not be lost
    signals.block_for_exec()
    os.execv(sys.executable, [sys.executable, "-c", CODE, "second"])
else:
    if {during}: os.kill(os.getpid(), signal.SIGINT)     # the new interpreter's startup, before hold_from_start
    signals.hold_from_start()
    print(signals.pending())
"""


@pytest.mark.skipif(not hasattr(__import__("signal"), "pthread_sigmask"), reason="POSIX signal masks")
@pytest.mark.parametrize("before, during, expected", [(True, False, "SIGTERM"), (False, True, "SIGINT"),
                                                      (False, False, "None")])
def test_a_stop_signal_around_the_reexec_is_held_not_lost(before, during, expected):
    """Wrong implementations: no block before execve (the second interpreter dies of KeyboardInterrupt, rc 1);
    a block that is never lifted (pending() stays None); a signal received before the exec dropped."""
    body = SIGNAL_ACROSS_EXEC.replace("{before}", str(before)).replace("{during}", str(during))
    code = f"CODE = {body!r}\n" + body
    out = subprocess.run([sys.executable, "-c", code, "first"], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stdout.split() == [expected]


def test_the_suite_adds_only_the_xla_flags_this_jaxlib_knows():
    """tests/conftest.py's code-generation flags are probed before they are added: under jax 0.11 the suite exited
    with status 1 before collecting a test (XLA aborts on a flag its build does not know). Wrong implementations:
    appending them unprobed (a bogus flag would abort this process's children too), or a probe that accepts an
    unknown flag."""
    from conftest import CODEGEN_FLAGS, _accepted
    assert not _accepted(["--xla_jaxformer_no_such_flag=1"])
    added = os.environ["JAXFORMER_TEST_FLAGS"].split()
    assert set(added) <= set(CODEGEN_FLAGS) and all(f in os.environ["XLA_FLAGS"] for f in added)
    # (that this jaxlib accepts `added` is shown by this process: it started with them)


def test_the_flag_probe_is_kept_per_jaxlib_version_and_xla_flags(tmp_path, monkeypatch):
    """conftest's `_codegen_flags`: probed once, then read from its file in the cache folder; another jaxlib
    version or other XLA_FLAGS probe again (a kept answer for another build could add a flag it aborts on)."""
    import importlib.metadata
    import conftest
    probes = []
    monkeypatch.setattr(conftest, "CACHE", tmp_path)
    monkeypatch.setattr(conftest, "_accepted", lambda flags: probes.append(list(flags)) or True)
    monkeypatch.setenv("XLA_FLAGS", "")
    first = conftest._codegen_flags()
    assert first == list(conftest.CODEGEN_FLAGS) and len(probes) == 1
    assert conftest._codegen_flags() == first and len(probes) == 1                 # kept
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9")
    conftest._codegen_flags()
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    conftest._codegen_flags()
    assert len(probes) == 3 and len(list(tmp_path.glob("codegen-flags-*.json"))) == 3
