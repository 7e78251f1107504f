"""Loopback harness for secure rounds: a real server, real client loops in threads, and
clients that vanish (their connection cut without a Leave) at a chosen stage.

With a ``pki`` folder (the `pki` fixture) client i connects over mutual TLS with the
certificate ``client-i`` and the rounds are authenticated; without one it talks
plaintext to a server that must allow unauthenticated secure rounds."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from helpers import committed_models

from fedloom import Weights
from fedloom.client_sdk import (
    CallNext,
    Client,
    ClientRunner,
    ClientStats,
    TaskContext,
    TaskResult,
)
from fedloom.config import ClientConfig
from fedloom.messages import ResultHeader, TaskHeader
from fedloom.secagg import SecAggConfig, Stage, flatten
from fedloom.server import Server


def secagg(**overrides: Any) -> SecAggConfig:
    base: dict[str, Any] = dict(enabled=True, neighbours=4, threshold=3, max_weight=100.0,
                                max_participants=64, bits=24, stage_timeout_s=20.0)
    base.update(overrides)
    return SecAggConfig(**base)


def client_config(address: str, pki: Path | None = None, index: int = 0) -> ClientConfig:
    """Fast-retrying settings: mutual TLS as ``client-<index>`` with a ``pki`` folder,
    plaintext without one."""
    settings: dict[str, Any] = dict(server_address=address,
                                    rpc_timeout_s=10.0, reconnect_initial_s=0.05,
                                    reconnect_max_s=0.3)
    if pki is None:
        settings["insecure"] = True
    else:
        settings.update(root_ca=str(pki / "ca.pem"), cert=str(pki / f"client-{index}.pem"),
                        key=str(pki / f"client-{index}.key"))
    return ClientConfig(**settings)


class RecordingClient(Client):
    """Adds a seeded normal step to every tensor; records (round, global, new, n)."""

    def __init__(self, seed: int, num_examples: int, scale: float = 1.0,
                 fit_delay_s: float = 0.0) -> None:
        self.rng = np.random.default_rng(seed)
        self.num_examples = num_examples
        self.scale = scale
        self.fit_delay_s = fit_delay_s
        self.sent: list[tuple[int, Weights, Weights, int]] = []

    def fit(self, weights, config):  # type: ignore[no-untyped-def]
        from fedloom.client_sdk import FitOutput

        time.sleep(self.fit_delay_s)
        new = Weights({n: (a + self.scale * self.rng.normal(size=a.shape)).astype(a.dtype)
                       for n, a in weights.items()})
        self.sent.append((int(config["server_round"]), weights.copy(), new, self.num_examples))
        return FitOutput(new, self.num_examples, {"train_loss": 1.0})

    def evaluate(self, weights, config):  # type: ignore[no-untyped-def]
        from fedloom.client_sdk import EvaluateOutput

        return EvaluateOutput(0.0, self.num_examples, {})

    def delta(self, server_round: int) -> tuple[np.ndarray, int] | None:
        """The flat float64 delta this client computed in ``server_round`` (if any)."""
        for r, old, new, n in self.sent:
            if r == server_round:
                return flatten(new.subtract(old)), n
        return None


@dataclasses.dataclass
class Behaviour:
    """How a test client misbehaves (nothing by default)."""

    vanish_after: Stage | None = None  # abort (no Leave) once this stage is pushed
    vanish_on: Stage | None = None  # abort when this stage's task arrives (no answer)
    vanish_delay_s: float = 0.3  # ... this long after the push (it is then long-polling)
    vanish_rounds: tuple[int, ...] = (1,)
    stay_away: bool = True  # False: run again (a new session) after vanishing
    delay: dict[Stage, float] = dataclasses.field(default_factory=dict)  # before answering
    tamper: Callable[[TaskHeader, ResultHeader, memoryview | None],
                     tuple[ResultHeader, memoryview | None]] | None = None
    vanished: threading.Event = dataclasses.field(default_factory=threading.Event)


class HarnessRunner(ClientRunner):
    """A `ClientRunner` that can vanish, stall or tamper at a chosen stage, through the
    SDK's public seams only: a middleware, ``on_pushed`` and `ClientRunner.abort`."""

    def __init__(self, client: Client, config: ClientConfig, behaviour: Behaviour) -> None:
        super().__init__(client, config, middleware=[self._misbehave], on_pushed=self._pushed)
        self.behaviour = behaviour
        self.stages_pushed: list[tuple[int, Stage]] = []
        self.results: list[ResultHeader] = []  # every stage result pushed
        self.client_id: str | None = None  # of the session of its latest secure task
        self._stopping = threading.Event()

    def run(self) -> ClientStats:
        """Run; after vanishing with ``stay_away=False``, come back as a new session."""
        while True:
            stats = super().run()
            b = self.behaviour
            if b.stay_away or not b.vanished.is_set() or self._stopping.is_set():
                return stats
            self.stop.clear()
            if self._stopping.is_set():  # asked to stop while it was clearing
                return stats

    def request_stop(self) -> None:
        self._stopping.set()
        super().request_stop()

    def _misbehave(self, context: TaskContext, call_next: CallNext) -> TaskResult:
        stage, b = context.stage, self.behaviour
        if stage is None:
            return call_next(context)
        self.client_id = context.session.client_id
        if stage is b.vanish_on and not b.vanished.is_set():
            b.vanished.set()  # crash while computing this stage: nothing is sent
            self.abort()
            return context.failure("gone")
        time.sleep(b.delay.get(stage, 0.0))
        result = call_next(context)
        if b.tamper is not None:
            result = TaskResult(*b.tamper(context.task, *result))
        return result

    def _pushed(self, context: TaskContext, result: TaskResult, *, refused: bool) -> None:
        stage, task = context.stage, context.task
        if stage is None:
            return
        self.stages_pushed.append((task.round, stage))
        self.results.append(result.header)
        b = self.behaviour
        if stage is b.vanish_after and task.round in b.vanish_rounds and not b.vanished.is_set():
            b.vanished.set()  # vanish while it waits for its next task
            threading.Timer(b.vanish_delay_s, self.abort).start()


