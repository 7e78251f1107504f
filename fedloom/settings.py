"""Typed settings: check configured values against type hints, build configuration
dataclasses from TOML tables, and carry each setting's help text.

`coerce` is the one routine that accepts, widens (int -> float) or refuses a configured
value. The configuration dataclasses use it through `from_mapping`, and
`fedloom.strategies.build_strategy` uses it for a strategy's constructor settings, so a
value means the same wherever it is configured. A field's help text is its metadata
(`described`), which the ``fedloom`` command reads with `field_help`.

>>> import dataclasses
>>> @dataclasses.dataclass(frozen=True)
... class Example:
...     rate: float = described(0.5, "share of clients, in (0, 1]")
>>> from_mapping(Example, {"rate": 1})
Example(rate=1.0)
>>> field_help(dataclasses.fields(Example)[0])
'share of clients, in (0, 1]'
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import numbers
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

from fedloom.errors import ConfigError

T = TypeVar("T")

_SCALARS = (bool, int, float, str)


def check(cond: bool, setting: str, problem: str) -> None:
    """Raise `ConfigError` for ``setting`` unless ``cond`` holds."""
    if not cond:
        raise ConfigError(setting, problem)


def check_address(setting: str, address: str) -> None:
    host, sep, port = address.rpartition(":")
    check(
        bool(sep) and bool(host) and port.isdigit() and 0 <= int(port) <= 65535,
        setting,
        f"{address!r} is not HOST:PORT (e.g. 127.0.0.1:8080; port 0 picks a free one)",
    )


def described(default: Any, help: str) -> Any:
    """A dataclass field with a default and its help text (read by `field_help`)."""
    return dataclasses.field(default=default, metadata={"help": help})


def field_help(field: dataclasses.Field[Any]) -> str:
    """The help text a field was `described` with ("" when it has none)."""
    return str(field.metadata.get("help", ""))


def from_mapping(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Build a config dataclass from a (TOML) mapping, refusing unknown keys and types."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        setting = f"{where}{key}"
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(setting, f"unknown setting{hint}")
        kwargs[key] = coerce(setting, hints[key], value)
    return cls(**kwargs)


def check_numbers(config: Any, where: str = "") -> None:
    """Check the number and true/false settings of a config dataclass built in Python
    (a TOML file is checked by `from_mapping`): ``ServerConfig(num_rounds="3")`` says
    ``num_rounds: must be an integer, got '3'`` rather than failing in a comparison. A
    numpy scalar is replaced by the Python value it holds."""
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        hint, value = hints[field.name], getattr(config, field.name)
        setting = f"{where}{field.name}"
        is_bool = isinstance(value, bool | np.bool_)
        if hint is bool and not is_bool:
            raise ConfigError(setting, f"must be true or false, got {value!r}")
        if hint is int and (is_bool or not isinstance(value, numbers.Integral)):
            raise ConfigError(setting, f"must be an integer, got {value!r}")
        if hint is float and (is_bool or not isinstance(value, numbers.Real)):
            raise ConfigError(setting, f"must be a number, got {value!r}")
        if hint in (bool, int, float) and isinstance(value, np.generic):
            # np.int64(4) from a sweep over np.arange: kept as the Python value it holds,
            # so the config (and a history that records it) is plain data, as a TOML one
            object.__setattr__(config, field.name, hint(value.item()))


def coerce(setting: str, hint: Any, value: Any) -> Any:
    """Return ``value`` checked (and widened: int -> float) against ``hint``.

    Understands ``float``, ``int``, ``bool``, ``str``, ``Literal[...]``, ``X | None``,
    ``tuple[X, ...]`` (a TOML array), ``Mapping[str, Scalar]`` (a TOML table of scalars)
    and config dataclasses (a TOML table, through `from_mapping`, or the class's own
    ``from_table(table, setting)`` when it has one). Raises `ConfigError` naming the
    setting and what it must be.
    """
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if isinstance(value, hint):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(setting, f"must be a table, got {type(value).__name__}")
        from_table = getattr(hint, "from_table", None)
        if from_table is not None:
            return from_table(value, setting)
        return from_mapping(hint, value, where=f"{setting}.")
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        if len(options) == 1:
            return coerce(setting, options[0], value)
        raise TypeError(f"{setting}: cannot check a union of {options}")
    if origin is typing.Literal:
        allowed = typing.get_args(hint)
        if value not in allowed or isinstance(value, bool):
            raise ConfigError(
                setting, f"must be one of {', '.join(map(repr, allowed))}, got {value!r}"
            )
        return value
    if hint in _SCALARS:
        return _coerce_scalar(setting, hint, value)
    if origin is tuple:
        item_hint = typing.get_args(hint)[0]
        if not isinstance(value, list | tuple):
            raise ConfigError(setting, f"must be a list, got {value!r}")
        return tuple(coerce(setting, item_hint, item) for item in value)
    if origin is Mapping or hint is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(setting, f"must be a table, got {value!r}")
        for key, item in value.items():
            if not isinstance(key, str) or not isinstance(item, _SCALARS):
                raise ConfigError(
                    f"{setting}.{key}", f"must be a boolean, number or string, got {item!r}"
                )
        return dict(value)
    raise TypeError(f"{setting}: no rule to check a value against {hint!r}")


def _coerce_scalar(setting: str, hint: type, value: Any) -> Any:
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(setting, f"must be a number, got {value!r}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(setting, f"must be an integer, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(setting, f"must be true or false, got {value!r}")
        return value
    if not isinstance(value, str):
        raise ConfigError(setting, f"must be a string, got {value!r}")
    return value


def type_name(hint: Any) -> str:
    """A short human name for a setting's type hint (for help text)."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return " | ".join(type_name(a) for a in options) + ", optional"
    if origin is typing.Literal:
        return " | ".join(repr(a).replace("'", '"') for a in typing.get_args(hint))
    if origin is Mapping or hint is Mapping:
        return "table"
    return getattr(hint, "__name__", str(hint))


def format_default(value: Any) -> str:
    """A default as it would be written in TOML (``true``, ``"clip"``, ``0.001``)."""
    if value is None or value is inspect.Parameter.empty or value is dataclasses.MISSING:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)
