"""The server half of SecAgg+ (Bonawitz et al., CCS 2017; Bell et al., CCS 2020).

`SecAggServer` runs one round attempt as a pure state machine: no gRPC, no threads, no
clock. The transport asks it for each client's request (`request_for`), hands it each
reply (`receive`) and each vanished client (`drop`, on a broken stream or missed
heartbeat), and closes a stage with `advance` once `stage_complete` is true or the
stage's deadline has passed. After the unmask stage `advance` produces `result`: the
weighted mean over the survivors, and nothing about any one of them.

Who takes part in each stage:

- advertise_keys: every participant that has no unused `KeyOffer` (``offers``: keys a
  client sent with an earlier share-keys reply); the offered keys count as advertised
  for this attempt, so when every participant has one the stage is complete as soon as
  it opens and the attempt costs three round trips. Closing it keeps the clients that
  answered (or offered), pruned until each has at least t such neighbours (fewer could
  not share a secret t-of-k).
- share_keys: those; each gets its neighbours' keys (a client whose offer was used also
  gets the setup and its own keys). Closing keeps those that answered,
  pruned the same way (a client with fewer than t sharing neighbours could never be
  unmasked, and its neighbours must not mask against it).
- masked_input: those; each gets the shares sealed for it. The inputs accepted are the
  survivors; closing publishes them, and no masked input is taken afterwards.
- unmask: the survivors still connected; each is told which of its neighbours survived
  and which dropped. Closing reconstructs the secrets, removes the masks and decodes.

Invalid replies raise `MessageRejectedError` and leave the round untouched (a bad client
is a dropout, not a crash). A round that cannot finish raises `SecureAggregationError`
and its status becomes FAILED; a retry is a new `SecAggServer` with a new attempt id.

Example, one round in-process (``clients`` maps ids to `SecAggClient` objects)::

    server = SecAggServer(RoundSetup.create(config, RoundId("run", 3, 0), ids, length))
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
from fedloom.secagg._crypto import SEALED_SHARE_BYTES, usable_public_key
from fedloom.secagg._graph import neighbour_graph
from fedloom.secagg._messages import (
    STAGE_OF,
    AdvertisedKeys,
    AdvertiseKeysRequest,
    EncryptedShare,
    KeyOffer,
    MaskedInputReply,
    MaskedInputRequest,
    RevealedShare,
    RoundSetup,
    SecAggReply,
    SecAggRequest,
    ShareKeysReply,
    ShareKeysRequest,
    Stage,
    UnmaskReply,
    UnmaskRequest,
)
from fedloom.secagg._quantize import dequantize
from fedloom.secagg._shamir import PRIME, SHARE_BYTES
from fedloom.secagg._unmask import MapFn, unmask_sum


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
    """

    mean: np.ndarray
    weighted_sum: np.ndarray
    total_weight: float
    total_examples: float
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]


def _reject(reason: RejectReason, message: str) -> MessageRejectedError:
    return MessageRejectedError(reason, message)


