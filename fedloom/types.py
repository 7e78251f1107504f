"""Round and task types shared by the server, the strategies and the client SDK.

All are frozen dataclasses validated in their constructors. `ClientUpdate` carries a
*delta* from the global model of `base_round`: deltas are what clipping, quantization,
masking, compression and staleness all need.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import NoReturn

import numpy as np

from fedloom.fit_config import MAX_UPDATE_NORM
from fedloom.weights import Weights

#: A value in a fit/evaluate configuration or a metrics record.
Scalar = bool | int | float | str | bytes
Config = Mapping[str, Scalar]
Metrics = Mapping[str, Scalar]

MAX_KEY_LENGTH = 256
#: The fit-config key of the update-norm bound (`fedloom.fit_config.MAX_UPDATE_NORM`).
MAX_NORM_KEY = MAX_UPDATE_NORM
MAX_STRING_VALUE = 4096
MAX_ENTRIES = 256
#: The range of an int in a record: the wire carries it as a signed 64-bit integer.
MIN_INT, MAX_INT = -(2**63), 2**63 - 1


class TaskKind(enum.StrEnum):
    FIT = "fit"
    EVALUATE = "evaluate"
    SECAGG = "secagg"  # a secure-aggregation stage of a fit round (fedloom.secagg)


class FrozenRecord(dict[str, Scalar]):
    """A validated config or metrics record: a dict that refuses every change.

    Made from a mapping, which it checks (`validate_record`'s rules, errors naming
    ``what``) and copies, numpy scalars converted to Python ones. The frozen dataclasses
    here hold their records as these, so a record cannot change after it was checked,
    and `validate_record` passes one on as it is: a client's metrics checked once in its
    `FitOutput` are not checked again in its `ClientUpdate`, nor when an engine replaces
    the update's delta. Reading, iterating, JSON and pickling work as for a dict;
    ``dict(record)`` (or ``record.copy()``) is a changeable copy.
    """

    __slots__ = ()

    def __init__(self, record: Mapping[str, Scalar] | None = None, what: str = "record") -> None:
        if record:
            dict.update(self, _checked_entries(record, what))

    def _refuse(self) -> NoReturn:
        raise TypeError("a validated record is read-only; change a copy (dict(record))")

    def __setitem__(self, key: str, value: Scalar) -> NoReturn:
        self._refuse()

    def __delitem__(self, key: str) -> NoReturn:
        self._refuse()

    def __ior__(self, other: object) -> NoReturn:  # type: ignore[misc]
        self._refuse()

    def clear(self) -> NoReturn:
        self._refuse()

    def pop(self, *args: object) -> NoReturn:
        self._refuse()

    def popitem(self) -> NoReturn:
        self._refuse()

    def setdefault(self, *args: object) -> NoReturn:
        self._refuse()

    def update(self, *args: object, **kwargs: object) -> NoReturn:
        self._refuse()

    def __reduce__(self) -> tuple[type[FrozenRecord], tuple[dict[str, Scalar]]]:
        return FrozenRecord, (dict(self),)  # (pickle would rebuild it item by item)

    def __copy__(self) -> FrozenRecord:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> FrozenRecord:
        return self  # its keys and values are immutable


def validate_record(record: Mapping[str, Scalar], what: str) -> FrozenRecord:
    """Validate a config/metrics record and return it as a `FrozenRecord`.

    Keys are non-empty strings of at most 256 characters; values are bool, int (signed
    64-bit, what the wire carries), float, str or bytes; there are at most 256 entries.
    Numpy scalars (``np.float32(0.5)``, ``np.int64(3)``, ``np.bool_(True)``) are
    converted to Python ones, as a metrics hook's output is: a metric computed with
    numpy need not be unwrapped by hand. Floats may be NaN only in metrics the caller
    chooses to accept; here they must be finite. A `FrozenRecord` was validated when it
    was made and cannot have changed since: it is returned as it is.
    """
    return record if type(record) is FrozenRecord else FrozenRecord(record, what)


def _checked_entries(record: Mapping[str, Scalar], what: str) -> dict[str, Scalar]:
    """``record``'s entries, numpy scalars as Python ones; `ValueError` naming the entry
    that a record cannot hold."""
    if len(record) > MAX_ENTRIES:
        raise ValueError(f"{what}: {len(record)} entries, at most {MAX_ENTRIES} allowed")
    checked: dict[str, Scalar] = {}
    for key, value in record.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_LENGTH:
            raise ValueError(f"{what}: key {key!r} must be a string of 1..{MAX_KEY_LENGTH}")
        checked[key] = checked_value(value.item() if isinstance(value, np.generic) else value,
                                      f"{what}[{key!r}]")
    return checked


def checked_value(value: Scalar, what: str) -> Scalar:
    """``value`` once a record can hold it (numpy scalars already converted), else
    `ValueError` starting with ``what``: the one rule of types, range and length."""
    if not isinstance(value, bool | int | float | str | bytes):
        raise ValueError(f"{what}: {type(value).__name__} is not a bool, int, float, str or bytes")
    if isinstance(value, int) and not MIN_INT <= value <= MAX_INT:
        raise ValueError(f"{what}: {value} is outside the signed 64-bit range "
                         f"[-2**63, 2**63 - 1]; send a larger number as a float or a str")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what}: {value} is not finite")
    if isinstance(value, str | bytes) and len(value) > MAX_STRING_VALUE:
        raise ValueError(f"{what}: longer than {MAX_STRING_VALUE}")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class ClientInfo:
    """What the server knows about a connected client."""

    client_id: str
    name: str = ""
    capabilities: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True, slots=True)
class ClientUpdate:
    """One client's fit result: the delta from the global model of `base_round`."""

    client_id: str
    delta: Weights
    num_examples: int
    base_round: int
    metrics: Metrics = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.num_examples, bool) or not isinstance(self.num_examples, int):
            raise ValueError("num_examples must be an int")
        if self.num_examples <= 0:
            raise ValueError(f"num_examples must be positive, got {self.num_examples}")
        if self.base_round < 0:
            raise ValueError(f"base_round must be >= 0, got {self.base_round}")
        object.__setattr__(self, "metrics", validate_record(self.metrics, "metrics"))


