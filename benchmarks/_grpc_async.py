"""The gRPC side of `benchmarks/async.py`: the same runs as the simulation side, on a
real fedloom server with real SDK clients that sleep out their fit time.

Each method's run is built from the simulation side's scenario (`_async_sim.scenario`:
the same partition, model, client settings, initial weights and client speeds for the
seed), so the two sides compare like with like. The server runs in this process with
the method's settings (FedAvg, or FedAvgM as a server learning rate; over-selection;
``[rounds] mode = "async"``); the 100 clients run as `start_client` threads in worker
processes. A client trains its shard for real, then sleeps until its fit has taken
``time_scale`` times its virtual duration (`fedloom.simulations.speed.SpeedModel`,
draw by draw). The server evaluates every version on the central test set; a run ends
when the target is reached (the same windowed rule as the simulation side) or after
``max_steps`` rounds / versions.

Times are reported in virtual seconds (wall seconds divided by ``time_scale``), so the
table lines up with the simulation's; what the scale does not shrink — the server's
step, commits, evaluation, the RPCs — weighs ``1 / time_scale`` times more here than
it would in a fleet whose fits take the unscaled times.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import statistics
import tempfile
import threading
import time
from typing import Any

from _async_sim import Settings, Setup, scenario


def _worker(run: Any, time_scale: float, address: str, first: int, count: int,
            stop: Any) -> None:
    """Run clients ``first .. first + count - 1`` of ``run`` until ``stop`` is set."""
    import logging

    import torch

    from fedloom.client_sdk import Client, start_client
    from fedloom.config import ClientConfig
    from fedloom.simulations.job import Job
    from fedloom.simulations.speed import SpeedModel

    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    job = Job.from_scenario(run)
    speeds = SpeedModel.from_spec(run.speed, run.num_clients, run.seed)

    class Sleeping(Client):
        def __init__(self, index: int) -> None:
            self.index = index
            self.draws = 0
            self.inner = job.make_client(index)

        def fit(self, weights, config):  # type: ignore[no-untyped-def]
            started = time.monotonic()
            seconds = time_scale * speeds.duration(self.index, self.draws)
            self.draws += 1
            out = self.inner.fit(weights, {**job.fit_defaults(), **config})
            time.sleep(max(0.0, seconds - (time.monotonic() - started)))
            return out

        def evaluate(self, weights, config):  # type: ignore[no-untyped-def]
            return self.inner.evaluate(weights, config)

    config = ClientConfig(server_address=address, insecure=True, reconnect_initial_s=0.05,
                          reconnect_max_s=0.5)
    stop_clients = threading.Event()
    threads = [threading.Thread(
        target=start_client, args=(address, Sleeping(i)), daemon=True,
        kwargs={"name": f"client-{i:03d}", "config": config, "handle_signals": False,
                "stop": stop_clients})
        for i in range(first, first + count)]
    for t in threads:
        t.start()
    stop.wait()
    stop_clients.set()
    for t in threads:
        t.join(5)


def run_grpc(setup: Setup, settings: Settings, seed: int, *, time_scale: float,
             max_steps: int, workers: int = 4) -> dict[str, Any]:
    """One method's run over gRPC: its curve, and time, updates and fits to the target."""
    import torch

    from fedloom.config import ServerConfig
    from fedloom.server import Server
    from fedloom.simulations.job import Job

    torch.set_num_threads(1)
    run = scenario(setup, settings, seed, max_steps)
    job = Job.from_scenario(run)
    curve: list[list[float]] = []  # [virtual seconds, accuracy, updates]
    recent: collections.deque[float] = collections.deque(maxlen=setup.window)
    reached = threading.Event()
    started: list[float] = []
    handle: Any = None

    def evaluate_fn(version: int, weights: Any) -> tuple[float, dict[str, Any]]:
        now = time.monotonic()
        if not started:
            started.append(now)
        metrics = job.central_evaluate(weights)
        accuracy = float(metrics["test_accuracy"])
        history = handle.server.coordinator.history if handle is not None else []
        updates = sum(r.num_updates for r in history) + (setup.per_step if version else 0)
        curve.append([round((now - started[0]) / time_scale, 3), round(accuracy, 4), updates])
        if version:
            recent.append(accuracy)
            if len(recent) == setup.window and statistics.fmean(recent) >= setup.target:
                reached.set()
        return float(metrics["test_loss"]), {"accuracy": accuracy}

    rounds = run.rounds_config
    extra: dict[str, Any] = {} if rounds.asynchronous else {
        "fraction_fit": setup.per_step / setup.clients, "min_fit_clients": setup.per_step,
        "over_selection": settings.over_selection}
    with tempfile.TemporaryDirectory() as state:
        config = ServerConfig(
            address="127.0.0.1:0", num_rounds=max_steps, min_clients=setup.clients,
            fraction_evaluate=0.0, state_dir=state, progress=False, insecure=True,
            round_timeout_s=600.0, long_poll_s=5.0, client_timeout_s=60.0,
            keep_checkpoints=1, seed=seed, strategy=run.strategy,
            rounds=rounds, **extra)
        handle = Server(config, initial_weights=job.initial_weights(),
                        evaluate_fn=evaluate_fn).start()
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        per = -(-setup.clients // workers)
        procs = [ctx.Process(target=_worker, args=(run, time_scale, handle.address, first,
                                                   min(per, setup.clients - first), stop))
                 for first in range(0, setup.clients, per)]
        for p in procs:
            p.start()
        try:
            _wait(reached, handle, procs)
            _let_commit(handle, len(curve) - 1)
        finally:
            handle.stop()
            stop.set()
            for p in procs:
                p.join(20)
                if p.is_alive():
                    p.terminate()
        coordinator = handle.server.coordinator
        history = list(coordinator.history) if coordinator is not None else []
    return _measure(curve, history, setup)


def _wait(reached: threading.Event, handle: Any, procs: list[Any]) -> None:
    """Until the target is reached or the run ends; the clients have 180 s to join."""
    joined_by = time.monotonic() + 180.0
    while not reached.wait(0.1):
        if any(p.exitcode not in (None, 0) for p in procs):
            raise RuntimeError("a client worker process failed")
        coordinator = handle.server.coordinator
        if coordinator is not None and coordinator.finished.is_set():
            return
        if (coordinator is None or not coordinator.history) and time.monotonic() > joined_by:
            raise RuntimeError("the clients did not all join within 180 s")


def _let_commit(handle: Any, version: int) -> None:
    """Give the version that reached the target a moment to commit (its record counts
    the fits it took)."""
    coordinator = handle.server.coordinator
    deadline = time.monotonic() + 10.0
    while coordinator is not None and time.monotonic() < deadline and not any(
            r.round >= version for r in coordinator.history):
        time.sleep(0.01)


def _measure(curve: list[list[float]], history: list[Any], setup: Setup) -> dict[str, Any]:
    """The simulation side's measures, from the server's curve and committed rounds."""
    fits = [r.num_sampled for r in history if r.round > 0]
    reached: dict[str, Any] = {"time_to_target_s": None, "updates_to_target": None,
                               "fits_to_target": None, "steps_to_target": None}
    recent: collections.deque[float] = collections.deque(maxlen=setup.window)
    first = None
    for step, (now, accuracy, updates) in enumerate(curve):
        if step == 0:
            continue
        recent.append(accuracy)
        if first is None and accuracy >= setup.target:
            first = now
        if len(recent) == setup.window and statistics.fmean(recent) >= setup.target:
            reached = {"time_to_target_s": now, "updates_to_target": int(updates),
                       "fits_to_target": sum(fits[:step]), "steps_to_target": step}
            break
    stale = [float(r.fit["staleness"]) for r in history
             if r.round > 0 and isinstance(r.fit.get("staleness"), int | float)]
    return {**reached, "first_time_to_target_s": first,
            "final_accuracy": curve[-1][1] if curve else None,
            "final_time_s": curve[-1][0] if curve else None,
            "updates": sum(r.num_updates for r in history), "fits": sum(fits),
            "mean_staleness": statistics.fmean(stale) if stale else None, "curve": curve}
