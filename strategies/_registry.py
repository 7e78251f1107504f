"""Build a strategy by name from configuration (``[strategy] name = "fedavg"``).

`STRATEGIES` maps each configurable name to its class. Hyperparameters are the class's
keyword arguments; unknown names, unknown settings and values of the wrong type are
refused with a `ConfigError` that names the setting.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

from fedloom.config import StrategyConfig
from fedloom.errors import ConfigError
from fedloom.strategies._composed import ComposedStrategy
from fedloom.strategies._fedavg import FedAvg

STRATEGIES: dict[str, type[ComposedStrategy]] = {
    "fedavg": FedAvg,
}

#: Settings the server passes from its own configuration, not from ``[strategy]``.
SERVER_OWNED = ("fraction_fit", "min_fit_clients", "fraction_evaluate", "min_evaluate_clients",
                "seed")


def strategy_settings(name: str) -> dict[str, inspect.Parameter]:
    """The ``[strategy]`` settings a named strategy accepts, with their defaults."""
    cls = _lookup(name)
    params = inspect.signature(cls.__init__).parameters
    return {
        k: p for k, p in params.items()
        if k != "self" and p.kind is p.KEYWORD_ONLY and k not in SERVER_OWNED
    }


def _lookup(name: str) -> type[ComposedStrategy]:
    cls = STRATEGIES.get(name.lower())
    if cls is None:
        close = difflib.get_close_matches(name.lower(), STRATEGIES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            "strategy.name", f"unknown strategy {name!r}{hint}; known: {', '.join(STRATEGIES)}"
        )
    return cls


def build_strategy(config: StrategyConfig, **server_owned: Any) -> ComposedStrategy:
    """Instantiate ``config.name`` with ``config.params`` plus the server-owned settings."""
    cls = _lookup(config.name)
    accepted = strategy_settings(config.name)
    kwargs: dict[str, Any] = {}
    for key, value in config.params.items():
        if key in SERVER_OWNED:
            raise ConfigError(
                f"strategy.{key}", "is a top-level server setting; move it out of [strategy]"
            )
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"strategy.{key}",
                f"{config.name} has no such setting{hint}; "
                f"it takes: {', '.join(accepted) or 'none'}",
            )
        kwargs[key] = _check_type(f"strategy.{key}", accepted[key], value)
    for key, value in server_owned.items():
        if key not in SERVER_OWNED:
            raise TypeError(f"{key} is not a server-owned strategy setting")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"strategy ({config.name})", str(exc)) from exc


def _check_type(setting: str, param: inspect.Parameter, value: Any) -> Any:
    default = param.default
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(setting, f"must be true or false, got {value!r}")
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(setting, f"must be a number, got {value!r}")
        return float(value)
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(setting, f"must be an integer, got {value!r}")
    elif default is None and isinstance(value, Mapping):
        return dict(value)
    return value
