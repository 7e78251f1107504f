"""Asynchronous rounds keep per-client metrics too: each model version commits a row per
buffered update it took (the client, its examples, its metrics and staleness)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from async_support import Harness, async_config

from fedloom.config import MetricsConfig
from fedloom.server.store import ClientRow, RunStore


def _run(config) -> Harness:  # type: ignore[no-untyped-def]
    async def main() -> Harness:
        async with Harness(config) as harness:
            for i, client in enumerate([0, 1, 2, 0]):
                await harness.answer(client, 10 * (client + 1))
                if i % 2 == 1:
                    await harness.committed((i + 1) // 2)
            assert harness.run_task is not None
            await asyncio.wait_for(harness.run_task, 20)
        return harness

    return asyncio.run(main())


def _rows(harness: Harness) -> dict[int, list[ClientRow]]:
    store = RunStore(harness.persistence.store.path, readonly=True)
    try:
        return store.client_rows(harness.coordinator.run_id)
    finally:
        store.close()


def test_each_version_commits_a_row_per_buffered_update(tmp_path: Path) -> None:
    rows = _rows(_run(async_config(tmp_path / "s", num_rounds=2, buffer_size=2)))
    got = {v: [(r.phase, r.client_name, r.num_examples) for r in rows[v]] for v in rows}
    assert got == {1: [("fit", "site-0", 10), ("fit", "site-1", 20)],
                   2: [("fit", "site-2", 30), ("fit", "site-0", 10)]}
    # Version 2 updates version 1. Site 2 trained version 0 (its task was issued at the
    # start), and so did site 0's second task, issued when its first update joined the
    # still open first buffer: both are one version stale.
    assert [r.metrics["staleness"] for r in rows[1] + rows[2]] == [0, 0, 1, 1]


def test_per_client_false_keeps_no_rows_in_async_rounds(tmp_path: Path) -> None:
    config = dataclasses.replace(async_config(tmp_path / "s", num_rounds=2, buffer_size=2),
                                 metrics=MetricsConfig(per_client=False))
    assert _rows(_run(config)) == {}


def test_a_bytes_metric_is_buffered_across_a_restart_and_recorded(tmp_path: Path) -> None:
    # Metrics may hold bytes (the wire allows them, and sync rounds record them): the
    # durable buffer row keeps them too, through a restart, into the version's rows.
    from fedbuff import client_delta

    config = async_config(tmp_path / "s", num_rounds=1, buffer_size=2)
    metrics = {"blob": b"\x00\x01\xff", "site": "a", "train_loss": 0.5}

    async def before() -> None:
        harness = Harness(config)
        harness.start()
        try:
            header = await harness.task_of(0)
            assert await harness.push(0, header, client_delta(0, 0, harness.initial), 10,
                                      metrics=metrics) is None  # acknowledged
        finally:
            await harness.stop()

    async def after() -> Harness:
        async with Harness(config) as harness:
            (entry,) = harness.driver._open.entries
            assert entry.row.metrics == {**metrics, "staleness": 0}
            await harness.answer(1, 20)
            assert harness.run_task is not None
            await asyncio.wait_for(harness.run_task, 20)
        return harness

    asyncio.run(before())
    rows = _rows(asyncio.run(after()))
    (first,) = [r for r in rows[1] if r.num_examples == 10]
    assert first.metrics == {**metrics, "staleness": 0}
