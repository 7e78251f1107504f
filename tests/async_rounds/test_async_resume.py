"""A server restarted mid-buffer loses no update it acknowledged.

Acknowledged updates are on disk (fsynced file + SQLite row) before the client hears
"accepted"; the restarted server puts them back in the buffer they joined, checked
against their digests, and the step they complete equals FedBuff's rule over every
acknowledged update. Tasks issued before the restart are unknown to the new server and
are refused; nothing is counted twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path

import numpy as np
import pytest
from async_support import Harness, async_config, refused
from fedbuff import Arrival, client_delta, committed_versions, fedbuff_reference, initial_weights

from fedloom.errors import RejectReason
from fedloom.server.store import BufferedRow, RunStore


def test_acknowledged_updates_survive_a_restart_mid_buffer(tmp_path: Path) -> None:
    state = tmp_path / "state"
    config = async_config(state, num_rounds=2, buffer_size=3)

    async def before() -> tuple[list[Arrival], object]:
        harness = Harness(config)
        harness.start()
        try:
            arrivals = [await harness.answer(0, 10), await harness.answer(1, 30)]
            unanswered = await harness.task_of(2)
            assert harness.persistence.completed_round == 0  # mid-buffer: 2 of 3
        finally:
            await harness.stop()  # the process goes; the buffer stays on disk
        return arrivals, unanswered

    arrivals, old_task = asyncio.run(before())

    async def after() -> list[Arrival]:
        async with Harness(config) as harness:  # resume = true: the same run
            assert harness.driver._open.count == 2  # both acknowledged updates are back
            # The task from before the restart is unknown to this server: refused.
            exc = await refused(harness.push(2, old_task, client_delta(2, 0, harness.initial),
                                             20))
            assert exc.reason is RejectReason.STALE
            more = [await harness.answer(2, 20)]
            await harness.committed(1)
            more += [await harness.answer(0, 10), await harness.answer(1, 30),
                     await harness.answer(2, 20)]
            assert harness.run_task is not None
            await asyncio.wait_for(harness.run_task, 20)
            history = harness.coordinator.history
            assert [r.num_updates for r in history] == [3, 3]
        return more

    arrivals += asyncio.run(after())
    want = fedbuff_reference(initial_weights(), arrivals, buffer_size=3)
    for version in (1, 2):
        got = committed_versions(state)[version]
        for name in got:
            np.testing.assert_allclose(got[name], want[version][name], rtol=1e-5, atol=1e-6)
    # Nothing of the finished run is left in the buffer folder or the store.
    assert not list((state / "buffer").rglob("*.bin"))
    store = RunStore(state / "fedloom.db")
    try:
        assert store.buffered_updates(store.runs()[-1].run_id) == []
    finally:
        store.close()


async def _two_updates(config, *, to_the_end: bool) -> None:  # type: ignore[no-untyped-def]
    """Clients 0 and 1 answer a task each (10 and 30 examples); then the server stops, or
    with ``to_the_end`` runs on until its run is over."""
    async with Harness(config) as harness:
        await harness.answer(0, 10)
        await harness.answer(1, 30)
        if to_the_end:
            assert harness.run_task is not None
            await asyncio.wait_for(harness.run_task, 20)


def test_a_buffered_update_that_fails_its_digest_is_dropped_with_an_error(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = tmp_path / "state"
    config = async_config(state, num_rounds=1, buffer_size=3)

    asyncio.run(_two_updates(config, to_the_end=False))
    files = sorted((state / "buffer").rglob("*.bin"))
    assert len(files) == 2
    damaged = bytearray(files[0].read_bytes())
    damaged[0] ^= 0xFF
    files[0].write_bytes(bytes(damaged))

    async def after() -> None:
        with caplog.at_level(logging.ERROR, logger="fedloom.server"):
            harness = Harness(config)
        try:
            assert harness.driver._open.count == 1
        finally:
            await harness.stop()

    asyncio.run(after())
    assert "does not match its digest" in caplog.text
    assert not files[0].exists()  # not read back, and not left behind


def test_a_finished_run_keeps_the_buffered_files_it_was_left_with(tmp_path: Path) -> None:
    # A server started on a finished run trains nothing and writes nothing: an
    # acknowledged update left on disk (a server killed after its last commit, before
    # the buffer was emptied) is not recovered, and not deleted either.
    state = tmp_path / "state"
    config = async_config(state, num_rounds=1, buffer_size=2)

    asyncio.run(_two_updates(config, to_the_end=True))
    store = RunStore(state / "fedloom.db")
    (run,) = store.runs()
    assert run.status == "finished"
    left = state / "buffer" / run.run_id / "left-over.bin"
    left.parent.mkdir(parents=True, exist_ok=True)
    left.write_bytes(b"an acknowledged update")
    store.buffer_update(run.run_id, BufferedRow(2, "c", 1, 5, {}, str(left.relative_to(state)),
                                                hashlib.sha256(left.read_bytes()).hexdigest()))
    store.close()

    async def restart() -> None:
        async with Harness(config) as harness:
            assert harness.persistence.finished
            assert harness.driver._open.count == 0  # nothing recovered into a buffer

    asyncio.run(restart())
    store = RunStore(state / "fedloom.db", readonly=True)
    try:
        assert len(store.buffered_updates(run.run_id)) == 1
    finally:
        store.close()
    assert left.exists()
