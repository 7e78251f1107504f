"""fedloom's side of benchmarks/transfer.py: a server process and client processes.

Both are started with the ``spawn`` method, so each is a fresh interpreter whose
memory is its own: the server's peak RSS (``VmHWM``) is read by the server process
itself at the end of the run, above the RSS it had once its imports were done and
before the model existed (its idle footprint).
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
from _procmem import idle_rss_bytes, peak_rss_bytes

BIAS = 10


def model_arrays(num_params: int) -> list[tuple[str, np.ndarray]]:
    """A flat weight and a small bias (float32), ``num_params`` values in all: the
    layout Flower's side moves too (``flower_transfer_app/.../model.py``)."""
    bias = min(BIAS, num_params // 2)
    return [
        ("w", np.full(num_params - bias, 0.01, dtype=np.float32)),
        ("b", np.full(bias, 0.01, dtype=np.float32)),
    ]


def plaintext(cls: Any) -> dict[str, Any]:
    """``insecure=True`` where the config has that switch: loopback, like Flower's side."""
    import dataclasses

    return {"insecure": True} if "insecure" in {f.name for f in dataclasses.fields(cls)} else {}


def cpu_seconds() -> float:
    """User + system CPU time this process has used so far."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def serve(num_params: int, rounds: int, num_clients: int, report: Connection) -> None:
    """Server process: run ``rounds`` fit-only rounds, then report times and memory."""
    import logging

    from fedloom import ServerConfig, Weights
    from fedloom.server import Server
    from fedloom.server.store import RunStore

    logging.basicConfig(level=logging.WARNING)
    idle = idle_rss_bytes()
    with tempfile.TemporaryDirectory(prefix="fedloom-bench-") as state_dir:
        config = ServerConfig(
            address="127.0.0.1:0",
            num_rounds=rounds,
            min_clients=num_clients,
            min_fit_clients=num_clients,
            fraction_evaluate=0.0,
            round_timeout_s=900.0,
            stream_timeout_s=900.0,
            state_dir=state_dir,
            progress=False,
            keep_checkpoints=1,
            **plaintext(ServerConfig),
        )
        server = Server(config, initial_weights=Weights(model_arrays(num_params)))
        handle = server.start(timeout_s=120)
        report.send({"port": handle.port})
        history = handle.wait()
        peak = peak_rss_bytes()
        store = RunStore(Path(state_dir) / "fedloom.db")
        run = store.runs()[-1]
        ends = [r.finished_at for r in store.rounds(run.run_id) if r.round > 0]
        store.close()
    report.send(
        {
            "idle_rss": idle,
            "cpu_s": cpu_seconds(),
            "peak_rss": peak,
            "round_ends": ends,
            "statuses": [r.status for r in history],
        }
    )


def _trivial_client() -> Any:
    from fedloom import Weights
    from fedloom.client_sdk import Client, EvaluateOutput, FitOutput

    step = np.float32(0.001)

    class Trivial(Client):
        """'Training' adds a constant to every weight: moves bytes, costs no CPU."""

        def fit(self, weights: Weights, config: Any) -> FitOutput:
            return FitOutput(Weights((n, a + step) for n, a in weights.items()), 10, {})

        def evaluate(self, weights: Weights, config: Any) -> EvaluateOutput:
            return EvaluateOutput(0.0, 10, {})

    return Trivial()


def clients(
    address: str, first: int, count: int, separate_uploads: bool, report: Connection
) -> None:
    """Client process: ``count`` clients (threads) until the run ends; report peak RSS."""
    from fedloom.client_sdk import start_client
    from fedloom.config import ClientConfig

    config = ClientConfig(
        server_address=address,
        rpc_timeout_s=120.0,
        separate_upload_connection=separate_uploads,
        **plaintext(ClientConfig),
    )
    stats: list[Any] = [None] * count

    def one(i: int) -> None:
        stats[i] = start_client(
            address,
            _trivial_client(),
            name=f"bench-{first + i}",
            config=config,
            handle_signals=False,
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fits = sum(s.fits for s in stats if s is not None)
    report.send({"peak_rss": peak_rss_bytes(), "cpu_s": cpu_seconds(), "fits": fits})


def _receive(conn: Connection, procs: list[Any], timeout_s: float) -> Any:
    """The next report on ``conn``; raise if every process in ``procs`` died first."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.5):
        if not any(p.is_alive() for p in procs) or time.monotonic() > deadline:
            raise RuntimeError("a fedloom benchmark process died or hung; see its output above")
    return conn.recv()


def run(
    num_params: int, rounds: int, num_clients: int, processes: int, separate_uploads: bool = True
) -> dict[str, Any]:
    """One fedloom run: a server process and ``processes`` client processes
    (``separate_uploads``: `ClientConfig.separate_upload_connection`)."""
    ctx = mp.get_context("spawn")
    server_end, server_report = ctx.Pipe(duplex=False)
    started = time.time()
    server = ctx.Process(target=serve, args=(num_params, rounds, num_clients, server_report))
    server.start()
    port = _receive(server_end, [server], 180)["port"]
    per_process = [
        num_clients // processes + (i < num_clients % processes) for i in range(processes)
    ]
    workers, reports = [], []
    first = 0
    for count in per_process:
        end, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=clients, args=(f"127.0.0.1:{port}", first, count, separate_uploads, child)
        )
        proc.start()
        workers.append(proc)
        reports.append(end)
        first += count
    try:
        result = _receive(server_end, [server], 3600)
        client_reports = [_receive(r, [w], 120) for r, w in zip(reports, workers, strict=True)]
    finally:
        for proc in [server, *workers]:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    result["wall_s"] = time.time() - started
    result["client_peak_rss"] = max(r["peak_rss"] for r in client_reports)
    result["clients_per_process"] = max(per_process)
    result["fits"] = sum(r["fits"] for r in client_reports)
    result["clients_cpu_s"] = sum(r["cpu_s"] for r in client_reports)
    return result
