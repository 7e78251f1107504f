"""`ClientRunner`'s public seams: middleware around each task, ``on_pushed`` after each
push, and `ClientRunner.abort`, driven against a scripted fake server that records what
it was sent (results, Leaves)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from helpers import RecordsLeaves, fake_fleet

from fedloom.client_sdk import (
    CallNext,
    Client,
    ClientRunner,
    EvaluateOutput,
    FitOutput,
    TaskContext,
    TaskResult,
    start_client,
)
from fedloom.config import ClientConfig, TransferConfig
from fedloom.messages import PROTOCOL_VERSION, JoinReply, NoTask, ResultHeader, Session, TaskHeader
from fedloom.payload import PayloadInfo, iter_chunks, serialize
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc
from fedloom.types import TaskKind
from fedloom.weights import Weights

MODEL = Weights({"w": np.zeros(8, np.float32)})
FIT, EVALUATE = TaskKind.FIT, TaskKind.EVALUATE


class ScriptedFleet(RecordsLeaves, pb_grpc.FleetServicer):
    """Hands out the scripted tasks, one per Pull, then says the run is finished (or,
    with ``finish=False``, holds the next Pull open); records results and Leaves."""

    def __init__(self, kinds: list[TaskKind], refuse: frozenset[str] = frozenset(),
                 finish: bool = True) -> None:
        super().__init__()
        payload = bytes(serialize(MODEL))
        info = PayloadInfo.describe(MODEL.specs(), payload)
        self.tasks = [TaskHeader(f"t{i}", "run-1", i + 1, kind, {"server_round": i + 1}, 10.0,
                                 info) for i, kind in enumerate(kinds)]
        self.payload, self.refuse, self.finish = payload, refuse, finish
        self.results: list[ResultHeader] = []

    def Join(self, request: Any, context: Any) -> pb.JoinResponse:
        return codec.join_reply_to_proto(JoinReply(
            Session("c1", b"s" * 32), PROTOCOL_VERSION, frozenset({"fit"}), "run-1", 5.0, 1.0,
            1024, 64 * 1024, 4096))

    def Pull(self, request: Any, context: Any) -> Iterator[pb.PullResponse]:
        with self.lock:
            task = self.tasks.pop(0) if self.tasks else None
        if task is None:
            while not self.finish and context.is_active():
                time.sleep(0.02)
            yield codec.no_task_to_proto(NoTask(0.0, run_finished=True))
            return
        yield codec.task_to_proto(task)
        for offset, data in iter_chunks(self.payload, 1024):
            yield pb.PullResponse(chunk=pb.Chunk(offset=offset, data=data))

    def Tasks(self, request: Any, context: Any) -> Iterator[pb.PullResponse]:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "this fake serves Pull only")
        yield from ()

    def Report(self, request: pb.PushRequest, context: Any) -> pb.PushResponse:
        self._take(request.result, context)
        return pb.PushResponse(duplicate=False)

    def Push(self, request_iterator: Iterator[pb.PushRequest], context: Any) -> pb.PushResponse:
        messages = list(request_iterator)
        self._take(messages[0].result, context)
        return pb.PushResponse(duplicate=False)

    def _take(self, header: Any, context: Any) -> None:
        result = codec.result_from_proto(header)
        with self.lock:
            self.results.append(result)
        if result.task_id in self.refuse:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused for the test")


    def outcome(self) -> list[tuple[str, TaskKind | None, str]]:
        """(task id, kind, failure) of each result received."""
        return [(r.task_id, r.kind, r.failure) for r in self.results]


class StepClient(Client):
    """Adds 1 to every weight; logs its calls into ``log``; ``fit_error`` makes fit raise."""

    def __init__(self, log: list[str] | None = None,
                 fit_error: BaseException | None = None) -> None:
        self.log = log if log is not None else []
        self.fit_error = fit_error

    def fit(self, weights: Weights, config: Any) -> FitOutput:
        self.log.append("fit")
        if self.fit_error is not None:
            raise self.fit_error
        return FitOutput(Weights({n: a + 1 for n, a in weights.items()}), 10)

    def evaluate(self, weights: Weights, config: Any) -> EvaluateOutput:
        self.log.append("evaluate")
        return EvaluateOutput(0.5, 10)


def _config(address: str) -> ClientConfig:
    transfer = TransferConfig(chunk_size=1024, max_message_bytes=64 * 1024, max_model_bytes=4096)
    return ClientConfig(server_address=address, rpc_timeout_s=5.0, reconnect_initial_s=0.05,
                        reconnect_max_s=0.2, max_reconnect_attempts=3, transfer=transfer,
                        insecure=True, task_stream=False)


def _run(fleet: ScriptedFleet, client: Client, **seams: Any) -> ClientRunner:
    """Run ``client`` against ``fleet`` until the run finishes (or the runner stops)."""
    with fake_fleet(fleet) as address:
        runner = ClientRunner(client, _config(address), **seams)
        runner.run()
    return runner


def _tracing(log: list[str], name: str) -> Callable[[TaskContext, CallNext], TaskResult]:
    def middleware(context: TaskContext, call_next: CallNext) -> TaskResult:
        log.append(f"{name}>")
        result = call_next(context)
        log.append(f"<{name}")
        return result

    return middleware


def test_middleware_wraps_each_task_in_list_order_and_hears_each_push() -> None:
    log: list[str] = []
    fleet = ScriptedFleet([FIT, EVALUATE])
    pushed: list[tuple[str, bool, bool]] = []

    def on_pushed(context: TaskContext, result: TaskResult, *, refused: bool) -> None:
        delivered = result.header.task_id in [r.task_id for r in fleet.results]
        pushed.append((context.task.task_id, refused, delivered))

    middleware = [_tracing(log, "a"), _tracing(log, "b")]
    runner = _run(fleet, StepClient(log), middleware=middleware, on_pushed=on_pushed)
    assert log == ["a>", "b>", "fit", "<b", "<a", "a>", "b>", "evaluate", "<b", "<a"]
    assert fleet.outcome() == [("t0", FIT, ""), ("t1", EVALUATE, "")]
    assert pushed == [("t0", False, True), ("t1", False, True)]  # after the server had it
    assert (runner.stats.fits, runner.stats.evaluations, runner.stats.failures) == (1, 1, 0)
    assert runner.stats.run_finished and fleet.left == ["run finished"]
    assert runner.middleware == tuple(middleware) and len(middleware) == 2  # a copy


def test_a_middleware_can_answer_or_change_a_task_itself() -> None:
    log: list[str] = []

    def low_battery(context: TaskContext, call_next: CallNext) -> TaskResult:
        if context.task.kind is TaskKind.FIT:
            return context.failure("battery below 20%: not training")  # fit never runs
        header, payload = call_next(context)
        assert context.stage is None  # a plain task, not a secure-aggregation stage
        return TaskResult(dataclasses.replace(header, loss=7.0), payload)

    fleet = ScriptedFleet([FIT, EVALUATE])
    runner = _run(fleet, StepClient(log), middleware=[low_battery])
    assert log == ["evaluate"]
    assert fleet.outcome() == [("t0", None, "battery below 20%: not training"),
                               ("t1", EVALUATE, "")]
    assert fleet.results[1].loss == 7.0
    # stats count what was reported: the replaced fit is a failure, not a fit
    assert (runner.stats.fits, runner.stats.evaluations, runner.stats.failures) == (0, 1, 1)


def test_a_plain_header_and_payload_tuple_is_taken_as_a_result() -> None:
    def as_tuple(context: TaskContext, call_next: CallNext) -> TaskResult:
        header, payload = call_next(context)
        return (header, payload)  # type: ignore[return-value]

    fleet = ScriptedFleet([FIT])
    runner = _run(fleet, StepClient(), middleware=[as_tuple])
    assert fleet.outcome() == [("t0", FIT, "")] and runner.stats.fits == 1


def _raise_before(context: TaskContext, call_next: CallNext) -> TaskResult:
    raise RuntimeError("boom")


def _raise_after(context: TaskContext, call_next: CallNext) -> TaskResult:
    call_next(context)
    raise RuntimeError("boom")


@pytest.mark.parametrize("where", ["fit", "middleware before call_next",
                                   "middleware after call_next"])
def test_a_middleware_that_raises_fails_the_task_as_a_failing_fit_does(where: str) -> None:
    """Reported to the server as the task's failure and counted; the run goes on."""
    fleet = ScriptedFleet([FIT, EVALUATE])
    if where == "fit":
        runner = _run(fleet, StepClient(fit_error=RuntimeError("boom")))
    else:
        layer = _raise_before if "before" in where else _raise_after
        only_fit = _only_fit(layer)
        runner = _run(fleet, StepClient(), middleware=[only_fit])
    assert fleet.outcome() == [("t0", None, "RuntimeError: boom"), ("t1", EVALUATE, "")]
    assert (runner.stats.fits, runner.stats.evaluations, runner.stats.failures) == (0, 1, 1)
    assert runner.stats.run_finished


