"""What a plain round does with an update once it has arrived whole: it reaches the
strategy under its client's session id, and an update whose round closed while its
checks ran is refused as stale rather than folded into a closed round."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import grpc
import pytest
from helpers import committed_models, run_to_end, scripted, small_weights
from ops_wire import connect, pull_task, push_zero_update

from fedloom import AggregateResult, ClientInfo, ClientUpdate, FitPlan, Weights
from fedloom.config import StrategyConfig
from fedloom.errors import AggregationError, RejectReason, ResultRefusedError
from fedloom.server import Server, plain_round
from fedloom.strategies import FedAvg


def _joined_ids(records: list[logging.LogRecord]) -> set[str]:
    """The session ids of the clients the server logged as joined."""
    return {r.getMessage().split(" ")[1] for r in records
            if r.getMessage().startswith("client ") and " joined; " in r.getMessage()}


def test_updates_reach_the_strategy_under_their_clients_session_ids(
        server_config, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    # FedProx names the updates that did not echo proximal_mu (these clients never do).
    config = server_config(num_rounds=1, min_clients=2, min_fit_clients=2,
                           fraction_evaluate=0.0,
                           strategy=StrategyConfig("fedprox", {"proximal_mu": 0.1}))
    handle = Server(config, initial_weights=small_weights()).start()
    with caplog.at_level(logging.INFO):
        history = run_to_end(handle, scripted(2))
    assert history[-1].status == "ok"
    warned = [r.getMessage() for r in caplog.records
              if "did not apply proximal_mu" in r.getMessage()]
    assert len(warned) == 1
    named = set(warned[0].rsplit(": ", 1)[1].split(", "))
    assert named == _joined_ids(caplog.records) and len(named) == 2


def test_an_update_whose_round_closed_during_its_checks_is_refused_as_stale(
        server_config, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    # Three tasks for a target of two: the first update to arrive is held in its checks
    # until the other two are in (the second of them closes the round), then let go.
    original = plain_round.check_decodes
    arrived: list[asyncio.Event] = []
    others_in = 0

    async def held_first(*args: Any) -> Any:
        nonlocal others_in
        if not arrived:
            arrived.append(asyncio.Event())
            await asyncio.wait_for(arrived[0].wait(), 30)
            return await original(*args)
        result = await original(*args)
        others_in += 1
        if others_in == 2:
            arrived[0].set()  # the round closes before the held fold resumes
        return result

    monkeypatch.setattr(plain_round, "check_decodes", held_first)
    config = server_config(num_rounds=1, min_clients=3, min_fit_clients=2,
                           fraction_fit=0.5, over_selection=1.5, fraction_evaluate=0.0)
    handle = Server(config, initial_weights=small_weights()).start()
    # The SDK sends this small update inside its result header (Report, "inline").
    with caplog.at_level(logging.WARNING, logger="fedloom.server"):
        history = run_to_end(handle, scripted(3))
    assert others_in == 2
    assert (history[-1].status, history[-1].num_updates) == ("ok", 2)
    stale = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Report rejected")]
    assert len(stale) == 1
    assert stale[0].endswith(f": the round closed while uploading ({RejectReason.STALE})")


class _HeldAggregation(FedAvg):
    """FedAvg whose round cannot end until ``release`` is set (its aggregation waits
    once it has every update)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.release = threading.Event()

    def aggregate_fit(self, server_round: int, current: Weights,
                      updates: Iterable[ClientUpdate]) -> AggregateResult:
        result = super().aggregate_fit(server_round, current, updates)
        assert self.release.wait(30)
        return result


@pytest.mark.parametrize("when", ["while the round ends", "after the round ended"])
def test_tasks_carry_the_rounds_deadline_and_a_result_after_the_round_closed_is_stale(
        server_config, when: str) -> None:  # type: ignore[no-untyped-def]
    # Three tasks for a target of two: the third result comes after the round closed,
    # while its aggregation still runs (its tasks still open) or once the next began.
    config = server_config(num_rounds=2, min_clients=3, min_fit_clients=2, fraction_fit=0.5,
                           over_selection=1.5, fraction_evaluate=0.0, round_timeout_s=25.0)
    strategy = _HeldAggregation(selection=config.selection)
    handle = Server(config, initial_weights=small_weights(), strategy=strategy).start()
    conns = [connect(handle.address, f"c{i}") for i in range(3)]
    try:
        tasks = [pull_task(conn) for conn in conns]
        assert [(task.round, task.deadline_s) for task, _ in tasks] == [(1, 25.0)] * 3
        for conn, (task, weights) in zip(conns[:2], tasks[:2], strict=True):
            push_zero_update(conn, task, weights)  # the second closes the round
        if when == "after the round ended":
            strategy.release.set()
            assert pull_task(conns[0])[0].round == 2
        with pytest.raises(ResultRefusedError) as late:
            push_zero_update(conns[2], *tasks[2])
        assert late.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "round 1 closed: enough results arrived (2 of 3 tasks)" in str(late.value)
    finally:
        strategy.release.set()
        handle.stop()
        handle.wait(30)
        for conn in conns:
            conn.close()