class SecAggServer:
    """One SecAgg+ round attempt on the server (see the module docstring).

    Args:
        setup: the attempt's public parameters.
        offers: unused `KeyOffer` of some participants, as an earlier attempt's
            `new_offers` took them (their keys were checked there); each is used here and
            must not be used again. Those clients skip advertise_keys.
        map_fn: runs the final unmasking's ranges (a thread pool's ``map``: parallel).
    """

    def __init__(self, setup: RoundSetup, *, offers: dict[str, KeyOffer] | None = None,
                 map_fn: MapFn = map) -> None:
        self.setup = setup
        self._map_fn = map_fn  # runs the unmasking's ranges (a thread pool's map: parallel)
        self.graph = neighbour_graph(setup)
        self.status = SecAggStatus.RUNNING
        self.failure = ""
        self._stage = Stage.ADVERTISE_KEYS
        self._expected: frozenset[str] = frozenset(setup.participants)
        self._answered: set[str] = set()
        self._gone: set[str] = set()
        self._advertised: dict[str, AdvertisedKeys] = {}
        self._offered: frozenset[str] = frozenset()  # advertised by an offer
        self._commitments: dict[str, bytes] = {}
        #: client id -> the `KeyOffer` its share-keys reply carried (for a later attempt)
        self.new_offers: dict[str, KeyOffer] = {}
        self._keys_seen: set[bytes] = set()
        self._roster: dict[str, frozenset[str]] = {}
        self._sealed: dict[str, ShareKeysReply] = {}
        self._inbox: dict[str, tuple[EncryptedShare, ...]] = {}
        self._sharers: frozenset[str] = frozenset()
        self._total = np.zeros(setup.masked_length, dtype=np.uint32)
        self._digests: dict[str, bytes] = {}
        self._survivors: frozenset[str] = frozenset()
        self._dropped: frozenset[str] = frozenset()
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
        if self._stage is Stage.ADVERTISE_KEYS:
            return AdvertiseKeysRequest(self.setup)
        rid = self.setup.round_id
        if self._stage is Stage.SHARE_KEYS:
            keys = tuple(self._advertised[v] for v in sorted(self._roster[client_id]))
            if client_id in self._offered:
                return ShareKeysRequest(rid, keys, self.setup, self._advertised[client_id])
            return ShareKeysRequest(rid, keys)
        if self._stage is Stage.MASKED_INPUT:
            return MaskedInputRequest(rid, self._inbox[client_id])
        neighbours = self.graph[client_id]
        return UnmaskRequest(rid, tuple(sorted(neighbours & self._survivors)),
                             tuple(sorted(neighbours & self._dropped)))

    def can_finish(self) -> bool:
        """In unmask: every secret that must be reconstructed has t shares already."""
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
            MessageRejectedError: the reply is refused; the round is unchanged.
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
        if self._stage is Stage.ADVERTISE_KEYS:
            alive = self._prune(done - self._gone, "advertised keys")
            self._roster = {u: self.graph[u] & alive for u in alive}
            self._open(Stage.SHARE_KEYS, alive)
        elif self._stage is Stage.SHARE_KEYS:
            self._sharers = self._prune(done - self._gone, "shared keys")
            for v in self._sharers:
                self._inbox[v] = tuple(
                    share for u in sorted(self.graph[v] & self._sharers)
                    for share in self._sealed[u].shares if share.receiver == v)
            self._sealed = {}
            self._open(Stage.MASKED_INPUT, self._sharers)
        elif self._stage is Stage.MASKED_INPUT:
            self._survivors = done
            self._dropped = self._sharers - done
            self._check_recoverable()
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
        self._keys_seen.update(keys)
        self._advertised[reply.client_id] = reply

    def _take_shares(self, reply: ShareKeysReply) -> None:
        receivers = [s.receiver for s in reply.shares]
        if sorted(receivers) != sorted(self._roster[reply.client_id]):
            raise _reject(RejectReason.INVALID,
                          "the shares must go to exactly the neighbours whose keys were sent")
        for share in reply.shares:
            if share.sender != reply.client_id or len(share.ciphertext) != SEALED_SHARE_BYTES:
                raise _reject(RejectReason.INVALID, "a share has the wrong sender or size")
        offer = reply.next_keys
        if offer is not None:
            offered = (offer.cipher_public_key, offer.mask_public_key)
            if set(offered) & self._keys_seen:
                raise _reject(RejectReason.INVALID, "the keys offered for the next attempt are "
                              "not fresh")
            if not all(usable_public_key(k) for k in offered):
                raise _reject(RejectReason.INVALID, "a key offered for the next attempt is a "
                              "point of small order")
        self._sealed[reply.client_id] = reply
        self._commitments[reply.client_id] = reply.self_mask_commitment
        if offer is not None:
            self.new_offers[reply.client_id] = offer

    def _take_masked_input(self, reply: MaskedInputReply, digest: bytes | None) -> None:
        masked = reply.masked
        if masked.dtype != np.dtype("<u4") or masked.shape != (self.setup.masked_length,):
            raise _reject(RejectReason.INVALID,
                          f"a masked input is uint32[{self.setup.masked_length}], got "
                          f"{masked.dtype}{list(masked.shape)}")
        np.add(self._total, masked, out=self._total)
        self._digests[reply.client_id] = digest or _digest(masked)

    def _take_unmask(self, reply: UnmaskReply) -> None:
        request = self.request_for(reply.client_id)
        assert isinstance(request, UnmaskRequest)
        _check_owners(reply.self_mask_shares, request.survivors, "self-mask")
        _check_owners(reply.mask_key_shares, request.dropped, "mask-key")
        x = self.setup.x_coordinate(reply.client_id)
        for shares, store in ((reply.self_mask_shares, self._self_mask_shares),
                              (reply.mask_key_shares, self._mask_key_shares)):
            for share in shares:
                store.setdefault(share.owner, {})[x] = share.value
        self._unmask_replies[reply.client_id] = reply

    def _finish(self) -> None:
        total = self._total
        self._total = np.zeros(0, dtype=np.uint32)
        try:
            unmask_sum(self.setup, self.graph, total, self._survivors, self._dropped,
                       self._advertised, self._commitments, self._self_mask_shares,
                       self._mask_key_shares, self._map_fn)
            weighted, weight = dequantize(total, len(self._survivors), self.setup.clip_range,
                                          self.setup.bits)
        except SecureAggregationError as exc:
            self._fail(str(exc))
        if not weight > 0:
            self._fail("the survivors' total weight decoded to zero")
        self._result = SecAggResult(
            mean=weighted / weight,
            weighted_sum=weighted,
            total_weight=weight,
            total_examples=weight * self.setup.max_weight,
            survivors=tuple(sorted(self._survivors)),
            dropped=tuple(sorted(self._dropped)),
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
        if len(alive) < t + 1:
            self._fail(f"only {len(alive)} clients {did} with at least {t} neighbours that "
                       f"did too; at least {t + 1} are needed")
        return frozenset(alive)

    def _check_recoverable(self) -> None:
        t, alive = self.setup.threshold, self._survivors - self._gone
        if len(self._survivors) < t + 1:
            self._fail(f"only {len(self._survivors)} masked inputs; at least {t + 1} needed")
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
        return self._unmask_replies.get(client_id) == reply

    def _check_running(self) -> None:
        if self.status is not SecAggStatus.RUNNING:
            raise _reject(RejectReason.STALE, f"the round attempt has {self.status}")

    def _fail(self, why: str) -> NoReturn:
        self.status, self.failure = SecAggStatus.FAILED, why
        self._total = np.zeros(0, dtype=np.uint32)
        raise SecureAggregationError(f"secure aggregation of {self.setup.round_id} failed: {why}")


def _digest(masked: np.ndarray) -> bytes:
    """SHA-256 of a masked vector (to recognise an identical retry), without a copy."""
    return hashlib.sha256(np.ascontiguousarray(masked).data.cast("B")).digest()


def _check_owners(shares: Iterable[RevealedShare], wanted: tuple[str, ...], kind: str) -> None:
    owners = [s.owner for s in shares]
    if sorted(owners) != sorted(wanted):
        raise _reject(RejectReason.INVALID,
                      f"the {kind} shares must be for exactly {list(wanted)}, got {owners}")
    for share in shares:
        if len(share.value) != SHARE_BYTES or int.from_bytes(share.value, "big") >= PRIME:
            raise _reject(RejectReason.INVALID, f"a {kind} share is not a field element")
