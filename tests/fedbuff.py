"""FedBuff in numpy, and scripted clients: shared by the asynchronous-rounds tests and
the recovery tests.

`fedbuff_reference` is an independent numpy statement of FedBuff's rule (Nguyen et al.,
AISTATS 2022) with the strategy's example weights; `GatedClient` is a real SDK client
whose fits wait until the test releases them, so the order in which updates reach the
server is the test's script.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedloom import Weights
from fedloom.client_sdk import Client, EvaluateOutput, FitOutput


def initial_weights() -> Weights:
    rng = np.random.default_rng(7)
    return Weights({"w": rng.normal(size=(3, 4)).astype(np.float32),
                    "b": np.zeros(4, np.float32)})


def client_delta(seed: int, call: int, like: Weights) -> Weights:
    """A client's seeded delta for its ``call``-th task."""
    rng = np.random.default_rng([seed, call])
    return Weights({n: rng.normal(size=a.shape).astype(a.dtype) for n, a in like.items()})


@dataclasses.dataclass
class Arrival:
    """An update the server accepted: who, on which version, what delta, its weight."""

    client: int
    base_version: int
    delta: Weights
    num_examples: int


def polynomial(staleness: int, exponent: float = 0.5) -> float:
    return float((1.0 + staleness) ** -exponent)


def committed_versions(state_dir: Path) -> dict[int, dict[str, np.ndarray]]:
    """Every committed round (version) of the newest run in ``state_dir``, as float64
    arrays read from its verified checkpoint."""
    from fedloom.server.checkpoint import load_checkpoint
    from fedloom.server.store import RunStore

    store = RunStore(state_dir / "fedloom.db")
    try:
        rows = store.rounds(store.runs()[-1].run_id)
    finally:
        store.close()
    return {row.round: {n: np.asarray(a, np.float64) for n, a in
                        load_checkpoint(state_dir / row.checkpoint, row.sha256).weights.items()}
            for row in rows}


def fedbuff_reference(initial: Weights, arrivals: Sequence[Arrival], buffer_size: int,
                      weight: Any = polynomial, momentum: float = 0.0,
                      server_lr: float = 1.0,
                      adam: tuple[float, float, float, float] | None = None,
                      ) -> list[dict[str, np.ndarray]]:
    """The model versions FedBuff produces from ``arrivals`` in order (float64).

    Version v's step averages the buffer's deltas, each scaled by ``weight`` of its
    staleness ``(v - 1) - base_version``, weighted by ``num_examples``, then steps the
    server optimizer with that mean: SGD (``w += server_lr * mean``); with ``momentum``
    FedAvgM (``m = momentum * m + mean``, ``w += server_lr * m``); with ``adam`` =
    (eta, beta_1, beta_2, tau) FedAdam without bias correction (Reddi et al.:
    ``m = b1 m + (1 - b1) mean``, ``v = b2 v + (1 - b2) mean**2``,
    ``w += eta m / (sqrt(v) + tau)``). Moments carry from version to version.
    """
    versions = [{n: np.asarray(a, np.float64) for n, a in initial.items()}]
    first = {n: np.zeros_like(a) for n, a in versions[0].items()}
    second = {n: np.zeros_like(a) for n, a in versions[0].items()}
    buffer: list[Arrival] = []
    for arrival in arrivals:
        buffer.append(arrival)
        if len(buffer) < buffer_size:
            continue
        version = len(versions)
        total = float(sum(a.num_examples for a in buffer))
        new = {}
        for name, current in versions[-1].items():
            mean = sum(a.num_examples * weight(version - 1 - a.base_version)
                       * np.asarray(a.delta[name], np.float64) for a in buffer) / total
            if adam is not None:
                eta, beta_1, beta_2, tau = adam
                first[name] = beta_1 * first[name] + (1 - beta_1) * mean
                second[name] = beta_2 * second[name] + (1 - beta_2) * mean**2
                step = eta * first[name] / (np.sqrt(second[name]) + tau)
            else:
                first[name] = momentum * first[name] + mean
                step = server_lr * first[name]
            # the server keeps float32 weights: round each version as it does
            new[name] = (current + step).astype(np.float32).astype(np.float64)
        versions.append(new)
        buffer = []
    return versions


class GatedClient(Client):
    """Each fit computes a seeded step, then waits until the test releases it."""

    def __init__(self, seed: int, num_examples: int) -> None:
        self.seed = seed
        self.num_examples = num_examples
        self.calls: list[tuple[int, Weights, Weights]] = []  # (task round, received, new)
        self.waiting = threading.Semaphore(0)  # one release per fit that waits
        self.gate = threading.Semaphore(0)

    def fit(self, weights, config):  # type: ignore[no-untyped-def]
        delta = client_delta(self.seed, len(self.calls), weights)
        new = Weights({n: (a + delta[n]).astype(a.dtype) for n, a in weights.items()})
        self.calls.append((int(config["server_round"]), weights.copy(), new))
        self.waiting.release()
        if not self.gate.acquire(timeout=60):
            raise RuntimeError("the test never released this fit")
        return FitOutput(new, self.num_examples, {})

    def evaluate(self, weights, config):  # type: ignore[no-untyped-def]
        return EvaluateOutput(0.0, self.num_examples, {})

    def release_all(self) -> None:
        """Let every fit still waiting (or about to) return: the end of a test."""
        for _ in range(3):
            self.gate.release()

    def arrival(self, call: int, index: int) -> Arrival:
        server_round, received, new = self.calls[call]
        delta = Weights({n: new[n].astype(np.float64) - received[n] for n in new})
        return Arrival(index, server_round - 1, delta, self.num_examples)


@contextlib.contextmanager
def gated_clients(address: str, clients: Sequence[GatedClient]) -> Iterator[None]:
    """Run ``clients`` (SDK client loops in threads) against ``address``; on the way out
    stop them and release whatever fit they wait in."""
    from helpers import run_clients

    stop = threading.Event()
    threads = run_clients(address, list(clients), stop=stop)
    try:
        yield
    finally:
        stop.set()
        for client in clients:
            client.release_all()
        for t in threads:
            t.join(10)
