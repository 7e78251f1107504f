"""A stopping client is bounded in time (`ClientConfig.stop_timeout_s`), whatever the
server does: against a fake server that freezes mid-call (its Push, Report or Join
never answers), a stop returns within the grace plus the Leave's own limit, where
without the bound the client waited out ``rpc_timeout_s`` (30 s by default) first."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers import RecordsLeaves, fake_fleet

from fedloom.client_sdk import Client, ClientRunner, EvaluateOutput, FitOutput
from fedloom.config import ClientConfig, TransferConfig
from fedloom.messages import PROTOCOL_VERSION, JoinReply, NoTask, Session, TaskHeader
from fedloom.payload import PayloadInfo, iter_chunks, serialize
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc
from fedloom.types import TaskKind
from fedloom.weights import Weights

CHUNK = 1024
#: The fake's calls that freeze hold for this long at most (the test ends them sooner).
FROZEN_S = 30.0


class FreezingFleet(RecordsLeaves, pb_grpc.FleetServicer):
    """Hands out one fit task, then holds every later Pull open; the calls named in
    ``freeze`` never answer (until ``thaw``); records what arrives."""

    def __init__(self, model: Weights, freeze: frozenset[str]) -> None:
        super().__init__()
        self.payload = bytes(serialize(model))
        info = PayloadInfo.describe(model.specs(), self.payload)
        self.tasks = [TaskHeader("t0", "run-1", 1, TaskKind.FIT, {"server_round": 1}, 10.0,
                                 info)]
        self.freeze = freeze
        self.entered: dict[str, threading.Event] = {
            name: threading.Event() for name in ("Join", "Push", "Report")}
        self.results: list[str] = []
        self.thawed = threading.Event()

    def _hold(self, name: str, context: Any) -> None:
        self.entered[name].set()
        if name in self.freeze:
            self.thawed.wait(FROZEN_S)

    def thaw(self) -> None:
        self.thawed.set()

    def Join(self, request: Any, context: Any) -> pb.JoinResponse:
        self._hold("Join", context)
        return codec.join_reply_to_proto(JoinReply(
            Session("c1", b"s" * 32), PROTOCOL_VERSION, frozenset({"fit", "inline"}), "run-1",
            5.0, 20.0,
            CHUNK, 64 * 1024, len(self.payload)))

    def Pull(self, request: Any, context: Any) -> Iterator[pb.PullResponse]:
        with self.lock:
            task = self.tasks.pop(0) if self.tasks else None
        if task is None:  # the next round never comes
            while context.is_active() and not self.thawed.is_set():
                time.sleep(0.02)
            yield codec.no_task_to_proto(NoTask(0.0, run_finished=True))
            return
        yield codec.task_to_proto(task)
        for offset, data in iter_chunks(self.payload, CHUNK):
            yield pb.PullResponse(chunk=pb.Chunk(offset=offset, data=data))

    def Report(self, request: pb.PushRequest, context: Any) -> pb.PushResponse:
        self._hold("Report", context)
        self._took(request.result)
        return pb.PushResponse(duplicate=False)

    def Push(self, request_iterator: Iterator[pb.PushRequest], context: Any) -> pb.PushResponse:
        first = next(request_iterator)
        self._hold("Push", context)
        for _ in request_iterator:
            pass
        self._took(first.result)
        return pb.PushResponse(duplicate=False)

    def _took(self, header: Any) -> None:
        with self.lock:
            self.results.append(codec.result_from_proto(header).task_id)



class StepClient(Client):
    """Adds 1 to every weight, after ``fit_s`` seconds; ``fitting`` is set as fit starts."""

    def __init__(self, fit_s: float = 0.0) -> None:
        self.fit_s = fit_s
        self.fitting = threading.Event()

    def fit(self, weights: Weights, config: Any) -> FitOutput:
        self.fitting.set()
        time.sleep(self.fit_s)
        return FitOutput(Weights({n: a + 1 for n, a in weights.items()}), 10)

    def evaluate(self, weights: Weights, config: Any) -> EvaluateOutput:
        return EvaluateOutput(0.5, 10)


def _config(address: str, model_bytes: int, stop_timeout_s: float) -> ClientConfig:
    transfer = TransferConfig(chunk_size=CHUNK, max_message_bytes=64 * 1024,
                              max_model_bytes=model_bytes)
    return ClientConfig(server_address=address, rpc_timeout_s=FROZEN_S,
                        stop_timeout_s=stop_timeout_s, reconnect_initial_s=0.05,
                        reconnect_max_s=0.2, transfer=transfer, insecure=True,
                        task_stream=False)


def _stop_when(runner: ClientRunner, event: threading.Event, stop: Any) -> float:
    """Run ``runner`` in a thread, call ``stop()`` once ``event`` is set; the seconds
    from the stop to ``run`` returning."""
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    assert event.wait(15), "the client never got that far"
    stopped = time.monotonic()
    stop()
    thread.join(FROZEN_S)
    assert not thread.is_alive(), "run() did not return"
    return time.monotonic() - stopped


# A 16-value model's update goes inline in one Report, a 1,000-value one (4 KB) in chunks
# through Push, and a 20k-value one (80 KB) through Push over a connection of its own
# (`separate_upload_connection`).
@pytest.mark.parametrize(("size", "call"), [(16, "Report"), (1000, "Push"), (20_000, "Push")])
def test_a_push_the_server_never_answers_is_cancelled_after_the_stops_grace(
        size: int, call: str, caplog: pytest.LogCaptureFixture) -> None:
    model = Weights({"w": np.zeros(size, np.float32)})
    fleet = FreezingFleet(model, freeze=frozenset({call}))
    with fake_fleet(fleet) as address:
        runner = ClientRunner(StepClient(), _config(address, model.nbytes, 0.5))
        with caplog.at_level(logging.WARNING, logger="fedloom.client"):
            took = _stop_when(runner, fleet.entered[call], runner.request_stop)
        fleet.thaw()
    assert 0.4 < took < 5.0  # the grace, then the Leave; not rpc_timeout_s (30 s)
    assert fleet.left == ["client stopping"]  # over a fresh channel: the old one is closed
    assert runner.stats.fits == 0  # the server never took it: not counted as sent
    assert any("still stopping after stop_timeout_s (0.5 s)" in r.getMessage()
               for r in caplog.records)


def test_a_push_that_answers_within_the_grace_goes_out() -> None:
    model = Weights({"w": np.zeros(16, np.float32)})
    fleet = FreezingFleet(model, freeze=frozenset({"Report"}))
    with fake_fleet(fleet) as address:
        runner = ClientRunner(StepClient(), _config(address, model.nbytes, 10.0))

        def stop_then_answer() -> None:
            runner.request_stop()
            threading.Timer(0.3, fleet.thaw).start()  # the server comes back in time

        took = _stop_when(runner, fleet.entered["Report"], stop_then_answer)
    assert took < 5.0
    assert fleet.results == ["t0"] and runner.stats.fits == 1
    assert fleet.left == ["client stopping"]


def test_a_fit_that_outlasts_the_grace_sends_nothing_but_the_leave() -> None:
    model = Weights({"w": np.zeros(16, np.float32)})
    fleet = FreezingFleet(model, freeze=frozenset())
    client = StepClient(fit_s=1.0)
    with fake_fleet(fleet) as address:
        runner = ClientRunner(client, _config(address, model.nbytes, 0.2))
        took = _stop_when(runner, client.fitting, runner.request_stop)
        fleet.thaw()
    assert 0.9 < took < 5.0  # the fit cannot be interrupted; nothing after it waits
    assert fleet.results == [] and fleet.left == ["client stopping"]


def test_a_join_the_server_never_answers_is_cancelled_after_the_grace() -> None:
    model = Weights({"w": np.zeros(16, np.float32)})
    fleet = FreezingFleet(model, freeze=frozenset({"Join"}))
    with fake_fleet(fleet) as address:
        runner = ClientRunner(StepClient(), _config(address, model.nbytes, 0.3))
        took = _stop_when(runner, fleet.entered["Join"], runner.request_stop)
        fleet.thaw()
    assert took < 5.0
    assert fleet.left == []  # no session to leave
    assert runner.stats.reconnects == 0


def test_setting_the_stop_event_ends_the_wait_for_a_task_at_once() -> None:
    """The application's own ``stop`` event, set from another thread, is seen while the
    client waits for a task (here for 20 s of long poll), not only after it."""
    model = Weights({"w": np.zeros(16, np.float32)})
    fleet = FreezingFleet(model, freeze=frozenset())
    stop = threading.Event()
    with fake_fleet(fleet) as address:
        runner = ClientRunner(StepClient(), _config(address, model.nbytes, 10.0), stop=stop)
        took = _stop_when(runner, fleet.entered["Report"], lambda: (time.sleep(0.3),
                                                                     stop.set()))
        fleet.thaw()
    assert took < 3.0
    assert fleet.results == ["t0"] and fleet.left == ["client stopping"]


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_a_stop_timeout_that_is_not_a_positive_number_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match="stop_timeout_s"):
        ClientConfig(server_address="127.0.0.1:1", insecure=True, stop_timeout_s=value)


def test_an_abort_is_not_bounded_again_by_the_watch(caplog: pytest.LogCaptureFixture) -> None:
    """abort() closes the connection itself: a fit that outlasts the grace after it is
    not reported as a stop past its grace."""
    model = Weights({"w": np.zeros(16, np.float32)})
    fleet = FreezingFleet(model, freeze=frozenset())
    client = StepClient(fit_s=0.8)
    with fake_fleet(fleet) as address:
        runner = ClientRunner(client, _config(address, model.nbytes, 0.2))
        with caplog.at_level(logging.WARNING, logger="fedloom.client"):
            took = _stop_when(runner, client.fitting, runner.abort)
        fleet.thaw()
    assert took < 5.0
    assert fleet.results == [] and fleet.left == []  # a killed process sends nothing
    assert not [r for r in caplog.records if "stop_timeout_s" in r.getMessage()]
