"""`RoundRecord`: one round of a run, as the server commits it and the simulations record it.

The server's history (`fedloom.server.Server.run`), its run store and `fedloom runs`,
and a simulation's `fedloom.simulations.History` all hold these. A record has sections:
``fit`` (the strategy's fit metrics), ``evaluate`` (federated evaluation, aggregated by
the strategy) and ``server`` (the evaluation function on the server's own data, as the
function named its metrics), plus the round's counts and wall time. Round 0 holds only
the evaluation of the initial model. The server commits a round before evaluating its
model, then records the evaluation: ``evaluation_pending`` marks a committed round whose
evaluation is due and not yet recorded (a server stopped in between evaluates it when
it resumes).

`RoundRecord.metrics` is the same round as one flat mapping (fit metrics as they are,
``num_failures``, ``federated_<key>``, the server-side metrics as they are,
``seconds``): what a simulation's CSV and plots are made of.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fedloom.types import Scalar

STATUSES = ("ok", "failed")
_SECTIONS = ("fit", "evaluate", "server", "secure_aggregation")


def _section() -> Any:
    return dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RoundRecord:
    """One round of a run (see the module docstring).

    >>> r = RoundRecord(1, fit={"train_loss": 0.5}, server={"test_accuracy": 0.9},
    ...                 num_sampled=3, num_updates=3, duration_s=1.5)
    >>> r.status, r.metrics["test_accuracy"], r.metrics["seconds"]
    ('ok', 0.9, 1.5)
    """

    round: int
    status: str = "ok"  # "ok", or "failed": the global model did not change
    fit: Mapping[str, Scalar] = _section()
    evaluate: Mapping[str, Scalar] = _section()
    server: Mapping[str, Scalar] = _section()
    num_sampled: int = 0  # clients given a fit task
    num_updates: int = 0  # updates aggregated (under secure aggregation: survivors)
    num_failures: int = 0  # sampled clients whose update did not count
    num_cancelled: int = 0  # tasks cancelled once enough updates arrived (over-selection)
    duration_s: float = 0.0
    reason: str = ""  # why a round produced no model, when it says
    #: What a secure round adds: attempts, survivors, dropped clients, stage times.
    secure_aggregation: Mapping[str, Any] = _section()
    #: Committed, and its evaluation is due but not recorded yet (see the module docstring).
    evaluation_pending: bool = False

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        for name in _SECTIONS:  # a copy: the record does not share its caller's dicts
            object.__setattr__(self, name, dict(getattr(self, name)))

    @property
    def metrics(self) -> dict[str, Any]:
        """The round as one flat mapping (see the module docstring)."""
        out: dict[str, Any] = {}
        if self.round > 0:
            out.update(self.fit)
            out["num_failures"] = self.num_failures
            if self.reason:
                out["no_model_reason"] = self.reason
        out.update({f"federated_{k}": v for k, v in self.evaluate.items()})
        out.update(self.server)
        out["seconds"] = self.duration_s
        return out

    def get(self, key: str, default: Any = None) -> Any:
        """One value of the flat `metrics`."""
        return self.metrics.get(key, default)

    @property
    def headline(self) -> Mapping[str, Any]:
        """The evaluation a round is summed up by (its loss and accuracy): see
        `headline_evaluation`."""
        return headline_evaluation(self.server, self.evaluate)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (what the run store keeps)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in _SECTIONS:
            out[name] = dict(out[name])
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RoundRecord:
        """A record from its JSON form; keys a newer writer added are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def headline_evaluation(server: Mapping[str, Any] | None,
                        evaluate: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The server-side evaluation when the round has one, else the federated one: every
    headline figure (loss, accuracy) of a round comes from the same evaluation, never a
    loss from one and an accuracy from the other."""
    return server or evaluate or {}

