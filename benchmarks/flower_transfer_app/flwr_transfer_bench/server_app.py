"""ServerApp: Flower's message-API FedAvg, fit only, timing the end of every round.

Writes ``{"round_ends": [...], "start": t0}`` (``time.time()`` stamps) to the run
config's ``out-file`` when the run ends (atomically); `evaluate_fn` is Flower's own per-round hook
and is used only as a clock.
"""

from __future__ import annotations

import json
import os
import time

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from flwr_transfer_bench.model import initial_arrays

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    num_params = int(config["num-params"])
    num_nodes = int(config["num-nodes"])
    stamps: list[float] = []

    def clock(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        stamps.append(time.time())
        return None

    strategy = FedAvg(
        fraction_train=1.0,
        fraction_evaluate=0.0,
        min_train_nodes=num_nodes,
        min_evaluate_nodes=0,
        min_available_nodes=num_nodes,
    )
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(initial_arrays(num_params)),
        num_rounds=int(config["num-rounds"]),
        evaluate_fn=clock,
    )
    out = str(config["out-file"])
    if out:  # written whole, then renamed: the benchmark waits for the name
        with open(out + ".tmp", "w") as fh:
            json.dump({"start": stamps[0], "round_ends": stamps[1:]}, fh)
        os.replace(out + ".tmp", out)
