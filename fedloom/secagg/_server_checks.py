"""What `SecAggServer` checks before it takes a client's reply, and before it closes a stage.

Each reply check raises `MessageRejectedError` (with the reason) and changes nothing:
a bad client is a dropout, not a crash. The stage checks (`prune`, `unrecoverable`)
say which clients can still take part and why an attempt cannot finish.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from fedloom.errors import MessageRejectedError, RejectReason, SecureAggregationError
from fedloom.secagg._crypto import (
    MASK_KEY,
    SEALED_SHARE_BYTES,
    SELF_MASK,
    commit_share,
    key_statement,
    usable_public_key,
)
from fedloom.secagg._graph import Graph, is_connected
from fedloom.secagg._identity import PeerVerifier, VerifiedPeer
from fedloom.secagg._messages import (
    AdvertisedKeys,
    RevealedShare,
    ShareCommitment,
    ShareKeysReply,
    UnmaskReply,
)
from fedloom.secagg._setup import RoundSetup
from fedloom.secagg._shamir import PRIME, SHARE_BYTES


def reject(reason: RejectReason, message: str) -> MessageRejectedError:
    return MessageRejectedError(reason, message)


def check_advertised_keys(setup: RoundSetup, reply: AdvertisedKeys, keys_seen: set[bytes],
                          verifier: PeerVerifier | None, checked: bool = False
                          ) -> VerifiedPeer | None:
    """Refuse advertised keys that are not fresh, not usable or (authenticated) not signed
    by the seated participant; returns the checked peer of an authenticated attempt."""
    keys = (reply.cipher_public_key, reply.mask_public_key)
    if keys[0] == keys[1] or any(k in keys_seen for k in keys):
        raise reject(RejectReason.INVALID, "an advertised public key is not fresh")
    # a key of small order would make every neighbour refuse the attempt
    if not checked and not all(usable_public_key(k) for k in keys):
        raise reject(RejectReason.INVALID, "an advertised public key is a point of small "
                     "order (no shared secret can be agreed with it)")
    if setup.authenticated:
        return check_signed(setup, verifier, reply)
    if reply.signed:
        raise reject(RejectReason.INVALID, "signed keys in an unauthenticated round")
    return None


def check_signed(setup: RoundSetup, verifier: PeerVerifier | None, reply: AdvertisedKeys
                 ) -> VerifiedPeer:
    """The certificate of signed keys, checked against the client CA and the seat."""
    who = reply.client_id
    if not reply.signed:
        raise reject(RejectReason.INVALID, "an authenticated round needs signed keys: "
                     "the client certificate and its signature")
    assert verifier is not None
    try:
        peer = verifier.verify_certificate(reply.certificate)
    except SecureAggregationError as exc:
        raise reject(RejectReason.INVALID, f"the certificate sent with the keys: {exc}"
                     ) from exc
    seated = setup.identity_of(who)
    if peer.name != seated:
        raise reject(RejectReason.FORBIDDEN, f"the certificate names {peer.name!r}, but "
                     f"this participant is {seated!r}")
    statement = key_statement(setup, who, reply.cipher_public_key, reply.mask_public_key)
    if not verifier.verify(peer, reply.signature, statement):
        raise reject(RejectReason.INVALID, "the signature on the advertised keys does not "
                     "verify (signed for another attempt, or not with the certificate's key)")
    return peer


def check_share_keys_reply(setup: RoundSetup, reply: ShareKeysReply, neighbours: Iterable[str],
                           keys_seen: set[bytes]) -> None:
    """Refuse shares that do not go to exactly the sender's neighbours, or an unusable
    key offer."""
    receivers = [s.receiver for s in reply.shares]
    if sorted(receivers) != sorted(neighbours):
        raise reject(RejectReason.INVALID,
                     "the shares must go to exactly the client's neighbours in the graph")
    for share in reply.shares:
        if share.sender != reply.client_id or len(share.ciphertext) != SEALED_SHARE_BYTES:
            raise reject(RejectReason.INVALID, "a share has the wrong sender or size")
    offer = reply.next_keys
    if offer is None:
        return
    if setup.authenticated:
        raise reject(RejectReason.INVALID, "a key offer in an authenticated round (its "
                     "keys must be made after the setup is known)")
    offered = (offer.cipher_public_key, offer.mask_public_key)
    if set(offered) & keys_seen:
        raise reject(RejectReason.INVALID, "the keys offered for the next attempt are "
                     "not fresh")
    if not all(usable_public_key(k) for k in offered):
        raise reject(RejectReason.INVALID, "a key offered for the next attempt is a "
                     "point of small order")


def check_masked_input(setup: RoundSetup, masked: np.ndarray) -> None:
    if masked.dtype != np.dtype("<u4") or masked.shape != (setup.masked_length,):
        raise reject(RejectReason.INVALID,
                     f"a masked input is uint32[{setup.masked_length}], got "
                     f"{masked.dtype}{list(masked.shape)}")


def check_revealed_shares(setup: RoundSetup, reply: UnmaskReply, held: Iterable[str],
                          survivors: frozenset[str],
                          share_commitments: dict[str, dict[str, ShareCommitment]]) -> None:
    """Refuse an unmask reply unless it reveals exactly the shares its sender may reveal
    (self-mask shares of the survivors it holds shares of, mask-key shares of the
    dropped ones), each a field element that matches its owner's commitment."""
    holder = reply.client_id
    held = list(held)
    wanted_seeds = sorted(u for u in held if u in survivors)
    wanted_keys = sorted(u for u in held if u not in survivors)
    check_owners(reply.self_mask_shares, wanted_seeds, "self-mask")
    check_owners(reply.mask_key_shares, wanted_keys, "mask-key")
    for shares, kind in ((reply.self_mask_shares, SELF_MASK),
                         (reply.mask_key_shares, MASK_KEY)):
        for share in shares:
            commitment = share_commitments[share.owner][holder]
            expected = commitment.self_mask if kind == SELF_MASK else commitment.mask_key
            if commit_share(setup, share.owner, holder, kind, share.value) != expected:
                raise reject(RejectReason.INVALID,
                             f"the {kind} share of {share.owner!r} does not match the "
                             "commitment its owner published with it")


