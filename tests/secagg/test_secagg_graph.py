"""The neighbour graph: k-regular, symmetric, deterministic from the public seed."""

from __future__ import annotations

import pytest

from fedloom.secagg import RoundId, RoundSetup, SecAggConfig, neighbour_graph


def _setup(n: int, k: int, t: int, seed: bytes | None = None, attempt: int = 0) -> RoundSetup:
    config = SecAggConfig(neighbours=k, threshold=t, bits=16, max_participants=4096)
    return RoundSetup.create(config, RoundId("run", 1, attempt),
                             [f"c{i}" for i in range(n)], 4, graph_seed=seed)


@pytest.mark.parametrize(("n", "k", "t"), [(12, 4, 3), (13, 4, 3), (50, 10, 6), (11, 10, 6),
                                          (200, 8, 5)])
def test_regular_and_symmetric(n: int, k: int, t: int) -> None:
    graph = neighbour_graph(_setup(n, k, t))
    degree = min(k, n - 1)
    for u, neighbours in graph.items():
        assert u not in neighbours
        assert len(neighbours) == degree
        assert all(u in graph[v] for v in neighbours)


def test_small_rounds_are_complete() -> None:
    graph = neighbour_graph(_setup(7, 10, 6))
    assert all(len(v) == 6 for v in graph.values())


def test_deterministic_from_the_seed() -> None:
    a = neighbour_graph(_setup(30, 6, 4, seed=b"\x01" * 32))
    b = neighbour_graph(_setup(30, 6, 4, seed=b"\x01" * 32))
    c = neighbour_graph(_setup(30, 6, 4, seed=b"\x02" * 32))
    assert a == b and a != c
    # the default seed depends on the attempt: a restarted round gets another graph
    assert neighbour_graph(_setup(30, 6, 4, attempt=0)) != neighbour_graph(
        _setup(30, 6, 4, attempt=1))
