"""Configs from outside: a configs/*.py file, `key=value` overrides from the command line, a run's config.json.

Each path validates once, after everything is applied, so the order of overrides never matters.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
import itertools
import json
import logging
import sys
import types
import typing
from pathlib import Path
from typing import Any

from jaxformer.config import SECTIONED, Config, _deferred_validation
from jaxformer.errors import ConfigError, JaxformerError

log = logging.getLogger("jaxformer")


# Keys that moved: read under their old names (run directories' config.json, --set) with a one-line deprecation
# warning; a config file that passes an old name to its dataclass is a named error naming the new key.
MOVED = {"model.moe_balance_weight": "optim.moe_balance_weight", "model.moe_z_weight": "optim.moe_z_weight",
         **{f"model.{old}": f"model.{new}" for old, new in SECTIONED.items()}}


def _moved(key: str) -> str:
    """The current name of config key `key` (warning once per read when it moved)."""
    new = MOVED.get(key)
    if new is not None:
        log.warning("config key %s is now %s: read as %s (update the config)", key, new, new)
    return new or key


def _move_old_keys(d: dict) -> dict:
    """A config dict (a copy) with each moved key (MOVED) under its new dotted path; both names with different
    values: an error."""
    d = copy.deepcopy(d)
    for old, new in MOVED.items():
        *opath, okey = old.split(".")
        parent = _walk(d, opath, create=False)
        if not isinstance(parent, dict) or okey not in parent:
            continue
        value = parent.pop(okey)
        _moved(old)
        *npath, nkey = new.split(".")
        target = _walk(d, npath, create=True)
        if not isinstance(target, dict):
            continue                            # a section that is not an object: from_dict names it
        if nkey in target and target[nkey] != value:
            raise ConfigError(f"{old}={value!r} and {new}={target[nkey]!r}: {old} is the old name of {new}; "
                              f"keep one")
        target.setdefault(nkey, value)
    return d


def _walk(d: Any, path: list[str], create: bool) -> Any:
    """The dict at `path` inside `d` (created when `create`), or None where the path does not lead to one."""
    for name in path:
        if not isinstance(d, dict):
            return None
        if name not in d and not create:
            return None
        d = d.setdefault(name, {})
    return d


def from_dict(d: Any) -> Config:
    """Inverse of to_dict for a Config (a run's saved config.json). Missing keys take their defaults;
    unknown keys and invalid values raise ConfigError naming them; moved keys (MOVED) are read under their new
    names."""
    if not isinstance(d, dict):
        raise ConfigError(f"a config must be a JSON object; got {type(d).__name__}")
    with _deferred_validation():
        cfg = _build(Config, _move_old_keys(d), "")
    cfg.validate()
    return cfg


def _build(cls: type, d: dict, prefix: str) -> Any:
    """Section `cls` from its JSON object `d` (sections nest; lists become the declared tuples), unvalidated."""
    fields = typing.get_type_hints(cls)
    unknown = sorted(set(d) - set(fields))
    if unknown:
        what = f"config section(s) {unknown}" if not prefix else f"config key(s) {[prefix + k for k in unknown]}"
        raise ConfigError(f"unknown {what} (known in {prefix.rstrip('.') or 'the root'}: {sorted(fields)})")
    kw = {}
    for k, v in d.items():
        typ = fields[k]
        if dataclasses.is_dataclass(typ):
            if not isinstance(v, dict):
                raise ConfigError(f"config section {prefix + k!r} must be an object; got {v!r}")
            v = _build(typ, v, f"{prefix}{k}.")
        elif _is_tuple(typ) and isinstance(v, list):
            v = tuple(v)                                         # JSON lists back to the declared tuples
        kw[k] = v
    return cls(**kw)


def _is_tuple(typ: Any) -> bool:
    """A tuple field (tuple[...], or tuple[...] | None)."""
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        return any(_is_tuple(a) for a in typing.get_args(typ))
    return typing.get_origin(typ) is tuple


def _coerce(key: str, raw: str, typ: Any) -> Any:
    """Parse a command-line string into the field's declared type, or raise ConfigError naming the key."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        if raw.lower() in ("none", "null") and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, raw, a)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}={raw!r}: " + "; ".join(errors))
    if typ is bool:
        if raw.lower() in ("true", "1", "yes"):
            return True
        if raw.lower() in ("false", "0", "no"):
            return False
        raise ConfigError(f"{key}={raw!r} is not a boolean (true/false)")
    if typ in (int, float):
        try:
            return typ(raw) if typ is float else int(raw, 10)
        except ValueError:
            raise ConfigError(f"{key}={raw!r} is not a valid {typ.__name__}") from None
    if typ is str:
        return raw
    if origin is tuple:
        try:
            vals = json.loads(raw) if raw.startswith("[") else raw.split(",")
        except json.JSONDecodeError as e:
            raise ConfigError(f"{key}={raw!r} is not a JSON list nor comma-separated values ({e.msg})") from None
        if not isinstance(vals, list):
            raise ConfigError(f"{key}={raw!r} is not a list")
        return tuple(_coerce(key, str(v), args[0]) for v in vals)
    raise ConfigError(f"{key}: cannot set a field of type {typ} from the command line")


def _set(cfg: Any, key: str, raw: str, prefix: str = "") -> Any:
    """A copy of the frozen tree `cfg` with dotted `key` parsed from string `raw` (type-checked, not validated)."""
    head, _, rest = key.partition(".")
    full = prefix + key
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    if head not in fields:
        raise ConfigError(f"unknown config key {full!r} (known in {prefix or 'the root'}: {sorted(fields)})")
    current = getattr(cfg, head)
    if rest:
        if not dataclasses.is_dataclass(current):
            raise ConfigError(f"unknown config key {full!r}: {prefix + head!r} is a value, not a section")
        new = _set(current, rest, raw, f"{prefix}{head}.")
    else:
        if dataclasses.is_dataclass(current):
            raise ConfigError(f"config key {full!r} is a section; set one of its fields")
        new = _coerce(full, raw, typing.get_type_hints(type(cfg))[head])
    return dataclasses.replace(cfg, **{head: new})


def override(cfg: Any, key: str, raw: str) -> Any:
    """Return a copy of the frozen tree `cfg` with dotted `key` set from string `raw`, validated."""
    return apply_overrides(cfg, [f"{key}={raw}"])


def apply_overrides(cfg: Any, pairs: list[str]) -> Any:
    """Apply `key=value` strings in order, then validate the result once: intermediate states may be
    invalid (e.g. data.block_size=5000 before model.max_len=10000)."""
    given = {}                               # current key -> (the name it was set under, its value)
    with _deferred_validation():
        for p in pairs:
            if "=" not in p:
                raise ConfigError(f"override {p!r} must look like key=value")
            k, v = p.split("=", 1)
            key = _moved(k.strip())
            cfg = _set(cfg, key, v.strip())
            value = _get(cfg, key)
            if key in given and given[key][0] != k.strip() and given[key][1] != value:
                (old, ov), (new, nv) = sorted([given[key], (k.strip(), value)], key=lambda g: g[0] == key)
                raise ConfigError(f"{old}={ov!r} and {new}={nv!r}: {old} is the old name of {new}; keep one")
            given[key] = (k.strip(), value)
    cfg.validate()
    return cfg


def _get(cfg: Any, key: str) -> Any:
    """The value of dotted `key` in the config tree `cfg`."""
    for name in key.split("."):
        cfg = getattr(cfg, name)
    return cfg


_loaded = itertools.count()


def load_python(path: str | Path, function: str, what: str, error: type[JaxformerError] = ConfigError) -> object:
    """Import the user's Python file `path` and return what its `function()` returns. Every way it can fail is
    `error` naming the file as `what` (e.g. "config file"): a missing path, a directory or other non-regular file,
    a non-.py file, no such function, and any exception or sys.exit() the file raises at import or in the call
    (a JaxformerError it raises, e.g. a ConfigError from building its Config, passes through unchanged)."""
    path = Path(path)
    name = f"{what} {str(path)!r}"
    if not path.exists():
        raise error(f"{name} does not exist")
    if path.is_dir():
        raise error(f"{name} is a directory, not a Python file (.py) defining {function}()")
    if not path.is_file():
        raise error(f"{name} is not a regular file")
    if path.suffix != ".py":
        raise error(f"{name} is not a Python file (.py) defining {function}()")
    modname = f"_jaxformer_user_{next(_loaded)}_{path.stem}"
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod          # as an import would (dataclasses, pickle look the module up by name)
    ok = False
    try:
        spec.loader.exec_module(mod)
        fn = getattr(mod, function, None)
        if not callable(fn):
            raise error(f"{name} defines no {function}()")
        out, ok = fn(), True
        return out
    except JaxformerError:
        raise
    except SystemExit as e:             # a sys.exit(0) in the file must not end the program "successfully"
        raise error(f"{name} called sys.exit({e.code!r})") from None
    except Exception as e:  # the file is user code: any failure in it is a named error
        raise error(f"{name} failed: {type(e).__name__}: {e}") from None
    finally:
        if not ok:
            sys.modules.pop(modname, None)


def _spelling(key: str) -> str:
    """How a config file sets dotted key `key`: model.norm.position -> ModelConfig(norm=NormConfig(position=...))."""
    *path, last = key.split(".")
    cls, call = Config, f"{last}=..."
    types_ = []
    for name in path:
        cls = typing.get_type_hints(cls)[name]
        types_.append((name, cls.__name__))
    for name, cls_name in reversed(types_[1:]):
        call = f"{name}={cls_name}({call})"
    return f"{types_[0][1]}({call})"


def load_config_file(path: str | Path) -> Any:
    """Import a configs/*.py file and return its get_config(), which must return a Config; or read a run's
    config.json (a resolved config, as `jaxformer.runs` writes it)."""
    if str(path).endswith(".json"):
        try:
            d = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"config file {str(path)!r} is unreadable: {type(e).__name__}: {e}") from None
        return from_dict(d)
    try:
        cfg = load_python(path, "get_config", "config file", ConfigError)
    except ConfigError as e:
        for old, new in MOVED.items():      # ModelConfig(norm_position=...): name where it lives now
            if f"unexpected keyword argument '{old.split('.')[1]}'" in str(e):
                raise ConfigError(f"{e}; {old} is now {new}: {_spelling(new)}") from None
        raise
    if not isinstance(cfg, Config):
        raise ConfigError(f"config file {str(path)!r}: get_config() returned {type(cfg).__name__}, not a "
                          f"jaxformer.config.Config")
    return cfg
