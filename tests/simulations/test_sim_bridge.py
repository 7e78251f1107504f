"""The Flower bridges, driven by Flower's own ``Strategy.start`` over an in-process grid.

Flower's message-API FedAvg is the oracle for the aggregation; the local engine is the
oracle for the round sequence (sampling, seeds, configs): same job, same weights.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from sim_fakegrid import FakeGrid
from test_sim_local import ShiftClient

from fedloom.client_sdk import FitOutput
from fedloom.config import SelectionConfig
from fedloom.simulations._records import arrays_to_weights, weights_to_arrays
from fedloom.simulations.clock import SyncClock
from fedloom.simulations.flower_client import partition_id, to_client_app
from fedloom.simulations.flower_strategy import FlowerStrategy
from fedloom.simulations.job import Job
from fedloom.simulations.local_engine import run_local
from fedloom.simulations.runner import job_client_app
from fedloom.simulations.scenario import Scenario
from fedloom.simulations.speed import SpeedModel
from fedloom.strategies import FedAvg
from fedloom.types import Config
from fedloom.weights import Weights


class FixedShiftClient(ShiftClient):
    """Client i moves every weight by i + 1 whatever the seed."""

    nan = False

    def fit(self, weights: Weights, config: Config) -> FitOutput:
        out = super().fit(weights, {**config, "seed": 0})
        if self.nan:
            return FitOutput(Weights((k, v * np.nan) for k, v in out.weights.items()), 1)
        return out


def shift_app(fail: frozenset[int] = frozenset(), nan: frozenset[int] = frozenset()) -> ClientApp:
    def client_fn(ctx: Context) -> FixedShiftClient:
        client = FixedShiftClient(partition_id(ctx), partition_id(ctx) in fail)
        client.nan = partition_id(ctx) in nan
        return client

    return to_client_app(client_fn)


def test_records_round_trip_keeps_names_order_and_dtypes() -> None:
    w = Weights([("b", np.arange(3, dtype=np.int64)), ("a", np.ones((2, 2), np.float32))])
    back = arrays_to_weights(weights_to_arrays(w))
    assert list(back) == ["b", "a"] and back["b"].dtype == np.int64
    assert back.allclose(w, 0, 0)


def test_bridge_under_flower_start_equals_the_local_engine() -> None:
    scenario = Scenario(num_clients=8, clients_per_round=3, rounds=3, seed=4,
                        evaluate_clients_per_round=2, progress=False)
    job = Job.from_scenario(scenario)
    initial = job.initial_weights()
    seen: list[tuple[int, int]] = []
    bridge = FlowerStrategy(
        job.build_strategy(), base_seed=scenario.seed, fit_defaults=job.fit_defaults(),
        min_available_nodes=8,
        on_fit_round=lambda r, res, f: seen.append((r, res.num_updates)),
    )
    grid = FakeGrid(job_client_app(job), 8)
    result = bridge.start(grid, weights_to_arrays(initial), num_rounds=3)
    local = run_local(
        job.build_strategy(), lambda i: job.make_client(i), initial,
        num_clients=8, num_rounds=3, base_seed=scenario.seed, fit_defaults=job.fit_defaults(),
    )
    assert local.weights is not None
    assert arrays_to_weights(result.arrays).allclose(local.weights, rtol=0, atol=0)
    assert seen == [(1, 3), (2, 3), (3, 3)]
    for r in (1, 2, 3):
        ours = result.train_metrics_clientapp[r]
        assert ours["train_loss"] == local.rounds[r].get("train_loss")
        assert ours["num-failures"] == 0
        assert result.evaluate_metrics_clientapp[r]["loss"] == local.rounds[r].get(
            "federated_loss")
    # One identity query per node, once; then 3 train + 2 evaluate messages per round.
    kinds = [m.metadata.message_type for m in grid.sent]
    assert kinds.count("query.fedloom_identity") == 8
    assert kinds.count("train") == 9 and kinds.count("evaluate") == 6


def test_fedloom_fedavg_matches_flowers_fedavg() -> None:
    # All 5 nodes train (Flower samples at random; with fraction 1 both take everyone).
    initial = Weights({"w": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3),
                       "b": np.zeros(3, np.float32)})
    ours = FlowerStrategy(FedAvg(), min_available_nodes=5).start(
        FakeGrid(shift_app(), 5), weights_to_arrays(initial), num_rounds=2)
    theirs = FlowerFedAvg(fraction_evaluate=0.0, min_available_nodes=5).start(
        FakeGrid(shift_app(), 5), weights_to_arrays(initial), num_rounds=2)
    # Our ClientApp also ran under Flower's FedAvg; its result is the oracle for our math.
    assert arrays_to_weights(ours.arrays).allclose(arrays_to_weights(theirs.arrays),
                                                   rtol=1e-6, atol=1e-6)


def test_failed_and_non_finite_replies_are_skipped() -> None:
    initial = Weights({"w": np.zeros(2, np.float32)})
    failures: list[int] = []
    bridge = FlowerStrategy(FedAvg(), min_available_nodes=4,
                            on_fit_round=lambda r, res, f: failures.append(f))
    app = shift_app(fail=frozenset({1}), nan=frozenset({2}))
    result = bridge.start(FakeGrid(app, 4), weights_to_arrays(initial), num_rounds=1)
    assert failures == [2]
    assert result.train_metrics_clientapp[1]["num_updates"] == 2
    # FedAvg of clients 0 and 3 only: shifts 1 and 4, weights 1 and 4 -> 17 / 5.
    np.testing.assert_allclose(arrays_to_weights(result.arrays)["w"], [3.4, 3.4], rtol=1e-6)


def plain_flower_app() -> ClientApp:
    """A Flower ClientApp written the Flower way: no identity handler."""
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        arrays = message.content["arrays"]
        assert isinstance(arrays, ArrayRecord)
        server_round = message.content["config"]["server-round"]  # as Flower's apps read it
        assert isinstance(server_round, int) and server_round >= 1
        new = [a + 1.0 for a in arrays.to_numpy_ndarrays()]
        record = ArrayRecord({k: v for k, v in zip(arrays.keys(), ArrayRecord(new).values(),
                                                    strict=True)})
        content = RecordDict({"arrays": record, "metrics": MetricRecord({"num-examples": 2})})
        return Message(content, reply_to=message)

    return app


def test_plain_flower_client_app_under_the_bridge() -> None:
    initial = Weights({"w": np.zeros(2, np.float32)})
    bridge = FlowerStrategy(FedAvg(selection=SelectionConfig(fraction_fit=0.5, min_fit_clients=1)),
                            min_available_nodes=4)
    grid = FakeGrid(plain_flower_app(), 4)
    result = bridge.start(grid, weights_to_arrays(initial), num_rounds=2,
                          train_config=ConfigRecord({"lr": 0.1}))
    np.testing.assert_allclose(arrays_to_weights(result.arrays)["w"], [2.0, 2.0])
    ids = sorted(info.client_id for info in bridge._client_of_node.values())
    assert ids == sorted(f"node-{n}" for n in grid.node_ids)
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert len(train) == 4
    config = train[0].content["config"]
    assert config["lr"] == 0.1 and "seed" in config
    assert [m.content["config"]["server-round"] for m in train] == [1, 1, 2, 2]


def test_two_nodes_with_one_partition_are_refused() -> None:
    grid = FakeGrid(shift_app(), 2)
    for context in grid.contexts.values():
        context.node_config["partition-id"] = 0
    bridge = FlowerStrategy(FedAvg(), min_available_nodes=2)
    with pytest.raises(ValueError, match="claim partition 0"):
        bridge.start(grid, weights_to_arrays(Weights({"w": np.zeros(1)})), num_rounds=1)


@pytest.mark.parametrize(
    ("server", "client"),
    [("fedloom_server_app", "flower_client_app"), ("flower_server_app", "fedloom_client_app")],
)
def test_documented_examples_run_in_both_directions(server: str, client: str) -> None:
    from fedloom.simulations import flower_examples

    grid = FakeGrid(getattr(flower_examples, client), 6)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config={"num-rounds": 2, "fraction-train": 0.5})
    getattr(flower_examples, server)(grid, context)
    # fedloom_server_app sends a plain Flower ClientApp no identity query: no error reply.
    train = [r for r in grid.replies if r.metadata.message_type == "train"]
    assert len(train) == 6 and not any(r.has_error() for r in grid.replies)


def test_the_bridge_times_rounds_and_over_selects_as_the_local_engine() -> None:
    """Under a virtual clock with over-selection the bridge sends train messages only to
    the clients that would answer first, and keeps the local engine's clock and model."""
    durations = [3.0, 1.0, 4.5, 2.0, 6.0, 0.5, 5.0, 2.5]

    def strategy() -> FedAvg:
        return FedAvg(selection=SelectionConfig(fraction_fit=0.5, min_fit_clients=4,
                                                fraction_evaluate=0.0, seed=2))

    def clock() -> SyncClock:
        return SyncClock(SpeedModel(durations), over_selection=1.5, seed=9)

    initial = Weights({"w": np.linspace(0, 1, 4)})
    flower_clock, seen = clock(), []
    bridge = FlowerStrategy(
        strategy(), min_available_nodes=8, clock=flower_clock,
        on_fit_round=lambda r, res, f: seen.append((flower_clock.now, res.num_updates)))
    grid = FakeGrid(shift_app(), 8)
    result = bridge.start(grid, weights_to_arrays(initial), num_rounds=3)
    local = run_local(strategy(), [FixedShiftClient(i) for i in range(8)].__getitem__,
                      initial, num_clients=8, num_rounds=3, clock=clock())
    assert local.weights is not None
    assert arrays_to_weights(result.arrays).allclose(local.weights, rtol=0, atol=0)
    assert seen == [(r.get("virtual_time_s"), 4) for r in local.rounds[1:]]
    assert [r.num_cancelled for r in local.rounds[1:]] == [2, 2, 2]
    assert [m.metadata.message_type for m in grid.sent].count("train") == 12  # 4 a round
