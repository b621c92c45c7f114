"""Configs from outside: a configs/*.py file, `key=value` overrides from the command line, a run's config.json.

Each path validates once, after everything is applied, so the order of overrides never matters.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import types
import typing
from pathlib import Path
from typing import Any

from jaxformer.config import Config, _deferred_validation
from jaxformer.errors import ConfigError


def from_dict(d: Any) -> Config:
    """Inverse of to_dict for a Config (a run's saved config.json). Missing keys take their defaults;
    unknown keys and invalid values raise ConfigError naming them."""
    if not isinstance(d, dict):
        raise ConfigError(f"a config must be a JSON object; got {type(d).__name__}")
    hints = typing.get_type_hints(Config)
    unknown = sorted(set(d) - set(hints))
    if unknown:
        raise ConfigError(f"unknown config section(s) {unknown} (known: {sorted(hints)})")
    kw = {}
    for name, sub in d.items():
        cls = hints[name]
        if not isinstance(sub, dict):
            raise ConfigError(f"config section {name!r} must be an object; got {sub!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(sub) - known)
        if bad:
            raise ConfigError(f"unknown config key(s) {[f'{name}.{k}' for k in bad]}")
        with _deferred_validation():
            kw[name] = cls(**sub)
    with _deferred_validation():
        cfg = Config(**kw)
    cfg.validate()
    return cfg


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
        vals = json.loads(raw) if raw.startswith("[") else raw.split(",")
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
    with _deferred_validation():
        for p in pairs:
            if "=" not in p:
                raise ConfigError(f"override {p!r} must look like key=value")
            k, v = p.split("=", 1)
            cfg = _set(cfg, k.strip(), v.strip())
    cfg.validate()
    return cfg


def load_config_file(path: str | Path) -> Any:
    """Import a configs/*.py file and return its get_config(), which must return a Config."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if path.suffix != ".py":
        raise ConfigError(f"config file {str(path)!r} is not a Python file (.py) defining get_config()")
    spec = importlib.util.spec_from_file_location(f"jaxformer_config_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
        if not callable(getattr(mod, "get_config", None)):
            raise ConfigError(f"config file {str(path)!r} defines no get_config()")
        cfg = mod.get_config()
    except ConfigError:
        raise
    except Exception as e:  # the file is user code: any failure in it is a config error, named
        raise ConfigError(f"config file {str(path)!r} failed: {type(e).__name__}: {e}") from None
    if not isinstance(cfg, Config):
        raise ConfigError(f"config file {str(path)!r}: get_config() returned {type(cfg).__name__}, not a "
                          f"jaxformer.config.Config")
    return cfg
