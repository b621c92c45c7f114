"""Writing an export folder whole or not at all, as `jaxformer data prepare` writes its shards: everything goes to
OUT.partial (a sibling folder, marked as jaxformer's by a file `.jaxformer-partial` in it), which is renamed to OUT
once complete.

OUT must not exist or be an empty folder: a folder holding anything (a file a user put there, an earlier export)
is refused, naming what it holds, and nothing in it is ever replaced or removed; export to a new folder instead.
An interrupted or failed export leaves no OUT (a stop signal held by the command line is honoured before the
rename; an error removes OUT.partial); OUT.partial left behind by a killed process is removed by the next export
to OUT, because it is marked; an unmarked OUT.partial (not jaxformer's) is refused and left as it is. The export
writing OUT.partial holds a lock (flock) on its mark, so that a second export to OUT started meanwhile is refused
instead of taking the folder over (it would remove the first one's files while they are written).
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from jaxformer.errors import Interrupted
from jaxformer.hf.families import HFError
from jaxformer.signals import pending

try:
    import fcntl
except ImportError:  # no flock on this platform: one export per --out at a time is then the user's responsibility
    fcntl = None

MARK = ".jaxformer-partial"        # the name `jaxformer.data.prepare` marks its OUT.partial with


def check_free(out: str | Path) -> Path:
    """OUT as an absolute path when an export may be written there (absent, or an empty folder); HFError naming
    what it holds otherwise."""
    out = Path(os.path.abspath(out))
    if not out.name:
        raise HFError(f"--out {str(out)!r} names no folder an export can be written to")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        what = "a symbolic link" if out.is_symlink() else "not a folder"
        raise HFError(f"--out {out} exists and is {what}; it is left as it is: choose another --out")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held:
        names = ", ".join(held[:6]) + (f" and {len(held) - 6} more" if len(held) > 6 else "")
        raise HFError(f"--out {out} is not empty (it holds {names}); an export is written only to a new or empty "
                      f"folder and never replaces a file: choose another --out, or move those files away")
    return out


@contextlib.contextmanager
def staged(out: str | Path, command: str = "export-hf") -> Iterator[Path]:
    """Yield a fresh, marked OUT.partial to write an export into; when the block ends without an error, rename it
    to OUT (module docstring). HFError: OUT not free, an unmarked OUT.partial, OUT filled meanwhile.
    Interrupted: a stop signal arrived while writing (nothing is left at OUT)."""
    out = check_free(out)
    tmp = out.with_name(out.name + ".partial")
    if tmp.is_symlink() or tmp.exists():
        if tmp.is_symlink() or not (tmp / MARK).is_file():
            raise HFError(f"{tmp} exists and was not made by jaxformer (no {MARK} in it); it is left as it is: "
                          f"move it away or choose another --out")
        if _held(tmp / MARK):
            raise HFError(f"another export to {out} is running (it is writing {tmp}); wait for it to finish or "
                          f"choose another --out")
        shutil.rmtree(tmp)                  # an interrupted earlier export: start afresh
    try:
        tmp.mkdir(parents=True)
    except FileExistsError:
        raise HFError(f"another export to {out} started at the same moment (it made {tmp}); wait for it to "
                      f"finish or choose another --out") from None
    try:
        lock = _hold(tmp / MARK, f"unfinished output of jaxformer {command}; removed by the next export to "
                                 f"{out.name}\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        yield tmp
        if pending():
            raise Interrupted(f"jaxformer {command} stopped on {pending()}: nothing was written to {out}", pending())
        (tmp / MARK).unlink()
        try:
            os.rename(tmp, out)             # POSIX: replaces an empty folder, fails on a non-empty one
        except OSError as e:
            raise HFError(f"--out {out} could not be replaced by the finished export ({e.strerror}): it was "
                          f"filled while the export ran; it is left as it is, choose another --out") from None
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if type(e).__name__ == "SafetensorError":       # safetensors' writer fails so, not with an OSError (full disk)
            raise HFError(f"writing {tmp} failed ({e}); nothing was written to {out}") from None
        raise
    finally:
        os.close(lock)                      # releases the lock


def _hold(mark: Path, text: str) -> int:
    """Create `mark` holding `text`, with an exclusive flock on it held until the returned descriptor is closed."""
    fd = os.open(mark, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            with contextlib.suppress(OSError):      # a file system without locks: unlocked, as without fcntl
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, text.encode())
    except BaseException:
        os.close(fd)
        raise
    return fd


def _held(mark: Path) -> bool:
    """Whether a running export holds `mark`'s lock (`_hold`); False where there is no flock."""
    if fcntl is None:
        return False
    fd = os.open(mark, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:                             # a file system without locks: nothing tells a live export
        return False
    finally:
        os.close(fd)