def start_runners(address: str, clients: list[Client],
                  behaviours: dict[int, Behaviour] | None = None, pki: Path | None = None,
                  ) -> tuple[list[HarnessRunner], list[threading.Thread]]:
    behaviours = behaviours or {}
    runners = [HarnessRunner(c, client_config(address, pki, i), behaviours.get(i, Behaviour()))
               for i, c in enumerate(clients)]
    threads = [threading.Thread(target=r.run, daemon=True, name=f"client-{i}")
               for i, r in enumerate(runners)]
    for t in threads:
        t.start()
    return runners, threads


def stop_runners(runners: list[HarnessRunner], threads: list[threading.Thread]) -> None:
    for r in runners:
        r.request_stop()
    for t in threads:
        t.join(10)


def run_to_end(handle: Any, clients: list[Client], pki: Any, timeout_s: float = 60.0
               ) -> tuple[list[Any], list[HarnessRunner]]:
    """Run ``clients`` (well-behaved runners) against a started server until its run
    ends; its history, and the runners."""
    runners, threads = start_runners(handle.address, clients, pki=pki)
    history = handle.wait(timeout_s)
    stop_runners(runners, threads)
    return history, runners


def plaintext(clients: list[RecordingClient], survivors: list[int], server_round: int,
              config: SecAggConfig) -> tuple[np.ndarray, np.ndarray, float]:
    """(weighted mean, weighted sum, total weight) of the survivors' clipped deltas."""
    total_weight, weighted = 0.0, None
    for i in survivors:
        got = clients[i].delta(server_round)
        assert got is not None, f"client {i} did not train in round {server_round}"
        vector, n = got
        w = n / config.max_weight
        term = np.clip(vector, -config.clip_range, config.clip_range) * w
        weighted = term if weighted is None else weighted + term
        total_weight += w
    assert weighted is not None
    return weighted / total_weight, weighted, total_weight


def mean_tolerance(weighted: np.ndarray, total_weight: float, count: int,
                   config: SecAggConfig) -> np.ndarray:
    """Largest |decoded mean - plaintext mean| per coordinate when each of ``count``
    clients is off by less than one quantum in each coordinate and in its weight.

    Decoded sums: ``S' = S + e``, ``|e| < count * q`` (q = 2c / L, `SecAggConfig.quantum`)
    and ``W' = W + f``, ``|f| < count / L``. Then
    ``|S'/W' - S/W| = |e W - S f| / (W W') <= count (q W + |S| / L) / (W (W - count / L))``.
    """
    levels = config.levels
    slack = count * (config.quantum * total_weight + np.abs(weighted) / levels)
    return slack / (total_weight * (total_weight - count / levels))


def checkpoints(state_dir: str) -> dict[int, Weights]:
    return committed_models(state_dir)


def survivor_indices(server: Server, runners: list[HarnessRunner]) -> list[int]:
    assert server.coordinator is not None
    result = server.coordinator.driver.last_result
    assert result is not None
    ids = set(result.survivors)
    return [i for i, r in enumerate(runners) if r.client_id in ids]
