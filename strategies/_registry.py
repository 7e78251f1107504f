"""Build a strategy by name from configuration (``[strategy] name = "fedyogi"``).

`STRATEGIES` maps each configurable name to its class. A strategy's settings are its
constructor's keyword arguments (typed by their annotations, ranges checked by the
constructor), plus two that every strategy takes and that wrap it in
`NormBoundedStrategy`: ``max_update_norm`` and ``norm_bound_mode``. Client selection is
not a strategy setting: the caller passes a `SelectionConfig` (the server its top-level
``fraction_fit``, ``min_fit_clients``, ..., ``seed``; a simulation its scenario's), and
those keys are refused inside ``[strategy]``. Unknown names, unknown settings, values of
the wrong type and out-of-range values raise a `ConfigError` naming the setting.

Help text comes from the constructors' Google-style ``Args:`` docstrings rather than
field metadata: a strategy's settings are constructor arguments, and the docstring that
documents them for Python users is then the one text `describe_strategies` prints.

.. code-block:: toml

    [strategy]
    name = "fedyogi"
    eta = 0.01
    max_update_norm = 10.0
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import textwrap
import typing
from collections.abc import Mapping
from typing import Any

from fedloom.config import SelectionConfig, StrategyConfig
from fedloom.errors import ConfigError
from fedloom.settings import coerce, format_default, type_name
from fedloom.strategies._base import Strategy
from fedloom.strategies._bulyan import Bulyan
from fedloom.strategies._composed import ComposedStrategy
from fedloom.strategies._fedavg import FedAvg
from fedloom.strategies._fedopt import FedAdagrad, FedAdam, FedYogi
from fedloom.strategies._fedprox import FedProx
from fedloom.strategies._krum import Krum, MultiKrum
from fedloom.strategies._median import FedMedian
from fedloom.strategies._momentum import FedAvgM
from fedloom.strategies._norm_bound import NormBoundedStrategy, NormBoundMode
from fedloom.strategies._settings import argument_docs, summary_line
from fedloom.strategies._trimmed_mean import FedTrimmedAvg

STRATEGIES: dict[str, type[ComposedStrategy]] = {
    "fedavg": FedAvg,
    "fedavgm": FedAvgM,
    "fedprox": FedProx,
    "fedadagrad": FedAdagrad,
    "fedadam": FedAdam,
    "fedyogi": FedYogi,
    "fedmedian": FedMedian,
    "fedtrimmedavg": FedTrimmedAvg,
    "krum": Krum,
    "multikrum": MultiKrum,
    "bulyan": Bulyan,
}

#: Client selection: the caller's `SelectionConfig`, never part of ``[strategy]``.
SELECTION_SETTINGS = tuple(f.name for f in dataclasses.fields(SelectionConfig))

_KW = inspect.Parameter.KEYWORD_ONLY
#: Settings every strategy takes; they wrap it in `NormBoundedStrategy` when set.
NORM_BOUND_SETTINGS: dict[str, inspect.Parameter] = {
    "max_update_norm": inspect.Parameter("max_update_norm", _KW, default=None,
                                         annotation=float | None),
    "norm_bound_mode": inspect.Parameter("norm_bound_mode", _KW, default="clip",
                                         annotation=NormBoundMode),
}
_COMMON = ("fit_config", "evaluate_config", *NORM_BOUND_SETTINGS)
#: Constructor arguments that are Python callables (Flower's metrics hooks): passed to
#: the constructor, never configured in ``[strategy]``.
PYTHON_ONLY_SETTINGS = ("fit_metrics_aggregation_fn", "evaluate_metrics_aggregation_fn")


def _lookup(name: str) -> type[ComposedStrategy]:
    cls = STRATEGIES.get(name.lower())
    if cls is None:
        close = difflib.get_close_matches(name.lower(), STRATEGIES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            "strategy.name", f"unknown strategy {name!r}{hint}; known: {', '.join(STRATEGIES)}"
        )
    return cls


def strategy_settings(name: str) -> dict[str, inspect.Parameter]:
    """The ``[strategy]`` settings a named strategy accepts, with defaults and annotations."""
    cls = _lookup(name)
    hints = typing.get_type_hints(cls.__init__)
    params = inspect.signature(cls.__init__).parameters
    out = {
        k: p.replace(annotation=hints.get(k, p.annotation)) for k, p in params.items()
        if k != "self" and p.kind is p.KEYWORD_ONLY and k != "selection"
        and k not in PYTHON_ONLY_SETTINGS
    }
    out.update(NORM_BOUND_SETTINGS)
    return out


def build_strategy(config: StrategyConfig, selection: SelectionConfig | None = None) -> Strategy:
    """Instantiate ``config.name`` with ``config.params``, sampling with ``selection``.

    Returns the strategy, wrapped in `NormBoundedStrategy` when ``max_update_norm`` is
    set. Raises `ConfigError` for an unknown name or setting, a value of the wrong type
    or out of range (the setting is named ``strategy.<setting>``).

    >>> build_strategy(StrategyConfig("fedyogi", {"eta": 0.02}),
    ...                SelectionConfig(fraction_fit=0.5, seed=1)).selection.fraction_fit
    0.5
    """
    cls = _lookup(config.name)
    accepted = strategy_settings(config.name)
    kwargs: dict[str, Any] = {}
    for key, value in config.params.items():
        if key in SELECTION_SETTINGS:
            raise ConfigError(
                f"strategy.{key}", "is client selection, a top-level server setting (in a "
                "scenario: clients_per_round, evaluate_clients_per_round, seed); move it out "
                "of [strategy]"
            )
        if key in PYTHON_ONLY_SETTINGS:
            raise ConfigError(
                f"strategy.{key}", "is a Python function, not a setting: build the strategy "
                f"in Python ({cls.__name__}({key}=...)) and pass it as Server(strategy=...)"
            )
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"strategy.{key}",
                f"{config.name} has no such setting{hint}; it takes: {', '.join(accepted)}",
            )
        kwargs[key] = coerce(f"strategy.{key}", accepted[key].annotation, value)
    kwargs["selection"] = selection
    max_norm = kwargs.pop("max_update_norm", None)
    mode = kwargs.pop("norm_bound_mode", "clip")
    try:
        strategy: Strategy = cls(**kwargs)
        if max_norm is not None:
            strategy = NormBoundedStrategy(strategy, max_norm, mode)
    except ConfigError as exc:
        if exc.setting in accepted:
            raise ConfigError(f"strategy.{exc.setting}", exc.problem) from exc
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"strategy ({config.name})", str(exc)) from exc
    return strategy


def describe_strategies(width: int = 100) -> str:
    """A human-readable list of every strategy and its settings, with defaults.

    For ``fedloom server --help`` and the README; built from the constructors'
    signatures and docstrings, so it cannot drift from the code.
    """
    lines = ['Strategies ([strategy] name = "<name>", settings in the same table):', ""]
    for name, cls in STRATEGIES.items():
        lines.append(f"{name}: {_plain(summary_line(cls))}")
        docs = argument_docs(cls)
        own = [(k, p) for k, p in strategy_settings(name).items() if k not in _COMMON]
        if not own:
            lines.append("    (no settings of its own)")
        for key, param in own:
            lines.extend(_describe_setting(key, param, docs.get(key, ""), width))
        lines.append("")
    lines.append("Settings every strategy takes:")
    common = {**NORM_BOUND_SETTINGS, **{
        k: inspect.Parameter(k, _KW, default=None, annotation=Mapping) for k in
        ("fit_config", "evaluate_config")}}
    docs = {**argument_docs(ComposedStrategy), **argument_docs(NormBoundedStrategy)}
    for key in _COMMON:
        lines.extend(_describe_setting(key, common[key], docs[key], width))
    lines.append("")
    lines.extend(textwrap.wrap("Client selection is not a strategy setting: the server's "
                               "top-level " + ", ".join(SELECTION_SETTINGS) + " (a scenario's "
                               "clients_per_round, evaluate_clients_per_round and seed).",
                               width=width))
    return "\n".join(lines)


def _plain(text: str) -> str:
    """Drop reST markup (````code````, ```ref```) for terminal help text."""
    return text.replace("``", "").replace("`", "")


def _describe_setting(key: str, param: inspect.Parameter, doc: str, width: int) -> list[str]:
    head = f"    {key} ({type_name(param.annotation)}) = {format_default(param.default)}"
    body = textwrap.wrap(_plain(doc), width=width, initial_indent=" " * 8,
                         subsequent_indent=" " * 8)
    return [head, *body]
