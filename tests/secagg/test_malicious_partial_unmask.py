"""A malicious server that unmasks an attempt through only some of its survivors, then
retries the round with the others.

Threat model: the server deviates; no client colludes. In an authenticated attempt a
survivor's neighbours reveal its self-mask share once they hold its confirmation, so
the server can read the attempt's sum while asking only a set R1 of revealers (every
survivor keeping t neighbours in R1) and leaving N1 = the rest unasked. N1 never
revealed anything, so they may join a retry of the round, and the server then holds
the retry's sum too: the difference is the sum over R1.

- For plain inputs that is the documented bound (docs/secure-aggregation.md): R1 holds
  t neighbours of every survivor, so it is a group in which every member has t
  neighbours inside — never one client's update. The first test measures it.
- A distributed-DP input (encoded by the caller) carries noise calibrated for one sum
  over the round's floor; R1's sum would carry only R1's. Such a client counts its
  confirmation as taking part: N1 refuses the retry, and the server gets one sum.
"""

from __future__ import annotations

import random

import numpy as np
from malicious_server import MaliciousServer
from secagg_driver import ids_of, make_client, make_inputs, make_setup

from fedloom.secagg import MaskExpander, RoundId, SecAggConfig, commit_self_mask, dequantize

K6 = SecAggConfig(enabled=True, neighbours=6, threshold=4, clip_range=2.0, bits=20,
                  max_weight=100.0, max_participants=64)
N, LENGTH = 24, 40


def _unasked(graph: dict[str, frozenset[str]], victim: str, want: int) -> list[str]:
    """A set N1 holding the victim such that every client keeps at least t neighbours
    outside it (so R1, the rest, can reveal every self-mask share)."""
    nodes, rng = sorted(graph), random.Random(0)
    for _ in range(2000):
        order = [v for v in nodes if v != victim]
        rng.shuffle(order)
        chosen: set[str] = set()
        for x in [victim, *order]:
            trial = chosen | {x}
            if all(len(graph[u] & trial) <= K6.neighbours - K6.threshold for u in nodes):
                chosen = trial
        if len(chosen) >= want:
            return sorted(chosen)
    raise AssertionError("no such set in this graph")


def _sum(server: MaliciousServer, members: list[str]) -> np.ndarray:
    """The server's unmasking of ``members``' masked inputs from the shares it holds
    (every member's self-mask seed, checked against its commitment)."""
    setup = server.setup
    total = np.zeros(setup.masked_length, dtype=np.uint32)
    masks = []
    for u in members:
        total += server.masked[u]
        commitment = server.shares[u].self_mask_commitment
        seed = server._secret(u, 1, lambda s, u=u, c=commitment: commit_self_mask(setup, u, s) == c)
        assert seed is not None, f"the server holds no self-mask seed of {u}"
        masks.append((seed, -1))
    MaskExpander(setup.masked_length).apply(total, masks)
    return total


def _first_attempt(inputs: dict[str, tuple[np.ndarray, int]]
                   ) -> tuple[dict, MaliciousServer, list[str], list[str]]:
    ids = ids_of(N)
    clients = {c: make_client(c, i) for i, c in enumerate(ids)}
    first = MaliciousServer(K6, clients, inputs,
                            make_setup(K6, ids, LENGTH, RoundId("run-1", 1, 1)))
    first.run_to_masked_input()
    everyone = tuple(ids)
    first.consistency(dict.fromkeys(everyone, everyone))
    unasked = _unasked(first.graph, ids[0], K6.threshold + 1)
    revealers = [c for c in ids if c not in unasked]
    first.unmask({c: everyone for c in revealers})  # the unasked get no unmask request
    assert first.refusals == {}
    return clients, first, unasked, revealers


def _retry(clients: dict, inputs: dict[str, tuple[np.ndarray, int]], members: list[str]
           ) -> MaliciousServer:
    second = MaliciousServer(K6, {c: clients[c] for c in members},
                             {c: inputs[c] for c in members},
                             make_setup(K6, members, LENGTH, RoundId("run-1", 1, 2)))
    second.run_to_masked_input()
    return second


def test_a_retry_with_the_unasked_survivors_shows_the_revealers_sum_and_no_less() -> None:
    ids = ids_of(N)
    inputs = make_inputs(ids, LENGTH, seed=7, scale=1.0)
    clients, first, unasked, revealers = _first_attempt(inputs)
    second = _retry(clients, inputs, unasked)
    members = tuple(unasked)
    second.consistency(dict.fromkeys(members, members))
    second.unmask(dict.fromkeys(members, members))
    assert second.refusals == {}
    difference = _sum(first, ids) - _sum(second, unasked)
    weighted, _ = dequantize(difference, len(revealers), K6.clip_range, K6.bits)
    expected = sum(np.clip(inputs[c][0], -K6.clip_range, K6.clip_range) * inputs[c][1]
                   / K6.max_weight for c in revealers)
    assert np.abs(weighted - expected).max() <= 2 * N * K6.quantum
    # the group the server isolated holds t neighbours of every survivor (the bound)
    assert all(len(first.graph[u] & set(revealers)) >= K6.threshold for u in ids)
    assert len(revealers) >= len(ids) - len(unasked) > K6.threshold


def test_distributed_dp_inputs_are_in_one_sum_of_the_round() -> None:
    ids = ids_of(N)
    rng = np.random.default_rng(3)
    masked_length = make_setup(K6, ids, LENGTH).masked_length
    encoded = {c: (rng.integers(0, 1 << 20, masked_length, dtype=np.uint32), 1) for c in ids}
    clients, first, unasked, _ = _first_attempt(encoded)
    assert np.array_equal(_sum(first, ids), np.sum([v for v, _ in encoded.values()], axis=0,
                                                    dtype=np.uint32))
    second = _retry(clients, encoded, unasked)
    assert set(second.refusals) == set(unasked)
    assert all("may be in the sum of an earlier attempt of round 1" in why
               for why in second.refusals.values())
    assert not second.masked  # no second sum exists
