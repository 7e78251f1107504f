"""A malicious server tampers with who takes part: rosters, keys, models, seats.

Threat model: the server is the adversary. It relays every participant's advertised
keys, so it may leave some out, show different rosters to different clients, put in
keys of its own (unsigned, signed with its own certificate or a certificate of another
CA, or under a victim's real certificate), bind a victim to another model or fit
config, seat one identity twice or under another name, and restart attempts until the
graph suits it. `MaliciousServer` drives real `SecAggClient` objects.

This module shows that authenticated clients refuse each of these, with a message that
names the problem, that the refusing client keeps no secret of the attempt, and that
the server then has no masked input of the victim to unmask. As a contrast, an
unauthenticated client accepts a substituted key and seals its shares for the server.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from malicious_server import MaliciousServer, build
from secagg_driver import ids_of, make_client, make_inputs, make_setup, pki

from fedloom import certs
from fedloom.errors import MessageRejectedError, SecureAggregationError
from fedloom.secagg import (
    MASK_KEY,
    AdvertisedKeys,
    AdvertiseKeysRequest,
    RoundId,
    RoundSetup,
    SecAggConfig,
    SecAggServer,
    SigningIdentity,
    agree,
    commit_share,
    derive_share_key,
    generate_private_key,
    key_statement,
    open_share,
    public_bytes,
)

K6 = SecAggConfig(enabled=True, neighbours=6, threshold=4, clip_range=2.0, bits=20,
                  max_weight=100.0, max_participants=64)
N = 12


def _fresh_keys() -> tuple[bytes, bytes]:
    return public_bytes(generate_private_key()), public_bytes(generate_private_key())


def _refused_alone(server: MaliciousServer, victim: str, what: str) -> None:
    """``victim`` refused with ``what`` in its message, dropped its attempt, and the
    server holds no masked input of it to unmask."""
    assert what in server.refusals[victim]
    assert server.clients[victim].setup is None
    server.masked_input()
    assert server.recover(victim).missing == f"the masked input of {victim!r}"


# -- graph choice after the keys ------------------------------------------------------


@pytest.mark.parametrize("how", ["leave_out", "outsider", "duplicate"])
def test_a_roster_the_server_chose_is_refused(how: str) -> None:
    server = build(K6, N)
    server.advertise()
    everyone = sorted(server.clients)
    victim, other = everyone[0], everyone[5]
    roster = list(server.full_roster())
    if how == "leave_out":  # drop one advertiser from the victim's roster (its graph)
        roster = [k for k in roster if k.client_id != other]
        what = f"the roster leaves out 1 participants ([{other!r}])"
    elif how == "outsider":  # keys a client signed for a setup that seats it
        setup = make_setup(K6, [*everyone, "client-099"], 64)
        outsider = make_client("client-099")
        roster.append(outsider.handle(AdvertiseKeysRequest(setup)))
        what = "'client-099' advertised keys but is not a participant"
    else:  # another advertiser's keys under a second name
        index = everyone.index(other)
        roster[index + 1] = dataclasses.replace(roster[index], client_id=everyone[index + 1])
        what = "advertised a public key listed before"
    server.share_keys({victim: tuple(roster)})
    assert set(server.refusals) == {victim}  # the others took their full roster
    _refused_alone(server, victim, what)


def test_rosters_without_the_victim_are_refused_by_everyone_else() -> None:
    """Showing the others a graph without the victim (so that the victim's neighbours
    in its own graph mask against it alone) is refused by each of them."""
    server = build(K6, N)
    server.advertise()
    victim = sorted(server.clients)[0]
    without = tuple(k for k in server.full_roster() if k.client_id != victim)
    server.share_keys({c: without for c in server.clients if c != victim})
    assert set(server.refusals) == set(server.clients) - {victim}
    assert all("the roster leaves out 1 participants" in m for m in server.refusals.values())
    server.masked_input()  # the victim alone holds its attempt: no neighbour shared keys
    assert "only 0 neighbours shared keys" in server.refusals[victim]
    assert server.recover(victim).missing == f"the masked input of {victim!r}"


def test_restarting_attempts_to_reshape_the_graph_is_capped() -> None:
    """The graph comes from keys made after the setup, so a server that dislikes it must
    start a new attempt; a client takes part in max_attempts (3) attempts of a round."""
    clients = None
    for attempt in (1, 2, 3):
        server = build(K6, N, round_id=RoundId("run-1", 1, attempt), clients=clients)
        server.advertise()
        assert server.refusals == {}
        clients = server.clients
    fourth = build(K6, N, round_id=RoundId("run-1", 1, 4), clients=clients)
    fourth.advertise()
    assert set(fourth.refusals) == set(fourth.clients)
    assert all("already took part in 3 attempts" in m for m in fourth.refusals.values())
    older = build(K6, N, round_id=RoundId("run-1", 1, 2), clients=clients)
    older.advertise()
    assert all("already used or is older" in m for m in older.refusals.values())
    assert all(c.setup is not None and c.setup.round_id.attempt == 3
               for c in clients.values())  # the attempt in progress goes on


# -- key substitution -----------------------------------------------------------------


def _signed_by(identity: SigningIdentity, setup: RoundSetup, who: str,
               keys: tuple[bytes, bytes]) -> AdvertisedKeys:
    signature = identity.sign(key_statement(setup, who, *keys))
    return AdvertisedKeys(setup.round_id, who, *keys, identity.certificate_der, signature)


def _substitute(how: str, real: AdvertisedKeys, setup: RoundSetup) -> AdvertisedKeys:
    who, keys = real.client_id, _fresh_keys()
    if how == "unsigned":
        return AdvertisedKeys(setup.round_id, who, *keys)
    if how == "server_certificate":  # the server's TLS certificate, from the same CA
        issued = certs.make_server_cert(pki().ca)
        return _signed_by(SigningIdentity(issued.cert, issued.key), setup, who, keys)
    if how == "other_ca":  # a certificate in the participant's name from another CA
        issued = certs.make_client_cert(certs.make_ca("rogue CA"), who)
        return _signed_by(SigningIdentity(issued.cert, issued.key), setup, who, keys)
    assert how == "bad_signature"  # the participant's real certificate and signature
    return AdvertisedKeys(setup.round_id, who, *keys, real.certificate, real.signature)


SUBSTITUTIONS = {
    "unsigned": "are not signed in an authenticated round",
    "server_certificate": "not valid under the client CA",
    "other_ca": "not valid under the client CA",
    "bad_signature": "does not verify (keys substituted",
}


@pytest.mark.parametrize("how", sorted(SUBSTITUTIONS))
def test_substituted_keys_are_refused(how: str) -> None:
    server = build(K6, N)
    server.advertise()
    everyone = sorted(server.clients)
    victim, other = everyone[0], everyone[4]
    roster = tuple(_substitute(how, k, server.setup) if k.client_id == other else k
                   for k in server.full_roster())
    server.share_keys({victim: roster})
    assert f"keys of {other!r}" in server.refusals[victim] or \
        f"certificate of {other!r}" in server.refusals[victim]
    _refused_alone(server, victim, SUBSTITUTIONS[how])
    # the honest server's own check refuses the same keys
    honest = SecAggServer(server.setup, verifier=pki().verifier)
    with pytest.raises(MessageRejectedError):
        honest.receive(other, roster[everyone.index(other)])


def test_the_victims_own_keys_substituted_are_refused() -> None:
    server = build(K6, N)
    server.advertise()
    victim = sorted(server.clients)[0]
    identity = server.clients[victim].identity
    assert identity is not None
    # even correctly signed (a colluder cannot sign for the victim; this checks the keys)
    forged = _signed_by(identity, server.setup, victim, _fresh_keys())
    roster = (forged, *server.full_roster()[1:])
    server.share_keys({victim: roster})
    assert server.refusals[victim] == (
        f"client {victim!r} refuses: the keys the roster lists as this client's are not its own")
    _refused_alone(server, victim, "the keys the roster lists as this client's are not its own")


def test_an_unauthenticated_client_seals_its_shares_for_a_substituted_key() -> None:
    """Contrast: without the PKI nothing tells the victim that a neighbour's keys are the
    server's, and the server opens the victim's shares for that neighbour."""
    server = build(K6, N, authenticated=False)
    server.advertise()
    everyone = sorted(server.clients)
    victim = everyone[0]
    for attempt in range(60):  # fresh keys until the substitution lands next to the victim
        other = everyone[1 + attempt % (N - 1)]
        cipher_key, mask_key = generate_private_key(), generate_private_key()
        fake = AdvertisedKeys(server.setup.round_id, other, public_bytes(cipher_key),
                              public_bytes(mask_key))
        roster = tuple(fake if k.client_id == other else k for k in server.full_roster())
        server.rosters[victim] = roster
        if other in server.graph_of(victim)[victim]:
            break
    server.share_keys({victim: roster})
    assert victim not in server.refusals
    share = next(s for s in server.shares[victim].shares if s.receiver == other)
    setup, victim_cipher = server.setup, server.keys[victim].cipher_public_key
    key = derive_share_key(agree(cipher_key, victim_cipher), setup, victim, other)
    plaintext = open_share(key, setup, victim, other, share.nonce, share.ciphertext,
                           graph_seed=server.seed_of(victim))
    commitment = next(c for c in server.shares[victim].share_commitments if c.holder == other)
    assert commit_share(setup, victim, other, MASK_KEY, plaintext[:66]) == commitment.mask_key


# -- different models per client ----------------------------------------------------


@pytest.mark.parametrize("field", ["model_digest", "config_digest"])
def test_a_victim_bound_to_another_model_is_refused_by_everyone(field: str) -> None:
    """The victim's setup binds another model (or fit config): its keys' signatures do
    not verify under its neighbours' setup, nor theirs under its own."""
    server = build(K6, N)
    victim = sorted(server.clients)[0]
    other = dataclasses.replace(server.setup, **{field: hashlib.sha256(b"other").digest()})
    assert other.digest != server.setup.digest
    server.setups[victim] = other
    server.advertise()
    assert server.refusals == {}  # each setup is sound on its own
    with pytest.raises(MessageRejectedError, match="does not verify"):
        SecAggServer(server.setup, verifier=pki().verifier).receive(victim,
                                                                    server.keys[victim])
    server.share_keys()
    assert "the signature on the keys of" in server.refusals[victim]
    for cid in set(server.clients) - {victim}:
        assert f"the signature on the keys of {victim!r} does not verify" in \
            server.refusals[cid]
    server.masked_input()
    assert server.masked == {}
    assert server.recover(victim).missing == f"the masked input of {victim!r}"


