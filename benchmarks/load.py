"""Load test: a thousand concurrent clients through rounds on loopback, or (``--soak``)
thousands of sessions held for minutes.

The server runs in its own process (so its peak memory and CPU are its own); the
clients are lean asyncio clients (`benchmarks/_load_client.py`), many per process, each
with its own TCP connection. Every client is sampled every round (``fraction_fit = 1``,
``min_fit_clients = clients``), and every round also runs federated evaluation on
every client, so a round is two fan-outs of ``clients`` tasks and ``2 * clients``
results. ``--soak`` holds sessions with heartbeats and no rounds instead
(`benchmarks/_load_soak.py`).

Run one benchmark at a time (two at once measure each other)::

    .venv/bin/python benchmarks/load.py --clients 1000 --rounds 3
    .venv/bin/python benchmarks/load.py --soak    # 5,000 sessions, 10 minutes

Writes ``benchmarks/results/load-<clients>.json`` (soak: ``load-soak-<sessions>.json``;
or ``--out``) and prints it; the current figures are in benchmarks/README.md.

Reported (JSON, and a summary on stdout):

- ``rounds_ok`` of ``rounds``; per round its updates, evaluations, ``duration_s`` (the
  server's: round 1 includes waiting for the clients to join), ``active_s`` (from the
  last join, or the round's start, to its commit) and the server's CPU seconds in that
  window (sampled from ``/proc``);
- ``client_errors``: every failed RPC or bad download (the target is none; a Leave
  after "run finished" that the stopped server no longer answers is counted apart, in
  ``unanswered_leaves``: leaving is best effort, as in the SDK), and
  ``refused``: results the server declined (none expected without over-selection);
- latency percentiles (p50/p95/p99, seconds): ``pull_delivery`` (the round's active
  start -> the client holds the verified fit task: the fan-out through the Tasks
  streams), ``download`` (task header -> payload verified), ``push_fit`` (whole Push),
  ``push_evaluate`` (whole Report), ``heartbeat`` and ``join``;
- the server's peak RSS (``VmHWM``) and RSS before any client joined; its CPU seconds,
  those of its event-loop thread and its garbage collector's pauses; the client
  processes' CPU seconds and the machine's busy CPU over the run (what is left over is
  another job's: the figures are then skewed).

``run_inprocess`` is the small version the test suite runs (server in a thread,
clients in this thread's event loop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load_client import LoadStats, drive, process_cpu_s
from _load_sampler import (
    ServerSampler,
    machine_busy_s,
    percentiles,
    raise_fd_limit,
    time_collections,
)

from fedloom.config import ServerConfig, TransferConfig
from fedloom.records import RoundRecord
from fedloom.server.store import RunStore
from fedloom.weights import Weights

RESULTS = Path(__file__).resolve().parent / "results"


def tiny_model(params: int) -> Weights:
    """A two-tensor model of about ``params`` float32 values."""
    cols = 10
    rows = max(1, params // cols - 1)
    return Weights({"w": np.zeros((rows, cols), np.float32), "b": np.zeros(cols, np.float32)})


def server_config(clients: int, rounds: int, state_dir: str, **overrides: Any) -> ServerConfig:
    settings: dict[str, Any] = dict(
        address="127.0.0.1:0",
        num_rounds=rounds,
        min_clients=clients,
        min_fit_clients=clients,
        fraction_fit=1.0,
        fraction_evaluate=1.0,
        min_evaluate_clients=clients,
        round_timeout_s=120.0,
        evaluate_timeout_s=120.0,
        state_dir=state_dir,
        progress=False,
        insecure=True,
        max_clients=clients + 10,
    )
    settings.update(overrides)
    return ServerConfig(**settings)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _server_process(
    config: ServerConfig, params: int, pipe: Any, log_level: str, profile: str
) -> None:
    """The server, in its own process: reports its port, then its history and memory."""
    import cProfile
    import logging
    import threading

    from fedloom.server import Server

    raise_fd_limit()
    logging.basicConfig(level=log_level)
    gc_time = time_collections()
    server = Server(config, initial_weights=tiny_model(params))

    def announce() -> None:
        server._ready.wait()
        pipe.send({"port": server.port, "metrics_port": server.metrics_port,
                   "rss_idle_bytes": _status_kb("VmRSS") * 1024})

    threading.Thread(target=announce, daemon=True).start()
    if profile:  # the event loop's thread (the gRPC handlers, the coordinator)
        # Its CPU time, not wall time: with clients on the same cores, wall time would
        # charge whatever runs when the thread is preempted.
        profiler = cProfile.Profile(time.thread_time)
        history = profiler.runcall(server.run)
        profiler.dump_stats(profile)
    else:
        history = server.run()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    pipe.send(
        {
            "history": history,
            "peak_rss_bytes": _status_kb("VmHWM") * 1024,
            "cpu_s": usage.ru_utime + usage.ru_stime,
            # The event loop's thread (this one); the rest is gRPC's core threads
            # (sockets, HTTP/2) and the aggregation thread.
            "loop_cpu_s": time.thread_time(),
            "gc_s": round(sum(gc_time), 3),
            "gc_s_by_generation": [round(t, 3) for t in gc_time],
        }
    )


def _client_process(
    address: str, start: int, stop: int, seed: int, train_s: float, ramp_s: float, pipe: Any
) -> None:
    raise_fd_limit()
    stats = asyncio.run(
        drive(address, range(start, stop), seed=seed, ramp_s=ramp_s, train_s=train_s)
    )
    stats.cpu_s = process_cpu_s()
    pipe.send(stats)


def _round_starts(state_dir: str) -> dict[int, float]:
    store = RunStore(Path(state_dir) / "fedloom.db", readonly=True)
    try:
        run = store.runs()[-1]
        return {r.round: r.started_at for r in store.rounds(run.run_id)}
    finally:
        store.close()


def active_windows(history: list[RoundRecord], starts: dict[int, float],
                   joined_at: list[float]) -> dict[int, tuple[float, float]]:
    """Each round's (start, end) on the wall clock, its start moved to the last join
    when the round was waiting for clients (round 1 waits for all of them)."""
    last_join = max(joined_at, default=0.0)
    windows = {}
    for r in history:
        if r.round in starts:
            start, end = starts[r.round], starts[r.round] + r.duration_s
            windows[r.round] = (max(start, last_join) if last_join < end else start, end)
    return windows


def report(
    stats: LoadStats, history: list[RoundRecord], starts: dict[int, float],
    sampler: ServerSampler | None = None, **extra: Any
) -> dict[str, Any]:
    rounds = [r for r in history if r.round > 0]
    windows = active_windows(rounds, starts, stats.joined_at)
    delivery = [t - windows[r][0] for r, t in stats.fit_received if r in windows]

    def row(r: RoundRecord) -> dict[str, Any]:
        start, end = windows.get(r.round, (0.0, 0.0))
        figures = {
            "round": r.round,
            "status": r.status,
            "sampled": r.num_sampled,
            "updates": r.num_updates,
            "cancelled": r.num_cancelled,
            "federated_evaluation": bool(r.evaluate),
            "failures": r.num_failures,
            "duration_s": round(r.duration_s, 3),
            "active_s": round(end - start, 3),
        }
        if sampler is not None:
            cpu, busy = sampler.between(start, end)
            figures["server_cpu_s"] = round(cpu, 3)
            figures["machine_busy_s"] = round(busy, 3)
        return figures

    return {
        **extra,
        "rounds_ok": sum(1 for r in rounds if r.status == "ok"),
        "per_round": [row(r) for r in rounds],
        "client_errors": len(stats.errors),
        "unanswered_leaves": stats.unanswered_leaves,
        "error_samples": sorted(set(stats.errors))[:10],
        "refused": len(stats.refused),
        "clients_finished": stats.finished,
        "fits": stats.fits,
        "evaluations": stats.evaluations,
        "latency_s": {
            "pull_delivery": percentiles(delivery),
            "download": percentiles(stats.download_s),
            "push_fit": percentiles(stats.push_fit_s),
            "push_evaluate": percentiles(stats.push_evaluate_s),
            "heartbeat": percentiles(stats.heartbeat_s),
            "join": percentiles(stats.join_s),
        },
    }


def run_inprocess(
    clients: int,
    rounds: int,
    state_dir: str,
    *,
    params: int = 1000,
    train_s: float = 0.05,
    ramp_s: float = 0.5,
    **overrides: Any,
) -> dict[str, Any]:
    """The small version: server in a thread, clients on this thread's event loop."""
    from fedloom.server import Server

    config = server_config(clients, rounds, state_dir, **overrides)
    handle = Server(config, initial_weights=tiny_model(params)).start()
    stats = asyncio.run(drive(handle.address, range(clients), ramp_s=ramp_s, train_s=train_s))
    history = handle.wait(120)
    return report(stats, history, _round_starts(state_dir), clients=clients, rounds=rounds)


