"""How a SecAgg+ client starts a round attempt and places each request in it.

Mixed into `fedloom.secagg.SecAggClient` (`_client`): an attempt starts with fresh key
pairs or with the keys of the client's outstanding `KeyOffer`, unless the round ledger,
the policy or the authentication mode forbid it (`_begin`); each later request must
belong to the current attempt and come in stage order, and an identical repeat gets the
identical reply (`_enter`, `_replay`).
"""

from __future__ import annotations

from typing import Any

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedloom.secagg._client_checks import ClientChecks
from fedloom.secagg._client_state import Attempt, Offer, RoundLedger
from fedloom.secagg._config import SecAggConfig
from fedloom.secagg._crypto import key_statement, new_seed, public_bytes
from fedloom.secagg._messages import (
    AdvertisedKeys,
    SecAggReply,
    ShareKeysRequest,
    Stage,
)
from fedloom.secagg._setup import RoundSetup


class ClientAttempts(ClientChecks):
    """The attempt bookkeeping of `SecAggClient` (see the module docstring)."""

    ledger: RoundLedger
    max_attempts: int | None
    _attempt: Attempt | None
    _offer: Offer | None

    def abort(self) -> None:
        """Forget the current attempt and drop its secrets (e.g. the round was cancelled)."""
        self._attempt = None

    def _own_keys(self, attempt: Attempt) -> AdvertisedKeys:
        """This client's advertised keys for the attempt (signed when authenticated)."""
        setup, (cipher, mask) = attempt.setup, attempt.public_keys
        if not setup.authenticated:
            return AdvertisedKeys(setup.round_id, self.client_id, cipher, mask)
        assert self.identity is not None
        signature = self.identity.sign(key_statement(setup, self.client_id, cipher, mask))
        return AdvertisedKeys(setup.round_id, self.client_id, cipher, mask,
                              self.identity.certificate_der, signature)

    def _begin(self, setup: RoundSetup, cipher_key: X25519PrivateKey,
               mask_key: X25519PrivateKey) -> None:
        """Start a new attempt with these key pairs, if ``setup`` may start one."""
        rid = setup.round_id
        key = (rid.run_id, rid.server_round)
        ledger = self.ledger
        if rid.attempt <= ledger.latest.get(key, -1):
            self._ignore(f"round {rid.server_round} attempt {rid.attempt} was already used or "
                         "is older than one seen; a restarted round needs a new attempt id")
        if self.client_id not in setup.participants:
            self._ignore("this client is not among the round's participants")
        if key in ledger.revealed:
            self._ignore(f"this client's input may be in the sum of an earlier attempt of round "
                         f"{rid.server_round} (it revealed shares, or confirmed the survivors of "
                         "a distributed-DP attempt): a second unmasked attempt would show the "
                         "server a second sum, and the difference of the two its missing "
                         "clients' updates")
        limit = (self.policy.max_attempts if self.policy is not None
                 else self.max_attempts or SecAggConfig().max_attempts)
        if ledger.attempts.get(key, 0) >= limit:
            self._ignore(f"this client already took part in {limit} attempts of round "
                         f"{rid.server_round} (max_attempts): every attempt shows the server a "
                         "sum over its survivors, so it takes part in no more")
        if self.policy is not None:
            self._check_policy(setup)
        self._check_authentication(setup)
        self.abort()  # a new attempt supersedes any older one
        ledger.latest[key] = rid.attempt
        ledger.attempts[key] = ledger.attempts.get(key, 0) + 1
        self._attempt = Attempt(setup=setup, cipher_key=cipher_key, mask_key=mask_key,
                                 self_mask_seed=new_seed(),
                                 public_keys=(public_bytes(cipher_key), public_bytes(mask_key)))

    def _begin_from_offer(self, request: ShareKeysRequest) -> None:
        """A share request that skips advertise_keys: start its attempt with the keys of
        the outstanding offer (used up here, whatever happens next)."""
        offer, self._offer = self._offer, None
        setup, own = request.setup, request.own_keys
        assert setup is not None and own is not None
        if setup.authenticated:
            self._ignore("an authenticated round never uses key offers: its keys must be made "
                         "after the setup is known")
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

    def _order(self, setup: RoundSetup) -> tuple[Stage, ...]:
        stages = tuple(Stage)
        return stages if setup.authenticated else tuple(
            s for s in stages if s is not Stage.CONSISTENCY)

    def _enter(self, stage: Stage, request: Any) -> Any:
        """The current attempt if ``request`` may run now, or the cached reply."""
        attempt = self._attempt
        if attempt is None or attempt.setup.round_id != request.round_id:
            self._ignore(f"{stage} for {request.round_id} does not match this client's "
                         "current round attempt")
        assert attempt is not None
        if stage in attempt.answered:
            return self._replay(attempt, stage, request)
        order = self._order(attempt.setup)
        if stage not in order:
            self._refuse(f"an unauthenticated round has no {stage} stage")
        # Stages are recorded in order, so the answered ones are a prefix of ``order``:
        # a stage may run when the one before it was answered (and it was not: above).
        previous = order[order.index(stage) - 1]
        if previous not in attempt.answered:
            self._refuse(f"{stage} arrived out of order")
        return attempt

    def _replay(self, attempt: Attempt, stage: Stage, request: Any) -> SecAggReply:
        cached = attempt.answered.get(stage)
        if cached is None or cached[0] != request:
            self._refuse(f"a second, different {stage} request for one round attempt")
        assert cached is not None
        return cached[1]
