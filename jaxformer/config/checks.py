"""What every config section shares: validate-on-construction (deferrable) and the checks that name a field.

A section is a frozen dataclass deriving `_Validated`; its `validate()` raises ConfigError naming the dotted key
and the value. `configio.apply_overrides` defers validation while it applies `--set` pairs, then validates once.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import types
import typing
from typing import Any

from jaxformer.errors import ConfigError

_DEFERRED = contextvars.ContextVar("jaxformer_config_validation_deferred", default=False)


@contextlib.contextmanager
def _deferred_validation():
    """Inside: constructing or replacing a config section does not validate it (see `apply_overrides`)."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


class _Validated:
    """Mixin: validate on construction unless deferred."""

    def __post_init__(self):
        if not _DEFERRED.get():
            self.validate()

    def validate(self) -> None:
        raise NotImplementedError


def choice(field: str, value: Any, options: tuple) -> None:
    if value not in options:
        raise ConfigError(f"{field}={value!r} is not one of {options}")


def positive(field: str, value: Any, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok or value != value or value == float("inf"):  # NaN and Inf are not usable either
        raise ConfigError(f"{field}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


def seed_range(field: str, value: Any) -> None:
    """A PRNG seed: an integer in [0, 2**32)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2 ** 32:
        raise ConfigError(f"{field}={value!r} must be an integer in [0, 2**32)")


def _type_ok(value: Any, typ: Any) -> bool:
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(typ))
    if typ is type(None):
        return value is None
    if typ is bool:
        return isinstance(value, bool)
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, typ) if isinstance(typ, type) else True


def check_types(cfg: Any, section: str) -> None:
    """Every field holds a value of its declared type (bool is not an int; an int is a float)."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if not _type_ok(v, hints[f.name]):
            want = str(hints[f.name]).replace("<class '", "").replace("'>", "")
            raise ConfigError(f"{section}.{f.name}={v!r} must be of type {want}")
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 2 ** 63:
            raise ConfigError(f"{section}.{f.name}={v} does not fit a 64-bit integer (no array or counter holds it)")


def flat_items(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """A dataclass tree as {dotted key: value} over its leaves (sections are walked, not listed)."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out.update(flat_items(v, f"{prefix}{f.name}.") if dataclasses.is_dataclass(v) else {prefix + f.name: v})
    return out


def replaced(cfg: Any, **changes: Any) -> Any:
    """A copy of the frozen config tree `cfg` with fields replaced, `__` reaching into a section (as scikit-learn's
    `set_params`): `replaced(model_cfg, d_model=64, norm__position="pre", runtime__dtype="bfloat16")`. Values
    are typed already (strings from a command line: `configio.apply_overrides`); validated once, at the end."""
    with _deferred_validation():
        for key, value in changes.items():
            cfg = _replace_one(cfg, key.split("__"), value, key.replace("__", "."))
    cfg.validate()
    return cfg


def _replace_one(cfg: Any, path: list[str], value: Any, key: str) -> Any:
    names = {f.name for f in dataclasses.fields(cfg)}
    if path[0] not in names:
        raise ConfigError(f"unknown config key {key!r} (known in {type(cfg).__name__}: {sorted(names)})")
    if len(path) > 1:
        inner = getattr(cfg, path[0])
        if not dataclasses.is_dataclass(inner):
            raise ConfigError(f"unknown config key {key!r}: {path[0]!r} is a value, not a section")
        value = _replace_one(inner, path[1:], value, key)
    return dataclasses.replace(cfg, **{path[0]: value})
