"""The task book's answers in detail: what it tells a client, what it hands a task's
owner, and how long it remembers closed tasks (found wanting by mutation testing,
``.ci/mutation coordinator``).

A stub owner (`StubOwner`) records what the book passes it, so each check sees the
book alone; `tests/operations/test_task_book.py` drives it with a real plain phase.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from helpers import small_weights

from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.messages import ResultHeader, Session, TaskHeader
from fedloom.payload import PayloadInfo, serialize
from fedloom.server.tasks import KEEP_CLOSINGS, Task, TaskBook, TaskStatus, result_fingerprint
from fedloom.types import TaskKind

INFO = PayloadInfo.describe(small_weights().specs(), serialize(small_weights()))


class StubOwner:
    """A task owner that records every call; ``accepting`` and ``needless`` are set."""

    def __init__(self, accepting: bool = True, needless: bool = False) -> None:
        self.accepting = accepting
        self._needless = needless
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    async def take(self, client: Any, task: Task, header: ResultHeader,
                   fingerprint: bytes) -> bool:
        self.calls.append(("take", (client, task, header, fingerprint)))
        return False

    def failed(self, task: Task, message: str) -> None:
        self.calls.append(("failed", (task, message)))

    def needless(self, task: Task, header: ResultHeader) -> bool:
        self.calls.append(("needless", (task, header)))
        return self._needless

    def end_reason(self, task: Task) -> str:
        return f"round {task.header.round} closed: stub"


class Client:
    def __init__(self, client_id: str) -> None:
        self.client_id = client_id


def _task(task_id: str, client_id: str = "a", server_round: int = 2) -> Task:
    header = TaskHeader(task_id, "run", server_round, TaskKind.FIT, {}, 10.0, INFO)
    return Task(header, client_id, memoryview(b"model"))


def _result(task: Task, examples: int = 5, server_round: int | None = None,
            **changes: Any) -> ResultHeader:
    values: dict[str, Any] = dict(kind=TaskKind.FIT, num_examples=examples,
                                  base_round=task.header.round - 1, update=INFO)
    values.update(changes)
    return ResultHeader(Session(task.client_id, b"s"), task.task_id,
                        task.header.round if server_round is None else server_round,
                        **values)


def _answer(book: TaskBook, client_id: str, header: ResultHeader) -> Any:
    return asyncio.run(book.answer(Client(client_id), header))  # type: ignore[arg-type]


def _refused(book: TaskBook, client_id: str, header: ResultHeader) -> MessageRejectedError:
    with pytest.raises(MessageRejectedError) as caught:
        _answer(book, client_id, header)
    return caught.value


def _issued(owner: StubOwner | None = None, *tasks: Task) -> TaskBook:
    book = TaskBook(lambda client_id: None)
    for task in tasks:
        book.issue(task, owner or StubOwner())  # type: ignore[arg-type]
    return book


def test_a_fresh_result_reaches_its_owner_with_the_client_and_its_fingerprint() -> None:
    task, owner = _task("t1"), StubOwner()
    book = _issued(owner, task)
    header = _result(task)
    assert _answer(book, "a", header) is False
    ((what, (client, got_task, got_header, fingerprint)),) = owner.calls
    assert what == "take" and client.client_id == "a"
    assert got_task is task and got_header is header
    assert fingerprint == result_fingerprint(header)


def test_a_reported_failure_reaches_the_owner_cut_to_200_characters() -> None:
    task, owner = _task("t1"), StubOwner()
    book = _issued(owner, task)
    assert _answer(book, "a", _result(task, kind=None, update=None, failure="x" * 300)) is False
    assert owner.calls == [("failed", (task, "x" * 200))]


def test_refusals_say_why() -> None:
    task = _task("t1")
    book = _issued(None, task)
    other = _refused(book, "b", _result(task))
    assert (other.reason, str(other)) == (RejectReason.FORBIDDEN,
                                          "that task was issued to another client")
    stale = _refused(book, "a", _result(task, server_round=1))
    assert (stale.reason, str(stale)) == (RejectReason.STALE,
                                          "result names round 1, the task is for round 2")


def test_a_pending_task_whose_owner_stopped_accepting_is_stale() -> None:
    task, owner = _task("t1"), StubOwner(accepting=False)
    book = _issued(owner, task)
    refused = _refused(book, "a", _result(task))
    assert (refused.reason, str(refused)) == (RejectReason.STALE, "round 2 closed: stub")
    assert owner.calls == [("needless", (task, owner.calls[0][1][1]))]  # asked, then refused
    assert book.offer("a") is None  # nor is the task offered any more


def test_a_result_the_owner_no_longer_needs_is_answered_not_refused() -> None:
    task, owner = _task("t1"), StubOwner(accepting=False, needless=True)
    book = _issued(owner, task)
    header = _result(task)
    assert _answer(book, "a", header) is False
    assert owner.calls == [("needless", (task, header))]


def test_a_different_result_for_an_accepted_task_is_a_conflict() -> None:
    task = _task("t1")
    book = _issued(None, task)
    task.settle(TaskStatus.ACCEPTED, result_fingerprint(_result(task)))
    assert _answer(book, "a", _result(task)) is True  # the same result: a retry
    refused = _refused(book, "a", _result(task, examples=6))
    assert (refused.reason, str(refused)) == (
        RejectReason.CONFLICT, "a different result was already accepted for this task")


def test_unknown_clients_hold_no_task() -> None:
    book = _issued(None, _task("t1"))
    assert book.offer("nobody") is None
    assert book.pending("nobody") is None
    assert not book.busy("nobody")
    assert book.busy("a") and book.pending("a") is not None


def test_closed_tasks_are_remembered_for_keep_closings_closings_each() -> None:
    """A late result hears how its task ended while its closing is among the last
    `KEEP_CLOSINGS` (64: an asynchronous run closes one a version, and a slow client
    answers many versions later); an older one, or one sent by another client, hears
    "not open"."""
    owner = StubOwner()
    tasks = [_task(f"t{i}") for i in range(KEEP_CLOSINGS + 1)]
    book = _issued(owner, tasks[0])
    tasks[0].settle(TaskStatus.FAILED)
    book.close([tasks[0]])
    assert bytes(tasks[0].payload) == b""  # the model is dropped at once
    for task in tasks[1:KEEP_CLOSINGS]:  # KEEP_CLOSINGS closings in all
        book.issue(task, owner)  # type: ignore[arg-type]
        task.settle(TaskStatus.FAILED)
        book.close([task])
        assert not book.busy("a")
    late = _refused(book, "a", _result(tasks[0]))  # found behind 63 newer closings
    assert (late.reason, str(late)) == (
        RejectReason.STALE, "round 2 closed: stub; this result is no longer needed")
    stranger = _refused(book, "b", _result(tasks[0]))
    assert str(stranger) == "task 't0' is not open (unknown, or its round has closed)"
    book.issue(tasks[-1], owner)  # type: ignore[arg-type]
    tasks[-1].settle(TaskStatus.FAILED)
    book.close([tasks[-1]])  # one closing more: the first is forgotten
    forgotten = _refused(book, "a", _result(tasks[0]))
    assert (forgotten.reason, str(forgotten)) == (
        RejectReason.STALE, "task 't0' is not open (unknown, or its round has closed)")


def test_an_accepted_closed_task_answers_retries_and_a_quiet_one_is_not_needed() -> None:
    accepted, quiet = _task("t1"), _task("t2", client_id="b")
    book = _issued(None, accepted, quiet)
    accepted.settle(TaskStatus.ACCEPTED, result_fingerprint(_result(accepted)))
    book.close([accepted])
    quiet.settle(TaskStatus.CANCELLED)
    book.close([quiet], quiet=True)
    assert _answer(book, "a", _result(accepted)) is True
    assert _refused(book, "a", _result(accepted, examples=6)).reason is RejectReason.CONFLICT
    assert _answer(book, "b", _result(quiet)) is False  # not needed, not refused


def test_an_unknown_task_id_is_quoted_cut_to_40_characters() -> None:
    book = _issued(None)
    header = _result(_task("x" * 100))
    refused = _refused(book, "a", header)
    assert str(refused) == f"task {'x' * 40!r} is not open (unknown, or its round has closed)"


def test_a_task_settles_once_to_an_end_status() -> None:
    task = _task("t1")
    with pytest.raises(ValueError, match=r"^a task settles to an end status$"):
        task.settle(TaskStatus.PENDING)
    task.settle(TaskStatus.FAILED)
    assert task.result_fingerprint == b""
    with pytest.raises(RuntimeError, match=r"^task t1 has already ended \(failed\)$"):
        task.settle(TaskStatus.ACCEPTED)


def test_the_fingerprint_covers_the_update_digest() -> None:
    task = _task("t1")
    other = PayloadInfo(INFO.specs, INFO.total_bytes, bytes(32))
    assert result_fingerprint(_result(task)) != result_fingerprint(_result(task, update=other))
