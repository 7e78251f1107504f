"""The soak of `benchmarks/load.py` (``--soak``): thousands of sessions held for minutes.

Each session joins (at a random moment within ``ramp_s``), heartbeats every interval
the server asks for, and holds its Tasks stream open as an SDK client does (the server
writes a keep-alive on it every ``long_poll_s``); by default each has its own TCP
connection. The server needs more clients than there are sessions before it starts a
round, so none starts: what is measured is the cost of holding the fleet. Once every
session has joined (the server's ``fedloom_clients_connected`` gauge says so), the hold
lasts ``duration_s``; then every session leaves.

The server process is sampled every ``sample_s`` from outside (`ServerSampler`: RSS, CPU,
the connected gauge). Memory is flat when the RSS's least-squares slope over the second
half of the hold is near zero (MB per minute, reported with the peak).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import signal
import tempfile
import time
from typing import Any

import grpc
import numpy as np
from _load_client import CHANNEL_OPTIONS, LoadClient, LoadStats, UpdatePool, process_cpu_s
from _load_sampler import (
    MB,
    Sample,
    ServerSampler,
    percentiles,
    raise_fd_limit,
    rss_slope_mb_per_min,
)

from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc

#: Sessions per client process (each process runs one event loop).
SESSIONS_PER_PROCESS = 500


async def _keep_stream(client: LoadClient, stub: Any) -> None:
    """Hold the session's Tasks stream open, reading its keep-alives; open it again if
    it breaks (an error: no stream should break while the server runs)."""
    while True:
        call = stub.Tasks(pb.PullRequest(session=client.session_message))
        try:
            while (message := await call.read()) is not grpc.aio.EOF:
                if message.WhichOneof("part") == "task":
                    client.stats.errors.append("tasks: a task arrived during the soak")
            client.stats.errors.append("tasks: the stream ended")
        except grpc.aio.AioRpcError as exc:
            client.stats.errors.append(f"tasks: {exc.code().name}: {exc.details()}")
        finally:
            call.cancel()
        await asyncio.sleep(1.0)


async def _session(client: LoadClient, channel: grpc.aio.Channel, leave: asyncio.Event
                   ) -> None:
    await asyncio.sleep(client.rng.uniform(0.0, client.ramp_s))
    stub = pb_grpc.FleetStub(channel)
    while not await client.join(stub):
        await asyncio.sleep(1.0)
    held = [asyncio.create_task(client.heartbeats(stub)),
            asyncio.create_task(_keep_stream(client, stub))]
    await leave.wait()
    for task in held:
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    await client.leave(stub)  # answered even when the cut stream ended the session first
    client.stats.finished += 1


async def hold(address: str, indices: range, stop: Any, *, seed: int, ramp_s: float,
               per_connection: int) -> LoadStats:
    """Hold sessions ``indices`` until ``stop`` (a multiprocessing event) is set."""
    stats = LoadStats()
    updates = UpdatePool(seed)  # unused: no round runs
    leave = asyncio.Event()
    count = len(indices)
    channels = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
                for _ in range(-(-count // per_connection))]
    clients = [LoadClient(i, address, stats, updates, seed=seed, ramp_s=ramp_s)
               for i in indices]
    sessions = [asyncio.create_task(_session(c, channels[k // per_connection], leave))
                for k, c in enumerate(clients)]
    while not stop.is_set():
        await asyncio.sleep(1.0)
    leave.set()
    for outcome in await asyncio.gather(*sessions, return_exceptions=True):
        if isinstance(outcome, BaseException):
            stats.errors.append(f"session crashed: {type(outcome).__name__}: {outcome}")
    for channel in channels:
        await channel.close()
    return stats


def _soak_process(address: str, start: int, stop_index: int, stop: Any, seed: int,
                  ramp_s: float, per_connection: int, pipe: Any) -> None:
    raise_fd_limit()
    stats = asyncio.run(hold(address, range(start, stop_index), stop, seed=seed,
                             ramp_s=ramp_s, per_connection=per_connection))
    stats.cpu_s = process_cpu_s()
    pipe.send(stats)


def _window(samples: list[Sample], start: float, end: float) -> list[Sample]:
    return [s for s in samples if start <= s.t <= end]


def summarize(samples: list[Sample], stats: LoadStats, hold_start: float, hold_end: float,
              idle_rss: int) -> dict[str, Any]:
    """The soak's figures from the server samples and what the sessions saw."""
    held = _window(samples, hold_start, hold_end)
    second_half = _window(samples, (hold_start + hold_end) / 2, hold_end)
    at = np.asarray(stats.heartbeat_at)
    beats = np.asarray(stats.heartbeat_s)
    during = beats[(at >= hold_start) & (at <= hold_end)] if len(at) else beats
    minutes = []
    for begin in np.arange(hold_start, hold_end, 60.0):
        chosen = beats[(at >= begin) & (at < begin + 60.0)] if len(at) else beats[:0]
        if len(chosen):
            minutes.append(round(float(np.percentile(chosen, 99)), 4))
    rss = [s.rss_bytes for s in held] or [0]
    connected = [s.connected for s in held if s.connected is not None]
    cpu = (held[-1].cpu_s - held[0].cpu_s) if len(held) > 1 else 0.0
    busy = (held[-1].machine_busy_s - held[0].machine_busy_s) if len(held) > 1 else 0.0
    wall = (held[-1].t - held[0].t) if len(held) > 1 else 0.0
    sessions = max(connected, default=0.0)
    return {
        "hold_s": round(hold_end - hold_start, 1),
        "samples": len(held),
        "connected_min": min(connected, default=None),
        "connected_max": max(connected, default=None),
        "server_rss_idle_mb": round(idle_rss / MB, 1),
        "server_rss_hold_start_mb": round(rss[0] / MB, 1),
        "server_rss_hold_end_mb": round(rss[-1] / MB, 1),
        "server_rss_peak_mb": round(max(rss) / MB, 1),
        "server_rss_per_session_kb": round((rss[0] - idle_rss) / max(sessions, 1) / 1e3, 1),
        "rss_slope_mb_per_min_second_half": round(rss_slope_mb_per_min(second_half), 3),
        "rss_slope_mb_per_min_whole_hold": round(rss_slope_mb_per_min(held), 3),
        "server_cpu_percent": round(100 * cpu / wall, 1) if wall else None,
        "machine_busy_percent_of_2_cores": round(100 * busy / wall / 2, 1) if wall else None,
        "heartbeat_s": percentiles([float(v) for v in during]),
        "heartbeat_p99_per_minute_s": minutes,
        "rss_mb_per_sample": [round(s.rss_bytes / MB, 1) for s in held],
    }


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    from load import _server_process, server_config  # the entry module; no cycle at import

    ctx = mp.get_context("spawn")
    sessions = args.sessions
    procs = args.procs or max(1, -(-sessions // SESSIONS_PER_PROCESS))
    with tempfile.TemporaryDirectory(prefix="fedloom-soak-", dir=args.state_parent) as state_dir:
        overrides: dict[str, Any] = {"metrics_address": "127.0.0.1:0"}
        if args.heartbeat_interval_s:
            overrides["heartbeat_interval_s"] = args.heartbeat_interval_s
        # One client more than the sessions before a round may start: none does.
        config = server_config(sessions + 1, 1, state_dir, **overrides)
        server_end, here = ctx.Pipe()
        server = ctx.Process(target=_server_process,
                             args=(config, args.params, server_end, args.server_log_level, ""))
        server.start()
        hello = here.recv()
        address = f"127.0.0.1:{hello['port']}"
        assert server.pid is not None  # started
        sampler = ServerSampler(server.pid, args.sample_s, hello["metrics_port"]).start()
        stop = ctx.Event()
        bounds = np.linspace(0, sessions, procs + 1).astype(int)
        workers = []
        for i in range(procs):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_soak_process,
                            args=(address, bounds[i], bounds[i + 1], stop, args.seed,
                                  args.ramp_s, args.sessions_per_connection, theirs))
            p.start()
            workers.append((p, mine))
        started = time.time()
        while time.time() - started < args.ramp_s + 600:  # every session joined
            last = sampler.samples[-1].connected if sampler.samples else None
            if last is not None and last >= sessions:
                break
            time.sleep(1.0)
        hold_start = time.time()
        time.sleep(args.duration_s)
        hold_end = time.time()
        stop.set()
        stats = LoadStats()
        for p, pipe in workers:
            stats.merge(pipe.recv())
            p.join()
        os.kill(server.pid, signal.SIGTERM)  # no round ran: stop it as an operator would
        final = here.recv()
        server.join()
        sampler.stop()
    return {
        "mode": "soak",
        "sessions": sessions,
        "client_processes": procs,
        "sessions_per_connection": args.sessions_per_connection,
        "ramp_s": args.ramp_s,
        "join_phase_s": round(hold_start - started, 1),
        **summarize(sampler.samples, stats, hold_start, hold_end, hello["rss_idle_bytes"]),
        "server_peak_rss_mb_vmhwm": round(final["peak_rss_bytes"] / MB, 1),
        "server_cpu_s": round(final["cpu_s"], 2),
        "server_gc_s": final["gc_s"],
        "clients_cpu_s": round(stats.cpu_s, 2),
        "joins": percentiles(stats.join_s),
        "sessions_left": stats.finished,
        "client_errors": len(stats.errors),
        "error_samples": sorted(set(stats.errors))[:10],
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
