"""Stragglers and churn: deadlines, over-selection, heartbeats, clients joining late."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
import time
from fractions import Fraction

import pytest
from helpers import ScriptedClient, run_clients, small_weights
from ops_wire import connect, pull_task, push_zero_update, wait_for

from fedloom import TaskKind
from fedloom.client_sdk.connection import ResultRefusedError
from fedloom.errors import ConfigError
from fedloom.messages import TaskHeader
from fedloom.payload import PayloadInfo, serialize
from fedloom.server import Server
from fedloom.server.rounds import IssuedTask, RoundTasks
from fedloom.server.stragglers import over_select
from fedloom.types import ClientInfo, EvaluateResult


def _infos(n: int) -> list[ClientInfo]:
    return [ClientInfo(f"id{i:03d}", f"c{i:03d}", frozenset({"fit"})) for i in range(n)]


# -- over_select, on its own -------------------------------------------------------------
def test_over_select_adds_the_ceiling_of_the_factor_from_outside_the_plan() -> None:
    clients = _infos(20)
    planned = ("id003", "id007", "id011")
    s = over_select(planned, clients, 1.5, seed=4, server_round=2)
    assert s.target == 3
    assert s.client_ids[:3] == planned  # the strategy's choice comes first, unchanged
    assert len(s.client_ids) == 5  # ceil(3 * 1.5)
    assert len(set(s.client_ids)) == 5
    assert set(s.client_ids) <= {c.client_id for c in clients}


@pytest.mark.parametrize(
    ("target", "factor"),
    # target * factor is an integer, but the float product lands just above it
    # (10 * 1.1 = 11.000000000000002): a bare ceil would add one client too many
    [(10, 1.1), (100, 1.1), (1000, 1.1), (20, 1.15), (7, 1.3), (5, 1.2), (3, 1.5)],
)
def test_over_select_rounds_the_decimal_factor_up_not_the_float_error(target: int,
                                                                     factor: float) -> None:
    clients = _infos(2 * target + 5)
    planned = tuple(c.client_id for c in clients[:target])
    wanted = math.ceil(Fraction(str(factor)) * target)  # exact decimal arithmetic
    s = over_select(planned, clients, factor, seed=0, server_round=1)
    assert len(s.client_ids) == wanted and s.target == target


def test_over_select_is_capped_by_the_connected_clients_and_off_at_one() -> None:
    clients = _infos(4)
    planned = ("id000", "id001", "id002")
    assert len(over_select(planned, clients, 3.0, seed=0, server_round=1).client_ids) == 4
    assert over_select(planned, clients, 1.0, seed=0, server_round=1).client_ids == planned
    everyone = tuple(c.client_id for c in clients)
    assert over_select(everyone, clients, 2.0, seed=0, server_round=1).client_ids == everyone


def test_over_select_depends_on_seed_and_round_not_on_join_order() -> None:
    clients = _infos(50)
    planned = ("id000",)
    a = over_select(planned, clients, 10.0, seed=1, server_round=3)
    b = over_select(planned, list(reversed(clients)), 10.0, seed=1, server_round=3)
    assert a == b  # a resumed run (clients rejoin in any order) draws alike
    draws = {over_select(planned, clients, 10.0, seed=1, server_round=r).client_ids for r in (1, 2)}
    assert len(draws) == 2  # a fresh draw per round


def _evaluate_phase(num_tasks: int, target: int | None) -> tuple[RoundTasks, list[IssuedTask]]:
    info = PayloadInfo.describe(small_weights().specs(), serialize(small_weights()))
    phase = RoundTasks(1, TaskKind.EVALUATE, minimum=1, target=target)
    tasks = []
    for i in range(num_tasks):
        header = TaskHeader(f"t{i}", "run", 1, TaskKind.EVALUATE, {}, 10.0, info)
        tasks.append(IssuedTask(header, f"c{i}", memoryview(b"")))
        phase.add(tasks[-1])
    return phase, tasks


def test_a_phase_closes_the_moment_its_target_is_reached() -> None:
    phase, tasks = _evaluate_phase(4, target=2)
    for task in tasks[:2]:
        phase.accept_evaluation(task, EvaluateResult(task.client_id, 1, 0.5), b"f")
    assert phase.closed  # at once: a result arriving before `wait` wakes is not taken
    assert phase.end_reason(tasks[2]).startswith("enough results arrived (2 of 4")
    enough = asyncio.run(phase.wait(5.0))
    assert enough and phase.num_cancelled == 2 and not phase.failures
    assert phase.outcomes() == {"pending": 0, "accepted": 2, "failed": 0, "cancelled": 2}


def test_without_a_target_a_phase_waits_for_everyone_or_the_deadline() -> None:
    phase, tasks = _evaluate_phase(3, target=None)
    phase.accept_evaluation(tasks[0], EvaluateResult("c0", 1, 0.5), b"f")
    phase.fail(tasks[1], "client failure: out of memory")
    assert not phase.closed
    assert asyncio.run(phase.wait(0.2))  # the deadline: one accepted, minimum 1
    assert phase.failures == {
        "c1": "client failure: out of memory",
        "c2": "no result before the deadline",
    }
    assert phase.num_cancelled == 0
    assert phase.end_reason(tasks[2]) == "no result before the deadline"


def test_over_selection_below_one_is_refused(server_config) -> None:
    with pytest.raises(ConfigError, match="over_selection"):
        server_config(over_selection=0.9)


# -- over the wire, with the SDK's Connection -----------------------------------------------
def test_over_selection_closes_with_the_first_enough_and_late_pushes_hear_round_closed(
    server_config,
) -> None:
    # 4 connected; the strategy samples half (2); over_selection 2 issues 4 tasks.
    config = server_config(
        num_rounds=2,
        min_clients=4,
        min_fit_clients=2,
        fraction_fit=0.5,
        fraction_evaluate=0.0,
        over_selection=2.0,
    )
    handle = Server(config, initial_weights=small_weights()).start()
    conns = [connect(handle.address, f"c{i}") for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        tasks = list(pool.map(pull_task, conns))
    assert len({t.task_id for t, _ in tasks}) == 4  # every over-selected client got a task
    for conn, (task, weights) in zip(conns[:2], tasks[:2], strict=True):
        assert push_zero_update(conn, task, weights) is False
    coordinator = handle.server.coordinator
    assert coordinator is not None
    wait_for(lambda: len(coordinator.history) >= 1)  # round 2 is open now
    record = coordinator.history[0]
    assert record.status == "ok"
    assert (record.num_sampled, record.num_updates) == (4, 2)
    assert (record.num_cancelled, record.num_failures) == (2, 0)
    for conn, (task, weights) in zip(conns[2:], tasks[2:], strict=True):
        with pytest.raises(ResultRefusedError, match="round 1 closed: enough results") as info:
            push_zero_update(conn, task, weights)
        assert info.value.code.name == "FAILED_PRECONDITION"
    handle.stop()
    handle.wait(10)
    for conn in conns:
        conn.close()


def test_the_deadline_closes_a_round_with_the_minimum_and_a_late_push_hears_why(
    server_config,
) -> None:
    config = server_config(
        num_rounds=2,
        min_clients=3,
        min_fit_clients=2,
        fraction_evaluate=0.0,
        round_timeout_s=1.5,
    )
    handle = Server(config, initial_weights=small_weights()).start()
    conns = [connect(handle.address, f"c{i}") for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        tasks = list(pool.map(pull_task, conns))
    for conn, (task, weights) in zip(conns[:2], tasks[:2], strict=True):
        push_zero_update(conn, task, weights)
    # the third sits on its task (and heartbeats) past the deadline
    coordinator = handle.server.coordinator
    assert coordinator is not None
    started = time.monotonic()
    while not coordinator.history:
        assert time.monotonic() - started < 10
        conns[2].heartbeat()
        time.sleep(0.1)
    record = coordinator.history[0]
    assert record.status == "ok"
    assert (record.num_updates, record.num_failures) == (2, 1)
    assert 1.4 < record.duration_s < 5.0
    with pytest.raises(ResultRefusedError, match="round 1 closed: no result before the deadline"):
        push_zero_update(conns[2], *tasks[2])
    handle.stop()
    handle.wait(10)
    for conn in conns:
        conn.close()


class SlowClient(ScriptedClient):
    """Trains for ``seconds`` (longer than the server's client timeout)."""

    def __init__(self, seed: int, seconds: float) -> None:
        super().__init__(seed, num_examples=4)
        self.seconds = seconds

    def fit(self, weights, config):  # type: ignore[no-untyped-def]
        time.sleep(self.seconds)
        return super().fit(weights, config)


def test_heartbeats_keep_a_slow_client_and_silence_drops_a_sampled_one(server_config) -> None:
    config = server_config(
        num_rounds=1,
        min_clients=3,
        min_fit_clients=2,
        fraction_evaluate=0.0,
        long_poll_s=0.5,
        heartbeat_interval_s=0.2,
        client_timeout_s=1.0,
        round_timeout_s=30.0,
    )
    handle = Server(config, initial_weights=small_weights()).start()
    silent = connect(handle.address, "silent")  # joins, then never calls again
    fast, slow = ScriptedClient(seed=0, num_examples=4), SlowClient(seed=1, seconds=2.5)
    threads = run_clients(handle.address, [fast, slow])
    history = handle.wait(30)
    for t in threads:
        t.join(10)
    record = history[-1]
    assert record.status == "ok"
    # The silent client's task failed when it was dropped, well before round_timeout_s;
    # the slow client outlived client_timeout_s (2.5 s > 1 s) on heartbeats alone.
    assert (record.num_sampled, record.num_updates, record.num_failures) == (3, 2, 1)
    assert record.duration_s < 15.0
    assert len(slow.sent) == 1
    coordinator = handle.server.coordinator
    assert coordinator is not None
    assert silent.session is not None
    assert silent.session.client_id not in coordinator.registry
    silent.close()


def test_a_client_joining_between_rounds_is_sampled_in_later_rounds(server_config) -> None:
    config = server_config(num_rounds=4, min_clients=2, min_fit_clients=2, fraction_evaluate=0.0)
    handle = Server(config, initial_weights=small_weights()).start()
    early = [SlowClient(seed=i, seconds=0.3) for i in range(2)]
    threads = run_clients(handle.address, early)
    coordinator = handle.server.coordinator
    assert coordinator is not None
    wait_for(lambda: len(coordinator.history) >= 1)
    late = SlowClient(seed=9, seconds=0.3)
    late_thread = threading.Thread(
        target=lambda: run_clients(handle.address, [late])[0].join(30), daemon=True
    )
    late_thread.start()
    history = handle.wait(60)
    for t in [*threads, late_thread]:
        t.join(10)
    assert [r.status for r in history] == ["ok"] * 4
    assert history[0].num_sampled == 2
    assert history[-1].num_sampled == 3  # it joined, and fraction_fit = 1 takes it
    rounds_late = sorted(r for r, _, _ in late.sent)
    assert rounds_late and rounds_late[0] >= 2
    assert all(r.num_failures == 0 for r in history)
