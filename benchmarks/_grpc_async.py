"""The gRPC side of the asynchronous-rounds experiment (`benchmarks/async.py`).

A real fedloom server (in this process) and real SDK clients (`start_client`, in
worker processes, one thread per client) on loopback. Each client trains the digits MLP
on its shard, then sleeps out the rest of its training time: its speed is a per-client
mean (``slow_factor`` times longer for the slow share) with a lognormal draw per task,
seeded, as the simulation's speed model draws it. The server evaluates every version on
the central test set; the run stops when the accuracy reaches ``target`` (or at
``max_seconds``). Reported: the wall-clock time from the first round to the target, the
client updates the server had taken by then, the versions, and the accuracy curve.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Fleet:
    """The simulated fleet: data split, client count and speeds."""

    clients: int = 100
    slow_fraction: float = 0.2
    slow_factor: float = 10.0
    mean_s: float = 0.3  # mean seconds of one fast fit
    sigma: float = 0.3  # lognormal spread of each fit's time
    alpha: float = 0.5  # Dirichlet label skew of the partition
    seed: int = 0
    lr: float = 0.05
    batch_size: int = 32
    local_epochs: int = 1

    def slow_clients(self) -> set[int]:
        rng = np.random.default_rng([self.seed, 1])
        count = round(self.clients * self.slow_fraction)
        return {int(i) for i in rng.choice(self.clients, size=count, replace=False)}

    def fit_seconds(self, client: int, call: int, slow: bool) -> float:
        """One fit's duration: lognormal with mean ``mean_s`` (times the slow factor)."""
        mean = self.mean_s * (self.slow_factor if slow else 1.0)
        rng = np.random.default_rng([self.seed, 2, client, call])
        mu = math.log(mean) - self.sigma**2 / 2
        return float(rng.lognormal(mu, self.sigma))


def _shards(fleet: Fleet) -> tuple[Any, list[np.ndarray]]:
    from fedloom.simulations.datasets import load_digits
    from fedloom.simulations.partition import dirichlet_partition

    data = load_digits(seed=fleet.seed)
    parts = dirichlet_partition(data.y_train, fleet.clients, fleet.alpha, seed=fleet.seed)
    return data, parts


def _worker(address: str, fleet: Fleet, first: int, count: int, stop: Any) -> None:
    """Run clients ``first .. first + count - 1`` until ``stop`` is set."""
    import logging

    import torch

    from fedloom.client_sdk import Client, start_client
    from fedloom.config import ClientConfig
    from fedloom.simulations.models import make_torch_client

    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    data, parts = _shards(fleet)
    slow = fleet.slow_clients()

    class Sleeping(Client):
        def __init__(self, index: int) -> None:
            idx = parts[index]
            self.index = index
            self.calls = 0
            self.inner = make_torch_client(
                data.x_train[idx], data.y_train[idx], batch_size=fleet.batch_size,
                local_epochs=fleet.local_epochs, lr=fleet.lr, seed=fleet.seed + index)

        def fit(self, weights, config):  # type: ignore[no-untyped-def]
            started = time.monotonic()
            duration = fleet.fit_seconds(self.index, self.calls, self.index in slow)
            self.calls += 1
            out = self.inner.fit(weights, config)
            time.sleep(max(0.0, duration - (time.monotonic() - started)))
            return out

        def evaluate(self, weights, config):  # type: ignore[no-untyped-def]
            return self.inner.evaluate(weights, config)

    config = ClientConfig(server_address=address, insecure=True, reconnect_initial_s=0.05,
                          reconnect_max_s=0.5)
    stop_event = threading.Event()
    threads = [threading.Thread(
        target=start_client, args=(address, Sleeping(i)), daemon=True,
        kwargs={"name": f"client-{i:03d}", "config": config, "handle_signals": False,
                "stop": stop_event})
        for i in range(first, first + count)]
    for t in threads:
        t.start()
    stop.wait()
    stop_event.set()
    for t in threads:
        t.join(5)


