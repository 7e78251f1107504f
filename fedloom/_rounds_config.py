"""`RoundsConfig`: the ``[rounds]`` settings, synchronous rounds or buffered asynchronous
aggregation (FedBuff).

.. code-block:: toml

    [rounds]
    mode = "async"                  # "sync" (default) | "async"
    concurrency = 20                # clients training at once
    buffer_size = 10                # K: updates per server step (a model version)
    max_staleness = 10              # updates older than this many versions are refused
    max_updates_per_client = 1      # the most updates one client adds to one step (0: any)
    staleness_weighting = "polynomial"   # "constant" | "polynomial" | "hinge"
    staleness_exponent = 0.5        # polynomial: (1 + s) ** -a
    total_updates = 0               # end the run after this many updates (0: num_rounds)
    evaluate_every = 1              # versions between evaluations

In async mode every flush of the buffer is a model version, committed as a round is;
``num_rounds`` counts versions. See docs/async.md for when to choose it.
"""

from __future__ import annotations

import dataclasses
import math

from fedloom.settings import check, described

SECTION = "rounds"
MODES = ("sync", "async")
WEIGHTINGS = ("constant", "polynomial", "hinge")


def _setting(name: str) -> str:
    return f"{SECTION}.{name}"


@dataclasses.dataclass(frozen=True)
class RoundsConfig:
    """How rounds run: ``mode = "sync"`` (sampled cohorts) or ``"async"`` (FedBuff).

    The staleness of an update is the number of model versions committed between the
    version it trained on and the version it is applied to; its delta is scaled by
    `fedloom.strategies.StalenessWeighting` before the strategy averages it.
    """

    mode: str = described("sync", 'how rounds run: "sync" (sampled cohorts) or "async" '
                                  "(buffered asynchronous aggregation, FedBuff)")
    concurrency: int = described(10, "async: clients training at once (each gets a new "
                                     "task as soon as it returns one)")
    buffer_size: int = described(10, "async: updates folded into each server step (K); "
                                     "each step is a committed model version")
    max_staleness: int = described(10, "async: updates trained on a model more than this "
                                       "many versions old are refused")
    max_updates_per_client: int = described(
        0, "async: the most updates one client (its identity, else its session) may add "
           "to one server step's buffer (0: no limit); a robust strategy needs a limit, "
           "or one fast client fills every buffer")
    staleness_weighting: str = described(
        "polynomial", 'async: how stale updates are weighted down: "constant", '
                      '"polynomial" ((1 + s) ** -a) or "hinge" (1 up to b, then '
                      "1 / (a (s - b) + 1))")
    staleness_exponent: float = described(0.5, "async: a of the polynomial weighting")
    hinge_slope: float = described(10.0, "async: a of the hinge weighting")
    hinge_after: int = described(4, "async: b of the hinge weighting (staleness with "
                                    "full weight)")
    total_updates: int = described(0, "async: end the run at the first version that brings "
                                      "the accepted updates to this many (0: num_rounds "
                                      "versions)")
    evaluate_every: int = described(1, "rounds (versions) between federated and server-side "
                                       "evaluations; the last round is always evaluated")

    def __post_init__(self) -> None:
        check(self.mode in MODES, _setting("mode"),
              f"must be one of {', '.join(map(repr, MODES))}, got {self.mode!r}")
        check(self.concurrency >= 1, _setting("concurrency"),
              f"must be at least 1, got {self.concurrency}")
        check(self.buffer_size >= 1, _setting("buffer_size"),
              f"must be at least 1, got {self.buffer_size}")
        check(self.max_staleness >= 0, _setting("max_staleness"),
              f"must be >= 0 (0 accepts only updates on the current model), "
              f"got {self.max_staleness}")
        check(self.max_updates_per_client >= 0, _setting("max_updates_per_client"),
              f"must be >= 0 (0: no limit), got {self.max_updates_per_client}")
        check(self.staleness_weighting in WEIGHTINGS, _setting("staleness_weighting"),
              f"must be one of {', '.join(map(repr, WEIGHTINGS))}, "
              f"got {self.staleness_weighting!r}")
        check(math.isfinite(self.staleness_exponent) and self.staleness_exponent >= 0,
              _setting("staleness_exponent"),
              f"must be a number >= 0, got {self.staleness_exponent}")
        check(math.isfinite(self.hinge_slope) and self.hinge_slope >= 0,
              _setting("hinge_slope"), f"must be a number >= 0, got {self.hinge_slope}")
        check(self.hinge_after >= 0, _setting("hinge_after"),
              f"must be >= 0, got {self.hinge_after}")
        check(self.total_updates >= 0, _setting("total_updates"),
              f"must be >= 0 (0: no limit), got {self.total_updates}")
        check(self.evaluate_every >= 1, _setting("evaluate_every"),
              f"must be at least 1, got {self.evaluate_every}")

    @property
    def asynchronous(self) -> bool:
        return self.mode == "async"

    def last_round(self, num_rounds: int) -> int:
        """The run's last round (version): ``num_rounds``, or fewer when async
        ``total_updates`` is reached sooner (every step takes ``buffer_size`` updates)."""
        if self.asynchronous and self.total_updates:
            return min(num_rounds, -(-self.total_updates // self.buffer_size))
        return num_rounds

    def evaluates(self, server_round: int, last_round: int) -> bool:
        """Whether round (version) ``server_round`` is evaluated."""
        return server_round % self.evaluate_every == 0 or server_round == last_round