@dataclasses.dataclass(frozen=True, slots=True)
class EvaluateResult:
    """One client's evaluation of the global model."""

    client_id: str
    num_examples: int
    loss: float
    metrics: Metrics = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_examples <= 0:
            raise ValueError(f"num_examples must be positive, got {self.num_examples}")
        if not math.isfinite(self.loss):
            raise ValueError(f"loss must be finite, got {self.loss}")
        object.__setattr__(self, "metrics", validate_record(self.metrics, "metrics"))


@dataclasses.dataclass(frozen=True, slots=True)
class FitPlan:
    """Which clients train this round, and the config each receives."""

    client_ids: tuple[str, ...]
    config: Config = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(set(self.client_ids)) != len(self.client_ids):
            raise ValueError("a client appears twice in the plan")
        object.__setattr__(self, "config", validate_record(self.config, "fit config"))


@dataclasses.dataclass(frozen=True, slots=True)
class EvaluatePlan:
    """Which clients evaluate this round (may be empty), and their config."""

    client_ids: tuple[str, ...]
    config: Config = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(set(self.client_ids)) != len(self.client_ids):
            raise ValueError("a client appears twice in the plan")
        object.__setattr__(self, "config", validate_record(self.config, "evaluate config"))


@dataclasses.dataclass(frozen=True, slots=True)
class AggregateResult:
    """The outcome of `aggregate_fit`: new weights, or none with the reason."""

    weights: Weights | None
    metrics: Metrics = dataclasses.field(default_factory=dict)
    num_updates: int = 0
    reason: str = ""

    def __post_init__(self) -> None:
        if self.weights is None and not self.reason:
            raise ValueError("an AggregateResult without weights must say why (reason)")
        object.__setattr__(self, "metrics", validate_record(self.metrics, "metrics"))

    @classmethod
    def failed(cls, exc: Exception, num_updates: int = 0) -> AggregateResult:
        """A round whose aggregation raised ``exc``: no model, the exception as the
        reason (its type when it says nothing), and the updates that came in."""
        return cls(None, num_updates=num_updates, reason=str(exc) or type(exc).__name__)
