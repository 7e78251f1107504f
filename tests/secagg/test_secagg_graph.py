"""The neighbour graph: k-regular, symmetric, connected, derived from every member's keys."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from property_budget import examples
from secagg_driver import make_setup

from fedloom.secagg import (
    AdvertisedKeys,
    RoundId,
    SecAggConfig,
    graph_seed,
    is_connected,
    neighbour_graph,
    ring_offsets,
    ring_order,
)
from fedloom.secagg._encoding import pack

CONFIG = SecAggConfig(enabled=True, neighbours=6, threshold=4, bits=16, max_participants=4096)


def _members(n: int) -> list[str]:
    return [f"c{i}" for i in range(n)]


def _bfs_component(graph: Mapping[str, frozenset[str]], start: str) -> set[str]:
    """Independent reference: breadth-first search over the whole graph."""
    seen, queue = {start}, collections.deque([start])
    while queue:
        for other in graph[queue.popleft()]:
            if other not in seen:
                seen.add(other)
                queue.append(other)
    return seen


def _check_graph(graph: Mapping[str, frozenset[str]], members: list[str], k: int) -> None:
    assert set(graph) == set(members)
    degree = min(k, len(members) - 1)
    for u, neighbours in graph.items():
        assert u not in neighbours
        assert neighbours <= set(members)
        assert len(neighbours) == degree
        assert all(u in graph[v] for v in neighbours)
    assert _bfs_component(graph, members[0]) == set(members)
    assert is_connected(graph, members)


@pytest.mark.parametrize(("n", "k"), [(12, 4), (13, 4), (50, 10), (11, 10), (200, 8),
                                      (4, 2), (3, 2), (64, 30), (32, 30)])
def test_regular_symmetric_and_connected(n: int, k: int) -> None:
    members = _members(n)
    for seed in (b"\0" * 32, b"\1" * 32, hashlib.sha256(b"x").digest()):
        _check_graph(neighbour_graph(members, k, seed), members, k)


def test_small_rounds_are_complete() -> None:
    members = _members(7)
    graph = neighbour_graph(members, 10, b"\0" * 32)
    assert all(graph[u] == frozenset(members) - {u} for u in members)
    # n = k + 1 is complete as well
    graph = neighbour_graph(_members(11), 10, b"\0" * 32)
    assert all(len(v) == 10 for v in graph.values())


def test_deterministic_from_the_seed_and_independent_of_member_order() -> None:
    members = _members(30)
    a = neighbour_graph(members, 6, b"\1" * 32)
    assert a == neighbour_graph(list(reversed(members)), 6, b"\1" * 32)
    assert a == neighbour_graph(frozenset(members), 6, b"\1" * 32)
    assert a != neighbour_graph(members, 6, b"\2" * 32)


def _roster(setup_round_id: RoundId, n: int) -> list[AdvertisedKeys]:
    return [AdvertisedKeys(setup_round_id, f"client-{i:03d}",
                           hashlib.sha256(b"c%d" % i).digest(),
                           hashlib.sha256(b"m%d" % i).digest()) for i in range(n)]


def test_the_seed_depends_on_every_members_keys_and_on_the_attempt() -> None:
    n = 20
    ids = [f"client-{i:03d}" for i in range(n)]
    setup = make_setup(CONFIG, ids, 4, RoundId("run", 1, 0))
    roster = _roster(setup.round_id, n)
    seed = graph_seed(setup, roster)
    graph = neighbour_graph(ids, CONFIG.neighbours, seed)
    seeds = {seed}
    for i in range(n):
        for field in ("cipher_public_key", "mask_public_key"):
            changed = list(roster)
            changed[i] = dataclasses.replace(roster[i], **{field: b"\x09" * 32})
            seeds.add(graph_seed(setup, changed))
    assert len(seeds) == 2 * n + 1  # every single key changes the seed
    # a member that did not advertise changes it too (the seed covers the members)
    assert graph_seed(setup, roster[1:]) not in seeds
    # a restarted round (same keys, new attempt) draws another graph
    later = make_setup(CONFIG, ids, 4, RoundId("run", 1, 1))
    later_seed = graph_seed(later, roster)
    assert later_seed != seed
    assert neighbour_graph(ids, CONFIG.neighbours, later_seed) != graph
    # and so does any other setup field, e.g. the model the round trains
    other_model = dataclasses.replace(setup, model_digest=hashlib.sha256(b"m").digest())
    assert graph_seed(other_model, roster) != seed


@settings(max_examples=examples(300), deadline=None)
@given(n=st.integers(3, 200), half_k=st.integers(1, 15), seed=st.binary(min_size=32,
                                                                          max_size=32))
def test_every_graph_is_connected_regular_and_symmetric(n: int, half_k: int,
                                                        seed: bytes) -> None:
    members = _members(n)
    _check_graph(neighbour_graph(members, 2 * half_k, seed), members, 2 * half_k)


@settings(max_examples=examples(300), deadline=None)
@given(n=st.integers(4, 400), half_k=st.integers(1, 15), seed=st.binary(min_size=32,
                                                                          max_size=32))
def test_ring_offsets_are_distinct_below_n_over_2_and_coprime_with_n(
        n: int, half_k: int, seed: bytes) -> None:
    k = 2 * half_k
    if n <= k + 1:  # complete graphs use no offsets
        n = k + 2
    offsets = ring_offsets(n, k, seed)
    assert len(offsets) == half_k == len(set(offsets))
    assert offsets == sorted(offsets)
    assert all(1 <= s <= (n - 1) // 2 for s in offsets)
    assert math.gcd(n, *offsets) == 1


def _ranked(n: int, seed: bytes) -> list[int]:
    """The documented ranking of the candidate offsets, restated."""
    return sorted(range(1, (n - 1) // 2 + 1),
                  key=lambda s: hashlib.sha256(seed + pack("offset", s)).digest())


def test_offsets_are_the_best_ranked_unless_they_share_a_factor_with_n() -> None:
    n, k = 24, 4  # candidates 1..11; half of them share a factor with 24
    replaced = kept = 0
    for i in range(200):
        seed = hashlib.sha256(b"%d" % i).digest()
        ranked = _ranked(n, seed)
        offsets = ring_offsets(n, k, seed)
        if math.gcd(n, *ranked[:2]) == 1:
            kept += 1
            assert offsets == sorted(ranked[:2])
        else:
            # the last is swapped for the best-ranked remaining offset that restores gcd 1
            replaced += 1
            swap = next(s for s in ranked[2:] if math.gcd(n, ranked[0], s) == 1)
            assert offsets == sorted([ranked[0], swap])
    assert replaced > 20 and kept > 20  # both branches were exercised


def test_an_odd_ring_draws_its_offsets_from_1_to_half_of_n_minus_1() -> None:
    """Every party derives the graph on its own, so the candidate offsets are part of the
    protocol: for odd n they run up to (n - 1) / 2 (each member's two farthest members).
    Every candidate is some seed's choice, and the drawn offsets are the documented
    best-ranked ones whenever those are coprime with n."""
    n, k = 25, 4  # candidates 1..12; only 5 and 10 share a factor with 25
    chosen: set[int] = set()
    for i in range(200):
        seed = hashlib.sha256(b"odd %d" % i).digest()
        ranked = _ranked(n, seed)
        offsets = ring_offsets(n, k, seed)
        if math.gcd(n, *ranked[:2]) == 1:
            assert offsets == sorted(ranked[:2])
        chosen.update(offsets)
    assert chosen == set(range(1, (n - 1) // 2 + 1))


def test_the_ring_is_the_documented_order() -> None:
    members, seed = _members(15), b"\3" * 32
    ring = ring_order(members, seed)
    assert ring == sorted(members, key=lambda m: hashlib.sha256(seed + pack(m)).digest())
    graph = neighbour_graph(members, 4, seed)
    offsets = ring_offsets(15, 4, seed)
    for i, member in enumerate(ring):
        assert graph[member] == {ring[(i + sign * s) % 15] for s in offsets for sign in (1, -1)}


def test_is_connected_looks_only_at_edges_inside_the_subset() -> None:
    path = {"a": frozenset("b"), "b": frozenset("ac"), "c": frozenset("b"), "d": frozenset()}
    assert is_connected(path, ["a", "b", "c"])
    assert not is_connected(path, ["a", "c"])  # only through b, which is not in the subset
    assert not is_connected(path, ["a", "b", "c", "d"])
    assert is_connected(path, []) and is_connected(path, ["d"])
    # a circulant graph whose offsets share a factor with n falls apart: 12 nodes, +-2
    ring = [f"r{i}" for i in range(12)]
    split = {ring[i]: frozenset({ring[(i + 2) % 12], ring[(i - 2) % 12]}) for i in range(12)}
    assert not is_connected(split, ring)
    assert _bfs_component(split, ring[0]) == set(ring[::2])
