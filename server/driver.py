"""The round-driver interface: how one round's fit is run, whatever its protocol.

The round loop (`fedloom.server.round_loop`) calls `RoundDriver.run_fit` once per round
(a model version) and commits what it returns; a driver issues its tasks through the
task book (`fedloom.server.tasks`), owns their results and uploads, and hears when a
client goes. Drivers: `PlainRounds` (`fedloom.server.plain_round`) and `SecureRounds`
(`fedloom.server.secure`) and `AsyncRounds` (`fedloom.server.async_rounds`, FedBuff:
its tasks outlive a round, and each ``run_fit`` returns at a buffer's step). A driver
is chosen in `fedloom.server.round_loop.round_driver`; the servicer, the task book and
the fleet are the same for every driver.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
from pathlib import Path
from typing import Any

from fedloom.config import ServerConfig
from fedloom.server.fleet import Fleet
from fedloom.server.model import GlobalModel
from fedloom.server.progress import RoundReporter
from fedloom.server.store import ClientRow
from fedloom.server.tasks import TaskBook
from fedloom.strategies import Strategy
from fedloom.types import AggregateResult


@dataclasses.dataclass(frozen=True)
class RoundParts:
    """What a driver works with: the server's parts, shared by the round loop."""

    config: ServerConfig
    run_id: str
    strategy: Strategy
    fleet: Fleet
    book: TaskBook
    model: GlobalModel
    #: One thread for the strategy's aggregation and other heavy steps, in order.
    executor: concurrent.futures.ThreadPoolExecutor
    spool_dir: Path  # where uploads are spooled while they arrive
    reporter: RoundReporter


@dataclasses.dataclass
class FitOutcome:
    """A round's fit: the strategy's result (None: the round failed) and what the round
    loop records of it (`fedloom.records.RoundRecord`)."""

    result: AggregateResult | None
    num_sampled: int = 0
    num_updates: int = 0
    num_failures: int = 0
    num_cancelled: int = 0
    #: A secure round's details (attempts, survivors, stage times).
    secure_aggregation: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: The accepted fit results, one row each, when the run keeps per-client metrics
    #: (`fedloom.server.client_metrics`).
    clients: list[ClientRow] = dataclasses.field(default_factory=list)


class RoundDriver(abc.ABC):
    """Runs the fit part of each round and owns the tasks it issues."""

    def __init__(self, parts: RoundParts) -> None:
        self.parts = parts

    @abc.abstractmethod
    async def run_fit(self, server_round: int) -> FitOutcome:
        """Sample, issue, collect and aggregate round ``server_round``'s fit.

        Raises:
            PrivacyBudgetExhausted: before any task goes out (the run ends cleanly).
        """

    def model_ready(self, server_round: int) -> None:
        """Round ``server_round``'s model is installed (or, after a failed round, the
        previous one stands for it): the model new tasks train from now on."""
        return None  # a driver that issues tasks between rounds (async rounds) overrides it

    def committed(self, server_round: int) -> None:
        """Round ``server_round`` is durable (checkpoint and SQLite)."""
        return None  # a driver that keeps state across rounds (async rounds) overrides it

    def finish(self) -> None:
        """The run's last round is committed (the run is over, not merely stopping)."""
        return None

    def client_gone(self, client_id: str, reason: str) -> None:
        """A client left or went silent (its pending task has already been told)."""
        return None  # a driver that keeps per-client state (secure rounds) overrides it

    def close(self) -> None:
        """The run is over (or the server stops): release threads and files."""
        return None  # a driver with threads of its own (secure rounds) overrides it

    def clean_spool(self) -> None:
        """Remove the spool files of a closed round (its aggregate has read them)."""
        folder = self.parts.spool_dir
        if folder.is_dir():
            for path in folder.glob("upload-*.bin"):
                path.unlink(missing_ok=True)
