"""The state of one SecAgg+ round attempt on the server, and its stage steps.

`AttemptState` holds what the server has taken in so far, takes each reply (after the
checks of `_server_checks`) and closes each stage; `SecAggServer` (`_server`) adds on
top what the transport calls. The protocol, stage by stage, is in `_server`'s docstring.
"""

from __future__ import annotations

from typing import NoReturn

import numpy as np

from fedloom.errors import MessageRejectedError, RejectReason, SecureAggregationError
from fedloom.secagg._graph import Graph, graph_seed, neighbour_graph
from fedloom.secagg._identity import PeerVerifier, VerifiedPeer
from fedloom.secagg._messages import (
    AdvertisedKeys,
    ConsistencyReply,
    EncryptedShare,
    KeyOffer,
    MaskedInputReply,
    MaskedInputRequest,
    SecAggReply,
    ShareCommitment,
    ShareKeysReply,
    Stage,
    UnmaskReply,
)
from fedloom.secagg._quantize import dequantize
from fedloom.secagg._result import SecAggResult, SecAggStatus
from fedloom.secagg._server_checks import (
    check_advertised_keys,
    check_masked_input,
    check_revealed_shares,
    check_share_keys_reply,
    masked_digest,
    prune,
    unrecoverable,
)
from fedloom.secagg._server_checks import reject as _reject
from fedloom.secagg._setup import RoundSetup
from fedloom.secagg._unmask import DealerFaultError, MapFn, unmask_sum


