"""The client half of SecAgg+ (Bonawitz et al., CCS 2017; Bell et al., CCS 2020).

`SecAggClient` is a pure state machine: give it the server's stage requests and it
returns its replies; it does no I/O, so any transport can carry the messages. The
security of a client's input rests on the checks made here, not on the server:

- **fresh keys**: per round attempt it uses two fresh X25519 key pairs and a fresh
  self-mask seed; a request for an attempt it has finished, or an older one, is refused,
  so masks are never reused; it takes part in at most ``max_attempts`` attempts of one
  round. (Unauthenticated attempts may use keys offered with the previous share-keys
  reply, a `KeyOffer`, once.)
- **one unmasking per round**: once it has revealed shares in an attempt of a round,
  it takes part in no other attempt of that round. Two unmasked attempts of one round
  over survivor sets that differ by one client would hand the server that client's
  update (the difference of the two sums; a retried attempt masks the same update). A
  client that confirmed an attempt's survivors but was not asked to unmask may join a
  retry: its neighbours may have revealed its self mask, so a deviating server can get
  that attempt's sum and the retry's, whose difference is the sum over the first
  attempt's revealers — a group that holds t neighbours of every survivor, within the
  bound of docs/secure-aggregation.md. An input the caller encoded itself (distributed
  DP), whose noise is calibrated for one sum, takes part in no other attempt once
  confirmed.
- **signed keys** (authenticated attempts, when the client holds a `SigningIdentity`):
  it signs its keys, bound to the setup, its id and identity; it checks every other
  participant's certificate against the client CA (`PeerVerifier`), its name against
  the identity the setup seats there, and its signature, and refuses a roster that
  leaves a participant out or lists a key twice. A server that substitutes a key is
  caught. A client with a certificate refuses unauthenticated attempts.
- **the graph is derived, not told**: it computes the neighbour graph from the setup and
  every participant's keys (`graph_seed`), and pairs only with its neighbours there.
- **shares**: those it receives must authenticate (sender, receiver, run, round,
  attempt, setup) and match the commitments their dealer published; it needs at least
  t of them before it masks.
- **one survivor set** (authenticated attempts): it confirms (signs) one survivor set
  per attempt, and only a set that contains it, names no client that is not a
  participant, includes every neighbour whose shares the server delivered to it only if
  it holds their shares, counts at least t of its neighbours and ``min_survivors`` in
  all, and is connected in the graph (a disconnected set would let the server read each
  part's sum). In unmask it needs the confirmations of at least t of its neighbours on
  that same set, and reveals a survivor's self-mask share only with that survivor's own
  confirmation. Unauthenticated attempts run the same set checks in unmask.
- **one answer**: it answers one unmask request per attempt and never reveals both the
  self-mask share and the mask-key share of one client.

Any refusal raises `SecureAggregationError` that says what was wrong, and ends the
attempt for this client (its secrets are dropped); to the server it is a dropout.
Repeating an identical request returns the identical reply (transport retries are safe
and reveal nothing new).

Example, one authenticated attempt (``reply`` goes back to the server)::

    client = SecAggClient("client-3", identity=SigningIdentity.from_files(cert, key),
                          peers=PeerVerifier.from_pem_file("ca.pem"))
    reply = client.handle(advertise_request)                   # AdvertisedKeys
    reply = client.handle(share_request)                       # ShareKeysReply
    reply = client.handle(masked_request, vector=delta_flat, num_examples=120)
    reply = client.handle(consistency_request)                 # ConsistencyReply
    reply = client.handle(unmask_request)                      # UnmaskReply
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from fedloom.errors import SecureAggregationError
from fedloom.secagg._client_attempts import ClientAttempts
from fedloom.secagg._client_state import Attempt, NotThisAttempt, Offer, RoundLedger, new_offer
from fedloom.secagg._config import SecAggConfig
from fedloom.secagg._crypto import (
    MASK_KEY,
    SELF_MASK,
    agree,
    commit_self_mask,
    commit_share,
    derive_mask_seed,
    derive_share_key,
    generate_private_key,
    private_bytes,
    seal_share,
    survivors_statement,
)
from fedloom.secagg._graph import Graph, graph_seed, neighbour_graph
from fedloom.secagg._identity import PeerVerifier, SigningIdentity
from fedloom.secagg._messages import (
    AdvertisedKeys,
    AdvertiseKeysRequest,
    ConsistencyReply,
    ConsistencyRequest,
    EncryptedShare,
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
from fedloom.secagg._prg import MaskExpander
from fedloom.secagg._quantize import quantize
from fedloom.secagg._setup import RoundSetup
from fedloom.secagg._shamir import split

_R = TypeVar("_R")


class SecAggClient(ClientAttempts):
    """One client's SecAgg+ state across round attempts.

    Args:
        client_id: this client's id, as the server lists it among the participants.
        policy: when given, the round's parameters (k, t, clip range, bits, max weight)
            must equal these, its ``max_participants`` bounds the round's size, its
            survivor floor bounds the setup's from below, and its ``max_attempts``
            caps the attempts per round; otherwise ``max_attempts`` (default: that of
            `SecAggConfig`, 3) caps them and any parameters that pass its rules are
            accepted.
        identity: this client's certificate and key. With one, the client takes part
            only in authenticated attempts, signs its keys and confirmations, and
            checks everyone else's with ``peers``.
        peers: the client CA, to check other participants' certificates.
        rng: randomness for stochastic rounding (not secret); seeded from the OS if None.
        offer_keys: send a `KeyOffer` for the next attempt with each share-keys reply of
            an unauthenticated attempt (lets the server skip the next advertise_keys).
        ledger: the rounds this client took part in, shared by all the client's
            sessions (a new one if None).
        max_attempts: attempts of one round this client takes part in (1..16), when no
            ``policy`` says; a server retrying past it retries without this client.
    """

    def __init__(self, client_id: str, *, policy: SecAggConfig | None = None,
                 identity: SigningIdentity | None = None, peers: PeerVerifier | None = None,
                 rng: np.random.Generator | None = None, offer_keys: bool = True,
                 ledger: RoundLedger | None = None, max_attempts: int | None = None) -> None:
        if identity is not None and peers is None:
            raise SecureAggregationError(
                "a client with a certificate needs the client CA (peers) to check the other "
                "participants' signatures")
        if max_attempts is not None and not 1 <= max_attempts <= 16:
            raise SecureAggregationError(f"max_attempts must be in 1..16, got {max_attempts}")
        self.client_id = client_id
        self.policy = policy
        #: attempts of one round this client takes part in, when no policy says
        self.max_attempts = max_attempts
        self.identity = identity
        self.peers = peers
        self.offer_keys = offer_keys
        self._rng = rng if rng is not None else np.random.default_rng()
        self._attempt: Attempt | None = None
        self._offer: Offer | None = None  # the latest KeyOffer sent, not used yet
        self.ledger = ledger if ledger is not None else RoundLedger()

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
        if isinstance(request, ConsistencyRequest):
            return self.consistency(request)
        if isinstance(request, UnmaskRequest):
            return self.unmask(request)
        raise SecureAggregationError(f"not a SecAgg+ request: {type(request).__name__}")

    @property
    def setup(self) -> RoundSetup | None:
        """The setup of the attempt in progress, if any."""
        return self._attempt.setup if self._attempt is not None else None

    @property
    def graph(self) -> Graph:
        """The neighbour graph of the attempt in progress (empty before share_keys)."""
        return self._attempt.graph if self._attempt is not None else {}

    # -- stages ---------------------------------------------------------------------
    # Each refusal ends the current attempt (its secrets are dropped), except for a request
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
        """Stage masked_input: open the neighbours' shares, mask the weighted update.

        ``vector`` is the float update (quantized here, weighted by ``num_examples``),
        or a uint32 vector of ``setup.masked_length`` the caller encoded itself (the
        distributed-DP encoding, `fedloom.privacy.encode_for_secagg`), masked as it is.
        """
        return self._guarded(self._masked_input, request, vector, num_examples)

    def consistency(self, request: ConsistencyRequest) -> ConsistencyReply:
        """Stage consistency: confirm (sign) the survivor set, once per attempt."""
        return self._guarded(self._consistency, request)

    def unmask(self, request: UnmaskRequest) -> UnmaskReply:
        """Stage unmask: reveal survivors' seed shares and dropped clients' key shares."""
        return self._guarded(self._unmask, request)

    def _guarded(self, stage: Callable[..., _R], *args: Any) -> _R:
        try:
            return stage(*args)
        except NotThisAttempt:
            raise
        except SecureAggregationError:
            self.abort()
            raise

    def _advertise_keys(self, request: AdvertiseKeysRequest) -> AdvertisedKeys:
        setup = request.setup
        current = self._attempt
        finished = current is not None and Stage.UNMASK in current.answered
        if current is not None and current.setup.round_id == setup.round_id and not finished:
            return self._replay(current, Stage.ADVERTISE_KEYS, request)  # type: ignore[return-value]
        self._begin(setup, generate_private_key(), generate_private_key())
        attempt = self._attempt
        assert attempt is not None
        reply = self._own_keys(attempt)
        attempt.answered[Stage.ADVERTISE_KEYS] = (request, reply)
        return reply

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
        self._take_roster(attempt, request.roster)
        attempt.graph_seed = graph_seed(setup, request.roster)
        attempt.graph = neighbour_graph(attempt.roster, setup.neighbours, attempt.graph_seed)
        attempt.neighbours = attempt.graph[self.client_id]
        # The graph gives every member min(k, n - 1) >= t neighbours once the roster has
        # passed `_take_roster`; this refusal keeps the client safe should that change.
        if len(attempt.neighbours) < threshold:
            self._refuse(f"only {len(attempt.neighbours)} neighbours advertised keys; at least "
                         f"the threshold ({threshold}) is needed to share secrets")
        assert attempt.mask_key is not None and attempt.self_mask_seed is not None
        receivers = sorted(attempt.neighbours)
        xs = [setup.x_coordinate(v) for v in receivers]
        key_shares = split(private_bytes(attempt.mask_key), threshold, xs)
        seed_shares = split(attempt.self_mask_seed, threshold, xs)
        sealed, secrets, commitments = [], {}, []
        assert attempt.cipher_key is not None
        for v, key_share, seed_share in zip(receivers, key_shares, seed_shares, strict=True):
            shared = secrets[v] = agree(attempt.cipher_key,
                                        attempt.roster[v].cipher_public_key)
            nonce, ciphertext = seal_share(derive_share_key(shared, setup, self.client_id, v),
                                           setup, self.client_id, v, key_share + seed_share,
                                           graph_seed=attempt.graph_seed)
            sealed.append(EncryptedShare(self.client_id, v, nonce, ciphertext))
            commitments.append(ShareCommitment(
                v, commit_share(setup, self.client_id, v, MASK_KEY, key_share),
                commit_share(setup, self.client_id, v, SELF_MASK, seed_share)))
        offer = None
        if self.offer_keys and not setup.authenticated:  # keys of this client's next attempt
            self._offer = new_offer()
            offer = self._offer.public
        reply = ShareKeysReply(setup.round_id, self.client_id, tuple(sealed),
                               commit_self_mask(setup, self.client_id, attempt.self_mask_seed),
                               tuple(commitments), offer)
        attempt.cipher_secrets = secrets
        attempt.answered[Stage.SHARE_KEYS] = (request, reply)
        return reply

    def _masked_input(self, request: MaskedInputRequest, vector: np.ndarray,
                      num_examples: int) -> MaskedInputReply:
        attempt = self._enter(Stage.MASKED_INPUT, request)
        if isinstance(attempt, MaskedInputReply):
            return attempt
        setup = attempt.setup
        held: dict[str, tuple[bytes, bytes]] = {}
        for share, commitment in zip(request.shares, request.commitments, strict=True):
            held[share.sender] = self._open(attempt, share, commitment, held)
        if len(held) < setup.threshold:
            self._refuse(f"only {len(held)} neighbours shared keys; at least the threshold "
                         f"({setup.threshold}) must survive for this input to be unmasked")
        values = np.asarray(vector)
        if values.dtype == np.uint32:  # encoded by the caller (distributed DP): as it is
            if values.shape != (setup.masked_length,):
                self._refuse(f"the encoded input has shape {values.shape}; the round expects "
                             f"({setup.masked_length},)")
            masked = values.copy()
            attempt.encoded = True
        elif values.shape != (setup.vector_length,):
            self._refuse(f"the update has shape {values.shape}; the round expects "
                         f"({setup.vector_length},)")
        else:
            weight = setup.config().weight_of(num_examples)
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

    def _consistency(self, request: ConsistencyRequest) -> ConsistencyReply:
        attempt = self._enter(Stage.CONSISTENCY, request)
        if isinstance(attempt, ConsistencyReply):
            return attempt
        setup = attempt.setup  # authenticated: `_enter` refuses the stage otherwise
        self._check_survivors(attempt, request.survivors)
        assert self.identity is not None
        signature = self.identity.sign(survivors_statement(setup, request.survivors,
                                                           graph_seed=attempt.graph_seed))
        reply = ConsistencyReply(setup.round_id, self.client_id, signature)
        attempt.view = request.survivors
        attempt.answered[Stage.CONSISTENCY] = (request, reply)
        if attempt.encoded:
            # With this signature its neighbours may reveal its self-mask shares without
            # it: a distributed-DP input may then be in this attempt's sum, and its noise
            # was calibrated for one sum over the round's floor, so no other attempt.
            self.ledger.revealed.add((setup.round_id.run_id, setup.round_id.server_round))
        return reply

    def _unmask(self, request: UnmaskRequest) -> UnmaskReply:
        attempt = self._enter(Stage.UNMASK, request)
        if isinstance(attempt, UnmaskReply):
            return attempt
        setup, survivors = attempt.setup, request.survivors
        confirmed: set[str] = set()
        if setup.authenticated:
            if survivors != attempt.view:
                self._refuse("the unmask request names another survivor set than the one this "
                             "client confirmed")
            confirmed = self._check_confirmations(attempt, request)
        else:
            if request.confirmations:
                self._refuse("an unauthenticated round carries confirmations")
            self._check_survivors(attempt, survivors)
        alive = set(survivors)
        self_mask_shares, mask_key_shares = [], []
        for owner in sorted(attempt.held):
            key_share, seed_share = attempt.held[owner]
            if owner not in alive:
                mask_key_shares.append(RevealedShare(owner, key_share))
            elif not setup.authenticated or owner in confirmed:
                self_mask_shares.append(RevealedShare(owner, seed_share))
        reply = UnmaskReply(setup.round_id, self.client_id, tuple(self_mask_shares),
                            tuple(mask_key_shares))
        attempt.held = {}  # one answer per attempt: nothing else can be revealed
        self.ledger.revealed.add((setup.round_id.run_id, setup.round_id.server_round))
        attempt.answered[Stage.UNMASK] = (request, reply)
        return reply
