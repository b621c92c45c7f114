"""Shared fixtures, and settings that make the suite mean the same on every machine.

Hypothesis: the "ci" profile (the default) is derandomized: every machine and every run draws the same
examples, with no example database and no deadline (first calls compile). HYPOTHESIS_PROFILE=dev selects a
randomized profile for local bug hunting. A test's own @settings(max_examples=...) overrides the profile's
max_examples (the expensive properties ask for fewer).

JAX: float32 matmuls at "highest" precision, so float32 tolerances hold on GPUs/TPUs (whose default matmul
precision is TF32 / bfloat16 passes) as they do on CPU. Compiled programs go to a persistent compilation cache in
the user's cache folder ($XDG_CACHE_HOME or ~/.cache, jaxformer/jax-compilation-cache; JAX_COMPILATION_CACHE_DIR
overrides it), shared by the xdist workers, by the CLI subprocesses some tests start and by every clone on the
machine (a fresh clone's CI reuses what earlier runs compiled; an entry is keyed by the program, the jax version
and the flags, so a stale one is a miss, never a wrong hit; no size cap: jax's eviction takes a file lock with a 10
s timeout, which the parallel workers could hit): the many small trainings compile the same few programs, and a
cache hit skips XLA's compile, not any computation. The tests' programs are tiny and compiling them costs far more
than running them, so XLA:CPU compiles them cheaply: LLVM optimisation level 0 (about 30% off the suite) and the
classic elemental emitters instead of the MLIR fusion emitters (compiling a small train step 2.5x faster: 1.7 s ->
0.7 s). Both are code-generation settings: no change to the HLO, nor to what the tests compute, only to how fast
the machine code is made and runs. Each is added only where this jaxlib's XLA accepts it (probed in a child process
once per jaxlib version, the answer kept in the cache folder: XLA aborts on a flag it does not know, and jax
0.11's does not know these); JAXFORMER_TEST_FLAGS records what was added. An xdist controller imports neither
jax nor Hypothesis (`pytest_configure`): it only hands out the files. On a GPU, memory is allocated on demand so that the two xdist workers can share it; the scale-out
tests run their 8 (or 2 × 4) devices as fake CPU devices in their own processes on any machine
(tests/test_parallel.py).
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxformer"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE / "jax-compilation-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # on a GPU, the xdist workers share its memory
CODEGEN_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")   # module docstring


def _accepted(flags: list[str]) -> bool:
    """Whether this jaxlib's XLA starts with `flags` added to XLA_FLAGS: XLA aborts a process on a flag its build
    does not know (jax 0.11 dropped these), so a child process is asked."""
    env = dict(os.environ, XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip(),
               JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", "import jax.numpy as j; j.zeros(1).block_until_ready()"], env=env,
                          capture_output=True, timeout=300).returncode == 0


def _codegen_flags() -> list[str]:
    """The CODEGEN_FLAGS not in XLA_FLAGS already that this jaxlib's XLA accepts: probed (`_accepted`) once per
    jaxlib version and XLA_FLAGS, the answer kept in the user's cache folder beside the compilation cache (a
    probe is a child process importing jax: seconds before any worker starts)."""
    import hashlib
    import json
    from importlib.metadata import version
    new = [f for f in CODEGEN_FLAGS if f.split("=")[0] not in os.environ.get("XLA_FLAGS", "")]
    if not new:
        return []
    key = hashlib.sha256(f"{version('jaxlib')}|{os.environ.get('XLA_FLAGS', '')}|{new}".encode()).hexdigest()[:16]
    memo = CACHE / f"codegen-flags-{key}.json"
    try:
        return json.loads(memo.read_text())
    except (OSError, ValueError):
        pass
    got = new if _accepted(new) else [f for f in new if _accepted([f])]
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(json.dumps(got))
    except OSError:
        pass
    return got


if "JAXFORMER_TEST_FLAGS" not in os.environ:      # once: xdist workers and CLI subprocesses inherit both
    _new = _codegen_flags()
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_new]).strip()
    os.environ["JAXFORMER_TEST_FLAGS"] = " ".join(_new) or "none"

import pytest  # noqa: E402


def pytest_configure(config):
    """JAX's and Hypothesis' settings, where tests run: not in an xdist controller, which only hands out the
    files (importing jax there costs seconds before the workers start)."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    from helpers import GC_THRESHOLDS
    gc.set_threshold(*GC_THRESHOLDS)
    import jax
    from hypothesis import settings
    jax.config.update("jax_default_matmul_precision", "highest")
    settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True,
                              max_examples=20)
    settings.register_profile("dev", derandomize=False, deadline=None, print_blob=True, max_examples=50)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory):
    """Two runs trained for 2 steps, shared by the files that draw from runs (once per xdist worker): a 1+1-layer
    encoder-decoder (reversal) and a 1-layer char LM. -> (s2s run dir, lm run dir)."""
    from helpers import tiny_lm, tiny_reverse
    from jaxformer.train.loop import train
    root = tmp_path_factory.mktemp("trained-runs")
    short = ["train.steps=2", "train.log_every=2", "train.eval_every=2", "train.checkpoint_every=2",
             "train.num_examples=0"]
    train(tiny_reverse(*short), root / "s2s", progress="none")
    train(tiny_lm(*short), root / "lm", progress="none")
    return root / "s2s", root / "lm"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The real corpora: ../shared/data beside the project, or $JAXFORMER_DATA. Skips where absent."""
    d = Path(os.environ.get("JAXFORMER_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")
    if not d.is_dir():
        pytest.skip(f"corpus folder {d} not found (set JAXFORMER_DATA to the folder holding the real text files)")
    return d


def pytest_collection_modifyitems(config, items):
    """The longest file (tests/test_parallel.py: an 8-device worker process and two 2-process runs) goes first:
    `--dist loadfile` hands files to the workers in collection order, so the other files fill the time around
    it instead of waiting behind it."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/test_parallel.py"))