class AttemptState:
    """What one attempt has taken in so far; the base of `SecAggServer` (see there for
    the arguments)."""

    def __init__(self, setup: RoundSetup, *, offers: dict[str, KeyOffer] | None = None,
                 verifier: PeerVerifier | None = None, map_fn: MapFn = map) -> None:
        if setup.authenticated and verifier is None:
            raise SecureAggregationError("an authenticated attempt needs the client CA to check "
                                         "the participants' signatures")
        if setup.authenticated and offers:
            raise SecureAggregationError("an authenticated attempt never uses key offers")
        self.setup = setup
        self._verifier = verifier
        self._map_fn = map_fn  # runs the unmasking's ranges (a thread pool's map: parallel)
        self.graph: Graph = {}  # over the members, once advertise_keys has closed
        self.graph_seed = b""  # derived from the setup and the members' keys
        self.status = SecAggStatus.RUNNING
        self.failure = ""
        #: clients proven to have cheated (dealt inconsistent shares)
        self.culprits: set[str] = set()
        #: participants that did not do their part in some stage (gone, refused, silent)
        self.failed_clients: set[str] = set()
        #: clients whose unmask reply was taken: they take part in no other attempt of
        #: this round (a second sum would reveal the difference), so no retry with them
        self.revealed: set[str] = set()
        self._stage = Stage.ADVERTISE_KEYS
        self._expected: frozenset[str] = frozenset(setup.participants)
        self._answered: set[str] = set()
        self._gone: set[str] = set()
        self._advertised: dict[str, AdvertisedKeys] = {}
        self._peers: dict[str, VerifiedPeer] = {}
        self._offered: frozenset[str] = frozenset()  # advertised by an offer
        self._roster: tuple[AdvertisedKeys, ...] = ()
        self._commitments: dict[str, bytes] = {}
        # dealer -> holder -> its commitments for that holder's shares
        self._share_commitments: dict[str, dict[str, ShareCommitment]] = {}
        #: client id -> the `KeyOffer` its share-keys reply carried (for a later attempt)
        self.new_offers: dict[str, KeyOffer] = {}
        self._keys_seen: set[bytes] = set()
        self._sealed: dict[str, ShareKeysReply] = {}
        self._inbox: dict[str, MaskedInputRequest] = {}
        self._sharers: frozenset[str] = frozenset()
        self._total = np.zeros(setup.masked_length, dtype=np.uint32)
        self._digests: dict[str, bytes] = {}
        self._survivors: frozenset[str] = frozenset()
        self._survivor_ids: tuple[str, ...] = ()  # the same, sorted: as requests carry it
        self._statement = b""  # what each survivor signs to confirm them (authenticated)
        self._dropped: frozenset[str] = frozenset()
        self._confirmations: dict[str, bytes] = {}
        self._unmask_replies: dict[str, UnmaskReply] = {}
        self._self_mask_shares: dict[str, dict[int, bytes]] = {}
        self._mask_key_shares: dict[str, dict[int, bytes]] = {}
        self._result: SecAggResult | None = None
        self._take_offers(offers or {})

    # -- stages -----------------------------------------------------------------------

    def _take_offers(self, offers: dict[str, KeyOffer]) -> None:
        """Count each participant's offered keys as advertised for this attempt."""
        rid, taken = self.setup.round_id, set()
        for client_id in sorted(offers):
            if client_id not in self._expected:
                continue
            try:
                self._take_keys(offers[client_id].advertised(rid, client_id), checked=True)
            except MessageRejectedError:
                continue  # a repeated key: this client advertises afresh instead
            taken.add(client_id)
        self._offered = frozenset(taken)
        self._answered.update(taken)

    def _take_keys(self, reply: AdvertisedKeys, checked: bool = False) -> None:
        peer = check_advertised_keys(self.setup, reply, self._keys_seen, self._verifier,
                                     checked)
        if peer is not None:
            self._peers[reply.client_id] = peer
        self._keys_seen.update((reply.cipher_public_key, reply.mask_public_key))
        self._advertised[reply.client_id] = reply

    def _close_advertise(self, done: frozenset[str]) -> None:
        members = done  # a client that vanished after advertising still shaped the graph
        if self.setup.authenticated and members != self._expected:
            missing = sorted(self._expected - members)
            self._fail(f"{len(missing)} participants did not advertise keys ({missing[:5]}); the "
                       "graph of an authenticated attempt comes from every participant's keys, so "
                       "a new attempt starts without them")
        t = self.setup.threshold
        if len(members) < t + 1:
            self._fail(f"only {len(members)} clients advertised keys; at least {t + 1} are "
                       "needed")
        self._roster = tuple(self._advertised[c] for c in sorted(members))
        self.graph_seed = graph_seed(self.setup, self._roster)
        self.graph = neighbour_graph(members, self.setup.neighbours, self.graph_seed)
        self._open(Stage.SHARE_KEYS, members - self._gone)

    def _take_shares(self, reply: ShareKeysReply) -> None:
        check_share_keys_reply(self.setup, reply, self.graph[reply.client_id], self._keys_seen)
        offer = reply.next_keys
        self._sealed[reply.client_id] = reply
        self._commitments[reply.client_id] = reply.self_mask_commitment
        self._share_commitments[reply.client_id] = {c.holder: c for c in reply.share_commitments}
        if offer is not None:
            self.new_offers[reply.client_id] = offer

    def _deliver_shares(self) -> None:
        """Each sharer's masked-input request: the shares its sharing neighbours sealed
        for it, with their commitments."""
        rid = self.setup.round_id
        inbox: dict[str, tuple[list[EncryptedShare], list[ShareCommitment]]] = {
            v: ([], []) for v in self._sharers}
        for u in sorted(self._sharers):
            commitments = self._share_commitments[u]
            for share in self._sealed[u].shares:
                if share.receiver in inbox:
                    shares, proofs = inbox[share.receiver]
                    shares.append(share)
                    proofs.append(commitments[share.receiver])
        self._inbox = {v: MaskedInputRequest(rid, tuple(s), tuple(c))
                       for v, (s, c) in inbox.items()}
        self._sealed = {}

    def _take_masked_input(self, reply: MaskedInputReply, digest: bytes | None) -> None:
        masked = reply.masked
        check_masked_input(self.setup, masked)
        np.add(self._total, masked, out=self._total)
        self._digests[reply.client_id] = digest or masked_digest(masked)

    def _take_confirmation(self, reply: ConsistencyReply) -> None:
        assert self._verifier is not None
        if not self._verifier.verify(self._peers[reply.client_id], reply.signature,
                                     self._statement):
            raise _reject(RejectReason.INVALID, "the confirmation does not verify: it is not a "
                          "signature of this attempt's survivor set by the client's certificate")
        self._confirmations[reply.client_id] = reply.signature

    def _take_unmask(self, reply: UnmaskReply) -> None:
        holder = reply.client_id
        held = self.graph[holder] & self._sharers  # whose shares it was given
        check_revealed_shares(self.setup, reply, held, self._survivors, self._share_commitments)
        x = self.setup.x_coordinate(holder)
        for shares, store in ((reply.self_mask_shares, self._self_mask_shares),
                              (reply.mask_key_shares, self._mask_key_shares)):
            for share in shares:
                store.setdefault(share.owner, {})[x] = share.value
        self._unmask_replies[holder] = reply
        self.revealed.add(holder)

    def _finish(self) -> None:
        total = self._total
        self._total = np.zeros(0, dtype=np.uint32)
        try:
            unmask_sum(self.setup, self.graph, total, self._survivors, self._dropped,
                       self._advertised, self._commitments, self._self_mask_shares,
                       self._mask_key_shares, self._map_fn)
            weighted, weight = dequantize(total, len(self._survivors), self.setup.clip_range,
                                          self.setup.bits)
        except DealerFaultError as exc:
            self.culprits.add(exc.owner)
            self._fail(str(exc))
        except SecureAggregationError as exc:
            self._fail(str(exc))
        if not weight > 0:
            self._fail("the survivors' total weight decoded to zero")
        self._result = SecAggResult(
            mean=weighted / weight,
            weighted_sum=weighted,
            total_weight=weight,
            total_examples=weight * self.setup.max_weight,
            survivors=self._survivor_ids,
            dropped=tuple(sorted(self._dropped)),
            total=total,
        )
        self.status = SecAggStatus.SUCCEEDED

    # -- helpers ----------------------------------------------------------------------

    def _open(self, stage: Stage, expected: frozenset[str]) -> None:
        self._stage, self._expected, self._answered = stage, expected, set()

    def _prune(self, clients: frozenset[str], did: str) -> frozenset[str]:
        """Drop clients with fewer than t neighbours left, until none is left short."""
        t = self.setup.threshold
        alive = prune(self.graph, clients, t)
        self.failed_clients |= clients - alive
        if len(alive) < t + 1:
            self._fail(f"only {len(alive)} clients {did} with at least {t} neighbours that "
                       f"did too; at least {t + 1} are needed")
        return frozenset(alive)

    def _check_recoverable(self) -> None:
        problem = unrecoverable(self.setup, self.graph, self._survivors, self._dropped,
                                self._survivors - self._gone)
        if problem:
            self._fail(problem)

    def _same_as_before(self, client_id: str, reply: SecAggReply) -> bool:
        if isinstance(reply, AdvertisedKeys):
            return self._advertised.get(client_id) == reply
        if isinstance(reply, ShareKeysReply):
            return self._sealed.get(client_id) == reply
        if isinstance(reply, MaskedInputReply):
            return self._digests.get(client_id) == masked_digest(reply.masked)
        if isinstance(reply, ConsistencyReply):
            return self._confirmations.get(client_id) == reply.signature
        return self._unmask_replies.get(client_id) == reply

    def _check_running(self) -> None:
        if self.status is not SecAggStatus.RUNNING:
            raise _reject(RejectReason.STALE, f"the round attempt has {self.status}")

    def _fail(self, why: str) -> NoReturn:
        self.status, self.failure = SecAggStatus.FAILED, why
        self.failed_clients |= self._gone  # vanished: a retry goes on without them
        self._total = np.zeros(0, dtype=np.uint32)
        raise SecureAggregationError(f"secure aggregation of {self.setup.round_id} failed: {why}")