def _wait(reached: threading.Event, started: list[float], max_seconds: float,
          procs: list[Any]) -> None:
    """Until the target is reached, or ``max_seconds`` after the first round (the clients'
    start-up, before it, is bounded separately)."""
    startup_deadline = time.monotonic() + 180.0
    while not reached.wait(0.1):
        if any(p.exitcode not in (None, 0) for p in procs):
            raise RuntimeError("a client worker process failed")
        if started and time.monotonic() - started[0] > max_seconds:
            return
        if not started and time.monotonic() > startup_deadline:
            raise RuntimeError("the clients did not all join within 180 s")


def run_grpc(name: str, rounds: Mapping[str, Any], fleet: Fleet, *, target: float,
             max_seconds: float, workers: int = 4) -> dict[str, Any]:
    """One setting over gRPC: ``rounds`` holds the server's settings that differ
    (``fraction_fit``, ``min_fit_clients``, ``over_selection``, ``rounds``: the
    ``[rounds]`` table). Returns its curve and time to ``target``."""
    import torch

    from fedloom.config import RoundsConfig, ServerConfig, StrategyConfig
    from fedloom.server import Server
    from fedloom.simulations.models import initial_weights, make_mlp

    torch.set_num_threads(1)
    data, _ = _shards(fleet)
    model = make_mlp(data.num_features, 64, data.num_classes)
    initial = initial_weights(model, fleet.seed)
    x_test = torch.from_numpy(data.x_test)
    y_test = torch.from_numpy(data.y_test)
    curve: list[tuple[float, int, float]] = []  # (seconds since round 1, version, accuracy)
    started: list[float] = []
    reached = threading.Event()

    def evaluate_fn(version: int, weights: Any) -> tuple[float, dict[str, float]]:
        now = time.monotonic()
        if not started:
            started.append(now)
        model.load_state_dict({k: torch.from_numpy(np.asarray(v).copy())
                               for k, v in weights.items()})
        with torch.no_grad():
            logits = model(x_test)
            loss = float(torch.nn.functional.cross_entropy(logits, y_test))
            accuracy = float((logits.argmax(1) == y_test).float().mean())
        curve.append((now - started[0], version, accuracy))
        if accuracy >= target:
            reached.set()
        return loss, {"accuracy": accuracy}

    settings = dict(rounds)
    rounds_table = settings.pop("rounds", {})
    with tempfile.TemporaryDirectory() as state:
        config = ServerConfig(
            address="127.0.0.1:0", num_rounds=100_000, min_clients=fleet.clients,
            fraction_evaluate=0.0, state_dir=state, progress=False, insecure=True,
            round_timeout_s=600.0, long_poll_s=5.0, client_timeout_s=60.0,
            heartbeat_interval_s=2.0, keep_checkpoints=1, seed=fleet.seed,
            strategy=StrategyConfig("fedavg"), rounds=RoundsConfig(**rounds_table),
            **settings)
        handle = Server(config, initial_weights=initial, evaluate_fn=evaluate_fn).start()
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        per = -(-fleet.clients // workers)
        procs = [ctx.Process(target=_worker, args=(handle.address, fleet, first,
                                                   min(per, fleet.clients - first), stop))
                 for first in range(0, fleet.clients, per)]
        for p in procs:
            p.start()
        try:
            _wait(reached, started, max_seconds, procs)
            coordinator = handle.server.coordinator
            if reached.is_set() and coordinator is not None:  # let that version commit
                version = next(v for _, v, a in curve if a >= target)
                deadline = time.monotonic() + 10.0
                while time.monotonic() < deadline and not any(
                        r.round >= version for r in coordinator.history):
                    time.sleep(0.01)
        finally:
            handle.stop()
            stop.set()
            for p in procs:
                p.join(20)
                if p.is_alive():
                    p.terminate()
        coordinator = handle.server.coordinator
        history = coordinator.history if coordinator is not None else []
    updates_by_version: dict[int, int] = {}
    total = 0
    for record in history:
        total += record.num_updates
        updates_by_version[record.round] = total
    hit = next(((t, v) for t, v, a in curve if a >= target), None)
    return {
        "setting": name,
        "side": "grpc",
        "server": dict(rounds),
        "target": target,
        "seconds_to_target": hit[0] if hit else None,
        "updates_to_target": updates_by_version.get(hit[1]) if hit else None,
        "versions_to_target": hit[1] if hit else None,
        "final_accuracy": curve[-1][2] if curve else None,
        "curve": [{"seconds": t, "version": v, "accuracy": a} for t, v, a in curve],
    }
