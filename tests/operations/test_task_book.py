"""The task book: one place where every task is issued, offered, answered and closed.

The client is the adversary here: it answers tasks that are not its own, for the wrong
round, twice with different results, after the round closed, or pushes one task's
update twice at once. Each must be refused with the right reason, and a retried
result must be recognised as a duplicate, before and after its task closed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers import small_weights

from fedloom.config import ServerConfig
from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.messages import PROTOCOL_VERSION, JoinRequest, ResultHeader, Session, TaskHeader
from fedloom.payload import PayloadInfo, serialize
from fedloom.server.driver import RoundParts
from fedloom.server.fleet import Fleet
from fedloom.server.plain_round import FitPhase
from fedloom.server.progress import RoundReporter
from fedloom.server.rounds import RoundTasks
from fedloom.server.tasks import Task, TaskBook, TaskStatus, result_fingerprint
from fedloom.server.uploads import Upload
from fedloom.types import ClientUpdate, TaskKind

INFO = PayloadInfo.describe(small_weights().specs(), serialize(small_weights()))


def _header(task_id: str, server_round: int = 2, kind: TaskKind = TaskKind.FIT) -> TaskHeader:
    return TaskHeader(task_id, "run", server_round, kind, {}, 10.0, INFO)


def _fit_result(task: Task, *, examples: int = 5, base_round: int = 1,
                server_round: int | None = None) -> ResultHeader:
    return ResultHeader(Session(task.client_id, b"s"), task.task_id,
                        task.header.round if server_round is None else server_round,
                        TaskKind.FIT, num_examples=examples, base_round=base_round,
                        update=INFO)


class _Setting:
    """A fleet of two joined clients and a book, with one plain fit phase open."""

    def __init__(self, tmp_path: Path) -> None:
        config = ServerConfig(min_clients=1, min_fit_clients=1, state_dir=str(tmp_path),
                              progress=False, insecure=True)
        self.fleet = Fleet(config, "run")
        self.woken: list[str] = []
        self.book = TaskBook(self.woken.append)
        joined = [self.fleet.join(JoinRequest(PROTOCOL_VERSION, frozenset({"fit"}), name))
                  for name in "ab"]
        self.clients = [self.fleet.registry.get(j.session.client_id) for j in joined]
        parts = RoundParts(config, "run", None, self.fleet, self.book, None,  # type: ignore[arg-type]
                           None, tmp_path / "spool", RoundReporter(enabled=False))  # type: ignore[arg-type]
        self.phase = RoundTasks(2, TaskKind.FIT, minimum=1)
        self.owner = FitPhase(parts, self.phase)
        self.tasks = []
        for i, client in enumerate(self.clients):
            assert client is not None
            task = Task(_header(f"t{i}"), client.client_id, memoryview(b""))
            self.phase.add(task)
            self.book.issue(task, self.owner)
            self.tasks.append(task)

    def answer(self, client_index: int, header: ResultHeader) -> Upload | bool:
        client = self.clients[client_index]
        assert client is not None
        return asyncio.run(self.book.answer(client, header))


@pytest.fixture
def setting(tmp_path: Path) -> _Setting:
    return _Setting(tmp_path)


def _refused(setting: _Setting, client_index: int, header: ResultHeader) -> RejectReason:
    with pytest.raises(MessageRejectedError) as caught:
        setting.answer(client_index, header)
    return caught.value.reason


def test_issuing_wakes_the_client_and_offers_its_task_until_it_is_answered(setting) -> None:  # type: ignore[no-untyped-def]
    a, b = setting.tasks
    assert setting.woken == [a.client_id, b.client_id]
    assert setting.book.offer(a.client_id) is a
    assert setting.book.offer(a.client_id, sent=a.task_id) is None  # a stream sent it
    setting.phase.fail(a, "client failure: out of memory")
    assert setting.book.offer(a.client_id) is None


def test_a_client_cannot_answer_another_clients_task(setting) -> None:  # type: ignore[no-untyped-def]
    a, _ = setting.tasks
    assert _refused(setting, 1, _fit_result(a)) is RejectReason.FORBIDDEN


def test_a_result_for_another_round_or_an_unknown_task_is_stale(setting) -> None:  # type: ignore[no-untyped-def]
    a, _ = setting.tasks
    assert _refused(setting, 0, _fit_result(a, server_round=1)) is RejectReason.STALE
    unknown = Task(_header("nope"), a.client_id, memoryview(b""))
    assert _refused(setting, 0, _fit_result(unknown)) is RejectReason.STALE


def test_a_second_upload_of_one_task_at_once_is_a_conflict(setting) -> None:  # type: ignore[no-untyped-def]
    a, _ = setting.tasks
    first = setting.answer(0, _fit_result(a))
    assert isinstance(first, Upload) and a.in_flight
    assert _refused(setting, 0, _fit_result(a)) is RejectReason.CONFLICT
    first.abandon()  # the stream broke: the client may push again
    assert not a.in_flight
    again = setting.answer(0, _fit_result(a))
    assert isinstance(again, Upload)
    again.abandon()


def test_an_update_on_the_wrong_base_or_with_absurd_examples_is_refused(setting) -> None:  # type: ignore[no-untyped-def]
    a, b = setting.tasks
    assert _refused(setting, 0, _fit_result(a, base_round=0)) is RejectReason.STALE
    assert _refused(setting, 1, _fit_result(b, examples=0)) is RejectReason.INVALID
    # each fails its task at once: the client does not send a refused result again
    for task in (a, b):
        assert not task.in_flight and task.status is TaskStatus.FAILED


def test_a_retry_is_a_duplicate_a_different_result_a_conflict_also_after_closing(setting) -> None:  # type: ignore[no-untyped-def]
    a, b = setting.tasks
    header = _fit_result(a)
    update = ClientUpdate(a.client_id, small_weights(), header.num_examples, 1)
    setting.phase.accept_update(a, update, result_fingerprint(header))
    assert setting.answer(0, _fit_result(a)) is True
    assert _refused(setting, 0, _fit_result(a, examples=6)) is RejectReason.CONFLICT
    asyncio.run(setting.phase.wait(0.01))  # b's task fails at the deadline
    setting.owner.close()
    assert setting.answer(0, _fit_result(a)) is True  # remembered after the close
    assert _refused(setting, 0, _fit_result(a, examples=6)) is RejectReason.CONFLICT
    with pytest.raises(MessageRejectedError, match="round 2 closed: no result before the "
                                                   "deadline; this result is no longer needed"):
        setting.answer(1, _fit_result(b))


def test_a_departed_client_s_pending_task_ends_at_once_but_not_its_upload(setting) -> None:  # type: ignore[no-untyped-def]
    a, b = setting.tasks
    upload = setting.answer(1, _fit_result(b))
    assert isinstance(upload, Upload)
    setting.fleet.on_departure(setting.book.client_gone)
    setting.fleet.drop(a.client_id, "no heartbeat")
    setting.fleet.drop(b.client_id, "no heartbeat")
    assert a.status is TaskStatus.FAILED and setting.phase.failures[a.client_id] == "no heartbeat"
    assert b.status is TaskStatus.PENDING  # its upload may still finish
    upload.abandon()  # ... it did not: the task fails now, not at the deadline
    assert b.status is TaskStatus.FAILED