_logged: list = []
_file_seconds: dict = {}
# the per-file time guard (`pytest_sessionfinish`): no file may take more than FILE_SHARE of the lane's test time
# nor, on a machine slow enough to make that small, more than FILE_FLOOR_S; it judges a run of at least
# FULL_LANE_FILES files (the lane, not a selection). JAXFORMER_TIME_GUARD="share,floor,files" overrides the three.
FILE_SHARE, FILE_FLOOR_S, FULL_LANE_FILES = (float(x) for x in os.environ.get("JAXFORMER_TIME_GUARD",
                                                                             "0.10,20,50").split(","))


def _record_file_time(report) -> None:
    """Each test file's seconds (setup, call and teardown of its tests), summed where the reports arrive."""
    path = report.nodeid.split("::")[0]
    _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """The per-file time guard: in a full run of the default lane, a test file that takes more than FILE_SHARE of
    the lane's test time (and more than FILE_FLOOR_S) fails the session, named with its seconds. A share, not a
    wall time, so that a slower machine does not trip it; the fix is to make the file cheaper (a session-scoped
    model, one jit per program), or to move its slow half to the slow lane keeping a cheap default-lane check."""
    if hasattr(session.config, "workerinput") or len(_file_seconds) < FULL_LANE_FILES:
        return
    if (session.config.option.markexpr or "") != "not slow and not gpu":
        return
    total = sum(_file_seconds.values())
    over = {f: t for f, t in _file_seconds.items() if t > max(FILE_SHARE * total, FILE_FLOOR_S)}
    if over:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        tr.write_line("")
        for f, t in sorted(over.items(), key=lambda kv: -kv[1]):
            tr.write_line(f"per-file time guard: {f} took {t:.1f} s, {100 * t / total:.0f}% of the lane's "
                          f"{total:.0f} s (at most {100 * FILE_SHARE:.0f}%, tests/conftest.py)", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_runtest_logreport(report):
    """$JAXFORMER_TEST_LOG (e.g. `make test-gpu`'s test-gpu.log): one line per test as it ends (outcome, seconds,
    id, a skip's reason or a failure's last line), so a run cut short still says how far it got. Also sums each
    file's seconds for the per-file time guard (`pytest_sessionfinish`)."""
    _record_file_time(report)
    path = os.environ.get("JAXFORMER_TEST_LOG")
    if not path or not (report.when == "call" or report.outcome != "passed"):
        return
    detail = ""
    if report.skipped and isinstance(report.longrepr, tuple):
        detail = report.longrepr[2]
    elif report.failed:
        detail = str(report.longrepr).strip().splitlines()[-1][:300]
    with open(path, "a") as f:
        if not _logged:
            import jax
            devices = jax.devices()
            f.write(f"# jax {jax.__version__} on {jax.default_backend()}: {len(devices)} x {devices[0].device_kind}\n")
            _logged.append(path)
        f.write(f"{report.outcome:7} {report.duration:6.1f}s {report.nodeid} {detail}\n".rstrip() + "\n")