# -- sybils and identities ------------------------------------------------------------


def test_a_setup_cannot_seat_one_identity_twice() -> None:
    ids = ids_of(N)
    with pytest.raises(MessageRejectedError, match="seats every identity once"):
        RoundSetup.create(K6, RoundId("run-1", 1, 1), [*ids, "sybil"], 64,
                          model_digest=b"m" * 32, config_digest=b"c" * 32,
                          identities={"sybil": ids[1]}, authenticated=True)


def test_a_client_seated_under_another_name_refuses() -> None:
    ids = ids_of(N)
    setup = RoundSetup.create(K6, RoundId("run-1", 1, 1), ids, 64, model_digest=b"m" * 32,
                              config_digest=b"c" * 32, identities={ids[3]: "client-099"},
                              authenticated=True)
    clients = {c: make_client(c, i) for i, c in enumerate(ids)}
    server = MaliciousServer(K6, clients, make_inputs(ids, 64), setup)
    server.advertise()
    assert set(server.refusals) == {ids[3]}
    assert "seats this client as 'client-099', but its certificate names" in \
        server.refusals[ids[3]]


def test_a_sybil_seat_signed_by_a_colluder_is_refused() -> None:
    """The server seats a 'ghost' participant and has a colluder sign its keys: the
    colluder's certificate names the colluder, not the ghost."""
    ids = ids_of(N)
    colluder = ids[1]
    setup = make_setup(K6, [*ids, "ghost"], 64)
    clients = {c: make_client(c, i) for i, c in enumerate(ids)}
    server = MaliciousServer(K6, clients, make_inputs(ids, 64), setup,
                             colluders={colluder})
    server.advertise()
    server.keys["ghost"] = _signed_by(pki().identity(colluder), setup, "ghost", _fresh_keys())
    server.share_keys()
    assert set(server.refusals) == set(ids)
    assert all(f"the certificate of 'ghost' names {colluder!r}" in m
               for m in server.refusals.values())


