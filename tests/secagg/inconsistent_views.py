"""The inconsistent-views attack's plan: the survivor set a malicious server shows each
client so that a victim's neighbours reveal both of its secrets, while every set passes
the client's own checks (`plan_split`)."""

from __future__ import annotations

from collections.abc import Mapping

from fedloom.secagg import is_connected

Graph = Mapping[str, frozenset[str]]


def plan_split(graph: Graph, victim: str, threshold: int, neighbours: int,
               min_survivors: int) -> dict[str, tuple[str, ...]] | None:
    """The inconsistent-views attack on ``victim``: every client's survivor set.

    Every neighbour of the victim is told the victim survived; for each neighbour v,
    ``threshold`` of v's neighbours (the victim may be one) are told v dropped (so they
    reveal shares of v's mask key). Each client is left at least ``threshold`` neighbours and a
    connected set of at least ``min_survivors``, so every set passes a client's own
    checks. The helpers are assigned by a max flow (each neighbour v needs t of its
    neighbours, each helper may be told of at most k - t drops). None if the graph
    admits no such assignment around this victim.
    """
    dropped = _assign_helpers(graph, victim, threshold, neighbours - threshold)
    if dropped is None:
        return None
    everyone = frozenset(graph)
    plan = {}
    for cid in sorted(graph):
        survivors = everyone - dropped.get(cid, set())
        if len(survivors) < min_survivors or not is_connected(graph, survivors):
            return None
        plan[cid] = tuple(sorted(survivors))
    return plan


def _assign_helpers(graph: Graph, victim: str, need: int,
                    capacity: int) -> dict[str, set[str]] | None:
    """helper -> the victim's neighbours it is told dropped (a bipartite b-matching,
    by augmenting paths); None if some neighbour cannot get ``need`` helpers."""
    targets = sorted(graph[victim])
    helps: dict[str, set[str]] = {c: set() for c in graph}  # helper -> targets assigned

    def augment(v: str) -> bool:
        # BFS over alternating paths: target -> helper (unused edge) -> target (used edge)
        parent: dict[tuple[str, str], tuple[str, str] | None] = {("t", v): None}
        queue = [("t", v)]
        while queue:
            kind, node = queue.pop(0)
            if kind == "t":
                for h in sorted(graph[node]):
                    if node not in helps[h] and ("h", h) not in parent:
                        parent[("h", h)] = (kind, node)
                        if len(helps[h]) < capacity:
                            _flip(parent, ("h", h), helps)
                            return True
                        queue.append(("h", h))
            else:
                for u in sorted(helps[node]):
                    if ("t", u) not in parent:
                        parent[("t", u)] = (kind, node)
                        queue.append(("t", u))
        return False

    for v in targets:
        for _ in range(need):
            if not augment(v):
                return None
    return helps


def _flip(parent: Mapping[tuple[str, str], tuple[str, str] | None], end: tuple[str, str],
          helps: dict[str, set[str]]) -> None:
    """Apply an augmenting path: its unused edges become used and vice versa."""
    node: tuple[str, str] | None = end
    while node is not None:
        previous = parent[node]
        if previous is None:
            break
        if node[0] == "h":  # edge target(previous) -> helper(node): now used
            helps[node[1]].add(previous[1])
        else:  # edge helper(previous) -> target(node): no longer used
            helps[previous[1]].discard(node[1])
        node = previous
