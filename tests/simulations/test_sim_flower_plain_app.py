"""A plain Flower ClientApp under the bridge runs without an ERROR log or a traceback.

The bridge asks nodes for their partition id only when their ClientApp answers that
query (`answers_identity_query`): a plain app has no handler for it, and Flower logs
every unhandled message as an ERROR with a traceback. The in-process tests show which
messages are sent; the Ray test runs examples/flower_clientapp as a user does and reads
everything the run printed, from the driver and from Ray's workers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from sim_fakegrid import FakeGrid
from test_sim_bridge import plain_flower_app, shift_app

from fedloom.config import SelectionConfig
from fedloom.simulations._records import weights_to_arrays
from fedloom.simulations.clock import SyncClock
from fedloom.simulations.flower_client import answers_identity_query
from fedloom.simulations.flower_strategy import FlowerStrategy
from fedloom.simulations.speed import SpeedModel
from fedloom.strategies import FedAvg
from fedloom.weights import Weights

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "flower_clientapp"


def test_only_apps_with_an_identity_handler_answer_the_query() -> None:
    hand_made = ClientApp()  # a Flower app that registers the handler itself

    @hand_made.query("fedloom_identity")
    def identity(message: Message, context: Context) -> Message:
        raise NotImplementedError

    assert answers_identity_query(shift_app())
    assert answers_identity_query(hand_made)
    assert not answers_identity_query(plain_flower_app())
    assert not answers_identity_query(ClientApp())


def test_without_identification_no_query_is_sent() -> None:
    grid = FakeGrid(plain_flower_app(), 3)
    bridge = FlowerStrategy(FedAvg(selection=SelectionConfig(fraction_evaluate=0.0)),
                            min_available_nodes=3, identify_nodes=False)
    bridge.start(grid, weights_to_arrays(Weights({"w": np.zeros(2, np.float32)})),
                 num_rounds=1)
    kinds = [m.metadata.message_type for m in grid.sent]
    assert kinds == ["train"] * 3
    assert not any(r.has_error() for r in grid.replies)
    assert sorted(i.client_id for i in bridge._client_of_node.values()) == sorted(
        f"node-{n}" for n in grid.node_ids)


def test_a_clock_needs_identified_nodes() -> None:
    # The clock's speed model is indexed by partition id, which only the query gives.
    with pytest.raises(ValueError, match="identify_nodes"):
        FlowerStrategy(FedAvg(), identify_nodes=False, clock=SyncClock(SpeedModel([1.0])))


# Runs the example's own script in a process of its own, with a logging handler that
# keeps every ERROR record of Flower's logger and of the root logger (Flower's stops
# propagating to the root under a running asyncio loop, so both are watched).
DRIVER = """
import json, logging, sys
errors = []

class KeepErrors(logging.Handler):
    def emit(self, record):
        if record not in errors:
            errors.append(record)

for name in ("", "flwr"):
    logging.getLogger(name).addHandler(KeepErrors(logging.ERROR))
import app
app.main(["--clients", "2", "--rounds", "1"])
print("ERROR RECORDS " + json.dumps([r.getMessage() for r in errors]))
"""


@pytest.mark.flower
def test_a_plain_flower_client_app_runs_without_error_logs() -> None:
    # Ray's workers import the ClientApp's module by name: PYTHONPATH reaches them.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(EXAMPLE), os.environ.get("PYTHONPATH")]))}
    process = subprocess.run(
        [sys.executable, "-c", DRIVER], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=180,
    )
    output = process.stdout
    assert process.returncode == 0, output[-4000:]
    assert "round 1: test accuracy" in output  # the run did happen
    marker = next(line for line in output.splitlines() if line.startswith("ERROR RECORDS "))
    assert json.loads(marker.removeprefix("ERROR RECORDS ")) == [], output[-4000:]
    assert "Traceback" not in output, output[-4000:]
