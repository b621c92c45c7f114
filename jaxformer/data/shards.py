"""Reading prepared token shards (`jaxformer data prepare`): memory-mapped, checked against their index.

`TokenShards(DIR)` opens DIR/index.json, checks the format, the tokenizer file's checksum and every shard's size
(and, with verify=True, every shard's sha256), and maps the shards read-only: nothing is read into memory until
a window is asked for. A split's tokens are one sequence across its shards: `window(split, start, n)` reads any
range, `document(split, i)` one document's tokens (without its end-of-document token).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxformer.data.documents import sha256_file
from jaxformer.data.prepare import FORMAT, SPLITS
from jaxformer.data.tokenizers import load_tokenizer
from jaxformer.errors import DataError


def _need(d, key: str, kind, where: str):
    """d[key], which must be of `kind` (a type or a tuple of allowed values); DataError naming it otherwise."""
    if not isinstance(d, dict) or key not in d:
        raise DataError(f"{where}: no {key!r} entry (the index of `jaxformer data prepare` has one); prepare the "
                        f"corpus again")
    v = d[key]
    ok = v in kind if isinstance(kind, tuple) else isinstance(v, kind) and not (kind is int and isinstance(v, bool))
    if not ok or (kind is int and v < 0):
        want = f"one of {kind}" if isinstance(kind, tuple) else f"a {'non-negative ' * (kind is int)}{kind.__name__}"
        raise DataError(f"{where}: {key!r} is {str(v)[:80]!r}, expected {want}; prepare the corpus again")
    return v


def check_index(index: dict, path: Path) -> None:
    """DataError naming the first entry of index.json that is missing or of the wrong type."""
    tok = _need(index, "tokenizer", dict, str(path))
    for key in ("file", "sha256"):
        _need(tok, key, str, f"{path} tokenizer")
    _need(index, "dtype", ("uint16", "uint32"), str(path))
    splits = _need(index, "splits", dict, str(path))
    for split in SPLITS:
        info = _need(splits, split, dict, f"{path} splits")
        where = f"{path} splits.{split}"
        _need(info, "tokens", int, where)
        _need(info, "documents_file", str, where)
        for i, shard in enumerate(_need(info, "shards", list, where)):
            for key, kind in (("file", str), ("tokens", int), ("sha256", str)):
                _need(shard, key, kind, f"{where}.shards[{i}]")


def _offsets(path: Path, tokens: int) -> np.ndarray:
    """A split's document offsets (int64 [documents + 1], from 0 to `tokens`, non-decreasing); DataError if the
    file is missing, not a plain .npy array (never unpickled) or not such offsets."""
    try:
        d = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"{path} is not a readable document-offset file ({type(e).__name__}: "
                        f"{str(e)[:120]}); prepare the corpus again") from None
    if not (isinstance(d, np.ndarray) and d.ndim == 1 and d.dtype.kind in "iu" and len(d) >= 1 and d[0] == 0
            and d[-1] == tokens and (np.diff(d) >= 0).all()):
        raise DataError(f"{path} does not hold document offsets from 0 to the split's {tokens} tokens; prepare "
                        f"the corpus again")
    return d.astype(np.int64)


class TokenShards:
    """The prepared output in `root` (module docstring). verify: hash every shard against the index."""

    def __init__(self, root: str | Path, *, verify: bool = True):
        self.root = Path(root)
        path = self.root / "index.json"
        if not path.is_file():
            raise DataError(f"{self.root} is not a prepared token folder (no index.json; make one with "
                            f"`jaxformer data prepare`)")
        try:
            self.index = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{path} is unreadable: {type(e).__name__}: {e}") from None
        if not isinstance(self.index, dict) or self.index.get("format") != FORMAT:
            raise DataError(f"{path}: format {self.index.get('format') if isinstance(self.index, dict) else None!r}"
                            f", expected {FORMAT!r}")
        check_index(self.index, path)
        tok = self.index["tokenizer"]
        tok_path = self.root / tok["file"]
        if not tok_path.is_file() or sha256_file(tok_path) != tok["sha256"]:
            raise DataError(f"{tok_path}: the tokenizer file is missing or not the one the shards were made with "
                            f"(sha256 differs from index.json)")
        self.tokenizer = load_tokenizer(tok_path)
        self.dtype = np.dtype(self.index["dtype"])
        self._maps, self._starts, self._docs = {}, {}, {}
        for split in SPLITS:
            info = self.index["splits"][split]
            maps, starts, at = [], [], 0
            for shard in info["shards"]:
                f = self.root / shard["file"]
                want = shard["tokens"] * self.dtype.itemsize
                if not f.is_file() or f.stat().st_size != want:
                    raise DataError(f"shard {f} is missing or has {f.stat().st_size if f.is_file() else 0} bytes, "
                                    f"not the {want} its index gives")
                if verify and sha256_file(f) != shard["sha256"]:
                    raise DataError(f"shard {f}: sha256 does not match index.json (the file changed or is "
                                    f"corrupt); prepare the corpus again")
                maps.append(np.memmap(f, self.dtype, "r", shape=(shard["tokens"],)))
                starts.append(at)
                at += shard["tokens"]
            if at != info["tokens"]:
                raise DataError(f"{path}: the {split} shards hold {at} tokens, the index says {info['tokens']}")
            self._maps[split], self._starts[split] = maps, np.asarray(starts + [at], np.int64)
            self._docs[split] = _offsets(self.root / info["documents_file"], at)

    def tokens(self, split: str) -> int:
        return int(self._starts[split][-1])

    def documents(self, split: str) -> np.ndarray:
        """[documents + 1] int64: document i is tokens [d[i], d[i+1]) (its last token is the end-of-document)."""
        return self._docs[split]

    def window(self, split: str, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) of the split as int32, across shard boundaries."""
        starts, out, filled = self._starts[split], np.empty(n, np.int32), 0
        if start < 0 or start + n > starts[-1]:
            raise IndexError(f"window [{start}, {start + n}) outside the {split} split's {starts[-1]} tokens")
        i = int(np.searchsorted(starts, start, side="right")) - 1
        while filled < n:
            m, off = self._maps[split][i], start + filled - starts[i]
            take = min(n - filled, len(m) - off)
            out[filled:filled + take] = m[off:off + take]
            filled += take
            i += 1
        return out

    def document(self, split: str, i: int) -> np.ndarray:
        d = self._docs[split]
        return self.window(split, int(d[i]), int(d[i + 1] - d[i]) - 1)
