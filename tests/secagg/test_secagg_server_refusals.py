"""What the SecAgg+ server refuses a client: each refusal's reason and message, and the
honest message still taken after it."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from clients_defend_support import CONFIG
from secagg_driver import (
    SMALL_ORDER,
    Round,
    answer,
    fresh_keys,
    ids_of,
    make_inputs,
    pki,
    run,
    setup_round,
)

from fedloom import certs
from fedloom.errors import MessageRejectedError, RejectReason, SecureAggregationError
from fedloom.secagg import (
    PRIME,
    SHARE_BYTES,
    AdvertisedKeys,
    ConsistencyReply,
    KeyOffer,
    MaskedInputReply,
    MaskedInputRequest,
    RevealedShare,
    RoundId,
    SecAggServer,
    ShareKeysReply,
    SigningIdentity,
    Stage,
    UnmaskReply,
    key_statement,
)

# -- what a client may not get or send: every refusal says why ------------------------
#
# A client is the server's adversary here: it may ask for what is not meant for it,
# answer in another's name or for another attempt, change an answer, or send keys,
# shares and confirmations it made up. Each refusal is checked for its reason and its
# words (the operator reads them), and the honest message is still taken after it.


def _refused(server: SecAggServer, cid: str, reply: Any) -> MessageRejectedError:
    with pytest.raises(MessageRejectedError) as info:
        server.receive(cid, reply)
    return info.value




def test_a_request_is_refused_to_a_client_with_no_part_in_the_stage() -> None:
    """Neither a vanished participant nor an outsider gets the shares sealed for the
    stage (or any other request)."""
    ids = ids_of(8)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 5), authenticated=False),
              stop_at=Stage.MASKED_INPUT)
    rnd.server.drop(ids[0])
    for cid in (ids[0], "client-099"):
        with pytest.raises(MessageRejectedError) as info:
            rnd.server.request_for(cid)
        assert info.value.reason is RejectReason.FORBIDDEN
        assert str(info.value) == f"{cid!r} has no part in stage masked_input"
    assert isinstance(rnd.server.request_for(ids[1]), MaskedInputRequest)


REPLY_REFUSALS = ["not-a-reply", "in-anothers-name", "another-attempt", "another-stage",
                  "vanished", "outsider", "changed", "attempt-over"]


@pytest.mark.parametrize("how", REPLY_REFUSALS)
def test_a_masked_input_reply_is_refused_with_its_reason(how: str) -> None:
    ids = ids_of(8)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 5), authenticated=False),
              stop_at=Stage.MASKED_INPUT)
    server, cid = rnd.server, ids[0]
    rid = server.setup.round_id
    reply = answer(rnd, cid)
    other = RoundId("run-1", 1, 2)
    sender = cid
    if how == "not-a-reply":  # the bare vector, without its envelope
        message: Any = reply.masked
        reason, why = RejectReason.INVALID, "not a SecAgg+ reply: ndarray"
    elif how == "in-anothers-name":
        message, sender = reply, ids[1]
        reason = RejectReason.FORBIDDEN
        why = "'client-001' sent a reply in the name of 'client-000'"
    elif how == "another-attempt":
        message = MaskedInputReply(other, cid, reply.masked)
        reason, why = RejectReason.STALE, f"a reply for {other}; this round attempt is {rid}"
    elif how == "another-stage":
        message = UnmaskReply(rid, cid, (), ())
        reason, why = RejectReason.STALE, "a unmask reply during stage masked_input"
    elif how == "vanished":
        server.drop(cid)
        message, reason = reply, RejectReason.STALE
        why = "'client-000' was dropped from this round"
    elif how == "outsider":  # a client id the setup does not seat
        message, sender = MaskedInputReply(rid, "client-099", reply.masked), "client-099"
        reason, why = RejectReason.FORBIDDEN, "'client-099' has no part in masked_input"
    elif how == "changed":
        server.receive(cid, reply)
        message = MaskedInputReply(rid, cid, reply.masked ^ np.uint32(1))
        reason = RejectReason.CONFLICT
        why = "'client-000' already answered masked_input differently"
    else:
        assert how == "attempt-over"
        for c in ids[1:]:
            server.drop(c)
        with pytest.raises(SecureAggregationError):
            server.advance()  # no masked input at all: the attempt fails
        message, reason, why = reply, RejectReason.STALE, "the round attempt has failed"
    refusal = _refused(server, sender, message)
    assert refusal.reason is reason and str(refusal) == why
    if how not in ("vanished", "attempt-over"):
        server.receive(cid, reply)  # the honest reply is still taken (or is a retry)
        assert cid not in server.pending()




KEY_REFUSALS = {
    "unsigned": (RejectReason.INVALID, "an authenticated round needs signed keys: the client "
                 "certificate and its signature"),
    "foreign-ca": (RejectReason.INVALID, "the certificate sent with the keys: "),
    "another-participants-certificate": (
        RejectReason.FORBIDDEN,
        "the certificate names 'client-001', but this participant is 'client-000'"),
    "signature-by-another-key": (
        RejectReason.INVALID, "the signature on the advertised keys does not verify (signed "
        "for another attempt, or not with the certificate's key)"),
    "repeated-key": (RejectReason.INVALID, "an advertised public key is not fresh"),
    "signed-unauthenticated": (RejectReason.INVALID, "signed keys in an unauthenticated round"),
}


@pytest.mark.parametrize("how", sorted(KEY_REFUSALS))
def test_advertised_keys_are_refused_with_their_reason(how: str) -> None:
    ids = ids_of(8)
    authenticated = how != "signed-unauthenticated"
    rnd = setup_round(CONFIG, make_inputs(ids, 4), authenticated=authenticated)
    server, cid = rnd.server, ids[0]
    keys = rnd.clients[cid].handle(server.request_for(cid))
    assert isinstance(keys, AdvertisedKeys)

    def signed_by(identity: SigningIdentity, certificate: bytes | None = None) -> AdvertisedKeys:
        statement = key_statement(server.setup, cid, keys.cipher_public_key,
                                  keys.mask_public_key)
        return dataclasses.replace(keys, certificate=certificate or identity.certificate_der,
                                   signature=identity.sign(statement))

    if how == "unsigned":
        bad = dataclasses.replace(keys, certificate=b"", signature=b"")
    elif how == "foreign-ca":
        issued = certs.make_client_cert(certs.make_ca("rogue CA"), cid)
        bad = signed_by(SigningIdentity(issued.cert, issued.key))
    elif how == "another-participants-certificate":
        bad = signed_by(pki().identity(ids[1]))
    elif how == "signature-by-another-key":  # its own certificate, another's signature
        bad = signed_by(pki().identity(ids[1]), pki().identity(cid).certificate_der)
    elif how == "repeated-key":  # a key another participant advertised first
        first = rnd.clients[ids[1]].handle(server.request_for(ids[1]))
        assert isinstance(first, AdvertisedKeys)
        server.receive(ids[1], first)
        bad = dataclasses.replace(keys, mask_public_key=first.cipher_public_key)
    else:  # keys signed for an authenticated attempt, sent to an unauthenticated one
        signed = setup_round(CONFIG, make_inputs(ids, 4))
        theirs = signed.clients[cid].handle(signed.server.request_for(cid))
        bad = dataclasses.replace(theirs, round_id=server.setup.round_id)
    reason, why = KEY_REFUSALS[how]
    refusal = _refused(server, cid, bad)
    assert refusal.reason is reason
    if how == "foreign-ca":
        assert str(refusal).startswith(why) and "not valid under the client CA" in str(refusal)
    else:
        assert str(refusal) == why
    server.receive(cid, keys)  # the client's own keys are still taken


SHARE_REFUSALS = {
    "a-neighbour-left-out": "the shares must go to exactly the client's neighbours in the graph",
    "in-anothers-name": "a share has the wrong sender or size",
    "short-ciphertext": "a share has the wrong sender or size",
    "offer-in-authenticated-round": "a key offer in an authenticated round (its keys must be "
                                    "made after the setup is known)",
    "offer-repeats-a-key": "the keys offered for the next attempt are not fresh",
    "offer-of-small-order": "a key offered for the next attempt is a point of small order",
}


@pytest.mark.parametrize("how", sorted(SHARE_REFUSALS))
def test_share_keys_replies_are_refused_with_their_reason(how: str) -> None:
    ids = ids_of(8)
    authenticated = how == "offer-in-authenticated-round"
    rnd = run(setup_round(CONFIG, make_inputs(ids, 5), authenticated=authenticated),
              stop_at=Stage.SHARE_KEYS)
    server, cid = rnd.server, ids[0]
    reply = rnd.clients[cid].handle(server.request_for(cid))
    assert isinstance(reply, ShareKeysReply)
    first, *rest = reply.shares
    if how == "a-neighbour-left-out":
        bad = dataclasses.replace(reply, shares=tuple(rest),
                                  share_commitments=reply.share_commitments[1:])
    elif how == "in-anothers-name":
        bad = dataclasses.replace(reply, shares=(dataclasses.replace(first, sender=ids[1]),
                                                 *rest))
    elif how == "short-ciphertext":
        short = dataclasses.replace(first, ciphertext=first.ciphertext[:-1])
        bad = dataclasses.replace(reply, shares=(short, *rest))
    elif how == "offer-in-authenticated-round":
        bad = dataclasses.replace(reply, next_keys=KeyOffer(*fresh_keys()))
    elif how == "offer-repeats-a-key":  # a key client-001 advertised in this attempt
        advertised = server.request_for(ids[1]).roster[1]
        repeated = KeyOffer(fresh_keys()[0], advertised.mask_public_key)
        bad = dataclasses.replace(reply, next_keys=repeated)
    else:
        bad = dataclasses.replace(reply, next_keys=KeyOffer(fresh_keys()[0], SMALL_ORDER[1]))
    refusal = _refused(server, cid, bad)
    assert refusal.reason is RejectReason.INVALID and str(refusal) == SHARE_REFUSALS[how]
    assert cid not in server.new_offers
    server.receive(cid, reply)  # the honest reply is still taken


def test_a_masked_input_of_the_wrong_type_is_refused_with_what_was_expected() -> None:
    ids = ids_of(8)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 5), authenticated=False),
              stop_at=Stage.MASKED_INPUT)
    reply = answer(rnd, ids[0])
    wide = MaskedInputReply(reply.round_id, ids[0], reply.masked.astype(np.int64))
    refusal = _refused(rnd.server, ids[0], wide)
    length = rnd.server.setup.masked_length
    assert str(refusal) == f"a masked input is uint32[{length}], got int64[{length}]"


def _at_unmask(ids: list[str], dropped: str) -> Round:
    """An unauthenticated round open at unmask; ``dropped`` vanished before its masked
    input, so its neighbours owe its mask-key shares."""
    return run(setup_round(CONFIG, make_inputs(ids, 5), authenticated=False),
               drop_at={dropped: Stage.MASKED_INPUT}, stop_at=Stage.UNMASK)


def _field(value: int) -> bytes:
    return value.to_bytes(SHARE_BYTES, "big")


UNMASK_REFUSALS = ["self-mask-share-left-out", "dropped-clients-share-as-self-mask",
                   "mask-key-share-left-out", "short-self-mask-share", "short-mask-key-share",
                   "self-mask-share-equal-to-the-prime", "largest-field-element-uncommitted"]


@pytest.mark.parametrize("how", UNMASK_REFUSALS)
def test_revealed_shares_are_refused_unless_exactly_the_owed_field_elements(how: str) -> None:
    """A holder reveals exactly the self-mask shares of the survivors it holds shares of
    and the mask-key shares of the dropped ones, each a field element (below PRIME) that
    matches its dealer's commitment."""
    ids = ids_of(10)
    dropped = ids[9]
    rnd = _at_unmask(ids, dropped)
    server = rnd.server
    cid = min(c for c in server.graph[dropped] if c in server.pending())
    reply = rnd.clients[cid].handle(server.request_for(cid))
    assert isinstance(reply, UnmaskReply)
    seeds, keys = reply.self_mask_shares, reply.mask_key_shares
    owners = sorted(s.owner for s in seeds)
    assert [s.owner for s in keys] == [dropped]
    first = seeds[0]
    if how == "self-mask-share-left-out":
        bad = dataclasses.replace(reply, self_mask_shares=seeds[1:])
        why = f"the self-mask shares must be for exactly {owners}, got {owners[1:]}"
    elif how == "dropped-clients-share-as-self-mask":  # both secrets of one client
        bad = dataclasses.replace(reply, self_mask_shares=(*seeds, *keys))
        why = (f"the self-mask shares must be for exactly {owners}, got "
               f"{[*[s.owner for s in seeds], dropped]}")
    elif how == "mask-key-share-left-out":
        bad = dataclasses.replace(reply, mask_key_shares=())
        why = f"the mask-key shares must be for exactly [{dropped!r}], got []"
    elif how == "short-self-mask-share":  # a small number, one byte short
        short = RevealedShare(first.owner, _field(5)[1:])
        bad = dataclasses.replace(reply, self_mask_shares=(short, *seeds[1:]))
        why = "a self-mask share is not a field element"
    elif how == "short-mask-key-share":
        bad = dataclasses.replace(reply, mask_key_shares=(
            RevealedShare(dropped, keys[0].value[:-1]),))
        why = "a mask-key share is not a field element"
    elif how == "self-mask-share-equal-to-the-prime":  # the same as 0 modulo PRIME
        at_prime = RevealedShare(first.owner, _field(PRIME))
        bad = dataclasses.replace(reply, self_mask_shares=(at_prime, *seeds[1:]))
        why = "a self-mask share is not a field element"
    else:  # a field element, but not the share its dealer committed to
        top = RevealedShare(first.owner, _field(PRIME - 1))
        bad = dataclasses.replace(reply, self_mask_shares=(top, *seeds[1:]))
        why = (f"the self-mask share of {first.owner!r} does not match the commitment its "
               "owner published with it")
    refusal = _refused(server, cid, bad)
    assert refusal.reason is RejectReason.INVALID and str(refusal) == why
    assert cid not in server.revealed
    server.receive(cid, reply)  # the honest reply is still taken
    assert cid in server.revealed


def test_a_confirmation_in_another_clients_name_is_refused_with_its_reason() -> None:
    ids = ids_of(8)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 4)), stop_at=Stage.CONSISTENCY)
    server = rnd.server
    mine, theirs = (rnd.clients[c].handle(server.request_for(c)) for c in ids[:2])
    assert isinstance(mine, ConsistencyReply) and isinstance(theirs, ConsistencyReply)
    refusal = _refused(server, ids[0], dataclasses.replace(mine, signature=theirs.signature))
    assert refusal.reason is RejectReason.INVALID
    assert str(refusal) == ("the confirmation does not verify: it is not a signature of this "
                            "attempt's survivor set by the client's certificate")
    server.receive(ids[0], mine)
