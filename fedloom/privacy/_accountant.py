"""The privacy ledger: each released round as a dp-accounting event, and ε(δ) of them all.

A round is one sampled Gaussian release (`RoundEvent`): the clipped sum of the sampled
clients' deltas (and, with adaptive clipping, the clipped count; the pair costs what one
Gaussian of the configured multiplier z does, Andrew et al. 2021) with noise ``z * C``.
`PrivacyAccountant` turns each into Google's ``dp-accounting`` event for the sampling
the server really did, composes them with its RDP or PLD accountant and reports ε at the
configured δ; the arithmetic is the library's. The ledger (the events, run-length
encoded) is the checkpointed state, and a resumed run rebuilds the accountant from it,
so it continues the same budget.

Sampling and neighbouring relation (dp-accounting needs both to agree):

- ``"fixed"``: m of n without replacement, replace-one relation. One client replaced
  moves the clipped sum by up to 2C, so the event's multiplier is z / 2;
- ``"poisson"``: each client with probability q, add-or-remove relation, multiplier z;
- ``"none"``: a plain Gaussian, add-or-remove, multiplier z (no amplification).

`epsilon_if` projects the next round without changing the ledger, which is how a run
stops before it would spend more than ``target_epsilon``. The Skellam mechanism of the
distributed mode keeps its own RDP ledger (`fedloom.privacy.SkellamLedger`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import types
from typing import Any

from fedloom.errors import ConfigError

#: The neighbouring relation dp-accounting must use for each sampling mode.
_RELATION = {"fixed": "REPLACE_ONE", "poisson": "ADD_OR_REMOVE_ONE", "none": "ADD_OR_REMOVE_ONE"}


@functools.cache
def _lib() -> types.ModuleType:
    """dp-accounting, imported on first use (it takes most of a second to import, and a
    process that never accounts, such as a client, should not pay for it). It comes with
    the ``server`` extra: a client install does without it."""
    try:
        import dp_accounting
        import dp_accounting.pld.pld_privacy_accountant
        import dp_accounting.rdp.rdp_privacy_accountant
    except ImportError as exc:
        raise ImportError(
            "differential-privacy accounting needs dp-accounting: "
            'pip install "fedloom[server]"') from exc
    logging.getLogger("absl").addFilter(_quiet_excluded_orders)
    return dp_accounting


def _quiet_excluded_orders(record: logging.LogRecord) -> bool:
    """Drop dp-accounting's warning that an RDP order did not converge and was left out
    of an ε: it comes for many fractional orders under Poisson sampling (fifty lines
    for one calibration), and leaving an order out only makes ε less tight, never
    smaller than it should be. Every other message passes."""
    return "Excluding this order" not in record.getMessage()


@dataclasses.dataclass(frozen=True)
class RoundEvent:
    """One round's release, as the server did it.

    Attributes:
        noise_multiplier: z, the noise std over the clip norm (add-or-remove sensitivity).
        sampled: m, the clients sampled (``"fixed"``); for ``"poisson"`` unused (0).
        population: n, the clients sampled from (connected and eligible).
        rate: q, the Poisson sampling probability (``"poisson"``); 0 otherwise.
    """

    noise_multiplier: float
    sampled: int = 0
    population: int = 0
    rate: float = 0.0

    def to_state(self) -> list[float]:
        return [self.noise_multiplier, self.sampled, self.population, self.rate]

    @classmethod
    def from_state(cls, value: Any) -> RoundEvent:
        if not (isinstance(value, list | tuple) and len(value) == 4):
            raise ValueError(f"a privacy event is [z, m, n, q], got {value!r}")
        z, m, n, q = (_number(v, "a privacy event") for v in value)
        if not (z > 0 and 0 <= q <= 1):
            raise ValueError(f"a privacy event out of range: {value!r}")
        return cls(z, _whole(m, "a privacy event's m"), _whole(n, "a privacy event's n"), q)


def _number(value: Any, what: str) -> float:
    """A finite number from a checkpoint (JSON or a 0-d/1-element array), else ValueError."""
    if hasattr(value, "reshape") and getattr(value, "size", 0) == 1:
        value = value.reshape(-1)[0].item()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} must hold finite numbers, got {value!r}")
    return float(value)


def _whole(value: float, what: str) -> int:
    if value < 0 or value != int(value):
        raise ValueError(f"{what} must be a whole number >= 0, got {value!r}")
    return int(value)


def dp_event(event: RoundEvent, sampling: str) -> Any:
    """The dp-accounting event of one round under ``sampling`` (see the module doc)."""
    z, dpa = event.noise_multiplier, _lib()
    if sampling == "fixed":
        if not 0 < event.sampled <= event.population:
            raise ValueError(f"fixed sampling of {event.sampled} of {event.population} clients")
        if event.sampled == event.population:
            # Everyone takes part: no amplification, and replace-one doubles the sensitivity.
            return dpa.GaussianDpEvent(z / 2)
        return dpa.SampledWithoutReplacementDpEvent(
            event.population, event.sampled, dpa.GaussianDpEvent(z / 2))
    if sampling == "poisson":
        return dpa.PoissonSampledDpEvent(event.rate, dpa.GaussianDpEvent(z))
    if sampling == "none":
        return dpa.GaussianDpEvent(z)
    raise ValueError(f"unknown sampling {sampling!r}")


def none_multiplier(z: float, displaceable: bool) -> float:
    """The multiplier a ``"none"`` round is accounted at: z when the round takes every
    eligible client whatever their number; z / 2 when a client added to the federation
    could be sampled in place of one who was in (a fixed round size below the
    population), which moves the clipped sum by up to 2C."""
    return z / 2 if displaceable else z


def new_backend(kind: str, sampling: str) -> Any:
    """A fresh dp-accounting accountant of ``kind`` for ``sampling``."""
    dpa = _lib()
    relation = getattr(dpa.NeighboringRelation, _RELATION[sampling])
    if kind == "rdp":
        return dpa.rdp.rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
    if kind == "pld":
        return dpa.pld.pld_privacy_accountant.PLDAccountant(neighboring_relation=relation)
    raise ValueError(f"unknown accountant {kind!r}")


class PrivacyAccountant:
    """The run's privacy ledger on a dp-accounting RDP or PLD accountant.

    Args:
        kind: ``"rdp"`` or ``"pld"``.
        sampling: ``"fixed"``, ``"poisson"`` or ``"none"``.
        delta: the δ at which ε is reported.
    """

    def __init__(self, kind: str, sampling: str, delta: float) -> None:
        self.kind, self.sampling, self.delta = kind, sampling, delta
        self._backend = new_backend(kind, sampling)
        self._ledger: list[tuple[RoundEvent, int]] = []
        self._pending: tuple[RoundEvent, Any] | None = None

    @property
    def num_rounds(self) -> int:
        """Rounds released so far."""
        return sum(count for _, count in self._ledger)

    def epsilon(self) -> float:
        """ε at ``delta`` of every round released so far (0 before the first)."""
        return float(self._backend.get_epsilon(self.delta)) if self._ledger else 0.0

    def epsilon_if(self, event: RoundEvent) -> float:
        """ε at ``delta`` were ``event`` released next; the ledger does not change."""
        if self._pending is None or self._pending[0] != event:
            projected = copy.deepcopy(self._backend)
            self._compose(projected, event, 1)
            self._pending = (event, projected)
        return float(self._pending[1].get_epsilon(self.delta))

    def record(self, event: RoundEvent) -> float:
        """Add a released round to the ledger; returns the new ε."""
        if self._pending is not None and self._pending[0] == event:
            self._backend = self._pending[1]
        else:
            self._compose(self._backend, event, 1)
        self._pending = None
        if self._ledger and self._ledger[-1][0] == event:
            self._ledger[-1] = (event, self._ledger[-1][1] + 1)
        else:
            self._ledger.append((event, 1))
        return self.epsilon()

    def _compose(self, backend: Any, event: RoundEvent,
                 count: int) -> None:
        backend.compose(dp_event(event, self.sampling), count)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "sampling": self.sampling,
                "events": [[e.to_state(), c] for e, c in self._ledger]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Rebuild the accountant from a ledger written by `state_dict`.

        Raises:
            ConfigError: the ledger was written under another accountant or sampling
                (a resumed run must continue the same budget, on the same terms).
        """
        if state.get("kind") != self.kind or state.get("sampling") != self.sampling:
            raise ConfigError(
                "privacy",
                f"the run's privacy ledger was kept with accountant {state.get('kind')!r} "
                f"and sampling {state.get('sampling')!r}; this server is configured with "
                f"{self.kind!r} and {self.sampling!r}. Resume with the run's settings",
            )
        events = state.get("events")
        if not isinstance(events, list):
            raise ValueError(f"a privacy ledger holds a list of events, got {events!r}")
        ledger = []
        for item in events:
            if not (isinstance(item, list | tuple) and len(item) == 2):
                raise ValueError(f"a privacy ledger entry is [event, count], got {item!r}")
            count = _whole(_number(item[1], "a privacy ledger count"), "a privacy ledger count")
            if count < 1:
                raise ValueError(f"a privacy ledger count must be >= 1, got {item[1]!r}")
            ledger.append((RoundEvent.from_state(item[0]), count))
        backend = new_backend(self.kind, self.sampling)
        for event, count in ledger:
            self._compose(backend, event, count)
        self._backend, self._ledger, self._pending = backend, ledger, None


