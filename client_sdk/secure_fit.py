"""The client's side of a secure fit round: SecAgg+ stage tasks run through `SecAggClient`.

A server with ``[secure_aggregation] enabled`` sends a client that joined with the
``secagg`` capability up to four stage tasks per round attempt instead of one fit task:

1. advertise keys: two fresh public keys (the round's parameters come with the request);
2. share keys: Shamir shares of its secrets, sealed for each neighbour, and fresh keys
   offered for the next attempt. When the server uses that offer, it skips stage 1 of
   the next attempt and this request carries the round's parameters instead;
3. masked input: carries the global weights and the fit config. The client trains (the
   application's `Client.fit`, unchanged), takes the delta, clips it to the norm bound
   when the fit config holds ``max_update_norm`` (under secure aggregation the bound
   can only be applied here), and uploads the clipped, quantized, weighted delta plus
   the masks as a chunked uint32 payload. Training here, not in stage 1, lets the key
   stages run before the model moves, and one client's upload overlap another's
   download, as in a plain round;
4. unmask: the shares the server may have, and no others.

The client checks what the server sends before it acts: the stage request must be for
the task's run and round and name this client, the model must have the length the
round announces, and every rule of `SecAggClient` holds (one unmask answer per attempt,
no overlapping survivor/dropped lists, at least t survivors, fresh attempts only). A
refusal goes back as a task failure, which the server treats as a dropout. Fit metrics
are not sent: under secure aggregation the server learns only sums.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from fedloom.client_sdk._client import Client
from fedloom.errors import SecureAggregationError
from fedloom.messages import MASKED_TENSOR, MaskedInputHeader, ResultHeader, Session, TaskHeader
from fedloom.payload import PayloadInfo
from fedloom.secagg import (
    STAGE_OF,
    AdvertiseKeysRequest,
    MaskedInputReply,
    MaskedInputRequest,
    RoundSetup,
    SecAggClient,
    SecAggConfig,
    SecAggReply,
    SecAggRequest,
    ShareKeysRequest,
    clip_delta,
    flatten,
)
from fedloom.types import MAX_NORM_KEY, TaskKind
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
    """

    def __init__(self, client: Client, client_id: str, policy: SecAggConfig | None = None,
                 cpu_s: dict[str, float] | None = None) -> None:
        self.client = client
        self.client_id = client_id
        self.protocol = SecAggClient(client_id, policy=policy)
        self.cpu_s = cpu_s if cpu_s is not None else {}
        self._setup: RoundSetup | None = None  # of the attempt whose keys were advertised
        self._train_cpu_s = 0.0

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
            return ResultHeader(session, task.task_id, task.round, None,
                                failure=f"SecureAggregationError: {exc}"), None
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
        if isinstance(request, AdvertiseKeysRequest):
            self._setup = None
            if self.client_id not in request.setup.participants:
                raise SecureAggregationError("this client is not among the round's participants")
            reply = self.protocol.advertise_keys(request)
            self._setup = request.setup
            return reply, None, None
        if isinstance(request, MaskedInputRequest):
            setup = self._setup
            if setup is None or setup.round_id != request.round_id:
                raise SecureAggregationError(f"no keys were advertised for {request.round_id}")
            vector, num_examples = self._train(task, setup, weights)
            masked = self.protocol.masked_input(request, vector, num_examples)
            self._setup = None  # masked and sent: this attempt trains no more
            return self._masked_payload(masked)
        if isinstance(request, ShareKeysRequest) and request.setup is not None:
            # the server used this client's key offer: advertise keys was skipped
            self._setup = None
            shared = self.protocol.share_keys(request)
            self._setup = request.setup
            return shared, None, None
        return self.protocol.handle(request), None, None

    def _train(self, task: TaskHeader, setup: RoundSetup, weights: Weights
               ) -> tuple[np.ndarray, int]:
        size = sum(spec.size for spec in weights.specs())
        if size != setup.vector_length:
            raise SecureAggregationError(
                f"the round announces {setup.vector_length} values, the model has {size}")
        started = time.thread_time()
        fit = self.client.fit(weights, task.config)
        self._train_cpu_s = time.thread_time() - started
        self.cpu_s["train"] = self.cpu_s.get("train", 0.0) + self._train_cpu_s
        weights.check_same_layout(fit.weights, what="the client's new weights")
        setup.config().weight_of(fit.num_examples)  # refuse early: weight above 1
        delta = fit.weights.subtract(weights)
        bound = task.config.get(MAX_NORM_KEY)
        if isinstance(bound, int | float) and not isinstance(bound, bool):
            delta = clip_delta(delta, float(bound))
        return flatten(delta, dtype=None), fit.num_examples  # quantize widens per block

    def _masked_payload(self, reply: MaskedInputReply
                        ) -> tuple[MaskedInputHeader, memoryview, PayloadInfo]:
        masked = np.ascontiguousarray(reply.masked, dtype="<u4")
        payload = memoryview(masked.data).cast("B")
        spec = TensorSpec(MASKED_TENSOR, "uint32", (masked.shape[0],))
        info = PayloadInfo.describe((spec,), payload)
        return MaskedInputHeader(reply.round_id, reply.client_id), payload, info
