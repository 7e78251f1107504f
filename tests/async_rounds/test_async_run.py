"""How an asynchronous run ends, evaluates and composes with the strategies."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
from async_support import Harness, async_config
from fedbuff import client_delta

from fedloom import Weights


def test_total_updates_ends_the_run_at_the_step_that_reaches_it(tmp_path: Path) -> None:
    async def main() -> Harness:
        async with Harness(async_config(tmp_path / "s", num_rounds=50, buffer_size=2,
                           total_updates=5)) as harness:
            for i in range(6):
                await harness.answer(i % 3, 10)
                if i % 2 == 1:
                    await harness.committed((i + 1) // 2)
            assert harness.run_task is not None
            await asyncio.wait_for(harness.run_task, 20)
        return harness

    harness = asyncio.run(main())
    history = harness.coordinator.history
    assert [r.round for r in history] == [1, 2, 3]  # 6 updates: the first step at >= 5
    assert harness.coordinator.finished.is_set()
    # The run is over: its tasks in flight were closed, nothing waits on disk.
    assert harness.driver.done
    assert not list((tmp_path / "s" / "buffer").rglob("*.bin"))


def test_server_evaluation_every_n_versions_and_the_last(tmp_path: Path) -> None:
    seen: list[int] = []

    def evaluate_fn(version: int, weights: Weights) -> tuple[float, dict[str, float]]:
        seen.append(version)
        return float(version), {}

    async def main() -> None:
        async with Harness(async_config(tmp_path / "s", num_rounds=5, buffer_size=1,
                           evaluate_every=2), evaluate_fn=evaluate_fn) as harness:
            for version in range(1, 6):
                await harness.answer(version % 3, 10)
                await harness.committed(version)
            assert harness.run_task is not None
            await asyncio.wait_for(harness.run_task, 20)

    asyncio.run(main())
    assert seen == [0, 2, 4, 5]


def test_a_robust_rule_aggregates_the_buffer_it_holds(tmp_path: Path) -> None:
    """FedMedian over a buffer of three fresh updates: the coordinate-wise median."""

    async def main() -> tuple[Harness, list[Weights]]:
        harness = Harness(async_config(tmp_path / "s", num_rounds=1, buffer_size=3,
                                       strategy="fedmedian", max_updates_per_client=1,
                                       min_clients=3))
        harness.start()
        deltas = []
        try:
            for client in range(3):
                arrival = await harness.answer(client, 10 * (client + 1))
                assert arrival.base_version == 0  # all fresh: weight 1
                deltas.append(arrival.delta)
            assert harness.run_task is not None
            await asyncio.wait_for(harness.run_task, 20)
        finally:
            await harness.stop()
        return harness, deltas

    harness, deltas = asyncio.run(main())
    got = harness.coordinator.global_weights
    for name, initial in harness.initial.items():
        want = initial + np.median(np.stack([d[name] for d in deltas]), axis=0)
        np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-6)


def test_federated_evaluation_asks_only_clients_that_are_not_training(tmp_path: Path) -> None:
    async def main() -> None:
        config = dataclasses.replace(
            async_config(tmp_path / "s", num_rounds=2, concurrency=1, buffer_size=1),
            fraction_evaluate=1.0, evaluate_timeout_s=30.0)
        async with Harness(config, num_clients=2) as harness:
            holder = await harness.holder()
            task = await harness.task_of(holder)
            await harness.push(holder, task, client_delta(holder, 0, harness.initial), 10)
            # Version 1 is being evaluated while one client trains for version 2: only
            # the other is asked, and the trainer's fit task is still its task.
            async with asyncio.timeout(10):
                while True:
                    offered = [harness.coordinator.book.offer(c.client_id)
                               for c in harness.clients]
                    kinds = sorted(str(t.header.kind) for t in offered if t is not None)
                    if kinds == ["evaluate", "fit"]:
                        break
                    await asyncio.sleep(0.005)

    asyncio.run(main())


def test_a_norm_bound_clips_each_buffered_update(tmp_path: Path) -> None:
    async def main() -> Harness:
        async with Harness(async_config(tmp_path / "s", num_rounds=1, buffer_size=2,
                           strategy_params={"max_update_norm": 1.0})) as harness:
            for client in (0, 1):
                task = await harness.task_of(client)
                huge = Weights({n: np.full(a.shape, 50.0 * (client + 1), a.dtype)
                                for n, a in harness.initial.items()})
                await harness.push(client, task, huge, 10)
            assert harness.run_task is not None
            await asyncio.wait_for(harness.run_task, 20)
        return harness

    harness = asyncio.run(main())
    got = harness.coordinator.global_weights
    step = np.sqrt(sum(float(np.sum((got[n].astype(np.float64) - a) ** 2))
                       for n, a in harness.initial.items()))
    assert step == pytest.approx(1.0, rel=1e-5)  # both clipped to 1, same direction
    assert harness.coordinator.history[-1].fit["num_clipped"] == 2


@pytest.mark.parametrize(("concurrency", "warned"), [(2, True), (1, False)])
def test_a_concurrency_that_leaves_no_client_to_evaluate_is_warned_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, concurrency: int,
        warned: bool) -> None:
    """Evaluation asks only clients that are not training: with concurrency at the
    fleet's size every client may be training, and versions go unevaluated, silently."""
    async def main() -> None:
        config = dataclasses.replace(
            async_config(tmp_path / "s", num_rounds=1, concurrency=concurrency,
                         min_clients=2), fraction_evaluate=1.0)
        with caplog.at_level(logging.WARNING, logger="fedloom.server"):
            async with Harness(config, num_clients=2):
                pass

    asyncio.run(main())
    said = [r.getMessage() for r in caplog.records if "versions may go unevaluated" in
            r.getMessage()]
    assert bool(said) is warned
