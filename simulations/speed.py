"""Client speeds on a virtual clock: how many seconds each simulated client's fit takes.

A simulation trains every client as fast as this machine can, so wall time says nothing
about a federation whose devices differ. The speed model gives each client a fit
duration on a *virtual* clock instead, deterministic for a seed, from which the engines
time their rounds (`fedloom.simulations.clock` for synchronous rounds,
`fedloom.simulations.local_async` for FedBuff). A scenario's ``[speed]`` table:

.. code-block:: toml

    [speed]
    distribution = "lognormal"    # "constant": every client takes mean_s
    mean_s = 1.0                  # mean seconds of one fit (clients that are no stragglers)
    sigma = 0.5                   # lognormal: spread of the clients' mean times (log space)
    jitter = 0.0                  # spread of one client's fit times around its mean
    straggler_fraction = 0.2      # this share of the clients (seeded) is ...
    straggler_factor = 10.0       # ... this many times slower

Client ``i`` has a mean fit time ``m_i``: ``mean_s`` (``constant``), or a draw from a
lognormal with mean ``mean_s`` and log-space deviation ``sigma`` (``lognormal``: a
device's speed is a product of many factors, hence heavy-tailed). Exactly
``round(straggler_fraction * num_clients)`` clients, chosen with the seed, have ``m_i``
multiplied by ``straggler_factor``. One fit of client ``i`` then takes ``m_i`` times a
mean-one lognormal factor of deviation ``jitter`` (1 when ``jitter = 0``), drawn from
``(seed, i, draw)`` so that it does not depend on the order the engine asks in: the
synchronous engines draw by round, the asynchronous one by the client's task number.

Limits, said plainly: a fit's duration does not grow with the client's data or local
epochs, and transfers and evaluation take no virtual time.

>>> model = SpeedModel([1.0, 2.5])
>>> model.duration(1, draw=7)
2.5
>>> spec = SpeedSpec(distribution="lognormal", straggler_fraction=0.5)
>>> len(SpeedModel.from_spec(spec, num_clients=10, seed=0).stragglers)
5
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

from fedloom.settings import check, described

DISTRIBUTIONS = ("constant", "lognormal")

# Separate random streams (the second word of each generator's seed), so that changing
# one setting (sigma) does not move another draw (which clients straggle).
_MEANS, _STRAGGLERS, _JITTER = 1, 2, 3


@dataclasses.dataclass(frozen=True)
class SpeedSpec:
    """A scenario's ``[speed]`` table (see the module docstring)."""

    distribution: str = described("constant", 'the clients\' mean fit times: "constant" '
                                               '(all mean_s) or "lognormal"')
    mean_s: float = described(1.0, "mean seconds of one fit, on the virtual clock")
    sigma: float = described(0.5, "lognormal: log-space deviation of the clients' mean "
                                  "fit times")
    jitter: float = described(0.0, "log-space deviation of one client's fit times around "
                                   "its mean (0: every fit takes the same time)")
    straggler_fraction: float = described(0.0, "share of the clients (chosen with the "
                                               "seed) that are straggler_factor times slower")
    straggler_factor: float = described(10.0, "how many times slower a straggler is")

    def __post_init__(self) -> None:
        check(self.distribution in DISTRIBUTIONS, "speed.distribution",
              f"{self.distribution!r} is not one of {', '.join(DISTRIBUTIONS)}")
        check(math.isfinite(self.mean_s) and self.mean_s > 0, "speed.mean_s",
              f"must be a number of seconds > 0, got {self.mean_s}")
        check(math.isfinite(self.sigma) and self.sigma >= 0, "speed.sigma",
              f"must be >= 0 (0: every client takes mean_s), got {self.sigma}")
        check(math.isfinite(self.jitter) and self.jitter >= 0, "speed.jitter",
              f"must be >= 0 (0: no variation between fits), got {self.jitter}")
        check(0.0 <= self.straggler_fraction <= 1.0, "speed.straggler_fraction",
              f"must be in [0, 1], got {self.straggler_fraction}")
        check(math.isfinite(self.straggler_factor) and self.straggler_factor >= 1.0,
              "speed.straggler_factor",
              f"must be >= 1 (a straggler is slower), got {self.straggler_factor}")


class SpeedModel:
    """Every client's fit duration on the virtual clock.

    Args:
        mean_s: client ``i``'s mean fit time in seconds, for each client.
        jitter: log-space deviation of one fit's time around the client's mean.
        seed: seeds the per-fit jitter.
        stragglers: which clients are stragglers (for reports; already in ``mean_s``).

    Build it from a scenario's ``[speed]`` with `from_spec`, or from scripted times
    (tests, traces of real devices) with the constructor.
    """

    def __init__(self, mean_s: Sequence[float] | np.ndarray, *, jitter: float = 0.0, seed: int = 0,
                 stragglers: Iterable[int] = ()) -> None:
        means = np.asarray(mean_s, dtype=np.float64)
        if means.ndim != 1 or not len(means):
            raise ValueError("mean_s must list one mean fit time per client")
        if not np.all(np.isfinite(means)) or np.any(means <= 0):
            raise ValueError("every mean fit time must be a number of seconds > 0")
        if not math.isfinite(jitter) or jitter < 0:
            raise ValueError(f"jitter must be >= 0, got {jitter}")
        self.mean_s = means
        self.jitter = jitter
        self.seed = seed
        self.stragglers = frozenset(int(i) for i in stragglers)

    @classmethod
    def from_spec(cls, spec: SpeedSpec, num_clients: int, seed: int) -> SpeedModel:
        """Draw the ``num_clients`` clients' mean times as ``spec`` says, from ``seed``."""
        if spec.distribution == "lognormal":
            # E[exp(N(mu, sigma^2))] = exp(mu + sigma^2 / 2): this mu makes the mean mean_s.
            mu = math.log(spec.mean_s) - spec.sigma ** 2 / 2
            rng = np.random.default_rng([seed, _MEANS])
            means = rng.lognormal(mu, spec.sigma, size=num_clients)
        else:
            means = np.full(num_clients, spec.mean_s)
        count = round(spec.straggler_fraction * num_clients)
        rng = np.random.default_rng([seed, _STRAGGLERS])
        stragglers = sorted(int(i) for i in rng.choice(num_clients, size=count, replace=False))
        means[stragglers] *= spec.straggler_factor
        return cls(means, jitter=spec.jitter, seed=seed, stragglers=stragglers)

    @property
    def num_clients(self) -> int:
        return len(self.mean_s)

    def duration(self, client_index: int, draw: int) -> float:
        """Seconds that fit number ``draw`` of client ``client_index`` takes."""
        mean = float(self.mean_s[client_index])
        if self.jitter == 0.0:
            return mean
        rng = np.random.default_rng([self.seed, _JITTER, client_index, draw])
        # A lognormal factor of mean 1: the client's mean time stays its mean.
        return mean * float(rng.lognormal(-self.jitter ** 2 / 2, self.jitter))
