"""The client half of SecAgg+ (Bonawitz et al., CCS 2017; Bell et al., CCS 2020).

`SecAggClient` is a pure state machine: give it the server's stage requests (from
`fedloom.secagg`) and it returns its replies; it does no I/O, so any transport can
carry the messages. The security of a client's input rests on the checks made here,
not on the server behaving:

- per round attempt it uses two fresh X25519 key pairs and a fresh self-mask seed;
  a request for an attempt it has already finished, or for an older attempt, is refused,
  so masks are never reused. The key pairs are made at advertise_keys, or ahead of time
  as a `KeyOffer` sent with the previous share_keys reply: an offer is used for one
  attempt at most (it is gone the moment a request names it), and only the latest
  offer is kept;
- it only pairs with neighbours of the public graph, and refuses to go on with fewer
  than t of them;
- shares it receives must authenticate (sender, receiver, run, round, attempt);
- it answers one unmask request per attempt, and refuses one whose survivor and dropped
  lists overlap, name a client that is not its neighbour (or whose share it lacks),
  leave a neighbour out, or hold fewer than t survivors. It never reveals both the
  self-mask share and the mask-key share of one client.

Any refusal raises `SecureAggregationError` and ends the attempt for this client (its
secrets are erased); to the server it is a dropout. Repeating an identical request
returns the identical reply (transport retries are safe and reveal nothing new).

Example, one attempt (``reply`` goes back to the server)::

    client = SecAggClient("client-3")
    reply = client.handle(advertise_request)                   # AdvertisedKeys
    reply = client.handle(share_request)                       # ShareKeysReply
    reply = client.handle(masked_request, vector=delta_flat, num_examples=120)
    reply = client.handle(unmask_request)                      # UnmaskReply

In the next attempt the server may skip advertise_keys: its share request then carries
the setup and the keys of ``reply.next_keys`` from the share-keys reply above.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedloom.errors import SecureAggregationError
from fedloom.secagg._config import SecAggConfig
from fedloom.secagg._crypto import (
    agree,
    commit_self_mask,
    derive_mask_seed,
    derive_share_key,
    generate_private_key,
    new_seed,
    open_share,
    private_bytes,
    public_bytes,
    seal_share,
)
from fedloom.secagg._graph import neighbour_graph
from fedloom.secagg._messages import (
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
from fedloom.secagg._prg import MaskExpander
from fedloom.secagg._quantize import quantize
from fedloom.secagg._shamir import SHARE_BYTES, split

_R = TypeVar("_R")


class _NotThisAttempt(SecureAggregationError):
    """A request for another (older, used or foreign) round attempt."""


_ORDER = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASK)


@dataclasses.dataclass(eq=False)
class _Offer:
    """The private halves of the client's outstanding `KeyOffer`."""

    cipher_key: X25519PrivateKey
    mask_key: X25519PrivateKey
    public: KeyOffer


def _new_offer() -> _Offer:
    cipher_key, mask_key = generate_private_key(), generate_private_key()
    return _Offer(cipher_key, mask_key, KeyOffer(public_bytes(cipher_key), public_bytes(mask_key)))


@dataclasses.dataclass(eq=False)
class _Attempt:
    """What one client holds during one round attempt (secrets are dropped early)."""

    setup: RoundSetup
    graph_neighbours: frozenset[str]
    cipher_key: X25519PrivateKey | None
    mask_key: X25519PrivateKey | None
    self_mask_seed: bytes | None
    public_keys: tuple[bytes, bytes]  # (cipher, mask), as the server presents them
    roster: dict[str, AdvertisedKeys] = dataclasses.field(default_factory=dict)
    # neighbour -> X25519 secret of the cipher keys (agreed to seal, reused to open; as
    # secret as cipher_key, and dropped with it)
    cipher_secrets: dict[str, bytes] = dataclasses.field(default_factory=dict)
    # owner -> (share of owner's mask key, share of owner's self-mask seed)
    held: dict[str, tuple[bytes, bytes]] = dataclasses.field(default_factory=dict)
    answered: dict[Stage, tuple[SecAggRequest, SecAggReply]] = dataclasses.field(
        default_factory=dict
    )