def run_processes(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="fedloom-load-", dir=args.state_parent) as state_dir:
        overrides: dict[str, Any] = {}
        if args.heartbeat_interval_s:
            overrides["heartbeat_interval_s"] = args.heartbeat_interval_s
        if args.no_inline:  # small payloads as a header and one Chunk, as before "inline"
            overrides["transfer"] = TransferConfig(inline_payloads=False)
        if args.fraction_fit < 1.0:  # the strategy samples this share; over-select on top
            overrides["fraction_fit"] = args.fraction_fit
            overrides["min_fit_clients"] = max(1, int(args.clients * args.fraction_fit))
            overrides["over_selection"] = args.over_selection
        config = server_config(args.clients, args.rounds, state_dir, **overrides)
        server_end, here = ctx.Pipe()
        server = ctx.Process(
            target=_server_process,
            args=(config, args.params, server_end, args.server_log_level, args.profile_server),
        )
        server.start()
        hello = here.recv()
        address = f"127.0.0.1:{hello['port']}"
        started = time.monotonic()
        busy_before = machine_busy_s()
        assert server.pid is not None  # started
        sampler = ServerSampler(server.pid, interval_s=0.5).start()
        bounds = np.linspace(0, args.clients, args.procs + 1).astype(int)
        workers = []
        for i in range(args.procs):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(
                target=_client_process,
                args=(
                    address,
                    bounds[i],
                    bounds[i + 1],
                    args.seed,
                    args.train_s,
                    args.ramp_s,
                    theirs,
                ),
            )
            p.start()
            workers.append((p, mine))
        stats = LoadStats()
        for p, pipe in workers:
            stats.merge(pipe.recv())
            p.join()
        final = here.recv()
        sampler.stop()
        server.join()
        wall = time.monotonic() - started
        busy = machine_busy_s() - busy_before
        starts = _round_starts(state_dir)
    return report(
        stats,
        final["history"],
        starts,
        sampler,
        clients=args.clients,
        rounds=args.rounds,
        client_processes=args.procs,
        model_bytes=tiny_model(args.params).nbytes,
        train_s=args.train_s,
        inline_payloads=not args.no_inline,
        fraction_fit=args.fraction_fit,
        over_selection=args.over_selection if args.fraction_fit < 1.0 else 1.0,
        wall_s=round(wall, 2),
        server_peak_rss_mb=round(final["peak_rss_bytes"] / 1e6, 1),
        server_idle_rss_mb=round(hello["rss_idle_bytes"] / 1e6, 1),
        server_cpu_s=round(final["cpu_s"], 2),
        server_loop_cpu_s=round(final["loop_cpu_s"], 2),
        server_gc_s=final["gc_s"],
        server_gc_s_by_generation=final["gc_s_by_generation"],
        clients_cpu_s=round(stats.cpu_s, 2),
        machine_busy_s=round(busy, 2),
        machine={"cpus": os.cpu_count(), "python": platform.python_version()},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--procs", type=int, default=0,
                        help="client processes (default: 4; soak: one per 500 sessions)")
    parser.add_argument("--params", type=int, default=1000, help="model size in float32s")
    parser.add_argument("--train-s", type=float, default=0.5, help="max simulated training")
    parser.add_argument("--ramp-s", type=float, default=None,
                        help="joins spread over this (default: 5 s; soak: 60 s)")
    parser.add_argument("--heartbeat-interval-s", type=float, default=0.0)
    parser.add_argument("--no-inline", action="store_true",
                        help="the server grants no 'inline' capability: small payloads "
                        "travel as a header and one Chunk")
    parser.add_argument(
        "--fraction-fit", type=float, default=1.0, help="below 1: sample this share per round"
    )
    parser.add_argument(
        "--over-selection", type=float, default=1.0, help="with --fraction-fit below 1"
    )
    parser.add_argument("--server-log-level", default="WARNING")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--state-parent", default=None, help="folder for the server's state_dir (default: TMPDIR)"
    )
    parser.add_argument("--profile-server", default="",
                        help="write a cProfile of the server's event-loop thread (CPU time) here")
    soak = parser.add_argument_group("soak: hold sessions with heartbeats, no rounds")
    soak.add_argument("--soak", action="store_true")
    soak.add_argument("--sessions", type=int, default=5_000)
    soak.add_argument("--duration-s", type=float, default=600.0, help="the hold, once all joined")
    soak.add_argument("--sample-s", type=float, default=5.0, help="server RSS/CPU sampling")
    soak.add_argument("--sessions-per-connection", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON report path (default: results/load-<clients>.json, "
                             "soak: results/load-soak-<sessions>.json)")
    args = parser.parse_args(argv)
    if args.soak:
        from _load_soak import run_soak

        args.ramp_s = 60.0 if args.ramp_s is None else args.ramp_s
        result = run_soak(args)
        out = args.out or RESULTS / f"load-soak-{args.sessions}.json"
        ok = result["client_errors"] == 0 and result["connected_min"] == args.sessions
    else:
        args.ramp_s = 5.0 if args.ramp_s is None else args.ramp_s
        args.procs = args.procs or 4
        result = run_processes(args)
        out = args.out or RESULTS / f"load-{args.clients}.json"
        ok = result["rounds_ok"] == args.rounds and result["client_errors"] == 0
    text = json.dumps(result, indent=2)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
