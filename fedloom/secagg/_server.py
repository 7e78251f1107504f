"""The server half of SecAgg+ (Bonawitz et al., CCS 2017; Bell et al., CCS 2020).

`SecAggServer` runs one round attempt as a pure state machine: no gRPC, no threads, no
clock. The transport asks it for each client's request (`request_for`), hands it each
reply (`receive`) and each vanished client (`drop`, on a broken stream or missed
heartbeat), and closes a stage with `advance` once `stage_complete` is true or the
stage's deadline has passed. After the unmask stage `advance` produces `result`: the
weighted mean over the survivors, and nothing about any one of them.

Who takes part in each stage:

- advertise_keys: every participant (in an unauthenticated attempt, every participant
  without an unused `KeyOffer`; the offered keys count as advertised). Closing it fixes
  the *members*, the participants that advertised, and the neighbour graph over them
  (`graph_seed`). An authenticated attempt needs every participant to advertise: the
  graph is derived from all their keys, so the server may not pick which keys count
  after seeing them; when some participant did not, the attempt fails and the round
  driver starts a new one without it.
- share_keys: the members; each gets every member's keys (`ShareKeysRequest.roster`)
  and derives the same graph. Closing keeps those that answered, pruned until each has
  at least t such neighbours (fewer could never be unmasked, and its neighbours must
  not mask against it).
- masked_input: those; each gets the shares sealed for it and their commitments. The
  inputs accepted are the survivors; closing publishes them (no masked input is taken
  afterwards) after checking that the survivors can be unmasked: at least
  ``min_survivors``, connected in the graph, and every secret with t holders left.
- consistency (authenticated attempts): the survivors; each signs the survivor set.
  Every survivor must confirm: its neighbours reveal its self-mask share only with its
  own confirmation, so a survivor that vanished before confirming fails the attempt.
- unmask: the survivors still connected; each gets the survivor set and (authenticated)
  its surviving neighbours' confirmations. Every share revealed is checked against the
  commitment its owner published at share_keys: a wrong share is refused (and blamed on
  the client that revealed it), and the stage waits for spares from other neighbours.
  Closing reconstructs the secrets, removes the masks and decodes.

Invalid replies raise `MessageRejectedError` and leave the round untouched (a bad client
is a dropout, not a crash). A round that cannot finish raises `SecureAggregationError`
and its status becomes FAILED; ``culprits`` then names clients proven to have cheated
(a dealer whose checked shares do not reconstruct what it committed to), and
``failed_clients`` every participant that did not do its part; a retry is a new
`SecAggServer` with a new attempt id, without them.

Example, one round in-process (``clients`` maps ids to `SecAggClient` objects)::

    server = SecAggServer(RoundSetup.create(config, RoundId("run", 3, 1), ids, length,
                                            model_digest=m, config_digest=c))
    while server.status is SecAggStatus.RUNNING:
        for cid in server.pending():
            server.receive(cid, clients[cid].handle(server.request_for(cid), **kwargs))
        server.advance()
    mean = server.result.mean
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Iterable
from typing import NoReturn

import numpy as np

from fedloom.errors import MessageRejectedError, RejectReason, SecureAggregationError
from fedloom.secagg._crypto import (
    MASK_KEY,
    SEALED_SHARE_BYTES,
    SELF_MASK,
    commit_share,
    key_statement,
    survivors_statement,
    usable_public_key,
)
from fedloom.secagg._graph import Graph, graph_seed, is_connected, neighbour_graph
from fedloom.secagg._identity import PeerVerifier, VerifiedPeer
from fedloom.secagg._messages import (
    STAGE_OF,
    AdvertisedKeys,
    AdvertiseKeysRequest,
    Confirmation,
    ConsistencyReply,
    ConsistencyRequest,
    EncryptedShare,
    KeyOffer,
    MaskedInputReply,
    MaskedInputRequest,
    RevealedShare,
    SecAggReply,
    SecAggRequest,
    ShareCommitment,
    ShareKeysReply,
    ShareKeysRequest,
    Stage,
    UnmaskReply,
    UnmaskRequest,
)
from fedloom.secagg._quantize import dequantize
from fedloom.secagg._setup import RoundSetup
from fedloom.secagg._shamir import PRIME, SHARE_BYTES
from fedloom.secagg._unmask import DealerFaultError, MapFn, unmask_sum


class SecAggStatus(enum.StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class SecAggResult:
    """What the server learns: sums over the survivors, and their mean.

    Attributes:
        mean: ``sum(w_v * clip(x_v)) / sum(w_v)`` over the survivors, float64.
        weighted_sum: ``sum(w_v * clip(x_v))``, float64.
        total_weight: ``sum(w_v)``, with ``w_v = num_examples_v / max_weight``.
        total_examples: ``total_weight * max_weight`` (the survivors' examples, to
            within quantization).
        survivors: clients whose masked input is in the sum.
        dropped: clients that shared keys but whose input is not in the sum.
        total: the unmasked sum itself, uint32 (modulo 2**32): what a round whose
            clients encoded their own vectors (distributed DP) decodes.
    """

    mean: np.ndarray
    weighted_sum: np.ndarray
    total_weight: float
    total_examples: float
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    total: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.uint32))


def _reject(reason: RejectReason, message: str) -> MessageRejectedError:
    return MessageRejectedError(reason, message)


class SecAggServer:
    """One SecAgg+ round attempt on the server (see the module docstring).

    Args:
        setup: the attempt's public parameters.
        offers: unused `KeyOffer` of some participants, as an earlier attempt's
            `new_offers` took them (their keys were checked there); each is used here and
            must not be used again. Those clients skip advertise_keys. Unauthenticated
            attempts only.
        verifier: the client CA, to check certificates and signatures; required in an
            authenticated attempt (so that one client's bad signature is refused here
            instead of making its honest neighbours abandon the attempt).
        map_fn: runs the final unmasking's ranges (a thread pool's ``map``: parallel).
    """

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

    # -- what the transport asks ------------------------------------------------------

    @property
    def stage(self) -> Stage:
        return self._stage

    def pending(self) -> frozenset[str]:
        """Clients that still owe a reply in the current stage (and are connected)."""
        if self.status is not SecAggStatus.RUNNING:
            return frozenset()
        return frozenset(self._expected - self._answered - self._gone)

    @property
    def stage_complete(self) -> bool:
        return not self.pending()

    @property
    def survivors(self) -> frozenset[str]:
        """The clients whose masked input was accepted (set when masked_input closes)."""
        return self._survivors

    @property
    def result(self) -> SecAggResult:
        if self._result is None:
            raise SecureAggregationError(f"the round has no result (status {self.status}"
                                         f"{': ' + self.failure if self.failure else ''})")
        return self._result

    def request_for(self, client_id: str) -> SecAggRequest:
        """The current stage's request for one client."""
        self._check_running()
        if client_id not in self._expected or client_id in self._gone:
            raise _reject(RejectReason.FORBIDDEN,
                          f"{client_id!r} has no part in stage {self._stage}")
        rid = self.setup.round_id
        if self._stage is Stage.ADVERTISE_KEYS:
            return AdvertiseKeysRequest(self.setup)
        if self._stage is Stage.SHARE_KEYS:
            if client_id in self._offered:
                return ShareKeysRequest(rid, self._roster, self.setup, self._advertised[client_id])
            return ShareKeysRequest(rid, self._roster)
        if self._stage is Stage.MASKED_INPUT:
            return self._inbox[client_id]
        survivors = self._survivor_ids
        if self._stage is Stage.CONSISTENCY:
            return ConsistencyRequest(rid, survivors)
        confirmations = tuple(Confirmation(v, self._confirmations[v])
                              for v in sorted(self.graph[client_id] & self._survivors)
                              if v in self._confirmations)
        return UnmaskRequest(rid, survivors, confirmations)

    def can_finish(self) -> bool:
        """In unmask: every secret that must be reconstructed has t checked shares."""
        if self.status is not SecAggStatus.RUNNING or self._stage is not Stage.UNMASK:
            return False
        t = self.setup.threshold
        return all(len(self._self_mask_shares.get(v, {})) >= t for v in self._survivors) and all(
            len(self._mask_key_shares.get(u, {})) >= t
            for u in self._dropped if self.graph[u] & self._survivors
        )

    # -- what the transport tells ----------------------------------------------------

    def drop(self, client_id: str) -> None:
        """A client vanished (stream closed, heartbeat missed): stop waiting for it.

        Its later replies are refused. A client dropped after its masked input was
        accepted stays a survivor: its input is in the sum.
        """
        if client_id in self.setup.participants:
            self._gone.add(client_id)

    def receive(self, client_id: str, reply: SecAggReply, *, digest: bytes | None = None) -> None:
        """Validate and take one reply from the (authenticated) client ``client_id``.

        ``digest``: the SHA-256 of a masked input's bytes when the transport has already
        verified it (to recognise a retry); otherwise it is computed here.

        Raises:
            MessageRejectedError: the reply is refused (the reason says what was wrong);
                the round is unchanged.
        """
        self._check_running()
        stage = STAGE_OF.get(type(reply))
        if stage is None:
            raise _reject(RejectReason.INVALID, f"not a SecAgg+ reply: {type(reply).__name__}")
        if reply.client_id != client_id:
            raise _reject(RejectReason.FORBIDDEN,
                          f"{client_id!r} sent a reply in the name of {reply.client_id!r}")
        if reply.round_id != self.setup.round_id:
            raise _reject(RejectReason.STALE, f"a reply for {reply.round_id}; this round "
                          f"attempt is {self.setup.round_id}")
        if stage is not self._stage:
            raise _reject(RejectReason.STALE, f"a {stage} reply during stage {self._stage}")
        if client_id in self._gone:
            raise _reject(RejectReason.STALE, f"{client_id!r} was dropped from this round")
        if client_id not in self._expected:
            raise _reject(RejectReason.FORBIDDEN, f"{client_id!r} has no part in {stage}")
        if client_id in self._answered:
            if not self._same_as_before(client_id, reply):
                raise _reject(RejectReason.CONFLICT,
                              f"{client_id!r} already answered {stage} differently")
            return  # an identical retry
        if isinstance(reply, AdvertisedKeys):
            self._take_keys(reply)
        elif isinstance(reply, ShareKeysReply):
            self._take_shares(reply)
        elif isinstance(reply, MaskedInputReply):
            self._take_masked_input(reply, digest)
        elif isinstance(reply, ConsistencyReply):
            self._take_confirmation(reply)
        else:
            assert isinstance(reply, UnmaskReply)
            self._take_unmask(reply)
        self._answered.add(client_id)

    def advance(self) -> None:
        """Close the current stage and open the next (or finish the round).

        Raises:
            SecureAggregationError: too few clients remain to finish; status is FAILED.
        """
        self._check_running()
        done = frozenset(self._answered)
        if self._stage is not Stage.UNMASK:  # unmask closes once the shares suffice
            self.failed_clients |= self._expected - done
        if self._stage is Stage.ADVERTISE_KEYS:
            self._close_advertise(done)
        elif self._stage is Stage.SHARE_KEYS:
            self._sharers = self._prune(done - self._gone, "shared keys")
            self._deliver_shares()
            self._open(Stage.MASKED_INPUT, self._sharers)
        elif self._stage is Stage.MASKED_INPUT:
            self._survivors, self._survivor_ids = done, tuple(sorted(done))
            self._dropped = self._sharers - done
            self._check_recoverable()
            if self.setup.authenticated:
                self._statement = survivors_statement(self.setup, self._survivor_ids,
                                                      graph_seed=self.graph_seed)
                self._open(Stage.CONSISTENCY, self._survivors - self._gone)
            else:
                self._open(Stage.UNMASK, self._survivors - self._gone)
        elif self._stage is Stage.CONSISTENCY:
            unconfirmed = self._survivors - done
            self.failed_clients |= unconfirmed  # gone before the stage opened, too
            if unconfirmed:
                self._fail(f"survivors {sorted(unconfirmed)[:5]} did not confirm the survivor set "
                           "(their neighbours reveal a survivor's self-mask share only with its "
                           "own confirmation)")
            self._open(Stage.UNMASK, self._survivors - self._gone)
        else:
            self._finish()

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
        keys = (reply.cipher_public_key, reply.mask_public_key)
        if keys[0] == keys[1] or any(k in self._keys_seen for k in keys):
            raise _reject(RejectReason.INVALID, "an advertised public key is not fresh")
        # a key of small order would make every neighbour refuse the attempt
        if not checked and not all(usable_public_key(k) for k in keys):
            raise _reject(RejectReason.INVALID, "an advertised public key is a point of small "
                          "order (no shared secret can be agreed with it)")
        if self.setup.authenticated:
            self._peers[reply.client_id] = self._check_signed(reply)
        elif reply.signed:
            raise _reject(RejectReason.INVALID, "signed keys in an unauthenticated round")
        self._keys_seen.update(keys)
        self._advertised[reply.client_id] = reply

    def _check_signed(self, reply: AdvertisedKeys) -> VerifiedPeer:
        who = reply.client_id
        if not reply.signed:
            raise _reject(RejectReason.INVALID, "an authenticated round needs signed keys: "
                          "the client certificate and its signature")
        assert self._verifier is not None
        try:
            peer = self._verifier.verify_certificate(reply.certificate)
        except SecureAggregationError as exc:
            raise _reject(RejectReason.INVALID, f"the certificate sent with the keys: {exc}"
                          ) from exc
        seated = self.setup.identity_of(who)
        if peer.name != seated:
            raise _reject(RejectReason.FORBIDDEN, f"the certificate names {peer.name!r}, but "
                          f"this participant is {seated!r}")
        statement = key_statement(self.setup, who, reply.cipher_public_key,
                                  reply.mask_public_key)
        if not self._verifier.verify(peer, reply.signature, statement):
            raise _reject(RejectReason.INVALID, "the signature on the advertised keys does not "
                          "verify (signed for another attempt, or not with the certificate's key)")
        return peer

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
        receivers = [s.receiver for s in reply.shares]
        if sorted(receivers) != sorted(self.graph[reply.client_id]):
            raise _reject(RejectReason.INVALID,
                          "the shares must go to exactly the client's neighbours in the graph")
        for share in reply.shares:
            if share.sender != reply.client_id or len(share.ciphertext) != SEALED_SHARE_BYTES:
                raise _reject(RejectReason.INVALID, "a share has the wrong sender or size")
        offer = reply.next_keys
        if offer is not None:
            if self.setup.authenticated:
                raise _reject(RejectReason.INVALID, "a key offer in an authenticated round (its "
                              "keys must be made after the setup is known)")
            offered = (offer.cipher_public_key, offer.mask_public_key)
            if set(offered) & self._keys_seen:
                raise _reject(RejectReason.INVALID, "the keys offered for the next attempt are "
                              "not fresh")
            if not all(usable_public_key(k) for k in offered):
                raise _reject(RejectReason.INVALID, "a key offered for the next attempt is a "
                              "point of small order")
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
        if masked.dtype != np.dtype("<u4") or masked.shape != (self.setup.masked_length,):
            raise _reject(RejectReason.INVALID,
                          f"a masked input is uint32[{self.setup.masked_length}], got "
                          f"{masked.dtype}{list(masked.shape)}")
        np.add(self._total, masked, out=self._total)
        self._digests[reply.client_id] = digest or _digest(masked)

    def _take_confirmation(self, reply: ConsistencyReply) -> None:
        assert self._verifier is not None
        if not self._verifier.verify(self._peers[reply.client_id], reply.signature,
                                     self._statement):
            raise _reject(RejectReason.INVALID, "the confirmation does not verify: it is not a "
                          "signature of this attempt's survivor set by the client's certificate")
        self._confirmations[reply.client_id] = reply.signature

    def _take_unmask(self, reply: UnmaskReply) -> None:
        holder = reply.client_id
        held = [u for u in self.graph[holder] & self._sharers]  # whose shares it was given
        wanted_seeds = sorted(u for u in held if u in self._survivors)
        wanted_keys = sorted(u for u in held if u not in self._survivors)
        _check_owners(reply.self_mask_shares, wanted_seeds, "self-mask")
        _check_owners(reply.mask_key_shares, wanted_keys, "mask-key")
        for shares, kind in ((reply.self_mask_shares, SELF_MASK),
                             (reply.mask_key_shares, MASK_KEY)):
            for share in shares:
                commitment = self._share_commitments[share.owner][holder]
                expected = commitment.self_mask if kind == SELF_MASK else commitment.mask_key
                if commit_share(self.setup, share.owner, holder, kind, share.value) != expected:
                    raise _reject(RejectReason.INVALID,
                                  f"the {kind} share of {share.owner!r} does not match the "
                                  "commitment its owner published with it")
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
        alive, t = set(clients), self.setup.threshold
        while short := {u for u in alive if len(self.graph[u] & alive) < t}:
            alive -= short
        self.failed_clients |= clients - alive
        if len(alive) < t + 1:
            self._fail(f"only {len(alive)} clients {did} with at least {t} neighbours that "
                       f"did too; at least {t + 1} are needed")
        return frozenset(alive)

    def _check_recoverable(self) -> None:
        t, alive = self.setup.threshold, self._survivors - self._gone
        floor = self.setup.min_survivors
        if len(self._survivors) < floor:
            self._fail(f"only {len(self._survivors)} masked inputs; clients unmask no fewer than "
                       f"min_survivors = {floor}")
        if not is_connected(self.graph, self._survivors):
            self._fail("the survivors are not connected in the neighbour graph (clients refuse "
                       "to unmask: each part's sum would be revealed)")
        needs = [(v, "self-mask seed") for v in sorted(self._survivors)]
        needs += [(u, "mask key") for u in sorted(self._dropped) if self.graph[u] & alive]
        for owner, what in needs:
            helpers = len(self.graph[owner] & alive)
            if helpers < t:
                self._fail(f"the {what} of {owner!r} cannot be recovered: {helpers} of its "
                           f"neighbours survive, the threshold is {t}")

    def _same_as_before(self, client_id: str, reply: SecAggReply) -> bool:
        if isinstance(reply, AdvertisedKeys):
            return self._advertised.get(client_id) == reply
        if isinstance(reply, ShareKeysReply):
            return self._sealed.get(client_id) == reply
        if isinstance(reply, MaskedInputReply):
            return self._digests.get(client_id) == _digest(reply.masked)
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


def _digest(masked: np.ndarray) -> bytes:
    """SHA-256 of a masked vector (to recognise an identical retry), without a copy."""
    return hashlib.sha256(np.ascontiguousarray(masked).data.cast("B")).digest()


def _check_owners(shares: Iterable[RevealedShare], wanted: list[str], kind: str) -> None:
    owners = [s.owner for s in shares]
    if sorted(owners) != wanted:
        raise _reject(RejectReason.INVALID,
                      f"the {kind} shares must be for exactly {wanted}, got {owners}")
    for share in shares:
        if len(share.value) != SHARE_BYTES or int.from_bytes(share.value, "big") >= PRIME:
            raise _reject(RejectReason.INVALID, f"a {kind} share is not a field element")