class _Watching(FedAvg):
    """FedAvg that records the model each round's configure_fit is given, and the round
    each aggregation is told."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.given: list[Weights] = []
        self.aggregated: list[int] = []

    def configure_fit(self, server_round: int, current: Weights,
                      clients: Sequence[ClientInfo]) -> FitPlan:
        self.given.append(current.copy())
        return super().configure_fit(server_round, current, clients)

    def aggregate_fit(self, server_round: int, current: Weights,
                      updates: Iterable[ClientUpdate]) -> AggregateResult:
        self.aggregated.append(server_round)
        return super().aggregate_fit(server_round, current, updates)


def test_a_strategy_plans_each_round_from_the_current_global_model(
        server_config) -> None:  # type: ignore[no-untyped-def]
    config = server_config(num_rounds=2, min_clients=2, min_fit_clients=2,
                           fraction_evaluate=0.0, keep_checkpoints=10)
    strategy = _Watching(selection=config.selection)
    handle = Server(config, initial_weights=small_weights(), strategy=strategy).start()
    history = run_to_end(handle, scripted(2))
    assert [r.status for r in history if r.round > 0] == ["ok", "ok"]
    models = committed_models(config.state_dir)
    assert len(strategy.given) == 2 and strategy.aggregated == [1, 2]
    for server_round, given in enumerate(strategy.given, start=1):
        assert given.allclose(models[server_round - 1], rtol=0, atol=0)


class _NamingAGhost(FedAvg):
    """FedAvg whose plan names, first, a client that is not connected."""

    def configure_fit(self, server_round: int, current: Weights,
                      clients: Sequence[ClientInfo]) -> FitPlan:
        plan = super().configure_fit(server_round, current, clients)
        return FitPlan(("0" * 16, *plan.client_ids), plan.config)


def test_a_planned_client_that_is_not_connected_leaves_the_others_their_tasks(
        server_config) -> None:  # type: ignore[no-untyped-def]
    config = server_config(num_rounds=1, min_clients=2, min_fit_clients=2,
                           fraction_evaluate=0.0)
    strategy = _NamingAGhost(selection=config.selection)
    handle = Server(config, initial_weights=small_weights(), strategy=strategy).start()
    history = run_to_end(handle, scripted(2))
    assert (history[-1].status, history[-1].num_updates) == ("ok", 2)


class _Refusing(FedAvg):
    """FedAvg whose aggregation gives up after taking every update."""

    def aggregate_fit(self, server_round: int, current: Weights,
                      updates: Iterable[ClientUpdate]) -> AggregateResult:
        for _ in updates:
            pass
        raise AggregationError("the updates disagree on everything")


def test_a_round_whose_aggregation_fails_is_logged_and_keeps_the_model(
        server_config, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    config = server_config(num_rounds=1, min_clients=2, min_fit_clients=2,
                           fraction_evaluate=0.0)
    strategy = _Refusing(selection=config.selection)
    handle = Server(config, initial_weights=small_weights(), strategy=strategy).start()
    with caplog.at_level(logging.WARNING, logger="fedloom.server"):
        history = run_to_end(handle, scripted(2))
    assert history[-1].status == "failed"
    assert history[-1].reason == "the updates disagree on everything"  # in the record too
    logged = [r.getMessage() for r in caplog.records if "round 1 failed" in r.getMessage()]
    assert logged == ["round 1 failed: the updates disagree on everything; the global model "
                      "is unchanged"]  # once
    # Every round failed: the run ends, but says loudly that it trained nothing.
    assert ("the run is over, but none of its 1 rounds produced a model: the final model is "
            "the initial one (last round: the updates disagree on everything)") in [
        r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert committed_models(config.state_dir)[1].allclose(small_weights(), rtol=0, atol=0)


def test_a_round_without_a_model_keeps_what_its_strategy_said(server_config) -> None:  # type: ignore[no-untyped-def]
    """Every update rejected by the norm bound: the round fails, and its record still
    says how many were rejected (it kept no fit metrics at all)."""
    config = server_config(num_rounds=1, min_clients=2, min_fit_clients=2,
                           fraction_evaluate=0.0,
                           strategy=StrategyConfig("fedavg", {"max_update_norm": 1e-9,
                                                              "norm_bound_mode": "reject"}))
    handle = Server(config, initial_weights=small_weights()).start()
    history = run_to_end(handle, scripted(2))
    assert history[-1].status == "failed"
    assert history[-1].fit["num_rejected"] == 2 and history[-1].fit["num_clipped"] == 0
