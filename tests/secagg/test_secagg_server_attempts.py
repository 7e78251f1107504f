"""When a SecAgg+ attempt can finish and when it cannot, decided before any share is
revealed; and the state a running attempt shows."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from clients_defend_support import BOTH_MODES, CONFIG
from secagg_driver import (
    Round,
    answer,
    assert_matches_plaintext,
    close_masked_input,
    fresh_keys,
    ids_of,
    make_inputs,
    make_setup,
    pki,
    run,
    setup_round,
)

from fedloom.errors import SecureAggregationError
from fedloom.secagg import (
    KeyOffer,
    MaskedInputReply,
    RoundId,
    SecAggServer,
    SecAggStatus,
    Stage,
    is_connected,
)
from fedloom.secagg._server_checks import unrecoverable

Graph = Mapping[str, frozenset[str]]



# -- when an attempt can finish, and when it cannot ----------------------------------


def test_can_finish_exactly_when_every_owed_secret_has_t_shares() -> None:
    """Never before unmask nor after the round; in unmask, as soon as every survivor's
    self-mask seed and the dropped client's mask key have t revealed shares (counted
    here from the graph: a holder reveals the secrets of its neighbours)."""
    ids = ids_of(10)
    dropped, t = ids[9], CONFIG.threshold
    ranges: list[tuple[int, int]] = []

    def recording_map(fn: Any, spans: Any) -> Any:
        spans = list(spans)
        ranges.extend(spans)
        return map(fn, spans)

    rnd = setup_round(CONFIG, make_inputs(ids, 5), authenticated=False)
    server = SecAggServer(rnd.server.setup, map_fn=recording_map)
    rnd = Round(server, rnd.clients, rnd.inputs)
    for stage in (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT):
        assert server.stage is stage and not server.can_finish()
        run(rnd, drop_at={dropped: Stage.MASKED_INPUT},
            stop_at=Stage.UNMASK if stage is Stage.MASKED_INPUT else
            (Stage.SHARE_KEYS if stage is Stage.ADVERTISE_KEYS else Stage.MASKED_INPUT))
    assert server.stage is Stage.UNMASK and not server.can_finish()
    survivors, graph, revealed = server.survivors, server.graph, set()
    owed = [*survivors, dropped]
    # the holders of the dropped client's mask key last, and of them some held back to
    # the very end: the t-th share of that key is the last one owed, so can_finish
    # turns True with exactly t of them
    pending, holders = server.pending(), server.pending() & graph[dropped]
    held = next(set(h) for h in itertools.combinations(sorted(holders), len(holders) - t)
                if all(len(graph[v] & (pending - set(h))) >= t for v in survivors))
    order = sorted(pending, key=lambda c: (c in holders, c in held, c))
    for cid in order:
        server.receive(cid, rnd.clients[cid].handle(server.request_for(cid)))
        revealed.add(cid)
        assert server.can_finish() == all(len(graph[v] & revealed) >= t for v in owed)
        assert server.can_finish() == (len(graph[dropped] & revealed) >= t)
    server.advance()
    assert server.status is SecAggStatus.SUCCEEDED and not server.can_finish()
    assert ranges == [(0, server.setup.masked_length)]  # the final unmasking ran on map_fn
    assert_matches_plaintext(CONFIG, rnd, ids[:9])


def _vanish_around(graph: Graph, t: int, with_neighbours: bool) -> tuple[str, set[str]] | None:
    """(u, the clients that vanish before their masked input) such that u vanishes and
    either its neighbours all vanish after their masked input (``with_neighbours``
    False) or they all vanish with it before theirs (True), while every other secret
    keeps t holders and the survivors stay connected. A deterministic search."""
    everyone = set(graph)
    for u in sorted(graph):
        before = {u, *graph[u]} if with_neighbours else {u}
        survivors = everyone - before
        alive = survivors if with_neighbours else survivors - graph[u]
        needed = survivors | {v for v in before - {u} if graph[v] & survivors}
        if (all(len(graph[v] & alive) >= t for v in needed)
                and is_connected(graph, frozenset(survivors))):
            return u, before
    return None


def _round_vanishing_around(with_neighbours: bool, authenticated: bool
                            ) -> tuple[Round, str, set[str]]:
    # The graph comes from the clients' fresh keys. It is circulant (every client sees
    # the same shape): with 60 clients about half the graphs have such clients, so 30
    # draws all miss with a probability of about 1e-9.
    for attempt in range(1, 31):
        rnd = run(setup_round(CONFIG, make_inputs(ids_of(60), 4), RoundId("run-1", 1, attempt),
                              authenticated=authenticated), stop_at=Stage.MASKED_INPUT)
        found = _vanish_around(rnd.server.graph, CONFIG.threshold, with_neighbours)
        if found is not None:
            return rnd, *found
    raise AssertionError("no graph in 30 rounds has such a client")


@BOTH_MODES
def test_a_dropped_client_whose_surviving_neighbours_all_vanished_fails_before_unmask(
        authenticated: bool) -> None:
    """u vanishes before its masked input; each of its neighbours sends its masked input
    (masked against u) and vanishes: no one is left to reveal u's mask key, so the sum
    can never be unmasked. The server must give up when masked_input closes, before
    any survivor reveals a share (a client that revealed takes part in no retry)."""
    rnd, u, before = _round_vanishing_around(False, authenticated)
    after = tuple(sorted(rnd.server.graph[u]))
    with pytest.raises(SecureAggregationError):
        close_masked_input(rnd, tuple(before), after)
    why = (f"the mask key of {u!r} cannot be recovered: 0 of its neighbours survive, the "
           f"threshold is {CONFIG.threshold}")
    assert rnd.server.failure == why and rnd.server.status is SecAggStatus.FAILED
    assert rnd.server.revealed == set()


def test_a_dropped_client_without_surviving_neighbours_is_not_waited_for() -> None:
    """u vanishes together with all its neighbours: no survivor masked against u, so
    its mask key is not needed; the round finishes over the rest."""
    rnd, u, before = _round_vanishing_around(True, authenticated=False)
    server = rnd.server
    close_masked_input(rnd, tuple(before), ())
    for cid in sorted(server.pending()):
        server.receive(cid, rnd.clients[cid].handle(server.request_for(cid)))
    assert server.can_finish()
    server.advance()
    assert u in server.result.dropped
    assert_matches_plaintext(CONFIG, rnd, sorted(set(rnd.inputs) - before))


@pytest.mark.parametrize("advertised", [CONFIG.threshold, CONFIG.threshold + 1])
def test_an_attempt_needs_t_plus_one_advertisers(advertised: int) -> None:
    ids = ids_of(8)
    silent = ids[advertised:]
    rnd = setup_round(CONFIG, make_inputs(ids, 4), authenticated=False)
    if advertised == CONFIG.threshold:
        with pytest.raises(SecureAggregationError):
            run(rnd, drop_at=dict.fromkeys(silent, Stage.ADVERTISE_KEYS))
        assert rnd.server.failure == (f"only {advertised} clients advertised keys; at least "
                                      f"{CONFIG.threshold + 1} are needed")
        assert rnd.server.failed_clients == set(silent)
    else:
        run(rnd, drop_at=dict.fromkeys(silent, Stage.ADVERTISE_KEYS), stop_at=Stage.SHARE_KEYS)
        assert rnd.server.pending() == frozenset(ids[:advertised])


def test_an_authenticated_attempt_fails_without_every_participants_keys() -> None:
    ids = ids_of(12)
    silent = ids[6:]
    rnd = setup_round(CONFIG, make_inputs(ids, 4))
    for cid in ids[:6]:
        rnd.server.receive(cid, answer(rnd, cid))
    rnd.server.drop(silent[-1])  # one vanished, the others said nothing
    with pytest.raises(SecureAggregationError):
        rnd.server.advance()
    assert rnd.server.failure == (
        f"6 participants did not advertise keys ({silent[:5]}); the graph of an "
        "authenticated attempt comes from every participant's keys, so a new attempt "
        "starts without them")
    assert rnd.server.failed_clients == set(silent)


def test_failed_clients_gather_across_stages() -> None:
    ids = ids_of(10)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 4), authenticated=False),
              drop_at={ids[0]: Stage.ADVERTISE_KEYS, ids[1]: Stage.SHARE_KEYS},
              stop_at=Stage.MASKED_INPUT)
    assert {ids[0], ids[1]} <= rnd.server.failed_clients
    assert rnd.server.failed_clients.isdisjoint(rnd.server.pending())


def test_too_few_sharers_left_after_pruning_fail_the_attempt() -> None:
    """Four sharers of eight: none has t = 4 neighbours that shared too."""
    ids = ids_of(8)
    rnd = setup_round(CONFIG, make_inputs(ids, 4), authenticated=False)
    with pytest.raises(SecureAggregationError):
        run(rnd, drop_at=dict.fromkeys(ids[4:], Stage.SHARE_KEYS))
    assert rnd.server.failure == ("only 0 clients shared keys with at least 4 neighbours "
                                  "that did too; at least 5 are needed")
    assert rnd.server.failed_clients == set(ids)


def test_survivors_that_do_not_confirm_fail_the_attempt_and_are_named() -> None:
    ids = ids_of(12)
    silent = ids[6:]
    rnd = setup_round(CONFIG, make_inputs(ids, 4))
    with pytest.raises(SecureAggregationError):
        run(rnd, drop_at=dict.fromkeys(silent, Stage.CONSISTENCY))
    assert rnd.server.failure == (
        f"survivors {silent[:5]} did not confirm the survivor set (their neighbours reveal a "
        "survivor's self-mask share only with its own confirmation)")
    assert set(silent) <= rnd.server.failed_clients


def test_an_unmask_closed_before_t_shares_fails_naming_the_secret() -> None:
    ids = ids_of(8)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 4), authenticated=False),
              stop_at=Stage.UNMASK)
    server = rnd.server
    holder = min(server.graph[ids[0]])
    server.receive(holder, rnd.clients[holder].handle(server.request_for(holder)))
    with pytest.raises(SecureAggregationError):
        server.advance()  # the deadline passed with one reply
    assert server.failure == ("self-mask seed of 'client-000': 1 shares revealed, the "
                              f"threshold is {CONFIG.threshold}")
    assert server.culprits == set()


@pytest.mark.parametrize("left", [0, 1], ids=["zero", "one-quantum"])
def test_a_total_weight_spoiled_to_zero_fails_and_one_quantum_is_enough(left: int) -> None:
    """An adversarial client that knows the others' weights (here: from a first run over
    the same inputs) takes them off its masked weight. A zero total weight fails the
    attempt (no mean of nothing); the smallest positive one, 1 / levels, is a result."""
    ids = ids_of(8)
    inputs = make_inputs(ids, 4)
    honest = run(setup_round(CONFIG, inputs, authenticated=False)).server.result
    weight = int(honest.total[-1])  # every client's quantized weight, summed
    assert honest.total_weight == weight / CONFIG.levels

    def spoil(stage: Stage, cid: str, reply: Any) -> Any:
        if stage is not Stage.MASKED_INPUT or cid != ids[0]:
            return reply
        masked = reply.masked.copy()
        masked[-1] -= np.uint32(weight - left)  # modulo 2**32, as the sum is
        return MaskedInputReply(reply.round_id, cid, masked)

    rnd = setup_round(CONFIG, inputs, round_id=RoundId("run-1", 2, 1), authenticated=False)
    if left == 0:
        with pytest.raises(SecureAggregationError):
            run(rnd, tamper_reply=spoil)
        assert rnd.server.failure == "the survivors' total weight decoded to zero"
        with pytest.raises(SecureAggregationError, match=r"no result \(status failed: the "):
            rnd.server.result  # noqa: B018
    else:
        run(rnd, tamper_reply=spoil)
        assert rnd.server.result.total_weight == 1 / CONFIG.levels


# -- the state an attempt shows ---------------------------------------------------------


def test_a_running_attempt_has_no_result_survivors_failure_or_culprits() -> None:
    ids = ids_of(8)
    rnd = setup_round(CONFIG, make_inputs(ids, 4), authenticated=False)
    server = rnd.server
    with pytest.raises(SecureAggregationError) as info:
        server.result  # noqa: B018
    assert str(info.value) == "the round has no result (status running)"
    assert server.failure == "" and server.survivors == frozenset()
    run(rnd)
    assert server.culprits == set() and server.failure == ""


def test_offers_of_clients_outside_the_attempt_are_passed_over() -> None:
    """The next round, without client-000, gets the offers every client made in the
    last one: client-000's is passed over, everyone else's used."""
    ids = ids_of(8)
    first = run(setup_round(CONFIG, make_inputs(ids, 4), authenticated=False))
    rest = {c: first.inputs[c] for c in ids[1:]}
    second = setup_round(CONFIG, rest, round_id=RoundId("run-1", 2, 1),
                         clients={c: first.clients[c] for c in rest},
                         offers=first.server.new_offers, authenticated=False)
    assert second.server.stage is Stage.ADVERTISE_KEYS and second.server.pending() == frozenset()
    run(second)
    assert_matches_plaintext(CONFIG, second, ids[1:])


def test_an_authenticated_server_is_refused_without_the_client_ca_or_with_offers() -> None:
    setup = make_setup(CONFIG, ids_of(8), 4)
    with pytest.raises(SecureAggregationError) as info:
        SecAggServer(setup)
    assert str(info.value) == ("an authenticated attempt needs the client CA to check the "
                               "participants' signatures")
    offers = {"client-000": KeyOffer(*fresh_keys())}
    with pytest.raises(SecureAggregationError) as info:
        SecAggServer(setup, offers=offers, verifier=pki().verifier)
    assert str(info.value) == "an authenticated attempt never uses key offers"


def test_survivors_split_into_two_parts_are_unrecoverable_even_with_t_holders_each() -> None:
    """Two groups of five, each a clique: every survivor keeps t = 4 neighbours and the
    survivors are above the floor, but no edge joins the groups, so clients would refuse
    the set (each group's sum would be revealed). The server must say so itself at the
    close of masked_input, before it asks for any share; one edge between the groups
    makes the same survivors recoverable."""
    ids = ids_of(10)
    setup = make_setup(CONFIG, ids, 4, authenticated=False)
    left, right = set(ids[:5]), set(ids[5:])
    split = {c: frozenset((left if c in left else right) - {c}) for c in ids}
    everyone, nobody = frozenset(ids), frozenset()
    assert all(len(split[c]) >= setup.threshold for c in ids)
    assert len(everyone) >= setup.min_survivors
    assert unrecoverable(setup, split, everyone, nobody, everyone) == (
        "the survivors are not connected in the neighbour graph (clients refuse to "
        "unmask: each part's sum would be revealed)")
    a, b = ids[0], ids[5]
    joined = {**split, a: split[a] | {b}, b: split[b] | {a}}
    assert unrecoverable(setup, joined, everyone, nobody, everyone) == ""