def _only_fit(layer: Callable[[TaskContext, CallNext], TaskResult]
              ) -> Callable[[TaskContext, CallNext], TaskResult]:
    def middleware(context: TaskContext, call_next: CallNext) -> TaskResult:
        if context.task.kind is TaskKind.FIT:
            return layer(context, call_next)
        return call_next(context)

    return middleware


@pytest.mark.parametrize("where", ["fit", "middleware"])
def test_an_unexpected_exception_ends_the_run_from_a_middleware_as_from_fit(where: str) -> None:
    """Only the errors a task is expected to raise become failures (fedloom's, ValueError,
    TypeError, RuntimeError, ArithmeticError); a KeyError is a bug and ends run()."""
    fleet = ScriptedFleet([FIT])
    with pytest.raises(KeyError, match="bug"):
        if where == "fit":
            _run(fleet, StepClient(fit_error=KeyError("bug")))
        else:
            _run(fleet, StepClient(), middleware=[_only_fit(_raise_key_error)])
    assert fleet.results == []


def _raise_key_error(context: TaskContext, call_next: CallNext) -> TaskResult:
    raise KeyError("bug")


def test_a_middleware_that_returns_no_result_fails_the_task_naming_it() -> None:
    def forgetful(context: TaskContext, call_next: CallNext) -> TaskResult:
        call_next(context)
        return None  # type: ignore[return-value]

    fleet = ScriptedFleet([EVALUATE])
    runner = _run(fleet, StepClient(), middleware=[forgetful])
    [(_, kind, failure)] = fleet.outcome()
    assert kind is None and runner.stats.failures == 1
    assert "forgetful" in failure and "returned NoneType, not a TaskResult" in failure


