"""A client that keeps sending refused messages is quarantined for a while; honest
clients and honest mistakes (late results, expired sessions) are not."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from fuzz_wire import RawClient
from helpers import ScriptedClient, run_clients, small_weights

from fedloom import ServerConfig, Weights
from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.messages import ResultHeader
from fedloom.server import Server
from fedloom.server.quarantine import Quarantine

ServerConfigFactory = Callable[..., ServerConfig]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_strikes_within_the_window_quarantine_and_it_ends() -> None:
    clock = FakeClock()
    q = Quarantine(after=3, duration_s=10.0, clock=clock)
    assert not q.strike("a", RejectReason.INVALID)
    clock.now += 11  # the first strike has aged out of the window
    assert not q.strike("a", RejectReason.INVALID)
    assert not q.strike("a", RejectReason.CONFLICT)
    q.check("a")  # two live strikes: not yet
    assert q.strike("a", RejectReason.TIMEOUT)
    with pytest.raises(MessageRejectedError) as info:
        q.check("a")
    assert info.value.reason is RejectReason.QUARANTINED and "retry in 10 s" in str(info.value)
    q.check("b")  # others are not affected
    clock.now += 10.5
    q.check("a")
    assert q.remaining_s("a") == 0.0


def test_honest_mistakes_are_not_strikes_and_zero_disables() -> None:
    q = Quarantine(after=1, duration_s=10.0, clock=FakeClock())
    for reason in (RejectReason.STALE, RejectReason.UNKNOWN_CLIENT, RejectReason.QUARANTINED):
        assert not q.strike("a", reason)
    off = Quarantine(after=0, duration_s=10.0)
    assert not any(off.strike("a", RejectReason.INVALID) for _ in range(100))
    off.check("a")


def test_memory_stays_bounded_under_a_flood_of_names() -> None:
    q = Quarantine(after=2, duration_s=10.0, clock=FakeClock(), max_tracked=50)
    for i in range(10_000):
        q.strike(f"name-{i}", RejectReason.INVALID)
    assert len(q._strikes) <= 50
    for i in range(10_000):
        q.strike(f"name-{i}", RejectReason.INVALID)
        q.strike(f"name-{i}", RejectReason.INVALID)
    assert len(q._until) <= 50


def _bad_header(raw: RawClient, task) -> tuple[ResultHeader, bytes]:  # type: ignore[no-untyped-def]
    nan = Weights({"w": np.full((4, 3), np.nan, np.float32), "b": np.zeros(3, np.float32)})
    return raw.fit_result(task, nan)


def test_a_client_sending_garbage_is_quarantined_and_the_round_goes_on(
    server_config: ServerConfigFactory,
) -> None:
    config = server_config(
        num_rounds=1, min_clients=3, min_fit_clients=2, quarantine_after=3, quarantine_s=2.0
    )
    handle = Server(config, initial_weights=small_weights()).start()
    raw = RawClient(handle.address, name="mallory")
    threads = run_clients(
        handle.address, [ScriptedClient(seed=i, num_examples=2) for i in range(2)]
    )
    task = raw.pull_task()
    header, payload = _bad_header(raw, task)
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as info:
            raw.push(header, [(0, payload)])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The third strike ended its session; joining again under its name is refused.
    with pytest.raises(grpc.RpcError) as info:
        raw.push(header, [(0, payload)])
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        RawClient(handle.address, name="mallory")
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "quarantined" in (info.value.details() or "")
    history = handle.wait(60)
    for t in threads:
        t.join(10)
    assert history[-1].status == "ok" and history[-1].num_updates == 2
    assert history[-1].duration_s < 10  # its dropped task did not hold the round open
    assert handle.server.coordinator is not None
    assert handle.server.coordinator.quarantine.remaining_s("c0") == 0.0  # honest: untouched


def test_the_quarantine_ends_and_the_client_may_join_again(
    server_config: ServerConfigFactory,
) -> None:
    config = server_config(
        num_rounds=3, min_clients=1, min_fit_clients=1, quarantine_after=2, quarantine_s=1.0
    )
    handle = Server(config, initial_weights=small_weights()).start()
    raw = RawClient(handle.address, name="flaky")
    task = raw.pull_task()
    header, payload = _bad_header(raw, task)
    for _ in range(2):
        with pytest.raises(grpc.RpcError):
            raw.push(header, [(0, payload)])
    with pytest.raises(grpc.RpcError) as info:
        RawClient(handle.address, name="flaky")
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    time.sleep(1.2)
    again = RawClient(handle.address, name="flaky")  # admitted: the quarantine is over
    assert again.session.client_id != raw.session.client_id
    handle.stop()
    handle.wait(10)
