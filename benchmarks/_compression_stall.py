"""Part 5 of benchmarks/compression.py: how long the server's event loop stalls when a
new model version is published with encoded, compressed broadcasts to prepare.

A real server (FedAvg, plaintext on loopback) runs on an event loop of this process,
beside a task that sleeps 5 ms at a time and records by how much each sleep overran
(the loop's lag: how long heartbeats and every other RPC would have waited), from the
moment every client has joined to the end of the run. 2 SDK
clients in their own spawned processes (`_compression_link.client_main`: a fit adds
Gaussian noise, sd 1e-3) are granted ``fp16+zstd`` downloads; the model is ``params``
Gaussian float32 values (sd 0.05), and the runs are fit-only rounds. The server's
`GlobalModel.publish` is timed: a version change is the span from its start to 0.2 s
after it returns (the next round's tasks are issued in it). Reported: the largest lag
within each version change, the largest and 99th-percentile lag over the whole run,
how long each publish took (the worker thread's build: payload, fp16 encode, zstd
frame), and what building that broadcast costs on one thread (what a build on the loop
would have stalled it for).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import tempfile
import time
from typing import Any

import numpy as np

#: Seconds the lag sampler sleeps each time.
TICK = 0.005
#: Seconds after a publish returns that still count as its version change.
AFTER = 0.2


def _model(params: int) -> Any:
    from fedloom import Weights

    values = np.random.default_rng(0).normal(0.0, 0.05, params).astype(np.float32)
    return Weights({"w": values[:-10], "b": values[-10:]})


def broadcast_build_s(params: int, repeats: int = 3) -> float:
    """Median seconds to build one version's ``fp16+zstd`` broadcast on one thread."""
    from fedloom.compression import CodecSpec
    from fedloom.server.model import Broadcast

    weights, times = _model(params), []
    for _ in range(repeats):
        broadcast = Broadcast(weights, 0)
        started = time.perf_counter()
        broadcast.select(CodecSpec("fp16"), True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def _sample_lag(samples: list[tuple[float, float]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        await asyncio.sleep(TICK)
        samples.append((started, time.perf_counter() - started - TICK))


def _joined(server: Any) -> int:
    coordinator = server.coordinator
    return len(coordinator.registry) if coordinator is not None else 0


async def _serve(server: Any, clients: int, samples: list[tuple[float, float]]) -> list[Any]:
    """Serve the run; lag is sampled from the moment every client has joined (the
    server's start and the clients' own start-up are not part of it)."""
    from _compression_link import client_main

    serving = asyncio.create_task(server.serve())
    while server.port is None and not serving.done():
        await asyncio.sleep(0.01)
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=client_main, daemon=True,
                           args=(f"127.0.0.1:{server.port}", i, (), ("fp16+zstd",)))
               for i in range(clients)]
    for worker in workers:
        worker.start()
    stop = asyncio.Event()
    try:
        while _joined(server) < clients and not serving.done():
            await asyncio.sleep(0.01)
        sampler = asyncio.create_task(_sample_lag(samples, stop))
        history = await serving
        stop.set()
        await sampler
    finally:
        for worker in workers:
            await asyncio.to_thread(worker.join, 20)
            if worker.is_alive():
                worker.kill()
    return history


def run_stall(params: int, rounds: int, clients: int = 2) -> dict[str, Any]:
    """``rounds`` fit-only rounds on a ``params``-value model (see the module docstring)."""
    from fedloom import ServerConfig
    from fedloom.config import CompressionConfig
    from fedloom.server import Server
    from fedloom.server.model import GlobalModel

    publishes: list[tuple[float, float, int]] = []
    real = GlobalModel.publish

    async def timed(model: GlobalModel, weights: Any, version: int, *args: Any,
                    **kwargs: Any) -> None:
        started = time.perf_counter()
        await real(model, weights, version, *args, **kwargs)
        publishes.append((started, time.perf_counter(), version))

    samples: list[tuple[float, float]] = []
    GlobalModel.publish = timed  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory(prefix="fedloom-stall-") as state_dir:
            config = ServerConfig(
                address="127.0.0.1:0", num_rounds=rounds, min_clients=clients,
                min_fit_clients=clients, fraction_evaluate=0.0, insecure=True,
                state_dir=state_dir, progress=False, keep_checkpoints=1,
                compression=CompressionConfig(download=("fp16+zstd",)))
            server = Server(config, initial_weights=_model(params))
            history = asyncio.run(_serve(server, clients, samples))
    finally:
        GlobalModel.publish = real  # type: ignore[method-assign]
    if [r.status for r in history if r.round > 0] != ["ok"] * rounds:
        raise RuntimeError(f"the stall run did not complete its {rounds} rounds")
    # The last version is published without a broadcast (no task carries it).
    changes = []
    for started, ended, version in publishes:
        if version >= rounds:
            continue
        # Every sleep that overlaps the change: one the loop could not end before the
        # publish began counts too.
        lags = [lag for at, lag in samples if at + TICK + lag >= started and at <= ended + AFTER]
        changes.append({"version": version, "publish_s": ended - started,
                        "max_lag_s": max(lags, default=0.0)})
    lags = sorted(lag for _, lag in samples)
    return {
        "params": params, "rounds": rounds, "clients": clients, "grant": "fp16+zstd",
        "tick_s": TICK, "changes": changes,
        "max_lag_at_change_s": max(c["max_lag_s"] for c in changes),
        "max_lag_s": lags[-1], "p99_lag_s": lags[int(0.99 * (len(lags) - 1))],
        "samples": len(lags), "build_on_one_thread_s": broadcast_build_s(params),
    }  # fmt: skip


def stall_line(result: dict[str, Any]) -> str:
    changes = result["changes"]
    each = ", ".join(f"{c['max_lag_s'] * 1e3:.1f}" for c in changes)
    return (f"event loop at a version change ({result['params']:,} params, "
            f"{result['grant']} grants): max lag {result['max_lag_at_change_s'] * 1e3:.1f} ms "
            f"(per change: {each}); "
            f"whole run max {result['max_lag_s'] * 1e3:.1f} ms, p99 "
            f"{result['p99_lag_s'] * 1e3:.1f} ms; the broadcast's build, now in the "
            f"worker thread: {statistics.median(c['publish_s'] for c in changes) * 1e3:.0f} ms "
            f"per publish, {result['build_on_one_thread_s'] * 1e3:.0f} ms for fp16 + zstd "
            "alone on one thread")
