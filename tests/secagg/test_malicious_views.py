"""A malicious server lies about who survived: inconsistent views, split graphs, withheld
shares.

Threat model: the server is the adversary. It may show each client its own survivor
set, declare dropouts that split the neighbour graph, withhold shares, and collude
with up to c = 2t - k - 1 clients (here one neighbour of the victim, which hands over
its shares and keys and signs any set). `MaliciousServer` drives real `SecAggClient`
objects and then tries to unmask one victim from everything it collected.

This module shows: the inconsistent-views attack reads the victim's input from
unauthenticated clients (the positive control: the attacker works, and that mode is
secure against an honest-but-curious server only) and fails against authenticated
clients, which act on a survivor set only with t neighbours' confirmations of it and
reveal a survivor's self-mask share only with its own confirmation; survivor sets that
are disconnected, too small or leave a client short of t neighbours are refused; no
amount of offline grinding gives a disconnected graph; a client refuses a set naming a
neighbour whose share was withheld from it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from malicious_server import Graph, MaliciousServer, build, plan_split
from secagg_driver import CONFIG_DIGEST, MODEL_DIGEST

from fedloom.secagg import (
    AdvertisedKeys,
    RoundId,
    RoundSetup,
    SecAggConfig,
    UnmaskRequest,
    graph_seed,
    is_connected,
    neighbour_graph,
)

K10 = SecAggConfig(enabled=True, neighbours=10, threshold=6, clip_range=2.0, bits=20,
                   max_weight=100.0, max_participants=64)
K6 = SecAggConfig(enabled=True, neighbours=6, threshold=4, clip_range=2.0, bits=20,
                  max_weight=100.0, max_participants=64)
CASES = [pytest.param(K10, 24, id="k10-t6-n24"), pytest.param(K6, 20, id="k6-t4-n20")]


def _inconsistent_views(config: SecAggConfig, n: int, *, authenticated: bool
                        ) -> tuple[MaliciousServer, str, dict[str, tuple[str, ...]]]:
    """Run the attack up to its unmask stage; returns the server, victim and plan.

    The graph is known once the keys are in, and some graphs admit no plan around any
    victim (too few helpers per neighbour): the server then starts over with fresh
    keys, as a real one would start a new attempt.
    """
    for _ in range(12):
        server = build(config, n, authenticated=authenticated)
        server.advertise()
        graph = server.graph
        found = [(v, p) for v in sorted(graph) if (p := plan_split(
            graph, v, config.threshold, config.neighbours, server.setup.min_survivors))]
        if found:
            break
    victim, plan = found[0]
    if authenticated:  # a colluding neighbour of the victim (c = 2t - k - 1 = 1)
        server.colluders = frozenset({min(graph[victim])})
    server.share_keys()
    server.masked_input()
    assert server.refusals == {}
    before = server.recover(victim)  # nothing revealed yet: the attacker needs the shares
    assert not before.recovered
    assert before.missing == f"the self-mask seed of {victim!r}"
    if authenticated:
        server.consistency(plan)
    server.unmask(plan)
    return server, victim, plan


@pytest.mark.parametrize(("config", "n"), CASES)
def test_inconsistent_views_unmask_an_unauthenticated_victim(config: SecAggConfig,
                                                             n: int) -> None:
    """Positive control: the victim's neighbours are told it survived (they reveal its
    self-mask seed), t neighbours of each of its neighbours v that v dropped (they reveal
    v's mask key, hence the pairwise seed s_Av). Unauthenticated clients check only their
    own set, each of which is plausible, so the server reads the victim's input."""
    server, victim, plan = _inconsistent_views(config, n, authenticated=False)
    assert len(set(plan.values())) > 2  # the clients were told different stories
    assert server.refusals == {}
    recovery = server.recover(victim)
    assert recovery.recovered, recovery.missing
    assert recovery.error <= config.quantum


@pytest.mark.parametrize(("config", "n"), CASES)
def test_inconsistent_views_fail_against_authenticated_clients(config: SecAggConfig,
                                                               n: int) -> None:
    server, victim, plan = _inconsistent_views(config, n, authenticated=True)
    everyone, graph, t = tuple(sorted(plan)), server.graph, config.threshold
    # each set passed its own client's checks, so every client confirmed its own story ...
    assert set(server.signed) == set(plan)
    # ... but acts on it only with t neighbours' confirmations of that very set (the
    # colluder signs whatever it is asked to)
    lied_to = {c for c, survivors in plan.items() if survivors != everyone}
    assert len(lied_to) >= config.neighbours
    refused = set()
    for cid in sorted(set(plan) - server.colluders):
        backing = sum(1 for v in graph[cid] if v in plan[cid] and (
            v in server.colluders or plan[v] == plan[cid]))
        if backing >= t:
            assert cid in server.unmasked
        else:
            assert f"only {backing} neighbours confirmed the survivor set" in \
                server.refusals[cid]
            assert server.clients[cid].setup is None  # its secrets are gone
            refused.add(cid)
    assert refused & lied_to  # the check is what stops the attack
    recovery = server.recover(victim)
    assert not recovery.recovered
    assert victim in recovery.missing


def test_a_survivors_self_mask_share_needs_its_own_confirmation() -> None:
    """Everyone confirms one set, but the server keeps the victim's own confirmation from
    its neighbours: they reveal every other survivor's self-mask share, not the victim's."""
    server = build(K10, 24)
    server.run_to_masked_input()
    everyone = tuple(sorted(server.clients))
    victim = everyone[3]
    server.consistency(dict.fromkeys(everyone, everyone))
    server.unmask({c: everyone for c in everyone if c != victim}, leave_out={victim})
    assert server.refusals == {}
    for holder in server.graph[victim]:
        owners = {share.owner for share in server.unmasked[holder].self_mask_shares}
        assert owners == set(server.graph[holder]) - {victim}
    recovery = server.recover(victim)
    assert recovery.missing == f"the self-mask seed of {victim!r}"


# -- survivor sets that split the graph -----------------------------------------------


def _split_set(server: MaliciousServer, cid: str, flaw: str) -> tuple[str, ...]:
    """A survivor set for ``cid`` with one flaw (each passes the checks before it)."""
    graph, everyone = server.graph, sorted(server.clients)
    near = sorted(graph[cid])
    if flaw == "disconnected":
        return _isolating_set(graph, cid, server.setup.threshold)
    if flaw == "below_floor":  # cid and all its neighbours, below min_survivors
        return tuple(sorted({cid, *near}))
    if flaw == "few_neighbours":  # everyone but k - t + 1 of cid's neighbours
        cut = set(near[: server.setup.neighbours - server.setup.threshold + 1])
        return tuple(c for c in everyone if c not in cut)
    if flaw == "without_client":
        return tuple(c for c in everyone if c != cid)
    assert flaw == "stranger"
    return tuple(sorted([*everyone, "client-999"]))


def _isolating_set(graph: Graph, cid: str, threshold: int) -> tuple[str, ...]:
    """``cid``, t or more of its neighbours, and a client z none of them touch."""
    for z in sorted(graph):
        free = set(graph[cid]) - graph[z] - {z}
        if z != cid and z not in graph[cid] and len(free) >= threshold:
            return tuple(sorted({cid, z} | free))
    return ()


FLAWS = {
    "disconnected": "refuses: the survivors are not connected in the neighbour graph: each "
                    "part's sum would be revealed on its own",
    "below_floor": "min_survivors = 12",
    "few_neighbours": "fewer than the threshold",
    "without_client": "leaves this client out",
    "stranger": "advertised no keys",
}


@pytest.mark.parametrize("authenticated", [True, False], ids=["authenticated", "plain"])
@pytest.mark.parametrize("flaw", sorted(FLAWS))
def test_survivor_sets_that_split_the_graph_are_refused(flaw: str,
                                                        authenticated: bool) -> None:
    config = dataclasses.replace(K6, min_survivors=12) if flaw == "below_floor" else K6
    server = build(config, 30, authenticated=authenticated)
    server.run_to_masked_input()
    # a client around which a disconnected set can be drawn (almost any)
    cid = next(c for c in sorted(server.clients)
               if _isolating_set(server.graph, c, config.threshold))
    survivors = _split_set(server, cid, flaw)
    if authenticated:  # refused when asked to confirm the set
        server.consistency({cid: survivors})
    else:  # refused when asked to act on it
        server.send_unmask(cid, UnmaskRequest(server.setup.round_id, survivors))
    assert FLAWS[flaw] in server.refusals[cid]
    assert server.clients[cid].setup is None
    assert cid not in server.signed and cid not in server.unmasked


def test_grinding_attempts_and_participants_never_yields_a_disconnected_graph() -> None:
    """A server that tries hundreds of attempt ids and participant sets offline finds no
    disconnected (or irregular) graph: the offsets are fixed up to gcd 1. Nor can it fix
    the graph by grinding: the seed also takes the keys clients make after the setup."""
    rng = np.random.default_rng(11)
    pool = [f"site-{i:02d}" for i in range(60)]
    for attempt in range(300):
        k, t = [(2, 2), (4, 3), (6, 4), (10, 6)][attempt % 4]
        config = SecAggConfig(enabled=True, neighbours=k, threshold=t, bits=20,
                              max_participants=64)
        n = int(rng.integers(t + 1, 41))
        ids = sorted(rng.choice(pool, n, replace=False).tolist())
        setup = RoundSetup.create(config, RoundId("grind", 1, attempt), ids, 8,
                                  model_digest=MODEL_DIGEST, config_digest=CONFIG_DIGEST)
        roster = [AdvertisedKeys(setup.round_id, c, rng.bytes(32), rng.bytes(32)) for c in ids]
        graph = neighbour_graph(ids, k, graph_seed(setup, roster))
        assert is_connected(graph, ids), (n, k, attempt)
        assert all(len(graph[c]) == min(k, n - 1) for c in ids)
        assert all(c in graph[v] for c in ids for v in graph[c])  # symmetric
    # one setup, fresh keys each time: the victim's neighbours are not the server's choice
    setup = RoundSetup.create(K10, RoundId("grind", 2, 1), pool[:30], 8,
                              model_digest=MODEL_DIGEST, config_digest=CONFIG_DIGEST)
    neighbourhoods = set()
    for _ in range(20):
        roster = [AdvertisedKeys(setup.round_id, c, rng.bytes(32), rng.bytes(32))
                  for c in pool[:30]]
        neighbourhoods.add(neighbour_graph(pool[:30], 10, graph_seed(setup, roster))[pool[0]])
    assert len(neighbourhoods) >= 15


# -- withheld shares ------------------------------------------------------------------


def test_a_set_naming_a_neighbour_whose_share_was_withheld_is_refused() -> None:
    """A's share goes to its neighbour w, w's share is withheld from A (A masks without
    w). A refuses to confirm a set naming w; without A's confirmation its neighbours
    reveal no share of its self-mask seed, so A's input stays hidden."""
    server = build(K10, 24)
    server.advertise()
    server.share_keys()
    victim = sorted(server.clients)[5]
    w = min(server.graph[victim])
    server.masked_input(withhold={(w, victim)})
    assert server.refusals == {}
    assert w not in server.delivered[victim]
    assert victim in server.delivered[w]
    everyone = tuple(sorted(server.clients))
    server.consistency(dict.fromkeys(everyone, everyone))
    assert server.refusals[victim] == (
        f"client {victim!r} refuses: the survivor set names the neighbours [{w!r}], whose "
        "shares the server never delivered to this client (a server that withholds shares "
        "could isolate a small group)")
    assert server.clients[victim].setup is None
    server.unmask({c: everyone for c in everyone if c != victim})
    for holder in server.graph[victim]:
        assert victim not in {s.owner for s in server.unmasked[holder].self_mask_shares}
    recovery = server.recover(victim)
    assert recovery.missing == f"the self-mask seed of {victim!r}"


def test_a_victim_told_another_set_than_its_neighbours_gets_no_confirmations() -> None:
    """The withholding server shows A a set without w (A confirms it) and the others the
    full set: A's confirmation does not cover their set, and A lacks t confirmations of
    its own."""
    server = build(K10, 24)
    server.advertise()
    server.share_keys()
    victim = sorted(server.clients)[5]
    w = min(server.graph[victim])
    server.masked_input(withhold={(w, victim)})
    everyone = tuple(sorted(server.clients))
    views = dict.fromkeys(everyone, everyone)
    views[victim] = tuple(c for c in everyone if c != w)
    server.consistency(views)
    assert server.refusals == {}  # A's set leaves w out, so A confirms it
    server.unmask(views)
    assert "only 0 neighbours confirmed" in server.refusals[victim]
    recovery = server.recover(victim)
    assert recovery.missing == f"the self-mask seed of {victim!r}"
