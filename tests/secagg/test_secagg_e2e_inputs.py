"""Secure rounds over loopback gRPC with bad or late masked inputs, and a norm bound.

A masked input of the wrong length, for the wrong round or attempt, or arriving after
the survivors were published is refused and its client counts as dropped; the round
completes over the others (their masks against it are removed) and equals the plaintext
mean over them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from e2e_harness import (
    Behaviour,
    HarnessRunner,
    RecordingClient,
    checkpoints,
    mean_tolerance,
    plaintext,
    secagg,
    start_runners,
    stop_runners,
    survivor_indices,
)
from helpers import small_weights

from fedloom.config import StrategyConfig
from fedloom.messages import MaskedInputHeader, ResultHeader, TaskHeader
from fedloom.payload import PayloadInfo
from fedloom.secagg import RoundId, SecAggConfig, Stage, flatten
from fedloom.server import Server
from fedloom.strategies import clip_update
from fedloom.weights import TensorSpec

Tamper = Callable[[TaskHeader, ResultHeader, memoryview | None],
                  tuple[ResultHeader, memoryview | None]]


def _wrong_length(task: TaskHeader, result: ResultHeader, payload: memoryview | None
                  ) -> tuple[ResultHeader, memoryview | None]:
    if not isinstance(result.secagg, MaskedInputHeader) or payload is None:
        return result, payload
    short = np.frombuffer(payload, "<u4")[:-1].copy()
    data = memoryview(short.data).cast("B")
    info = PayloadInfo.describe((TensorSpec("masked", "uint32", (short.size,)),), data)
    return dataclasses.replace(result, update=info), data


def _renamed(change: Callable[[RoundId], RoundId]) -> Tamper:
    def tamper(task: TaskHeader, result: ResultHeader, payload: memoryview | None
               ) -> tuple[ResultHeader, memoryview | None]:
        header = result.secagg
        if not isinstance(header, MaskedInputHeader):
            return result, payload
        return dataclasses.replace(
            result, secagg=MaskedInputHeader(change(header.round_id), header.client_id)), payload

    return tamper


TAMPERS = {
    "wrong length": _wrong_length,
    "another attempt": _renamed(lambda r: RoundId(r.run_id, r.server_round, r.attempt + 1)),
    "another round": _renamed(lambda r: RoundId(r.run_id, r.server_round + 1, r.attempt)),
}


@dataclasses.dataclass
class Outcome:
    server: Server
    runners: list[HarnessRunner]
    clients: list[RecordingClient]
    history: list[dict[str, Any]]
    state_dir: str
    sa: SecAggConfig


def _run(server_config, tls: tuple[dict[str, Any], Path], behaviours: dict[int, Behaviour],  # type: ignore[no-untyped-def]
         **overrides) -> Outcome:
    """One secure round of 7 clients over mutual TLS (``tls``: the mtls and pki fixtures)."""
    mtls, pki = tls
    sa = overrides.pop("secure_aggregation", secagg())
    config = server_config(**mtls, num_rounds=1, min_clients=7, min_fit_clients=6,
                           fraction_evaluate=0.0, secure_aggregation=sa, **overrides)
    server = Server(config, initial_weights=small_weights())
    handle = server.start()
    clients = [RecordingClient(seed=i, num_examples=8 + 5 * i) for i in range(7)]
    runners, threads = start_runners(handle.address, clients, behaviours, pki=pki)
    history = handle.wait(60)
    stop_runners(runners, threads)
    return Outcome(server, runners, clients, history, config.state_dir, sa)


@pytest.mark.parametrize("kind", sorted(TAMPERS))
def test_a_bad_masked_input_is_dropped_and_the_round_completes(server_config, mtls, pki,
                                                             kind: str) -> None:  # type: ignore[no-untyped-def]
    out = _run(server_config, (mtls, pki), {3: Behaviour(tamper=TAMPERS[kind])})
    assert out.history[0].status == "ok", out.history
    info = out.history[0].secure_aggregation
    assert (info["survivors"], info["dropped"]) == (6, 1)  # its keys were shared: dropped
    assert out.runners[3].stats.refused == 1  # the server refused its upload
    survivors = survivor_indices(out.server, out.runners)
    assert survivors == [0, 1, 2, 4, 5, 6]
    sa = out.sa
    mean, weighted, total_weight = plaintext(out.clients, survivors, 1, sa)
    saved = checkpoints(out.state_dir)
    got = flatten(saved[1].subtract(saved[0]))
    assert np.all(np.abs(got - mean) <= mean_tolerance(weighted, total_weight, 6, sa) + 1e-6)


def test_no_masked_input_is_taken_after_the_survivors_are_published(  # type: ignore[no-untyped-def]
        server_config, mtls, pki) -> None:
    """The masked-input stage closes at its deadline (the round's, 1.5 s: the stage where
    clients train) without the slow client; its input, arriving later, is refused and it
    counts as dropped."""
    out = _run(server_config, (mtls, pki), {5: Behaviour(delay={Stage.MASKED_INPUT: 3.0})},
               round_timeout_s=1.5)
    assert out.history[0].status == "ok", out.history
    info = out.history[0].secure_aggregation
    assert (info["survivors"], info["dropped"]) == (6, 1)
    assert out.runners[5].stats.refused == 1
    survivors = survivor_indices(out.server, out.runners)
    assert 5 not in survivors and len(survivors) == 6


def test_a_norm_bound_becomes_clipping_on_the_client(server_config, mtls, pki) -> None:  # type: ignore[no-untyped-def]
    """With max_update_norm = 1, each client clips its delta before masking; the new
    model is the weighted mean of the clipped deltas (oracle: `clip_update`)."""
    out = _run(server_config, (mtls, pki), {},
               strategy=StrategyConfig("fedavg", {"max_update_norm": 1.0}))
    assert out.history[0].status == "ok"
    assert "num_clipped" not in out.history[0].fit  # the server sees no update to clip
    sa, clients = out.sa, out.clients
    total_weight, weighted = 0.0, np.zeros(15)
    for c in clients:
        _round, old, new, n = c.sent[0]
        delta = new.subtract(old)
        assert flatten(delta) @ flatten(delta) > 4.0  # the bound bites
        weighted += flatten(clip_update(delta, 1.0)) * n / sa.max_weight
        total_weight += n / sa.max_weight
    mean = weighted / total_weight
    saved = checkpoints(out.state_dir)
    got = flatten(saved[1].subtract(saved[0]))
    assert np.all(np.abs(got - mean) <= mean_tolerance(weighted, total_weight, 7, sa) + 1e-6)
    unclipped, _, _ = plaintext(clients, list(range(7)), 1, sa)
    assert np.abs(got - unclipped).max() > 0.05
