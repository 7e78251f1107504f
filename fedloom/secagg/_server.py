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

from fedloom.errors import RejectReason, SecureAggregationError
from fedloom.secagg._attempt import AttemptState
from fedloom.secagg._crypto import survivors_statement
from fedloom.secagg._messages import (
    STAGE_OF,
    AdvertisedKeys,
    AdvertiseKeysRequest,
    Confirmation,
    ConsistencyReply,
    ConsistencyRequest,
    MaskedInputReply,
    SecAggReply,
    SecAggRequest,
    ShareKeysReply,
    ShareKeysRequest,
    Stage,
    UnmaskReply,
    UnmaskRequest,
)
from fedloom.secagg._result import SecAggResult, SecAggStatus
from fedloom.secagg._server_checks import reject as _reject

__all__ = ["SecAggResult", "SecAggServer", "SecAggStatus"]


class SecAggServer(AttemptState):
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
    def confirmed(self) -> frozenset[str]:
        """The survivors whose confirmation of the survivor set was taken (authenticated
        attempts): their neighbours may reveal their self masks from then on."""
        return frozenset(self._confirmations)

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