class SecAggClient:
    """One client's SecAgg+ state across round attempts.

    Args:
        client_id: this client's id, as the server lists it among the participants.
        policy: when given, the server's round parameters must equal these (the
            client's own ``[secure_aggregation]`` settings); otherwise any parameters
            that pass `SecAggConfig`'s rules are accepted.
        rng: randomness for stochastic rounding (not secret); seeded from the OS if None.
        offer_keys: send a `KeyOffer` for the next attempt with each share-keys reply
            (lets the server skip the next advertise_keys stage).
    """

    def __init__(self, client_id: str, *, policy: SecAggConfig | None = None,
                 rng: np.random.Generator | None = None, offer_keys: bool = True) -> None:
        self.client_id = client_id
        self.policy = policy
        self.offer_keys = offer_keys
        self._rng = rng if rng is not None else np.random.default_rng()
        self._attempt: _Attempt | None = None
        self._offer: _Offer | None = None  # the latest KeyOffer sent, not used yet
        self._latest: dict[tuple[str, int], int] = {}  # (run, round) -> newest attempt

    # -- dispatch -------------------------------------------------------------------

    def handle(self, request: SecAggRequest, *, vector: np.ndarray | None = None,
               num_examples: int | None = None) -> SecAggReply:
        """Answer one stage request; ``vector`` and ``num_examples`` for masked_input."""
        if isinstance(request, AdvertiseKeysRequest):
            return self.advertise_keys(request)
        if isinstance(request, ShareKeysRequest):
            return self.share_keys(request)
        if isinstance(request, MaskedInputRequest):
            if vector is None or num_examples is None:
                raise SecureAggregationError("masked_input needs the vector and num_examples")
            return self.masked_input(request, vector, num_examples)
        if isinstance(request, UnmaskRequest):
            return self.unmask(request)
        raise SecureAggregationError(f"not a SecAgg+ request: {type(request).__name__}")

    def abort(self) -> None:
        """Forget the current attempt and erase its secrets (e.g. the round was cancelled)."""
        self._attempt = None

    # -- stages ---------------------------------------------------------------------
    # Each refusal ends the current attempt (its secrets are erased), except for a request
    # that does not belong to the current attempt at all (stale or foreign): that one is
    # refused and the attempt in progress goes on.

    def advertise_keys(self, request: AdvertiseKeysRequest) -> AdvertisedKeys:
        """Stage advertise_keys: fresh key pairs and self-mask seed for this attempt."""
        return self._guarded(self._advertise_keys, request)

    def share_keys(self, request: ShareKeysRequest) -> ShareKeysReply:
        """Stage share_keys: Shamir-share the mask key and seed, sealed per neighbour."""
        return self._guarded(self._share_keys, request)

    def masked_input(self, request: MaskedInputRequest, vector: np.ndarray,
                     num_examples: int) -> MaskedInputReply:
        """Stage masked_input: open the neighbours' shares, mask the weighted update."""
        return self._guarded(self._masked_input, request, vector, num_examples)

    def unmask(self, request: UnmaskRequest) -> UnmaskReply:
        """Stage unmask: reveal survivors' seed shares and dropped clients' key shares."""
        return self._guarded(self._unmask, request)

    def _guarded(self, stage: Callable[..., _R], *args: Any) -> _R:
        try:
            return stage(*args)
        except _NotThisAttempt:
            raise
        except SecureAggregationError:
            self.abort()
            raise


    def _advertise_keys(self, request: AdvertiseKeysRequest) -> AdvertisedKeys:
        setup = request.setup
        rid = setup.round_id
        current = self._attempt
        finished = current is not None and Stage.UNMASK in current.answered
        if current is not None and current.setup.round_id == rid and not finished:
            return self._replay(current, Stage.ADVERTISE_KEYS, request)  # type: ignore[return-value]
        self._begin(setup, generate_private_key(), generate_private_key())
        assert self._attempt is not None
        reply = AdvertisedKeys(rid, self.client_id, *self._attempt.public_keys)
        self._attempt.answered[Stage.ADVERTISE_KEYS] = (request, reply)
        return reply

    def _begin(self, setup: RoundSetup, cipher_key: X25519PrivateKey,
               mask_key: X25519PrivateKey) -> None:
        """Start a new attempt with these key pairs, if ``setup`` may start one."""
        rid = setup.round_id
        key = (rid.run_id, rid.server_round)
        if rid.attempt <= self._latest.get(key, -1):
            self._ignore(f"round {rid.server_round} attempt {rid.attempt} was already used or "
                         "is older than one seen; a restarted round needs a new attempt id")
        if self.client_id not in setup.participants:
            self._ignore("this client is not among the round's participants")
        if self.policy is not None:
            self._check_policy(setup)
        self.abort()  # a new attempt supersedes any older one
        self._latest[key] = rid.attempt
        self._attempt = _Attempt(setup=setup,
                                 graph_neighbours=neighbour_graph(setup)[self.client_id],
                                 cipher_key=cipher_key, mask_key=mask_key,
                                 self_mask_seed=new_seed(),
                                 public_keys=(public_bytes(cipher_key), public_bytes(mask_key)))

    def _begin_from_offer(self, request: ShareKeysRequest) -> None:
        """A share request that skips advertise_keys: start its attempt with the keys of
        the outstanding offer (used up here, whatever happens next)."""
        offer, self._offer = self._offer, None
        setup, own = request.setup, request.own_keys
        assert setup is not None and own is not None
        if offer is None:
            self._ignore("the server presents keys this client never offered (or offered "
                         "for an attempt that already used them)")
        if (own.client_id != self.client_id
                or (own.cipher_public_key, own.mask_public_key)
                != (offer.public.cipher_public_key, offer.public.mask_public_key)):
            self._ignore("the keys the server presents as this client's are not its "
                         "latest offer")
        self._begin(setup, offer.cipher_key, offer.mask_key)
        assert self._attempt is not None
        self._attempt.answered[Stage.ADVERTISE_KEYS] = (request, own)

    def _share_keys(self, request: ShareKeysRequest) -> ShareKeysReply:
        current = self._attempt
        if request.setup is not None and (current is None
                                          or current.setup.round_id != request.round_id):
            self._begin_from_offer(request)
        attempt = self._enter(Stage.SHARE_KEYS, request)
        if isinstance(attempt, ShareKeysReply):
            return attempt
        setup, threshold = attempt.setup, attempt.setup.threshold
        if request.setup is not None and request.setup != setup:
            self._refuse("the share-keys request's setup differs from this attempt's")
        own = request.own_keys
        if own is not None and (own.client_id != self.client_id or (
                own.cipher_public_key, own.mask_public_key) != attempt.public_keys):
            self._refuse("the keys the server presents as this client's are not its own")
        roster: dict[str, AdvertisedKeys] = {}
        seen_keys: set[bytes] = set(attempt.public_keys)
        for keys in request.neighbours:
            if keys.round_id != setup.round_id:
                self._refuse(f"the keys of {keys.client_id!r} are for another round attempt")
            if keys.client_id not in attempt.graph_neighbours:
                self._refuse(f"{keys.client_id!r} is not a neighbour of this client")
            if keys.client_id in roster:
                self._refuse(f"{keys.client_id!r} is listed twice")
            for k in (keys.cipher_public_key, keys.mask_public_key):
                if k in seen_keys:
                    self._refuse("two advertised public keys are equal (keys were substituted)")
                seen_keys.add(k)
            roster[keys.client_id] = keys
        if len(roster) < threshold:
            self._refuse(f"only {len(roster)} neighbours advertised keys; at least the "
                         f"threshold ({threshold}) is needed to share secrets")
        assert attempt.mask_key is not None and attempt.self_mask_seed is not None
        receivers = sorted(roster)
        xs = [setup.x_coordinate(v) for v in receivers]
        key_shares = split(private_bytes(attempt.mask_key), threshold, xs)
        seed_shares = split(attempt.self_mask_seed, threshold, xs)
        sealed, secrets = [], {}
        for v, key_share, seed_share in zip(receivers, key_shares, seed_shares, strict=True):
            assert attempt.cipher_key is not None
            shared = secrets[v] = agree(attempt.cipher_key, roster[v].cipher_public_key)
            nonce, ciphertext = seal_share(derive_share_key(shared, setup, self.client_id, v),
                                           setup, self.client_id, v, key_share + seed_share)
            sealed.append(EncryptedShare(self.client_id, v, nonce, ciphertext))
        offer = None
        if self.offer_keys:  # the keys of this client's next attempt
            self._offer = _new_offer()
            offer = self._offer.public
        reply = ShareKeysReply(setup.round_id, self.client_id, tuple(sealed),
                               commit_self_mask(setup, self.client_id, attempt.self_mask_seed),
                               offer)
        attempt.roster, attempt.cipher_secrets = roster, secrets
        attempt.answered[Stage.SHARE_KEYS] = (request, reply)
        return reply

    def _masked_input(self, request: MaskedInputRequest, vector: np.ndarray,
                     num_examples: int) -> MaskedInputReply:
        attempt = self._enter(Stage.MASKED_INPUT, request)
        if isinstance(attempt, MaskedInputReply):
            return attempt
        setup = attempt.setup
        held: dict[str, tuple[bytes, bytes]] = {}
        for share in request.shares:
            held[share.sender] = self._open(attempt, share, held)
        if len(held) < setup.threshold:
            self._refuse(f"only {len(held)} neighbours shared keys; at least the threshold "
                         f"({setup.threshold}) must survive for this input to be unmasked")
        weight = setup.config().weight_of(num_examples)
        values = np.asarray(vector)
        if values.shape != (setup.vector_length,):
            self._refuse(f"the update has shape {values.shape}; the round expects "
                         f"({setup.vector_length},)")
        masked = quantize(values, weight, setup.clip_range, setup.bits, self._rng)
        assert attempt.mask_key is not None and attempt.self_mask_seed is not None
        masks = [(attempt.self_mask_seed, 1)]
        for v in sorted(held):
            shared = agree(attempt.mask_key, attempt.roster[v].mask_public_key)
            seed = derive_mask_seed(shared, setup, self.client_id, v)
            masks.append((seed, 1 if self.client_id < v else -1))
        MaskExpander(setup.masked_length).apply(masked, masks)  # one pass, block by block
        # no longer needed: the shares are open, the masks are applied
        attempt.mask_key = attempt.self_mask_seed = attempt.cipher_key = None
        attempt.cipher_secrets = {}
        masked.flags.writeable = False
        reply = MaskedInputReply(setup.round_id, self.client_id, masked)
        attempt.held = held
        attempt.answered[Stage.MASKED_INPUT] = (request, reply)
        return reply

    def _unmask(self, request: UnmaskRequest) -> UnmaskReply:
        attempt = self._enter(Stage.UNMASK, request)
        if isinstance(attempt, UnmaskReply):
            return attempt
        survivors, dropped = set(request.survivors), set(request.dropped)
        if len(survivors) != len(request.survivors) or len(dropped) != len(request.dropped):
            self._refuse("the unmask request lists a client twice")
        if survivors & dropped:
            self._refuse(f"the unmask request lists {sorted(survivors & dropped)} as both "
                         "survived and dropped (it asks for both shares of one client)")
        strangers = (survivors | dropped) - set(attempt.held)
        if strangers:
            self._refuse(f"the unmask request names {sorted(strangers)}, which are not "
                         "neighbours whose shares this client holds")
        missing = set(attempt.held) - survivors - dropped
        if missing:
            self._refuse(f"the unmask request leaves out the neighbours {sorted(missing)}")
        if len(survivors) < attempt.setup.threshold:
            self._refuse(f"only {len(survivors)} surviving neighbours; fewer than the "
                         f"threshold ({attempt.setup.threshold}) would expose too small a sum")
        reply = UnmaskReply(
            round_id=attempt.setup.round_id,
            client_id=self.client_id,
            self_mask_shares=tuple(RevealedShare(v, attempt.held[v][1])
                                   for v in request.survivors),
            mask_key_shares=tuple(RevealedShare(v, attempt.held[v][0])
                                  for v in request.dropped),
        )
        attempt.held = {}  # one answer per attempt: nothing else can be revealed
        attempt.answered[Stage.UNMASK] = (request, reply)
        return reply

    # -- helpers --------------------------------------------------------------------

    def _enter(self, stage: Stage, request: Any) -> Any:
        """The current attempt if ``request`` may run now, or the cached reply."""
        attempt = self._attempt
        if attempt is None or attempt.setup.round_id != request.round_id:
            self._ignore(f"{stage} for {request.round_id} does not match this client's "
                         "current round attempt")
        assert attempt is not None
        if stage in attempt.answered:
            return self._replay(attempt, stage, request)
        previous = _ORDER[_ORDER.index(stage) - 1]
        if previous not in attempt.answered or any(
            s in attempt.answered for s in _ORDER[_ORDER.index(stage) + 1 :]
        ):
            self._refuse(f"{stage} arrived out of order")
        return attempt

    def _replay(self, attempt: _Attempt, stage: Stage, request: Any) -> SecAggReply:
        cached = attempt.answered.get(stage)
        if cached is None or cached[0] != request:
            self._refuse(f"a second, different {stage} request for one round attempt")
        assert cached is not None
        return cached[1]

    def _open(self, attempt: _Attempt, share: EncryptedShare,
              held: dict[str, tuple[bytes, bytes]]) -> tuple[bytes, bytes]:
        """Authenticate and decrypt one share; returns (mask-key share, seed share)."""
        sender = share.sender
        if share.receiver != self.client_id:
            self._refuse(f"a share addressed to {share.receiver!r} was delivered here")
        if sender not in attempt.roster:
            self._refuse(f"a share from {sender!r}, which is not a neighbour that shared keys")
        if sender in held:
            self._refuse(f"two shares from {sender!r} (a replay)")
        shared = attempt.cipher_secrets[sender]  # agreed when this client sealed its shares
        key = derive_share_key(shared, attempt.setup, sender, self.client_id)
        try:
            plaintext = open_share(key, attempt.setup, sender, self.client_id,
                                   share.nonce, share.ciphertext)
        except SecureAggregationError as exc:
            self._refuse(str(exc))
        if len(plaintext) != 2 * SHARE_BYTES:
            self._refuse(f"the share from {sender!r} is malformed")
        return plaintext[:SHARE_BYTES], plaintext[SHARE_BYTES:]

    def _check_policy(self, setup: RoundSetup) -> None:
        assert self.policy is not None
        if len(setup.participants) > self.policy.max_participants:
            self._ignore(f"{len(setup.participants)} participants exceed this client's "
                         f"max_participants ({self.policy.max_participants})")
        theirs = setup.config()
        mine = dataclasses.replace(self.policy, enabled=True,
                                   max_participants=max(2, len(setup.participants)),
                                   stage_timeout_s=theirs.stage_timeout_s)  # not a parameter
        if mine != theirs:
            self._ignore(f"the round's parameters {theirs} differ from this client's "
                         f"secure_aggregation settings {mine}")

    def _refuse(self, why: str) -> NoReturn:
        """Refuse a request of the current attempt; `_guarded` then ends the attempt."""
        raise SecureAggregationError(f"client {self.client_id!r} refuses: {why}")

    def _ignore(self, why: str) -> NoReturn:
        """Refuse a request that is not part of the current attempt (which goes on)."""
        raise _NotThisAttempt(f"client {self.client_id!r} refuses: {why}")