class _ReturnsNothing(StepClient):
    def fit(self, weights: Weights, config: Any) -> FitOutput:
        return None  # type: ignore[return-value]

    def evaluate(self, weights: Weights, config: Any) -> EvaluateOutput:
        return (0.5, 10)  # type: ignore[return-value]


def test_a_client_that_returns_no_output_fails_the_task_naming_it() -> None:
    """Reported as the task's failure (it used to end the run with an AttributeError
    inside the SDK, and no failure reached the server)."""
    fleet = ScriptedFleet([FIT, EVALUATE])
    runner = _run(fleet, _ReturnsNothing())
    [(_, fit_kind, fit_failure), (_, eval_kind, eval_failure)] = fleet.outcome()
    assert fit_kind is None and eval_kind is None and runner.stats.failures == 2
    assert "_ReturnsNothing.fit returned NoneType, not a FitOutput" in fit_failure
    assert "_ReturnsNothing.evaluate returned tuple, not an EvaluateOutput" in eval_failure


class _SendsBadOutput(StepClient):
    """Returns what ``make_fit`` / ``make_evaluate`` build: outputs the SDK cannot send."""

    def __init__(self, make_fit: Callable[[Weights], FitOutput] | None = None,
                 make_evaluate: Callable[[], EvaluateOutput] | None = None) -> None:
        super().__init__()
        self.make_fit, self.make_evaluate = make_fit, make_evaluate

    def fit(self, weights: Weights, config: Any) -> FitOutput:
        return self.make_fit(weights) if self.make_fit else super().fit(weights, config)

    def evaluate(self, weights: Weights, config: Any) -> EvaluateOutput:
        return self.make_evaluate() if self.make_evaluate else super().evaluate(weights, config)


@pytest.mark.parametrize(("client", "failed", "message"), [
    (_SendsBadOutput(make_fit=lambda w: FitOutput({n: a + 0.1 for n, a in w.items()}, 10)),
     FIT, "TypeError: FitOutput.weights must be a fedloom.weights.Weights, not dict: wrap "
          "the arrays, FitOutput(Weights(arrays), num_examples)"),
    (_SendsBadOutput(make_evaluate=lambda: EvaluateOutput(0.5, num_examples=10.5)),  # type: ignore[arg-type]
     EVALUATE, "TypeError: EvaluateOutput.num_examples must be an int, not float (10.5): "
               "pass the number of examples as int(n)"),
    (_SendsBadOutput(make_fit=lambda w: FitOutput(w, 10, {"n": 2**70})),
     FIT, "ValueError: fit metrics['n']: 1180591620717411303424 is outside the signed 64-bit "
          "range [-2**63, 2**63 - 1]; send a larger number as a float or a str"),
], ids=["fit weights a dict", "evaluate num_examples a float", "fit metric past 64 bits"])
def test_a_client_output_the_sdk_cannot_send_fails_the_task_naming_the_fix(
        client: Client, failed: TaskKind, message: str) -> None:
    """Refused when the output is made, inside the task: the run goes on. These used to
    end run() (an AttributeError in the SDK, or a push that could not encode them)."""
    fleet = ScriptedFleet([FIT, EVALUATE])
    runner = _run(fleet, client)
    [(_, fit_kind, fit_failure), (_, eval_kind, eval_failure)] = fleet.outcome()
    assert (fit_failure or eval_failure) == message
    assert (fit_kind, eval_kind) == ((None, EVALUATE) if failed is FIT else (FIT, None))
    assert runner.stats.failures == 1 and runner.stats.run_finished