def test_different_rosters_for_two_halves_of_the_federation_cannot_be_mixed() -> None:
    """A colluder signs a second pair of keys, so the server holds two genuine rosters
    that differ in the colluder's entry, hence two graphs: it shows one to half of the
    clients and the other to the rest, to shape each half's neighbourhoods. Every share
    and confirmation is bound to the roster its client was shown (the graph seed), so a
    share sealed under one roster does not open under the other: the holder refuses."""
    server = build(K6, N)
    everyone = sorted(server.clients)
    colluder = everyone[-1]
    server.colluders = frozenset({colluder})
    server.advertise()
    identity = server.clients[colluder].identity
    assert identity is not None
    second = _signed_by(identity, server.setup, colluder, _fresh_keys())
    one = server.full_roster()
    other = tuple(second if k.client_id == colluder else k for k in one)
    half = set(everyone[: N // 2]) | {colluder}  # the colluder itself is shown its own keys
    server.share_keys({cid: one if cid in half else other for cid in everyone})
    assert not server.refusals  # every roster is genuine, every signature good
    assert server.seed_of(everyone[0]) != server.seed_of(everyone[N // 2])
    assert server.graph_of(everyone[0]) != server.graph_of(everyone[N // 2])
    # deliver to each client only shares from its own graph's neighbours (a server
    # that delivers the others is refused for that already: "not a neighbour")
    withhold = {(sender, cid) for cid in everyone for sender in everyone
                if sender not in server.graph_of(cid)[cid]}
    server.masked_input(withhold)
    crossed = {cid for cid in everyone
               if any((s in half) != (cid in half) for s in server.delivered.get(cid, ()))}
    assert crossed  # with 12 clients and k = 6 the two halves' graphs share edges
    for cid in crossed:
        assert "sealed under another roster" in server.refusals[cid], server.refusals.get(cid)
    assert all(server.recover(v).missing for v in everyone if v != colluder)


@pytest.mark.parametrize("limit", [1, 5])
def test_a_client_may_take_part_in_as_many_attempts_as_it_says(limit: int) -> None:
    """A client's own ``max_attempts`` (`ClientConfig.secagg_max_attempts`, to match a
    server that retries more than 3 times) caps its attempts; the server cannot raise it:
    the cap is the client's, not the round's."""
    ids = ids_of(N)
    clients = {cid: make_client(cid, i, max_attempts=limit) for i, cid in enumerate(ids)}
    for attempt in range(1, limit + 1):
        server = build(K6, N, round_id=RoundId("run-1", 1, attempt), clients=clients)
        server.advertise()
        assert server.refusals == {}
    extra = build(dataclasses.replace(K6, max_attempts=16), N,
                  round_id=RoundId("run-1", 1, limit + 1), clients=clients)
    extra.advertise()
    assert all(f"already took part in {limit} attempts" in m
               for m in extra.refusals.values()) and len(extra.refusals) == N


def test_a_clients_own_attempt_cap_is_checked() -> None:
    with pytest.raises(SecureAggregationError, match=r"max_attempts must be in 1\.\.16, got 17"):
        make_client("client-000", max_attempts=17)
