"""The client's side of a secure fit round: SecAgg+ stage tasks run through `SecAggClient`.

A server with ``[secure_aggregation] enabled`` sends a client that joined with the
``secagg`` capability up to five stage tasks per round attempt instead of one fit task:

1. advertise keys: two fresh public keys (the round's setup comes with the request),
   signed with the client's certificate key when the round is authenticated;
2. share keys: every participant's keys (checked, and the neighbour graph derived from
   them); the client answers with Shamir shares of its secrets, sealed for each
   neighbour, and commitments to them. In an unauthenticated round it also offers fresh
   keys for its next attempt, and when the server uses that offer this request carries
   the setup instead of stage 1;
3. masked input: carries the global weights and the fit config, which must be the ones
   the setup binds (`fedloom.secagg.model_digest`, `config_digest`): a server that
   sends this client another model than the other participants is refused here. The
   client trains (the application's `Client.fit`, unchanged), takes the delta, clips it
   to the norm bound when the fit config holds ``max_update_norm`` (under secure
   aggregation the bound can only be applied here), and uploads the clipped, quantized,
   weighted delta plus the masks as a chunked uint32 payload;
4. consistency (authenticated rounds): the survivor set, which the client checks and
   signs, once per attempt;
5. unmask: the shares the server may have, and no others.

A round whose attempt fails is retried by the server with fresh keys; the client trains
once per round and masks the same update again in a retried attempt of that round (the
model and config are bound by the setup, so a retry trains on exactly the same inputs).

The client checks what the server sends before it acts: the stage request must be for
the task's run and round, and every rule of `SecAggClient` holds. A refusal goes back as
a task failure naming what was wrong, which the server treats as a dropout. Fit metrics
are not sent: under secure aggregation the server learns only sums.

A client with a certificate (``identity``) takes part only in authenticated rounds and
checks the other participants against ``peers`` (the client CA); without one it takes
part in unauthenticated rounds only, which protect it from an honest-but-curious server
only (logged once).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from fedloom.client_sdk._client import Client
from fedloom.client_sdk._plain_task import checked_fit
from fedloom.errors import SecureAggregationError
from fedloom.fit_config import MAX_UPDATE_NORM
from fedloom.messages import MASKED_TENSOR, MaskedInputHeader, ResultHeader, Session, TaskHeader
from fedloom.payload import PayloadInfo
from fedloom.privacy._distributed import (
    accounted_noise_multiplier,
    encode_for_secagg,
    from_fit_config,
    noisy_shares,
    survivor_floor,
)
from fedloom.privacy._noise_reserve import NoiseReserve
from fedloom.privacy._skellam import SkellamParams
from fedloom.secagg import (
    STAGE_OF,
    AdvertiseKeysRequest,
    DealerAccused,
    MaskedInputReply,
    MaskedInputRequest,
    PeerVerifier,
    RoundLedger,
    RoundSetup,
    SecAggClient,
    SecAggConfig,
    SecAggReply,
    SecAggRequest,
    SigningIdentity,
    accusation_failure,
    clip_delta,
    config_digest,
    flatten,
    model_digest,
)
from fedloom.types import TaskKind
from fedloom.weights import TensorSpec, Weights

log = logging.getLogger("fedloom.client")


class SecureFit:
    """Runs the secure-aggregation stage tasks of one session (one client id).

    Args:
        client: the application's `Client`; its `fit` runs in stage 3 (masked input).
        client_id: the id the server gave this session (the round's participant id).
        policy: when given, the round's parameters must equal these settings.
        cpu_s: adds the CPU seconds (of the calling thread) spent per stage to this
            mapping: ``"train"`` (the application's fit), then each `Stage`'s value.
        identity: this client's certificate and key (authenticated rounds).
        peers: the client CA, to check the other participants (with ``identity``).
        ledger: the rounds this client took part in, kept across its sessions.
        max_attempts: attempts of one round this client takes part in, when no
            ``policy`` says (`fedloom.secagg.SecAggClient`).
        min_noise_multiplier: in a distributed-DP round, refuse announced noise below
            this multiplier as the server's ledger counts it over the round's survivor
            floor (`fedloom.privacy._distributed.accounted_noise_multiplier`; the
            colluding clients of ``policy``, or the default, are not counted).
    """

    def __init__(self, client: Client, client_id: str, policy: SecAggConfig | None = None,
                 cpu_s: dict[str, float] | None = None, *,
                 identity: SigningIdentity | None = None,
                 peers: PeerVerifier | None = None, ledger: RoundLedger | None = None,
                 min_noise_multiplier: float = 0.0, max_attempts: int | None = None) -> None:
        self.client = client
        self.client_id = client_id
        self.protocol = SecAggClient(client_id, policy=policy, identity=identity, peers=peers,
                                     ledger=ledger, max_attempts=max_attempts)
        self.cpu_s = cpu_s if cpu_s is not None else {}
        self.min_noise_multiplier = min_noise_multiplier
        self._noise = NoiseReserve()  # distributed DP: the next round's draws, ahead
        self._train_cpu_s = 0.0
        # (run, round, model digest, config digest) -> (flat clipped delta, num_examples):
        # the update of this round, masked again if the server retries the round
        self._trained: tuple[tuple[str, int, bytes, bytes], np.ndarray, int] | None = None
        self._warned = False

    def execute(self, session: Session, task: TaskHeader, weights: Weights
                ) -> tuple[ResultHeader, memoryview | None]:
        """Answer one stage task: a stage reply, or a failure (a refusal) to report."""
        request = task.secagg
        started, self._train_cpu_s = time.thread_time(), 0.0
        try:
            if request is None:
                raise SecureAggregationError("a secagg task without its stage request")
            self._check_task(task, request)
            reply, payload, update = self._answer(task, request, weights)
        except SecureAggregationError as exc:
            log.warning("secure round %d: %s", task.round, exc)
            failure = (accusation_failure(exc) if isinstance(exc, DealerAccused)
                       else f"SecureAggregationError: {exc}")
            return ResultHeader(session, task.task_id, task.round, None, failure=failure), None
        header = ResultHeader(session, task.task_id, task.round, TaskKind.SECAGG, update=update,
                              secagg=reply)
        stage = str(STAGE_OF[type(request)])  # the protocol's own cost, training apart
        spent = time.thread_time() - started - self._train_cpu_s
        self.cpu_s[stage] = self.cpu_s.get(stage, 0.0) + spent
        return header, payload

    def _check_task(self, task: TaskHeader, request: SecAggRequest) -> None:
        rid = request.round_id
        if rid.run_id != task.run_id or rid.server_round != task.round:
            raise SecureAggregationError(
                f"the stage request names {rid}, but its task is run {task.run_id!r} round "
                f"{task.round}")

    def _answer(self, task: TaskHeader, request: SecAggRequest, weights: Weights
                ) -> tuple[SecAggReply | MaskedInputHeader, memoryview | None, PayloadInfo | None]:
        if isinstance(request, AdvertiseKeysRequest) and not request.setup.authenticated:
            self._warn_unauthenticated()
        if isinstance(request, MaskedInputRequest):
            setup = self.protocol.setup
            if setup is None or setup.round_id != request.round_id:
                raise SecureAggregationError(f"no keys were shared for {request.round_id}")
            vector, num_examples = self._update(task, setup, weights)
            masked = self.protocol.masked_input(request, vector, num_examples)
            return self._masked_payload(masked)
        return self.protocol.handle(request), None, None

    def _warn_unauthenticated(self) -> None:
        if not self._warned:
            self._warned = True
            log.warning("this secure round is unauthenticated (the server runs without a "
                        "client PKI): it protects this client's update from an "
                        "honest-but-curious server only")

    def _update(self, task: TaskHeader, setup: RoundSetup, weights: Weights
                ) -> tuple[np.ndarray, int]:
        """The round's update: trained here once, on the model and config the setup binds."""
        if model_digest(task.weights.specs, task.weights.sha256) != setup.model_digest:
            raise SecureAggregationError(
                "the model delivered for this round is not the one its setup binds (the "
                "server sent this client another model than the other participants)")
        if config_digest(task.config) != setup.config_digest:
            raise SecureAggregationError(
                "the fit config delivered for this round is not the one its setup binds")
        size = sum(spec.size for spec in weights.specs())
        private = from_fit_config(task.config, size)  # distributed DP: encode it here
        if private is not None:  # every attempt: a retried one may unmask fewer survivors
            self._check_noise(private[0], setup, survivor_floor(task.config))
        key = (setup.round_id.run_id, setup.round_id.server_round, setup.model_digest,
               setup.config_digest)
        if self._trained is not None and self._trained[0] == key:
            return self._trained[1], self._trained[2]  # a retried attempt of this round
        vector, num_examples = self._train(task, setup, weights, size, private)
        self._trained = (key, vector, num_examples)
        return vector, num_examples

    def _train(self, task: TaskHeader, setup: RoundSetup, weights: Weights, size: int,
               private: tuple[SkellamParams, bytes] | None) -> tuple[np.ndarray, int]:
        expected = size if private is None else private[0].padded_dimension
        if expected != setup.vector_length:
            raise SecureAggregationError(
                f"the round announces {setup.vector_length} values, the model has {size}")
        started = time.thread_time()
        fit = checked_fit(self.client, self.client.fit(weights, task.config))
        self._train_cpu_s = time.thread_time() - started
        self.cpu_s["train"] = self.cpu_s.get("train", 0.0) + self._train_cpu_s
        weights.check_same_layout(fit.weights, what="the client's new weights")
        delta = fit.weights.subtract(weights)
        if private is not None:  # clipped, rotated, rounded and noised, in the ring
            params, length = private[0], private[0].padded_dimension
            flat = flatten(delta, dtype=None)
            if not np.isfinite(flat).all():
                # Taking part with a zero update, rather than dropping out, keeps whether
                # this client is in the sum independent of its data (the guarantee's).
                log.warning("secure round %d: the update holds non-finite values; this "
                            "client sends a zero update with its noise", task.round)
                flat = np.zeros_like(flat)
            noise = self._noise.take(params.client_noise_mu, length)
            vector = encode_for_secagg(flat, *private, noise=noise)
            self._noise.refill(params.client_noise_mu, length)  # while the server works
            return vector, fit.num_examples
        setup.config().weight_of(fit.num_examples)  # refuse early: weight above 1
        bound = task.config.get(MAX_UPDATE_NORM)
        if isinstance(bound, int | float) and not isinstance(bound, bool):
            delta = clip_delta(delta, float(bound))
        return flatten(delta, dtype=None), fit.num_examples  # quantize widens per block

    def _check_noise(self, params: SkellamParams, setup: RoundSetup, floor: int) -> None:
        """Refuse a distributed-DP round whose noise a server could have cut short."""
        if setup.min_survivors < floor:
            raise SecureAggregationError(
                f"the round's noise needs {floor} survivors, but its setup would unmask a "
                f"sum of {setup.min_survivors}")
        if self.min_noise_multiplier <= 0:
            return
        colluding = (self.protocol.policy or SecAggConfig()).colluding_clients
        accounted = accounted_noise_multiplier(params, noisy_shares(floor, colluding))
        if accounted < self.min_noise_multiplier:
            raise SecureAggregationError(
                f"the round's noise, as its accountant counts it over {floor} survivors "
                f"({colluding} colluding), is noise multiplier {accounted:.4g}; this client "
                f"requires at least {self.min_noise_multiplier:g}")

    def _masked_payload(self, reply: MaskedInputReply
                        ) -> tuple[MaskedInputHeader, memoryview, PayloadInfo]:
        masked = np.ascontiguousarray(reply.masked, dtype="<u4")
        payload = memoryview(masked.data).cast("B")
        spec = TensorSpec(MASKED_TENSOR, "uint32", (masked.shape[0],))
        info = PayloadInfo.describe((spec,), payload)
        return MaskedInputHeader(reply.round_id, reply.client_id), payload, info
