"""Typed strategy settings: check a configured value against a constructor's type hint,
and read each setting's description from the class's Google-style ``Args:`` section.

Kept apart from the registry so that `describe_strategies` and `build_strategy` share
one source of truth: the constructors' signatures, type hints and docstrings.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

from fedloom.errors import ConfigError

_SCALARS = (bool, int, float, str)


def coerce(setting: str, hint: Any, value: Any) -> Any:
    """Return ``value`` checked (and widened: int -> float) against ``hint``.

    Understands ``float``, ``int``, ``bool``, ``str``, ``Literal[...]``, ``X | None`` and
    ``Mapping[str, Scalar]`` (a TOML table of scalars). Raises `ConfigError` naming the
    setting and what it must be.
    """
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
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(setting, f"must be a string, got {value!r}")
        return value
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
    if value is None or value is inspect.Parameter.empty:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def argument_docs(obj: Any) -> dict[str, str]:
    """Descriptions from the ``Args:`` section of a Google-style docstring, by name."""
    doc = inspect.getdoc(obj) or ""
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    except StopIteration:
        return {}
    out: dict[str, str] = {}
    current: str | None = None
    entry = re.compile(r"^    (\w+)(?: \([^)]*\))?: (.*)$")
    for line in lines[start + 1:]:
        if line and not line.startswith(" "):
            break  # the next section (e.g. "Raises:") or prose
        match = entry.match(line)
        if match:
            current = match.group(1)
            out[current] = match.group(2).strip()
        elif current is not None and line.startswith("        "):
            out[current] += " " + line.strip()
    return out


def summary_line(obj: Any) -> str:
    """The first line of an object's docstring."""
    doc = inspect.getdoc(obj) or ""
    return doc.splitlines()[0] if doc else ""