def calibrate_noise_multiplier(
    target_epsilon: float, delta: float, rounds: int, *, sampling: str = "fixed",
    sampled: int = 0, population: int = 0, rate: float = 0.0, accountant: str = "rdp",
) -> float:
    """The smallest noise multiplier z whose ``rounds`` rounds spend at most ``target_epsilon``.

    The search is dp-accounting's (`mechanism_calibration.calibrate_dp_mechanism`) over
    the same events a run records: ``sampling = "fixed"`` needs ``sampled`` m and
    ``population`` n, ``"poisson"`` needs ``rate`` q; ``"none"`` takes m and n when the
    round does not take every client (its events are then at z / 2, `none_multiplier`).
    Raises `ConfigError` for settings it cannot account for.
    """
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ConfigError("target_epsilon", f"must be a positive number, got {target_epsilon}")
    if not 0 < delta < 1:
        raise ConfigError("delta", f"must be in (0, 1), got {delta}")
    if rounds < 1:
        raise ConfigError("rounds", f"must be at least 1, got {rounds}")
    if sampling == "fixed" and not 0 < sampled <= population:
        raise ConfigError("sampled", f"fixed sampling needs 0 < sampled ({sampled}) <= "
                          f"population ({population})")
    if sampling == "poisson" and not 0 < rate <= 1:
        raise ConfigError("rate", f"poisson sampling needs a rate in (0, 1], got {rate}")
    if accountant not in ("rdp", "pld"):
        raise ConfigError("accountant", f"must be 'rdp' or 'pld', got {accountant!r}")
    if accountant == "pld" and sampling == "fixed":
        raise ConfigError("accountant", "PLD does not cover fixed-size sampling; use rdp")
    base, dpa = RoundEvent(1.0, sampled, population, rate), _lib()
    # "none" over m < n clients: the run records z / 2 (`none_multiplier`)
    factor = none_multiplier(1.0, sampled < population) if sampling == "none" else 1.0

    def event(z: float) -> Any:
        one = dp_event(dataclasses.replace(base, noise_multiplier=z * factor), sampling)
        return dpa.SelfComposedDpEvent(one, rounds)

    lowest, highest = 1e-2, 1e3
    if _spend(event(highest), "rdp", sampling, delta) > target_epsilon:
        raise ConfigError("target_epsilon", f"{target_epsilon:g} cannot be met over {rounds} "
                          f"rounds even with noise multiplier {highest:g}")
    if _spend(event(lowest), "rdp", sampling, delta) <= target_epsilon:
        return lowest  # as good as no noise: the budget is not the constraint
    z = float(dpa.calibrate_dp_mechanism(
        lambda: new_backend("rdp", sampling), event, target_epsilon, delta,
        bracket_interval=dpa.ExplicitBracketInterval(lowest, highest), tol=1e-4))
    if accountant == "rdp":
        return z
    # RDP's epsilon bounds PLD's from above, so PLD's z is below RDP's and, in practice,
    # above half of it. (PLDs of tiny noise multipliers take gigabytes: stay in range.)
    low = max(z / 2, lowest)
    if _spend(event(low), "pld", sampling, delta) <= target_epsilon:
        return low
    return float(dpa.calibrate_dp_mechanism(
        lambda: new_backend("pld", sampling), event, target_epsilon, delta,
        bracket_interval=dpa.ExplicitBracketInterval(low, z), tol=1e-3))


def _spend(event: Any, accountant: str, sampling: str, delta: float) -> float:
    backend = new_backend(accountant, sampling)
    backend.compose(event)
    return float(backend.get_epsilon(delta))
