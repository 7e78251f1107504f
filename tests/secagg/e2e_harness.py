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
from fedloom.client_sdk import Client, ClientRunner
from fedloom.config import ClientConfig
from fedloom.messages import ResultHeader, Session, TaskHeader
from fedloom.secagg import STAGE_OF, SecAggConfig, Stage, flatten
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

    vanish_after: Stage | None = None  # cut the connection once this stage is pushed
    vanish_on: Stage | None = None  # cut it when this stage's task arrives (no answer)
    vanish_delay_s: float = 0.3  # ... this long after the push (it is then long-polling)
    vanish_rounds: tuple[int, ...] = (1,)
    stay_away: bool = True  # False: reconnect (a new session) after vanishing
    delay: dict[Stage, float] = dataclasses.field(default_factory=dict)  # before answering
    tamper: Callable[[TaskHeader, ResultHeader, memoryview | None],
                     tuple[ResultHeader, memoryview | None]] | None = None
    vanished: threading.Event = dataclasses.field(default_factory=threading.Event)


class HarnessRunner(ClientRunner):
    """A `ClientRunner` that can vanish, stall or tamper at a chosen stage."""

    def __init__(self, client: Client, config: ClientConfig, behaviour: Behaviour) -> None:
        super().__init__(client, config)
        self.behaviour = behaviour
        self.stages_pushed: list[tuple[int, Stage]] = []
        self.results: list[ResultHeader] = []  # every stage result pushed

    def _execute(self, session: Session, task: TaskHeader, weights: Weights
                 ) -> tuple[ResultHeader, memoryview | None]:
        stage = STAGE_OF.get(type(task.secagg))
        self._last = (task, stage)
        b = self.behaviour
        if stage is not None and stage is b.vanish_on and not b.vanished.is_set():
            b.vanished.set()  # crash while computing this stage: nothing is sent
            assert self._connection is not None
            self._vanish(self._connection)
            return ResultHeader(session, task.task_id, task.round, None, failure="gone"), None
        if stage is not None:
            time.sleep(self.behaviour.delay.get(stage, 0.0))
        result, payload = super()._execute(session, task, weights)
        if stage is not None and self.behaviour.tamper is not None:
            result, payload = self.behaviour.tamper(task, result, payload)
        return result, payload

    def _push(self, connection: Any, result: ResultHeader, payload: memoryview | None) -> None:
        if connection.session is None:  # vanished: a dead process sends nothing
            return
        super()._push(connection, result, payload)
        task, stage = self._last
        if stage is None:
            return
        self.stages_pushed.append((task.round, stage))
        self.results.append(result)
        b = self.behaviour
        if stage is b.vanish_after and task.round in b.vanish_rounds and not b.vanished.is_set():
            b.vanished.set()
            threading.Timer(b.vanish_delay_s, self._vanish, args=(connection,)).start()

    def _vanish(self, connection: Any) -> None:
        """Cut the connection as a killed process would: no Leave, streams just end."""
        connection.session = None  # no Leave on the way out; heartbeats stop working
        if self.behaviour.stay_away:
            self.stop.set()
        connection.close()


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
    return [i for i, r in enumerate(runners) if r._secure and r._secure.client_id in ids]
