"""The coordinator's checks of a fit result's header, before a byte of its update is
read (`fedloom.server.plain_round.start_fit_upload`, through the task book).

Each check is driven at its boundary: the last value it accepts and the first it
refuses, with the reason the client is told. A result the checks let through becomes
an `Upload` of its task.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
from helpers import small_weights

from fedloom.config import ServerConfig, TransferConfig
from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.messages import PROTOCOL_VERSION, JoinRequest, ResultHeader, Session, TaskHeader
from fedloom.payload import PayloadInfo, serialize
from fedloom.server.driver import RoundParts
from fedloom.server.fleet import Fleet
from fedloom.server.plain_round import FitPhase
from fedloom.server.progress import RoundReporter
from fedloom.server.registry import ClientRecord
from fedloom.server.rounds import RoundTasks
from fedloom.server.tasks import Task, TaskBook, TaskStatus, result_fingerprint
from fedloom.server.uploads import Upload
from fedloom.types import TaskKind
from fedloom.weights import TensorSpec

MODEL = PayloadInfo.describe(small_weights().specs(), serialize(small_weights()))
ROUND = 3
MAX_EXAMPLES = 1000


class _Round:
    """One joined client with one fit task of round 3 (the model of round 2)."""

    def __init__(self, tmp_path: Path, max_model_bytes: int = 1 << 20) -> None:
        config = ServerConfig(min_clients=1, min_fit_clients=1, state_dir=str(tmp_path),
                              progress=False, insecure=True, max_num_examples=MAX_EXAMPLES,
                              transfer=TransferConfig(max_model_bytes=max_model_bytes))
        self.fleet = Fleet(config, "run")
        self.book = TaskBook(lambda client_id: None)
        joined = self.fleet.join(JoinRequest(PROTOCOL_VERSION, frozenset({"fit"}), "a"))
        client = self.fleet.registry.get(joined.session.client_id)
        assert client is not None
        self.client: ClientRecord = client
        parts = RoundParts(config, "run", None, self.fleet, self.book, None,  # type: ignore[arg-type]
                           None, tmp_path / "spool", RoundReporter(enabled=False))  # type: ignore[arg-type]
        self.phase = RoundTasks(ROUND, TaskKind.FIT, minimum=1)
        header = TaskHeader("task-1", "run", ROUND, TaskKind.FIT, {}, 10.0, MODEL)
        self.task = Task(header, client.client_id, memoryview(b""))
        self.phase.add(self.task)
        self.book.issue(self.task, FitPhase(parts, self.phase))

    def result(self, **changes: object) -> ResultHeader:
        header = ResultHeader(Session(self.client.client_id, b"s"), "task-1", ROUND,
                              TaskKind.FIT, num_examples=5, base_round=ROUND - 1, update=MODEL)
        return dataclasses.replace(header, **changes)  # type: ignore[arg-type]

    def answer(self, header: ResultHeader) -> Upload | bool:
        return asyncio.run(self.book.answer(self.client, header))

    def refusal(self, header: ResultHeader, ends_the_task: bool = True
                ) -> MessageRejectedError:
        """The refusal of ``header``; a result refused for what it is also fails its
        task at once (the client does not send it again: the round would wait for it
        until round_timeout_s)."""
        with pytest.raises(MessageRejectedError) as caught:
            self.answer(header)
        assert not self.task.in_flight
        assert self.task.status is (TaskStatus.FAILED if ends_the_task else TaskStatus.PENDING)
        return caught.value


def _accepted(rnd: _Round, header: ResultHeader) -> None:
    upload = rnd.answer(header)
    assert isinstance(upload, Upload) and upload.header is header and rnd.task.in_flight
    upload.abandon()  # free the task for the next case
    assert not rnd.task.in_flight


def test_an_update_over_max_model_bytes_is_too_large(tmp_path: Path) -> None:
    size = MODEL.total_bytes
    small = _Round(tmp_path / "small", max_model_bytes=size - 1)
    refused = small.refusal(small.result())
    assert refused.reason is RejectReason.TOO_LARGE
    assert str(refused) == f"update of {size} bytes exceeds max_model_bytes ({size - 1})"
    exact = _Round(tmp_path / "exact", max_model_bytes=size)
    _accepted(exact, exact.result())


@pytest.mark.parametrize("examples", [0, -1, MAX_EXAMPLES + 1])
def test_num_examples_out_of_range_is_invalid(tmp_path: Path, examples: int) -> None:
    rnd = _Round(tmp_path)
    refused = rnd.refusal(rnd.result(num_examples=examples))
    assert refused.reason is RejectReason.INVALID
    assert str(refused) == f"num_examples {examples} is out of range (1..{MAX_EXAMPLES})"


@pytest.mark.parametrize("examples", [1, MAX_EXAMPLES])
def test_num_examples_at_the_bounds_is_taken(tmp_path: Path, examples: int) -> None:
    rnd = _Round(tmp_path)
    _accepted(rnd, rnd.result(num_examples=examples))


def test_a_fit_result_without_an_update_is_invalid(tmp_path: Path) -> None:
    rnd = _Round(tmp_path)
    refused = rnd.refusal(rnd.result(update=None))
    assert refused.reason is RejectReason.INVALID
    assert str(refused) == "a fit result carries an update"


@pytest.mark.parametrize("base_round", [ROUND - 2, ROUND])
def test_an_update_on_another_model_is_stale(tmp_path: Path, base_round: int) -> None:
    rnd = _Round(tmp_path)
    refused = rnd.refusal(rnd.result(base_round=base_round))
    assert refused.reason is RejectReason.STALE
    assert str(refused) == (f"update is based on round {base_round}; this task trains the "
                            f"model of round {ROUND - 1}")


@pytest.mark.parametrize(
    "specs",
    [
        (TensorSpec("w", "float32", (4, 3)),),  # a tensor left out
        (TensorSpec("w", "float32", (3, 4)), TensorSpec("b", "float32", (3,))),  # shape
        (TensorSpec("w", "float64", (4, 3)), TensorSpec("b", "float32", (3,))),  # dtype
        (TensorSpec("v", "float32", (4, 3)), TensorSpec("b", "float32", (3,))),  # name
    ],
    ids=["missing", "shape", "dtype", "name"],
)
def test_an_update_of_another_layout_is_invalid(tmp_path: Path,
                                                specs: tuple[TensorSpec, ...]) -> None:
    rnd = _Round(tmp_path)
    update = PayloadInfo(specs, sum(s.nbytes for s in specs), MODEL.sha256)
    refused = rnd.refusal(rnd.result(update=update))
    assert refused.reason is RejectReason.INVALID
    assert str(refused).startswith("update does not fit the model: ")


def test_a_result_of_another_kind_is_invalid(tmp_path: Path) -> None:
    rnd = _Round(tmp_path)
    refused = rnd.refusal(rnd.result(kind=TaskKind.EVALUATE, update=None, loss=0.5),
                          ends_the_task=False)  # refused by the book, before the round
    assert refused.reason is RejectReason.INVALID
    assert str(refused) == "a evaluate result was sent for a fit task"


def test_a_reported_failure_ends_the_task_without_an_upload(tmp_path: Path) -> None:
    rnd = _Round(tmp_path)
    assert rnd.answer(rnd.result(kind=None, update=None, failure="out of memory")) is False
    assert rnd.task.status is TaskStatus.FAILED
    assert rnd.phase.failures[rnd.client.client_id] == "client failure: out of memory"


def test_a_valid_header_starts_the_upload_of_its_task(tmp_path: Path) -> None:
    rnd = _Round(tmp_path)
    upload = rnd.answer(rnd.result())
    assert isinstance(upload, Upload)
    assert upload.task is rnd.task and rnd.task.in_flight
    assert rnd.book.pending(rnd.client.client_id) is None  # an upload is under way
    assert rnd.book.busy(rnd.client.client_id)
    upload.abandon()
    assert rnd.book.pending(rnd.client.client_id) is rnd.task


def test_a_second_upload_at_once_is_a_conflict_that_says_so(tmp_path: Path) -> None:
    rnd = _Round(tmp_path)
    first = rnd.answer(rnd.result())
    assert isinstance(first, Upload)
    assert first.fingerprint == result_fingerprint(rnd.result())  # kept for retries
    with pytest.raises(MessageRejectedError) as caught:
        rnd.answer(rnd.result())
    assert (caught.value.reason, str(caught.value)) == (
        RejectReason.CONFLICT, "an upload for this task is already in progress")
    first.abandon()


def test_a_client_gone_during_its_failed_upload_fails_its_task_with_the_reason(
    tmp_path: Path,
) -> None:
    rnd = _Round(tmp_path)
    upload = rnd.answer(rnd.result())
    assert isinstance(upload, Upload)
    rnd.fleet.drop(rnd.client.client_id, "no heartbeat")  # its upload may still finish
    assert rnd.task.status is TaskStatus.PENDING
    upload.abandon()  # ... it did not
    assert rnd.task.status is TaskStatus.FAILED
    assert rnd.phase.failures[rnd.client.client_id] == (
        "the client left while its upload was failing")
