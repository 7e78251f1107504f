"""A scripted malicious SecAgg+ server that drives real `SecAggClient` objects.

The adversary of fedloom's threat model is the server: it may send each client
anything (its own survivor set, its own setup or roster, substituted or replayed keys,
withheld shares), sees every message it relays, and may collude with up to
``colluding_clients`` clients. `MaliciousServer` plays that server stage by stage:
each method builds the requests itself (per client, tampered at will), hands them to
the clients and collects every reply; a client's refusal is recorded in ``refusals``
(to the server it is a dropout). Colluding clients hand over what they hold: the
shares dealt to them, their own mask key, and their signing key (a colluder signs any
survivor set the server likes).

`MaliciousServer.recover` is the adversary's unmasking attempt on one victim A: from
everything collected it reconstructs A's self-mask seed b_A (checked against A's
commitment) and every pairwise seed s_{A,v} A masked with (from A's mask key or v's,
each checked against the advertised public key), removes the masks from A's masked
input y_A and decodes it; it reports whether the decode equals A's true clipped,
weighted input (within one quantum), or which secret it could not obtain.

`plan_split` (in `inconsistent_views`, re-exported here) computes the survivor set
each client is shown in the inconsistent-views attack.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Collection, Mapping

import numpy as np
from inconsistent_views import Graph, plan_split
from secagg_driver import ids_of, make_client, make_inputs, make_setup

from fedloom.errors import SecureAggregationError
from fedloom.secagg import (
    AdvertisedKeys,
    AdvertiseKeysRequest,
    Confirmation,
    ConsistencyReply,
    ConsistencyRequest,
    MaskedInputReply,
    MaskedInputRequest,
    MaskExpander,
    RoundId,
    RoundSetup,
    SecAggClient,
    SecAggConfig,
    SecAggReply,
    SecAggRequest,
    ShareKeysReply,
    ShareKeysRequest,
    UnmaskReply,
    UnmaskRequest,
    agree,
    commit_self_mask,
    dequantize,
    derive_mask_seed,
    graph_seed,
    neighbour_graph,
    private_bytes,
    private_key_from_bytes,
    public_bytes,
    reconstruct,
    survivors_statement,
)

__all__ = ["Graph", "Inputs", "MaliciousServer", "Recovery", "build", "plan_split"]

Inputs = Mapping[str, tuple[np.ndarray, int]]


@dataclasses.dataclass(frozen=True)
class Recovery:
    """The outcome of the adversary's unmasking attempt on one victim.

    ``recovered``: the decode equals the victim's clipped, weighted input within one
    quantum; ``missing`` names the secret that could not be obtained (empty when every
    secret was); ``error``: the largest deviation of the decode (inf if none).
    """

    recovered: bool
    missing: str = ""
    error: float = float("inf")


class MaliciousServer:
    """A server that scripts every request itself (see the module docstring).

    Args:
        config: the round's parameters (for decoding the victim's input).
        clients: the real clients, by id.
        inputs: each client's (vector, num_examples).
        setup: the setup every client is shown unless ``setups`` says otherwise.
        setups: per-client setups (a different model or attempt for some).
        colluders: clients that hand the server their secrets and signing keys.
    """

    def __init__(self, config: SecAggConfig, clients: Mapping[str, SecAggClient],
                 inputs: Inputs, setup: RoundSetup, *,
                 setups: Mapping[str, RoundSetup] | None = None,
                 colluders: Collection[str] = ()) -> None:
        self.config = config
        self.clients = dict(clients)
        self.inputs = inputs
        self.setup = setup
        self.setups = {cid: (setups or {}).get(cid, setup) for cid in clients}
        self.colluders = frozenset(colluders)
        self.refusals: dict[str, str] = {}
        self.keys: dict[str, AdvertisedKeys] = {}
        self.rosters: dict[str, tuple[AdvertisedKeys, ...]] = {}
        self.shares: dict[str, ShareKeysReply] = {}
        self.delivered: dict[str, tuple[str, ...]] = {}  # receiver -> senders delivered
        self.masked: dict[str, np.ndarray] = {}
        self.signed: dict[str, tuple[tuple[str, ...], bytes]] = {}  # cid -> (set, signature)
        self.unmasked: dict[str, UnmaskReply] = {}
        self.leaked_keys: dict[str, bytes] = {}  # colluder -> its mask private key
        self.leaked_shares: dict[str, dict[str, tuple[bytes, bytes]]] = {}  # colluder -> held

    # -- sending ----------------------------------------------------------------------

    def send(self, cid: str, request: SecAggRequest) -> SecAggReply | None:
        """Hand one request to a client; its reply, or None (refusal in ``refusals``)."""
        vector, num_examples = self.inputs[cid]
        try:
            return self.clients[cid].handle(request, vector=vector, num_examples=num_examples)
        except SecureAggregationError as exc:
            self.refusals[cid] = str(exc)
            return None

    def advertise(self) -> None:
        """Stage advertise_keys: each client gets its setup; keys are collected."""
        for cid in sorted(self.clients):
            reply = self.send(cid, AdvertiseKeysRequest(self.setups[cid]))
            if isinstance(reply, AdvertisedKeys):
                self.keys[cid] = reply

    def full_roster(self) -> tuple[AdvertisedKeys, ...]:
        return tuple(self.keys[c] for c in sorted(self.keys))

    def share_keys(self, rosters: Mapping[str, tuple[AdvertisedKeys, ...]] | None = None
                   ) -> None:
        """Stage share_keys: each advertiser gets its roster (the full one by default).
        ``keys`` may also hold keys the server made up (for no client)."""
        for cid in sorted(set(self.keys) & set(self.clients)):
            roster = (rosters or {}).get(cid, self.full_roster())
            self.rosters[cid] = roster
            reply = self.send(cid, ShareKeysRequest(self.setups[cid].round_id, roster))
            if isinstance(reply, ShareKeysReply):
                self.shares[cid] = reply
                if cid in self.colluders:
                    attempt = self.clients[cid]._attempt  # a colluder hands over its key
                    assert attempt is not None and attempt.mask_key is not None
                    self.leaked_keys[cid] = private_bytes(attempt.mask_key)

    def inbox_for(self, cid: str, withhold: Collection[tuple[str, str]] = ()
                  ) -> MaskedInputRequest:
        """``cid``'s masked-input request: the shares sealed for it (with their dealers'
        commitments), except the (sender, receiver) pairs in ``withhold``."""
        shares, commitments = [], []
        for sender in sorted(self.shares):
            reply = self.shares[sender]
            for share, commitment in zip(reply.shares, reply.share_commitments, strict=True):
                if share.receiver == cid and (sender, cid) not in withhold:
                    shares.append(share)
                    commitments.append(commitment)
        return MaskedInputRequest(self.setups[cid].round_id, tuple(shares), tuple(commitments))

    def masked_input(self, withhold: Collection[tuple[str, str]] = ()) -> None:
        """Stage masked_input: each sharer gets its `inbox_for` request."""
        for cid in sorted(self.shares):
            self.send_masked_input(cid, self.inbox_for(cid, withhold))

    def send_masked_input(self, cid: str, request: MaskedInputRequest) -> None:
        self.delivered[cid] = tuple(s.sender for s in request.shares)
        reply = self.send(cid, request)
        if isinstance(reply, MaskedInputReply):
            self.masked[cid] = reply.masked
            if cid in self.colluders:  # a colluder hands over the shares it holds
                attempt = self.clients[cid]._attempt
                assert attempt is not None
                self.leaked_shares[cid] = dict(attempt.held)

    def run_to_masked_input(self) -> None:
        self.advertise()
        self.share_keys()
        self.masked_input()

    def consistency(self, survivors_for: Mapping[str, tuple[str, ...]]) -> None:
        """Stage consistency: each listed client is shown its own survivor set."""
        for cid in sorted(survivors_for):
            survivors = survivors_for[cid]
            reply = self.send(cid, ConsistencyRequest(self.setups[cid].round_id, survivors))
            if isinstance(reply, ConsistencyReply):
                self.signed[cid] = (survivors, reply.signature)

    def confirmations_for(self, cid: str, survivors: tuple[str, ...],
                          leave_out: Collection[str] = ()) -> tuple[Confirmation, ...]:
        """Every confirmation of ``survivors`` the server holds or can forge (colluders
        sign anything) from ``cid``'s surviving neighbours, but ``leave_out``."""
        setup = self.setups[cid]
        found = []
        for v in sorted(self.graph_of(cid)[cid] & set(survivors)):
            if v in leave_out:
                continue
            if v in self.colluders:
                identity = self.clients[v].identity
                assert identity is not None
                found.append(Confirmation(v, identity.sign(survivors_statement(
                    setup, survivors, graph_seed=self.seed_of(cid)))))
            elif v in self.signed and self.signed[v][0] == survivors:
                found.append(Confirmation(v, self.signed[v][1]))
        return tuple(found)

    def unmask(self, survivors_for: Mapping[str, tuple[str, ...]],
               leave_out: Collection[str] = ()) -> None:
        """Stage unmask: each listed client is shown its survivor set with every
        confirmation of it the server has (authenticated attempts)."""
        for cid in sorted(survivors_for):
            survivors = survivors_for[cid]
            confirmations = (self.confirmations_for(cid, survivors, leave_out)
                             if self.setups[cid].authenticated else ())
            self.send_unmask(cid, UnmaskRequest(self.setups[cid].round_id, survivors,
                                                confirmations))

    def send_unmask(self, cid: str, request: UnmaskRequest) -> UnmaskReply | None:
        reply = self.send(cid, request)
        if isinstance(reply, UnmaskReply):
            self.unmasked[cid] = reply
            return reply
        return None

    # -- what the server knows ----------------------------------------------------------

    def seed_of(self, cid: str) -> bytes:
        """The graph seed ``cid`` derived from the roster and setup it was shown."""
        return graph_seed(self.setups[cid], self.rosters.get(cid, self.full_roster()))

    def graph_of(self, cid: str) -> Graph:
        """The neighbour graph ``cid`` derived from the roster and setup it was shown."""
        roster = self.rosters.get(cid, self.full_roster())
        return neighbour_graph([k.client_id for k in roster], self.setups[cid].neighbours,
                               self.seed_of(cid))

    @property
    def graph(self) -> Graph:
        """The graph of the full roster under the common setup."""
        roster = self.full_roster()
        return neighbour_graph([k.client_id for k in roster], self.setup.neighbours,
                               graph_seed(self.setup, roster))

    # -- the adversary's unmasking attempt -----------------------------------------------

    def recover(self, victim: str) -> Recovery:
        """Try to recover ``victim``'s input from everything collected."""
        if victim not in self.masked:
            return Recovery(False, f"the masked input of {victim!r}")
        setup = self.setups[victim]
        commitment = self.shares[victim].self_mask_commitment
        seed = self._secret(victim, 1, lambda s: commit_self_mask(setup, victim, s)
                            == commitment)
        if seed is None:
            return Recovery(False, f"the self-mask seed of {victim!r}")
        own_key = self._mask_key(victim)
        masks = [(seed, -1)]
        for v in self.delivered[victim]:  # the victim masked against exactly these
            if own_key is not None:
                shared = agree(private_key_from_bytes(own_key), self.keys[v].mask_public_key)
            else:
                other = self._mask_key(v)
                if other is None:
                    return Recovery(False, f"the pairwise mask seed of {victim!r} and {v!r} "
                                           f"(neither mask key)")
                shared = agree(private_key_from_bytes(other), self.keys[victim].mask_public_key)
            sign = 1 if victim < v else -1  # the victim added sign * PRG(s_{victim,v})
            masks.append((derive_mask_seed(shared, setup, victim, v), -sign))
        total = self.masked[victim].copy()
        MaskExpander(setup.masked_length).apply(total, masks)
        weighted, weight = dequantize(total, 1, setup.clip_range, setup.bits)
        vector, num_examples = self.inputs[victim]
        w = num_examples / setup.max_weight
        truth = np.clip(vector, -setup.clip_range, setup.clip_range) * w
        error = float(np.abs(weighted - truth).max())
        ok = (error <= self.config.quantum * (1 + 1e-9)
              and abs(weight - w) <= (1 + 1e-9) / self.config.levels)
        return Recovery(ok, "" if ok else "a consistent decode", error)

    def _points(self, owner: str, kind: int) -> dict[int, bytes]:
        """x -> share of ``owner``'s secret (kind 0: mask key, 1: self-mask seed),
        from the unmask replies and the colluders' holdings."""
        setup = self.setups[owner]
        points: dict[int, bytes] = {}
        for holder, reply in self.unmasked.items():
            revealed = reply.mask_key_shares if kind == 0 else reply.self_mask_shares
            for share in revealed:
                if share.owner == owner:
                    points[setup.x_coordinate(holder)] = share.value
        for holder, held in self.leaked_shares.items():
            if owner in held:
                points[setup.x_coordinate(holder)] = held[owner][kind]
        return points

    def _secret(self, owner: str, kind: int, check: Callable[[bytes], bool]) -> bytes | None:
        points = sorted(self._points(owner, kind).items())
        t = self.setups[owner].threshold
        for subset in itertools.islice(itertools.combinations(points, t), 64):
            try:
                secret = reconstruct(list(subset), t)
            except SecureAggregationError:
                continue
            if check(secret):
                return secret
        return None

    def _mask_key(self, owner: str) -> bytes | None:
        if owner in self.leaked_keys:
            return self.leaked_keys[owner]
        public = self.keys[owner].mask_public_key
        return self._secret(owner, 0,
                            lambda s: public_bytes(private_key_from_bytes(s)) == public)



def build(config: SecAggConfig, n: int, length: int = 64, *, authenticated: bool = True,
          round_id: RoundId | None = None, seed: int = 0,
          clients: Mapping[str, SecAggClient] | None = None) -> MaliciousServer:
    """A malicious server over ``n`` fresh real clients (``client-000`` ...), each with a
    random input of ``length`` values (or over ``clients``, reused across attempts)."""
    ids = ids_of(n)
    inputs = make_inputs(ids, length, seed=seed, scale=config.clip_range / 2)
    if clients is None:
        clients = {cid: make_client(cid, i, authenticated=authenticated)
                   for i, cid in enumerate(ids)}
    setup = make_setup(config, ids, length, round_id, authenticated=authenticated)
    return MaliciousServer(config, clients, inputs, setup)
