"""The checks a SecAgg+ client makes before it acts on a request (`ClientChecks`).

Mixed into `fedloom.secagg.SecAggClient`: the roster's certificates and signatures, the
setup's seat and authentication mode, the client's policy, each share it opens against
its dealer's commitment, every survivor set, and its neighbours' confirmations. Each
refusal says what was wrong (`_refuse` ends the attempt; `_ignore` refuses a request of
another attempt and lets the current one go on).
"""

from __future__ import annotations

from typing import NoReturn

from fedloom.errors import SecureAggregationError
from fedloom.secagg._client_state import Attempt, DealerAccused, NotThisAttempt
from fedloom.secagg._config import SecAggConfig
from fedloom.secagg._crypto import (
    MASK_KEY,
    SELF_MASK,
    commit_share,
    derive_share_key,
    key_statement,
    open_share,
    survivors_statement,
)
from fedloom.secagg._graph import is_connected
from fedloom.secagg._identity import PeerVerifier, SigningIdentity, VerifiedPeer
from fedloom.secagg._messages import (
    AdvertisedKeys,
    EncryptedShare,
    ShareCommitment,
    UnmaskRequest,
)
from fedloom.secagg._setup import RoundSetup
from fedloom.secagg._shamir import SHARE_BYTES


class ClientChecks:
    """The refusals of `SecAggClient` (see the module docstring)."""

    client_id: str
    policy: SecAggConfig | None
    identity: SigningIdentity | None
    peers: PeerVerifier | None

    def _check_authentication(self, setup: RoundSetup) -> None:
        if self.identity is None:
            if setup.authenticated:
                self._ignore("the round signs its keys (authenticated), but this client has no "
                             "certificate to sign with: give it its client certificate and key")
            return
        if not setup.authenticated:
            self._ignore("this client holds a certificate and takes part only in rounds whose "
                         "keys are signed; an unauthenticated round would let the server "
                         "substitute keys unseen")
        seated = setup.identity_of(self.client_id)
        if seated != self.identity.name:
            self._ignore(f"the setup seats this client as {seated!r}, but its certificate "
                         f"names {self.identity.name!r}")

    def _take_roster(self, attempt: Attempt, roster: tuple[AdvertisedKeys, ...]) -> None:
        """Check every participant's advertised keys; keep them (and their certificates)."""
        setup = attempt.setup
        seen_keys: set[bytes] = set()
        for keys in roster:
            who = keys.client_id
            if keys.round_id != setup.round_id:
                self._refuse(f"the keys of {who!r} are for another round attempt")
            if who not in setup.participants:
                self._refuse(f"{who!r} advertised keys but is not a participant")
            if who in attempt.roster:  # (the message refuses it too; a roster built here)
                self._refuse(f"the roster lists {who!r} twice")
            for k in (keys.cipher_public_key, keys.mask_public_key):
                if k in seen_keys:
                    self._refuse(f"{who!r} advertised a public key listed before (keys were "
                                 "substituted or replayed)")
                seen_keys.add(k)
            if setup.authenticated and who != self.client_id:  # its own: compared below
                attempt.peers[who] = self._check_signed(setup, keys)
            elif keys.signed and not setup.authenticated:
                self._refuse("an unauthenticated round carries signed keys")
            attempt.roster[who] = keys
        mine = attempt.roster.get(self.client_id)
        if mine is None or (mine.cipher_public_key, mine.mask_public_key) != attempt.public_keys:
            self._refuse("the keys the roster lists as this client's are not its own")
        if setup.authenticated and len(attempt.roster) != len(setup.participants):
            missing = sorted(set(setup.participants) - set(attempt.roster))
            self._refuse(f"the roster leaves out {len(missing)} participants ({missing[:5]}): "
                         "in an authenticated round every participant's keys shape the graph, so "
                         "the server must start a new attempt without them rather than choose "
                         "which keys count")
        if len(attempt.roster) < setup.threshold + 1:
            self._refuse(f"only {len(attempt.roster)} participants advertised keys; at least "
                         f"threshold + 1 = {setup.threshold + 1} are needed")

    def _check_signed(self, setup: RoundSetup, keys: AdvertisedKeys) -> VerifiedPeer:
        who = keys.client_id
        if not keys.signed:
            self._refuse(f"the keys of {who!r} are not signed in an authenticated round")
        assert self.peers is not None
        try:
            peer = self.peers.verify_certificate(keys.certificate)
        except SecureAggregationError as exc:
            self._refuse(f"the certificate of {who!r}: {exc}")
        if peer.name != setup.identity_of(who):
            self._refuse(f"the certificate of {who!r} names {peer.name!r}, but the setup seats "
                         f"{setup.identity_of(who)!r} there")
        statement = key_statement(setup, who, keys.cipher_public_key, keys.mask_public_key)
        if not self.peers.verify(peer, keys.signature, statement):
            self._refuse(f"the signature on the keys of {who!r} does not verify (keys "
                         "substituted, or signed for another attempt)")
        return peer

    def _check_survivors(self, attempt: Attempt, survivors: tuple[str, ...]) -> None:
        """The checks a survivor set must pass before this client acts on it."""
        setup, mine = attempt.setup, set(survivors)
        if self.client_id not in mine:
            self._refuse("the survivor set leaves this client out, yet asks it to act on it")
        strangers = mine - set(attempt.roster)
        if strangers:
            self._refuse(f"the survivor set names {sorted(strangers)[:5]}, which advertised no "
                         "keys in this attempt")
        near = attempt.neighbours & mine
        withheld = near - set(attempt.held)
        if withheld:
            self._refuse(f"the survivor set names the neighbours {sorted(withheld)[:5]}, whose "
                         "shares the server never delivered to this client (a server that "
                         "withholds shares could isolate a small group)")
        if len(near) < setup.threshold:
            self._refuse(f"only {len(near)} surviving neighbours; fewer than the threshold "
                         f"({setup.threshold}) would expose too small a sum")
        if len(survivors) < setup.min_survivors:
            self._refuse(f"only {len(survivors)} survivors; this round unmasks no fewer than "
                         f"min_survivors = {setup.min_survivors}")
        if not is_connected(attempt.graph, survivors):
            self._refuse("the survivors are not connected in the neighbour graph: each part's "
                         "sum would be revealed on its own")

    def _check_confirmations(self, attempt: Attempt, request: UnmaskRequest) -> set[str]:
        """The neighbours whose signature of the survivor set verifies (at least t)."""
        setup = attempt.setup
        statement = survivors_statement(setup, request.survivors,
                                        graph_seed=attempt.graph_seed)
        assert self.peers is not None
        confirmed = set()
        for confirmation in request.confirmations:
            signer = confirmation.signer
            if signer not in attempt.neighbours or signer not in request.survivors:
                self._refuse(f"a confirmation from {signer!r}, which is not a surviving "
                             "neighbour of this client")
            if not self.peers.verify(attempt.peers[signer], confirmation.signature, statement):
                self._refuse(f"the confirmation of {signer!r} does not verify: it did not sign "
                             "this survivor set for this attempt and roster")
            confirmed.add(signer)
        if len(confirmed) < setup.threshold:
            self._refuse(f"only {len(confirmed)} neighbours confirmed the survivor set; at "
                         f"least the threshold ({setup.threshold}) must, before any share is "
                         "revealed")
        return confirmed

    def _open(self, attempt: Attempt, share: EncryptedShare, commitment: ShareCommitment,
              held: dict[str, tuple[bytes, bytes]]) -> tuple[bytes, bytes]:
        """Authenticate, decrypt and check one share; returns (mask-key share, seed share)."""
        sender = share.sender
        if share.receiver != self.client_id:
            self._refuse(f"a share addressed to {share.receiver!r} was delivered here")
        if sender not in attempt.cipher_secrets:
            self._refuse(f"a share from {sender!r}, which is not a neighbour of this client")
        if sender in held:
            self._refuse(f"two shares from {sender!r} (a replay)")
        shared = attempt.cipher_secrets[sender]  # agreed when this client sealed its shares
        setup = attempt.setup
        key = derive_share_key(shared, setup, sender, self.client_id)
        try:
            plaintext = open_share(key, setup, sender, self.client_id, share.nonce,
                                   share.ciphertext, graph_seed=attempt.graph_seed)
        except SecureAggregationError as exc:
            self._accuse(sender, str(exc))
        if len(plaintext) != 2 * SHARE_BYTES:
            self._accuse(sender, f"the share from {sender!r} is malformed")
        key_share, seed_share = plaintext[:SHARE_BYTES], plaintext[SHARE_BYTES:]
        if (commit_share(setup, sender, self.client_id, MASK_KEY, key_share)
                != commitment.mask_key
                or commit_share(setup, sender, self.client_id, SELF_MASK, seed_share)
                != commitment.self_mask):
            self._accuse(sender, f"the shares from {sender!r} do not match the commitments "
                         "published with them (a dealer that commits to one share and sends "
                         "another)")
        return key_share, seed_share

    def _check_policy(self, setup: RoundSetup) -> None:
        policy = self.policy
        assert policy is not None
        if len(setup.participants) > policy.max_participants:
            self._ignore(f"{len(setup.participants)} participants exceed this client's "
                         f"max_participants ({policy.max_participants})")
        theirs = (setup.neighbours, setup.threshold, setup.clip_range, setup.bits,
                  setup.max_weight)
        mine = (policy.neighbours, policy.threshold, float(policy.clip_range), policy.bits,
                float(policy.max_weight))
        if theirs != mine:
            self._ignore(f"the round's parameters (neighbours, threshold, clip_range, bits, "
                         f"max_weight) = {theirs} differ from this client's secure_aggregation "
                         f"settings {mine}")
        if setup.min_survivors < policy.survivor_floor:
            self._ignore(f"the round unmasks sums of {setup.min_survivors} survivors; this "
                         f"client requires at least {policy.survivor_floor} (min_survivors)")

    def _refuse(self, why: str) -> NoReturn:
        """Refuse a request of the current attempt; `_guarded` then ends the attempt."""
        raise SecureAggregationError(f"client {self.client_id!r} refuses: {why}")

    def _accuse(self, dealer: str, why: str) -> NoReturn:
        """Refuse the attempt over ``dealer``'s share, naming it (`DealerAccused`)."""
        raise DealerAccused(dealer, f"client {self.client_id!r} refuses: {why}")

    def _ignore(self, why: str) -> NoReturn:
        """Refuse a request that is not part of the current attempt (which goes on)."""
        raise NotThisAttempt(f"client {self.client_id!r} refuses: {why}")