def check_owners(shares: Iterable[RevealedShare], wanted: list[str], kind: str) -> None:
    owners = [s.owner for s in shares]
    if sorted(owners) != wanted:
        raise reject(RejectReason.INVALID,
                     f"the {kind} shares must be for exactly {wanted}, got {owners}")
    for share in shares:
        if len(share.value) != SHARE_BYTES or int.from_bytes(share.value, "big") >= PRIME:
            raise reject(RejectReason.INVALID, f"a {kind} share is not a field element")


def masked_digest(masked: np.ndarray) -> bytes:
    """SHA-256 of a masked vector (to recognise an identical retry), without a copy."""
    return hashlib.sha256(np.ascontiguousarray(masked).data.cast("B")).digest()


def prune(graph: Graph, clients: frozenset[str], threshold: int) -> set[str]:
    """``clients`` less those with fewer than t neighbours left, until none is short."""
    alive = set(clients)
    while short := {u for u in alive if len(graph[u] & alive) < threshold}:
        alive -= short
    return alive


def unrecoverable(setup: RoundSetup, graph: Graph, survivors: frozenset[str],
                  dropped: frozenset[str], alive: frozenset[str]) -> str:
    """Why the survivors' sum cannot be unmasked ("" when it can): too few survivors,
    survivors not connected, or a secret with fewer than t holders left (``alive``):
    each survivor's self-mask seed, and the mask key of each dropped client with a
    surviving neighbour (one that masked against it, even if it has vanished since)."""
    t, floor = setup.threshold, setup.min_survivors
    if len(survivors) < floor:
        return (f"only {len(survivors)} masked inputs; clients unmask no fewer than "
                f"min_survivors = {floor}")
    if not is_connected(graph, survivors):
        return ("the survivors are not connected in the neighbour graph (clients refuse "
                "to unmask: each part's sum would be revealed)")
    needs = [(v, "self-mask seed") for v in sorted(survivors)]
    needs += [(u, "mask key") for u in sorted(dropped) if graph[u] & survivors]
    for owner, what in needs:
        helpers = len(graph[owner] & alive)
        if helpers < t:
            return (f"the {what} of {owner!r} cannot be recovered: {helpers} of its "
                    f"neighbours survive, the threshold is {t}")
    return ""
