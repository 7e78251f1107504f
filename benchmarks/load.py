"""Load test: hundreds of concurrent clients through several rounds on loopback.

The server runs in its own process (so its peak memory is its own); the clients run
as lean asyncio clients (`benchmarks/_load_client.py`), many per process, each with
its own TCP connection. Every client is sampled every round (``fraction_fit = 1``,
``min_fit_clients = clients``), and every round also runs federated evaluation on
every client, so a round is two fan-outs of ``clients`` tasks and ``2 * clients``
results.

Run one benchmark at a time (two at once measure each other)::

    .venv/bin/python benchmarks/load.py --clients 500 --rounds 5

Writes ``benchmarks/results/load-<clients>.json`` (or ``--out``) and prints it; the
current figures are in benchmarks/README.md.

Reported (JSON, and a summary on stdout):

- ``rounds_ok`` of ``rounds`` and each round's updates, evaluations and duration;
- ``client_errors``: every failed RPC or bad download (the target is none), and
  ``refused``: results the server declined (none expected without over-selection);
- latency percentiles (p50/p95/p99, seconds): ``pull_delivery`` (the round opened on
  the server -> the client holds the verified fit task: fan-out latency through the
  long-poll), ``download`` (task header -> payload verified), ``push_fit`` and
  ``push_evaluate`` (whole Push RPC), ``heartbeat`` and ``join``;
- the server process's peak RSS (``VmHWM``) and RSS before any client joined, and
  its CPU seconds.

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
from _load_client import LoadStats, drive

from fedloom.config import ServerConfig
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

    logging.basicConfig(level=log_level)
    server = Server(config, initial_weights=tiny_model(params))

    def announce() -> None:
        server._ready.wait()
        pipe.send({"port": server.port, "rss_idle_bytes": _status_kb("VmRSS") * 1024})

    threading.Thread(target=announce, daemon=True).start()
    if profile:  # the event loop's thread (the gRPC handlers, the coordinator)
        profiler = cProfile.Profile()
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
        }
    )


def _client_process(
    address: str, start: int, stop: int, seed: int, train_s: float, ramp_s: float, pipe: Any
) -> None:
    stats = asyncio.run(
        drive(address, range(start, stop), seed=seed, ramp_s=ramp_s, train_s=train_s)
    )
    pipe.send(stats)


def percentiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    p50, p95, p99 = np.percentile(np.asarray(values), [50, 95, 99])
    return {
        "n": len(values),
        "p50": round(float(p50), 5),
        "p95": round(float(p95), 5),
        "p99": round(float(p99), 5),
        "max": round(float(max(values)), 5),
    }


def _round_starts(state_dir: str) -> dict[int, float]:
    store = RunStore(Path(state_dir) / "fedloom.db", readonly=True)
    try:
        run = store.runs()[-1]
        return {r.round: r.started_at for r in store.rounds(run.run_id)}
    finally:
        store.close()


def report(
    stats: LoadStats, history: list[RoundRecord], starts: dict[int, float], **extra: Any
) -> dict[str, Any]:
    delivery = [t - starts[r] for r, t in stats.fit_received if r in starts]
    rounds = [r for r in history if r.round > 0]
    return {
        **extra,
        "rounds_ok": sum(1 for r in rounds if r.status == "ok"),
        "per_round": [
            {
                "round": r.round,
                "status": r.status,
                "sampled": r.num_sampled,
                "updates": r.num_updates,
                "cancelled": r.num_cancelled,
                "federated_evaluation": bool(r.evaluate),
                "failures": r.num_failures,
                "duration_s": round(r.duration_s, 3),
            }
            for r in rounds
        ],
        "client_errors": len(stats.errors),
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
        server.join()
        wall = time.monotonic() - started
        starts = _round_starts(state_dir)
    return report(
        stats,
        final["history"],
        starts,
        clients=args.clients,
        rounds=args.rounds,
        client_processes=args.procs,
        model_bytes=tiny_model(args.params).nbytes,
        train_s=args.train_s,
        fraction_fit=args.fraction_fit,
        over_selection=args.over_selection if args.fraction_fit < 1.0 else 1.0,
        wall_s=round(wall, 2),
        server_peak_rss_mb=round(final["peak_rss_bytes"] / 1e6, 1),
        server_idle_rss_mb=round(hello["rss_idle_bytes"] / 1e6, 1),
        server_cpu_s=round(final["cpu_s"], 2),
        machine={"cpus": os.cpu_count(), "python": platform.python_version()},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--procs", type=int, default=4, help="client processes")
    parser.add_argument("--params", type=int, default=1000, help="model size in float32s")
    parser.add_argument("--train-s", type=float, default=0.5, help="max simulated training")
    parser.add_argument("--ramp-s", type=float, default=5.0, help="joins spread over this")
    parser.add_argument("--heartbeat-interval-s", type=float, default=0.0)
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
    parser.add_argument("--profile-server", default="", help="write the server's cProfile here")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON report path (default: results/load-<clients>.json)")
    args = parser.parse_args(argv)
    result = run_processes(args)
    text = json.dumps(result, indent=2)
    out = args.out or RESULTS / f"load-{args.clients}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)
    print(f"wrote {out}")
    ok = result["rounds_ok"] == args.rounds and result["client_errors"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