def test_on_pushed_hears_a_refused_result() -> None:
    fleet = ScriptedFleet([FIT, EVALUATE], refuse=frozenset({"t0"}))
    heard: list[tuple[str, bool]] = []

    def on_pushed(context: TaskContext, result: TaskResult, *, refused: bool) -> None:
        heard.append((result.header.task_id, refused))

    runner = _run(fleet, StepClient(), on_pushed=on_pushed)
    assert heard == [("t0", True), ("t1", False)]
    assert runner.stats.refused == 1


def test_a_refused_result_is_neither_counted_nor_logged_as_sent(
        caplog: pytest.LogCaptureFixture) -> None:
    fleet = ScriptedFleet([FIT, EVALUATE, FIT], refuse=frozenset({"t0", "t1"}))
    with caplog.at_level(logging.INFO, logger="fedloom.client"):
        runner = _run(fleet, StepClient())
    stats = runner.stats
    assert (stats.fits, stats.evaluations, stats.refused) == (1, 0, 2)
    sent = [r.getMessage() for r in caplog.records if "update sent" in r.getMessage()
            or "evaluated on" in r.getMessage()]
    assert len(sent) == 1  # the third task's, the only one the server took


def test_abort_in_a_middleware_sends_neither_the_result_nor_a_leave() -> None:
    fleet = ScriptedFleet([FIT, EVALUATE])
    runner: ClientRunner | None = None

    def crash(context: TaskContext, call_next: CallNext) -> TaskResult:
        assert runner is not None
        result = call_next(context)
        runner.abort()  # the process dies with its update computed
        return result

    with fake_fleet(fleet) as address:
        runner = ClientRunner(StepClient(), _config(address), middleware=[crash])
        stats = runner.run()
    assert fleet.results == [] and fleet.left == []
    assert not stats.run_finished and stats.reconnects == 0


@pytest.mark.parametrize("how", ["abort", "request_stop"])
def test_abort_while_waiting_for_a_task_leaves_no_leave_unlike_request_stop(how: str) -> None:
    fleet = ScriptedFleet([FIT], finish=False)  # then the next Pull waits
    with fake_fleet(fleet) as address:
        runner = ClientRunner(StepClient(), _config(address))
        timer = threading.Timer(0.3, getattr(runner, how))
        runner_thread = threading.Thread(target=runner.run)
        started = time.monotonic()
        runner_thread.start()
        timer.start()
        runner_thread.join(10)
    assert not runner_thread.is_alive() and time.monotonic() - started < 5
    assert fleet.outcome() == [("t0", FIT, "")]
    assert fleet.left == ([] if how == "abort" else ["client stopping"])
    assert runner.stats.reconnects == 0


def _one_argument(context: TaskContext) -> TaskResult:
    raise AssertionError("never called")


def _no_refused(context: TaskContext, result: TaskResult) -> None:
    raise AssertionError("never called")


@pytest.mark.parametrize(("seams", "message"), [
    ({"middleware": _raise_before}, r"list of callables: write middleware=\[_raise_before\]"),
    ({"middleware": "abc"}, "list of callables, not str"),
    ({"middleware": iter([_raise_before])}, "list of callables, not list_iterator"),
    ({"middleware": [_raise_before, 3]}, r"middleware\[1\] must be a callable .* not int"),
    ({"middleware": [_one_argument]}, r"middleware\[0\] \(_one_argument\) must take "
                                      r"\(context, call_next\)"),
    ({"on_pushed": "log"}, "on_pushed must be a callable taking .* not str"),
    ({"on_pushed": _no_refused}, r"on_pushed \(_no_refused\) must take "
                                 r"\(context, result, \*, refused\)"),
])
def test_bad_seams_are_refused_with_a_type_error(seams: dict[str, Any], message: str) -> None:
    config = _config("127.0.0.1:1")
    with pytest.raises(TypeError, match=message):
        ClientRunner(StepClient(), config, **seams)
    with pytest.raises(TypeError, match=message):  # before start_client connects
        start_client("127.0.0.1:1", StepClient(), config=config, handle_signals=False,
                     log_to_console=False, **seams)
