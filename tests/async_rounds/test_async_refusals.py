"""What asynchronous rounds refuse, and what they keep, with the client as the adversary.

An update older than ``max_staleness``, one that claims a version the task did not
train (or that does not exist), a result from a client that holds no task, another
client's task, a task past its deadline: each gets its own clear status and leaves the
buffer (in memory and on disk) as it was. A retry of an accepted result is answered
"duplicate" and counted once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
from async_support import Harness, async_config, refused
from fedbuff import client_delta

from fedloom.errors import RejectReason
from fedloom.messages import ResultHeader, Session
from fedloom.payload import PayloadInfo, iter_chunks, serialize
from fedloom.types import TaskKind


def _buffered(harness: Harness) -> int:
    """Acknowledged updates waiting on disk, as the store records them."""
    return len(harness.persistence.store.buffered_updates(harness.persistence.run_id))


def test_an_update_past_max_staleness_is_refused_and_the_buffer_untouched(
        tmp_path: Path) -> None:
    async def main() -> None:
        async with Harness(async_config(tmp_path / "s", num_rounds=3, concurrency=2,
                           buffer_size=1, max_staleness=0), num_clients=2) as harness:
            slow = await harness.task_of(1)  # trains version 0
            await harness.answer(0, 10)
            await harness.committed(1)
            delta = client_delta(1, 0, harness.initial)
            exc = await refused(harness.push(1, slow, delta, 10))
            assert exc.reason is RejectReason.STALE
            # Ended when the step made it too old to take: its slot went to fresh work.
            assert "(version 0) became more than rounds.max_staleness = 0" in str(exc)
            assert harness.driver.num_accepted == 1
            assert _buffered(harness) == 0 and harness.driver._open.count == 0
            # The same result again: the same refusal, still nothing buffered.
            again = await refused(harness.push(1, slow, delta, 10))
            assert again.reason is RejectReason.STALE and "max_staleness" in str(again)
            # The client is free again: its next task trains the current version.
            fresh = await harness.task_of(1)
            assert fresh.task_id != slow.task_id and fresh.round == 2

    asyncio.run(main())


def test_an_update_for_a_version_the_task_did_not_train_is_refused(tmp_path: Path) -> None:
    async def main() -> None:
        async with Harness(async_config(tmp_path / "s", buffer_size=2), num_clients=2) as harness:
            delta = client_delta(0, 0, harness.initial)
            for offset in (0, 5):  # versions that do not exist yet
                task = await harness.task_of(0)
                claimed = task.round + offset
                exc = await refused(harness.push(0, task, delta, 10, base_round=claimed))
                assert exc.reason is RejectReason.STALE
                assert f"update is based on round {claimed}" in str(exc)
                # refused for what it is, the task ends at once (its slot goes to fresh
                # work): the result is not taken even when sent right
                again = await refused(harness.push(0, task, delta, 10))
                assert f"update refused: update is based on round {claimed}" in str(again)
            assert harness.driver.num_accepted == 0 and _buffered(harness) == 0

    asyncio.run(main())


def test_results_for_tasks_a_client_does_not_hold_are_refused(tmp_path: Path) -> None:
    async def main() -> None:
        async with Harness(async_config(tmp_path / "s", concurrency=1), num_clients=2) as harness:
            holder = await harness.holder()
            idle = 1 - holder
            task = await harness.task_of(holder)
            delta = client_delta(holder, 0, harness.initial)
            # Another client's task: forbidden.
            exc = await refused(harness.push(idle, task, delta, 10))
            assert exc.reason is RejectReason.FORBIDDEN
            # A task id nobody was given: not open.
            made_up = dataclasses.replace(task, task_id="f" * 32)
            exc = await refused(harness.push(idle, made_up, delta, 10))
            assert exc.reason is RejectReason.STALE and "is not open" in str(exc)
            assert harness.driver.num_accepted == 0 and _buffered(harness) == 0
            assert await harness.push(holder, task, delta, 10) is None

    asyncio.run(main())


def test_a_retried_result_is_a_duplicate_counted_once(tmp_path: Path) -> None:
    async def main() -> None:
        async with Harness(async_config(tmp_path / "s", buffer_size=3), num_clients=2) as harness:
            task = await harness.task_of(0)
            delta = client_delta(0, 0, harness.initial)
            assert await harness.push(0, task, delta, 10) is None
            assert await harness.push(0, task, delta, 10) is True  # lost ack: a retry
            other = client_delta(0, 1, harness.initial)
            exc = await refused(harness.push(0, task, other, 10))
            assert exc.reason is RejectReason.CONFLICT
            assert harness.driver.num_accepted == 1 and _buffered(harness) == 1

    asyncio.run(main())


def test_a_task_past_its_deadline_frees_its_slot(tmp_path: Path) -> None:
    async def main() -> None:
        config = dataclasses.replace(
            async_config(tmp_path / "s", concurrency=1), round_timeout_s=0.2)
        async with Harness(config, num_clients=1) as harness:
            late = await harness.task_of(0)
            # The driver checks deadlines while the buffer fills: the task ends, but the
            # client, still working on it, is handed no other until it answers (a task
            # sent now would only wait behind the old fit, and go stale in turn).
            record, book = harness.clients[0], harness.coordinator.book
            await asyncio.sleep(0.6)
            assert late.task_id in harness.driver._reasons  # ended at its deadline
            assert book.busy(record.client_id) and book.offer(record.client_id) is None
            exc = await refused(harness.push(0, late, client_delta(0, 0, harness.initial), 10))
            assert exc.reason is RejectReason.STALE and "deadline" in str(exc)
            assert harness.driver.num_accepted == 0
            fresh = await harness.task_of(0, timeout_s=5.0)  # it answered: a new task follows
            assert fresh.task_id != late.task_id

    asyncio.run(main())


def test_a_client_that_leaves_frees_its_slot_for_another(tmp_path: Path) -> None:
    async def main() -> None:
        async with Harness(async_config(tmp_path / "s", concurrency=1), num_clients=2) as harness:
            holder = await harness.holder()
            other = 1 - holder
            harness.coordinator.leave(harness.clients[holder], "battery low")
            task = await harness.task_of(other)
            assert await harness.push(other, task, client_delta(other, 0, harness.initial),
                                      10) is None
            assert harness.driver.num_accepted == 1

    asyncio.run(main())


@pytest.mark.parametrize("max_staleness", [1, 3])
def test_an_update_exactly_max_staleness_old_is_taken(tmp_path: Path, max_staleness: int) -> None:
    async def main() -> None:
        async with Harness(async_config(tmp_path / "s", num_rounds=6, concurrency=2,
                           buffer_size=1, max_staleness=max_staleness),
                           num_clients=2) as harness:
            slow = await harness.task_of(1)  # trains version 0
            for version in range(1, max_staleness + 1):
                await harness.answer(0, 10)
                await harness.committed(version)
            # The open buffer updates version max_staleness: the slow update is that old.
            assert await harness.push(1, slow, client_delta(1, 0, harness.initial), 10) is None
            await harness.committed(max_staleness + 1)
            record = harness.coordinator.history[-1]
            assert record.fit["staleness"] == max_staleness

    asyncio.run(main())


def test_an_upload_that_grows_too_stale_while_it_arrives_is_refused(tmp_path: Path) -> None:
    """The check is made again when the upload is whole: steps may pass meanwhile."""

    async def main() -> None:
        async with Harness(async_config(tmp_path / "s", num_rounds=4, concurrency=2,
                           buffer_size=1, max_staleness=1), num_clients=2) as harness:
            slow = await harness.task_of(1)
            delta = client_delta(1, 0, harness.initial)
            payload = serialize(delta)
            header = ResultHeader(
                Session(harness.clients[1].client_id, b"t"), slow.task_id, slow.round,
                TaskKind.FIT, num_examples=10, base_round=slow.round - 1,
                update=PayloadInfo.describe(delta.specs(), payload))
            upload = await harness.coordinator.accept_result(harness.clients[1], header)
            assert not isinstance(upload, bool)
            upload.feed(0, bytes(payload[:16]))  # the upload is under way
            for version in (1, 2):  # two steps pass while it arrives
                await harness.answer(0, 10)
                await harness.committed(version)
            for offset, chunk in iter_chunks(payload[16:], 1 << 16):
                upload.feed(16 + offset, chunk)
            exc = await refused(upload.finish())
            assert exc.reason is RejectReason.STALE
            assert "trained on version 0 is 2 versions old" in str(exc)
            assert "rounds.max_staleness is 1" in str(exc)
            assert harness.driver.num_accepted == 2 and _buffered(harness) == 0
            assert not list((tmp_path / "s" / "spool").rglob("upload-*.bin"))  # discarded

    asyncio.run(main())
