"""Writing an output so that no user's file is ever lost: two ways, one for each kind of output folder.

`staged(out)`: a folder written whole or not at all, as `jaxformer data prepare` writes its shards (export-hf,
`jaxformer sae --out`, `sae.save_saelens`). Everything goes to OUT.partial (a sibling folder, marked as jaxformer's
by a file `.jaxformer-partial` in it), which is renamed to OUT once complete. OUT must not exist or be an empty
folder: a folder holding anything (a file a user put there, an earlier output) is refused, naming what it holds,
and nothing in it is ever replaced or removed; write to a new folder instead. An interrupted or failed write
leaves no OUT (a stop signal held by the command line is honoured before the rename; an error removes
OUT.partial); OUT.partial left behind by a killed process is removed by the next write to OUT, because it is
marked; an unmarked OUT.partial (not jaxformer's) is refused and left as it is. The process writing OUT.partial
holds a lock (flock) on its mark, so that a second write to OUT started meanwhile is refused instead of taking
the folder over (it would remove the first one's files while they are written).

`write_kept(folder, writers)`: files written into a folder shared by several calls (`jaxformer viz`: RUN/viz/ or
its --out, one call per plot). A manifest in the folder (`.jaxformer-viz`, one name a line) lists the files
jaxformer wrote there; those it may replace. Any other file of a name it would write is refused before anything
is written (a named error listing them). Each file is written to a temporary name beside it and renamed into
place (`os.replace`: whole, never half-written), its name entered in the manifest (itself written so) first.

Errors are `error` (default `OutputError`), worded with `what` (how the caller's user names the folder: "--out";
None: the path alone) and `noun` (what is written: "output", "export").
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator, Mapping

from jaxformer.errors import Interrupted, OutputError
from jaxformer.signals import pending

try:
    import fcntl
except ImportError:  # no flock on this platform: one write per OUT at a time is then the user's responsibility
    fcntl = None

MARK = ".jaxformer-partial"        # the name `jaxformer.data.prepare` marks its OUT.partial with
MANIFEST = ".jaxformer-viz"        # `write_kept`'s list of the files jaxformer wrote in a folder
_MANIFEST_HEAD = "# files jaxformer wrote in this folder (it may replace them); one name a line\n"


def _named(out, what: str | None) -> str:
    return f"{what} {out}" if what else str(out)


def _choose(what: str | None) -> str:
    return f"choose another {what}" if what else "choose another folder"


def _article(noun: str) -> str:
    """"an" before a vowel sound: a vowel, or an initialism spelt out from a letter named with one ("an SAE")."""
    word = noun.split(" ", 1)[0]
    return "an" if word[:1].lower() in "aeiou" or (word.isupper() and word[:1] in "FHLMNRSX") else "a"


def check_free(out: str | Path, *, what: str | None = None, noun: str = "output",
               error: type[Exception] = OutputError) -> Path:
    """OUT as an absolute path when `staged` may write there (absent, or an empty folder, and no OUT.partial
    that is not jaxformer's or is being written); `error` naming what it holds otherwise."""
    out = Path(os.path.abspath(out))
    if not out.name:
        raise error(f"{_named(repr(str(out)), what)} names no folder {_article(noun)} {noun} can be written to")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        kind = "a symbolic link" if out.is_symlink() else "not a folder"
        raise error(f"{_named(out, what)} exists and is {kind}; it is left as it is: {_choose(what)}")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held:
        names = ", ".join(held[:6]) + (f" and {len(held) - 6} more" if len(held) > 6 else "")
        raise error(f"{_named(out, what)} is not empty (it holds {names}); {_article(noun)} {noun} is written only "
                    f"to a new or empty folder and never replaces a file: {_choose(what)}, or move those files away")
    _check_partial(out, what, noun, error)
    return out


def _check_partial(out: Path, what, noun, error) -> bool:
    """Whether OUT.partial is there, a killed write's (marked, unlocked): free to remove. `error` when it is not
    jaxformer's or a running write holds it."""
    tmp = out.with_name(out.name + ".partial")
    if not (tmp.is_symlink() or tmp.exists()):
        return False
    if tmp.is_symlink() or not (tmp / MARK).is_file():
        raise error(f"{tmp} exists and was not made by jaxformer (no {MARK} in it); it is left as it is: "
                    f"move it away or {_choose(what)}")
    if _held(tmp / MARK):
        raise error(f"another {noun} to {out} is running (it is writing {tmp}); wait for it to finish or "
                    f"{_choose(what)}")
    return True


@contextlib.contextmanager
def staged(out: str | Path, command: str | None = None, *, what: str | None = None, noun: str = "output",
           error: type[Exception] = OutputError) -> Iterator[Path]:
    """Yield a fresh, marked OUT.partial to write into; when the block ends without an error, rename it to OUT
    (module docstring). command: the jaxformer command writing (named in the mark and when stopped). `error`:
    OUT not free, an unmarked OUT.partial, OUT filled meanwhile. Interrupted: a stop signal held by the command
    line arrived while writing (nothing is left at OUT)."""
    out = check_free(out, what=what, noun=noun, error=error)
    tmp = out.with_name(out.name + ".partial")
    who = f"jaxformer {command}" if command else "jaxformer"
    if _check_partial(out, what, noun, error):
        shutil.rmtree(tmp)                  # an interrupted earlier write: start afresh
    try:
        tmp.mkdir(parents=True)
    except FileExistsError:
        raise error(f"another {noun} to {out} started at the same moment (it made {tmp}); wait for it to "
                    f"finish or {_choose(what)}") from None
    try:
        lock = _hold(tmp / MARK, f"unfinished output of {who}; removed by the next {noun} to {out.name}\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        yield tmp
        if pending():
            raise Interrupted(f"{who} stopped on {pending()}: nothing was written to {out}", pending())
        (tmp / MARK).unlink()
        try:
            os.rename(tmp, out)             # POSIX: replaces an empty folder, fails on a non-empty one
        except OSError as e:
            raise error(f"{_named(out, what)} could not be replaced by the finished {noun} ({e.strerror}): it was "
                        f"filled while the {noun} was written; it is left as it is, {_choose(what)}") from None
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if type(e).__name__ == "SafetensorError":       # safetensors' writer fails so, not with an OSError (full disk)
            raise error(f"writing {tmp} failed ({e}); nothing was written to {out}") from None
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
    """Whether a running write holds `mark`'s lock (`_hold`); False where there is no flock."""
    if fcntl is None:
        return False
    fd = os.open(mark, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:                             # a file system without locks: nothing tells a live write
        return False
    finally:
        os.close(fd)


# ------------------------------------------------------------------ files in a folder shared by several calls

def _manifest(folder: Path, what, error) -> set[str]:
    """The names `write_kept` wrote in `folder` (its manifest); `error` when the manifest's name is taken by a
    file that is not jaxformer's."""
    path = folder / MANIFEST
    if not (path.is_symlink() or path.exists()):
        return set()
    try:
        if path.is_symlink() or not path.is_file():
            raise ValueError
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError):
        text = ""
    if not text.startswith(_MANIFEST_HEAD):
        raise error(f"{path} is not jaxformer's list of the files it wrote in {_named(folder, what)}; it and the "
                    f"folder are left as they are: {_choose(what)} or move it away")
    return {line for line in text[len(_MANIFEST_HEAD):].splitlines() if line}


def _replace_whole(path: Path, write: Callable[[Path], None]) -> None:
    """write(tmp) a temporary file beside `path` (its name ends as path's, for writers that read the format from
    the suffix), then rename it to `path`; no temporary file is left on an error."""
    tmp = path.with_name(f".jaxformer-tmp-{os.getpid()}-{path.name}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_kept(folder: str | Path, writers: Mapping[str, Callable[[Path], None]], *, what: str | None = None,
               error: type[Exception] = OutputError) -> list[Path]:
    """Write the files `writers` names ({file name: write(path)}) into `folder` (created), each whole, replacing
    only files jaxformer wrote there before (module docstring). -> their paths, in order. `error` before anything
    is written when a name is taken by a file that is not in the folder's manifest (a user's) or is not a file."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise error(f"{_named(folder, what)} exists and is not a folder; it is left as it is: {_choose(what)}")
    ours = _manifest(folder, what, error) if folder.is_dir() else set()
    taken = [n for n in writers if (folder / n).is_symlink() or (folder / n).exists()]
    foreign = [n for n in taken if n not in ours or (folder / n).is_symlink() or not (folder / n).is_file()]
    if foreign:
        names = ", ".join(foreign[:6]) + (f" and {len(foreign) - 6} more" if len(foreign) > 6 else "")
        raise error(f"{_named(folder, what)} holds {names}, not written there by jaxformer: left as they are; "
                    f"{_choose(what)} or move them away")
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, write in writers.items():
        if name not in ours:                # listed first: a file of this name is never left unlisted
            ours.add(name)
            _replace_whole(folder / MANIFEST, lambda p: p.write_text(
                _MANIFEST_HEAD + "".join(f"{n}\n" for n in sorted(ours)), encoding="utf-8"))
        _replace_whole(folder / name, write)
        paths.append(folder / name)
    return paths


def fresh(out: str | Path) -> Path:
    """OUT when `staged` may write there, else the first of OUT-2, OUT-3, ... that is free (for a default
    folder, never one a user named: that one is refused instead)."""
    out = Path(out)
    for n in range(1, 10_000):
        candidate = out if n == 1 else out.with_name(f"{out.name}-{n}")
        try:
            check_free(candidate)
        except OutputError:
            continue
        return candidate
    raise OutputError(f"{out} and {out.name}-2 to {out.name}-9999 are all taken; choose a folder")
