"""The bridge's identity query survives nodes that answer late or with an error.

On a busy machine a node's first answer to ``query.fedloom_identity`` can be an error
(or miss the deadline) while Ray starts its workers. The bridge asks such nodes again
within ``identify_timeout``; a node that never answers falls back to its node id, which
a virtual clock cannot use, so with a clock the run stops with a clear error instead
of indexing the speed model with a node id.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest
from flwr.app import Error, Message
from sim_fakegrid import FakeGrid
from test_sim_bridge import shift_app

from fedloom.config import SelectionConfig
from fedloom.simulations._records import IDENTITY_MESSAGE_TYPE, weights_to_arrays
from fedloom.simulations.clock import SyncClock
from fedloom.simulations.flower_strategy import FlowerStrategy
from fedloom.simulations.speed import SpeedModel
from fedloom.strategies import FedAvg
from fedloom.weights import Weights


class FlakyGrid(FakeGrid):
    """Identity queries to ``flaky`` nodes fail their first ``failures`` times."""

    def __init__(self, num_nodes: int, flaky: set[int], failures: int) -> None:
        super().__init__(shift_app(), num_nodes)
        self.flaky = {self.node_ids[k] for k in flaky}
        self.failures = failures
        self.asked: dict[int, int] = {}

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        passed, failed = [], []
        for message in messages:
            node = message.metadata.dst_node_id
            if message.metadata.message_type == IDENTITY_MESSAGE_TYPE:
                self.asked[node] = self.asked.get(node, 0) + 1
                if node in self.flaky and self.asked[node] <= self.failures:
                    self.sent.append(message)
                    failed.append(Message(Error(code=1, reason="worker not ready"),
                                          reply_to=message))
                    continue
            passed.append(message)
        return [*super().send_and_receive(passed, timeout=timeout), *failed]


def _start(grid: FakeGrid, clock: SyncClock | None = None) -> FlowerStrategy:
    bridge = FlowerStrategy(FedAvg(selection=SelectionConfig(fraction_evaluate=0.0)),
                            min_available_nodes=len(grid.node_ids), clock=clock)
    bridge.start(grid, weights_to_arrays(Weights({"w": np.zeros(2, np.float32)})),
                 num_rounds=1)
    return bridge


def test_a_node_that_first_answers_with_an_error_is_asked_again() -> None:
    grid = FlakyGrid(4, flaky={1, 3}, failures=2)
    bridge = _start(grid)
    # Every node is known by its partition id, not its node id.
    assert sorted(i.client_id for i in bridge._client_of_node.values()) == ["0", "1", "2", "3"]
    assert [grid.asked[n] for n in grid.node_ids] == [1, 3, 1, 3]


def test_with_a_clock_a_node_that_never_answers_stops_the_run_clearly() -> None:
    grid = FlakyGrid(3, flaky={2}, failures=10**6)
    clock = SyncClock(SpeedModel([1.0, 1.0, 1.0]))
    with pytest.raises(RuntimeError, match="did not say their partition-id"):
        _start(grid, clock)
