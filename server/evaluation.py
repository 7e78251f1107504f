"""Evaluation after a round's fit: federated (evaluate tasks to the clients, through the
task book) and server-side (``evaluate_fn`` on the server's own data)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from fedloom.messages import Capability, ResultHeader
from fedloom.server.client_metrics import evaluate_rows, records_per_client
from fedloom.server.crashpoints import crashpoint
from fedloom.server.driver import RoundParts
from fedloom.server.plain_round import PhaseOwner, check_num_examples, issue_phase
from fedloom.server.registry import ClientRecord
from fedloom.server.rounds import RoundTasks
from fedloom.server.store import ClientRow
from fedloom.server.tasks import Task
from fedloom.server.uploads import SpooledWeights, Upload
from fedloom.strategies import HookOutputError, checked_output
from fedloom.types import EvaluateResult, Metrics, TaskKind
from fedloom.weights import Weights

log = logging.getLogger("fedloom.server")

#: ``evaluate_fn(server_round, weights) -> (loss, metrics)``, or None to skip.
EvaluateFn = Callable[[int, Weights], tuple[float, Metrics] | None]


class EvaluatePhase(PhaseOwner):
    """The evaluate tasks of one round: each result is taken whole (no payload)."""

    async def take(self, client: ClientRecord, task: Task, header: ResultHeader,
                   fingerprint: bytes) -> Upload | bool:
        check_num_examples(self.parts, header.num_examples)
        result = EvaluateResult(client.client_id, header.num_examples, header.loss,
                                header.metrics)
        self.phase.accept_evaluation(task, result, fingerprint)
        crashpoint("mid_evaluation")
        self.progress()
        return False

    async def fold(self, upload: Upload, payload: SpooledWeights) -> None:
        raise AssertionError("an evaluate result has no payload")  # take never uploads

    def abandoned(self, upload: Upload) -> None:
        raise AssertionError("an evaluate result has no payload")


async def federated_evaluate(parts: RoundParts, server_round: int
                             ) -> tuple[dict[str, Any], list[ClientRow]]:
    """Run the round's federated evaluation: its aggregated metrics ({} if skipped), and
    a row per result when the run keeps per-client metrics."""
    config = parts.config
    # A client holding a task (asynchronous rounds keep clients training) is not asked.
    eligible = [c for c in parts.fleet.registry.infos()
                if Capability.EVALUATE in c.capabilities and not parts.book.busy(c.client_id)]
    plan = parts.strategy.configure_evaluate(server_round, parts.model.weights, eligible)
    if not plan.client_ids:
        return {}, []
    phase = RoundTasks(server_round, TaskKind.EVALUATE, config.min_evaluate_clients)
    owner = EvaluatePhase(parts, phase)
    issue_phase(parts, phase, owner, plan.client_ids, plan.config, config.evaluate_timeout_s)
    try:
        enough = await phase.wait(config.evaluate_timeout_s)
    finally:
        owner.close()
    if not enough:
        log.warning("round %d: only %d evaluation results; skipping federated metrics",
                    server_round, len(phase.evaluations))
        return {}, []
    # In the aggregation thread: an evaluate metrics hook is the application's code, and
    # the event loop must keep answering heartbeats while it runs.
    loop = asyncio.get_running_loop()
    metrics = dict(await loop.run_in_executor(
        parts.executor, parts.strategy.aggregate_evaluate, server_round, phase.evaluations))
    keep = records_per_client(parts.config, parts.strategy)
    return metrics, evaluate_rows(parts.fleet.registry, phase.evaluations) if keep else []


async def server_evaluate(parts: RoundParts, evaluate_fn: EvaluateFn | None,
                          server_round: int, weights: Weights) -> dict[str, Any]:
    """``evaluate_fn`` on ``weights``, in the aggregation thread ({} without one)."""
    if evaluate_fn is None:
        return {}
    loop = asyncio.get_running_loop()
    outcome = await loop.run_in_executor(parts.executor, evaluate_fn, server_round, weights)
    if outcome is None:
        return {}
    try:
        return checked_evaluation(outcome)
    except HookOutputError as exc:
        # As for a metrics hook: a fault in reporting code costs this round's server
        # metrics, not the run (the round is committed; a restart would meet it again).
        log.error("round %d: %s; its server-side metrics are not recorded", server_round, exc)
        return {}


def checked_evaluation(outcome: Any) -> dict[str, Any]:
    """``evaluate_fn``'s ``(loss, metrics)`` as a round's server metrics: the loss a
    finite number, the metrics what a round record holds (numpy scalars become Python
    numbers; `fedloom.strategies.checked_output`'s rules).

    Raises:
        HookOutputError: anything else, naming what was wrong and the fix.
    """
    if not (isinstance(outcome, tuple | list) and len(outcome) == 2):
        raise HookOutputError(f"evaluate_fn must return (loss, metrics) or None, got "
                              f"{type(outcome).__name__}")
    loss, metrics = outcome
    if isinstance(loss, np.generic):
        loss = loss.item()
    if isinstance(loss, bool) or not isinstance(loss, int | float):
        raise HookOutputError(f"evaluate_fn returned a loss of type {type(loss).__name__}; "
                              "return a Python float (e.g. float(loss) or loss.item())")
    if not math.isfinite(loss):
        raise HookOutputError(f"evaluate_fn returned the loss {loss} (the model may have "
                              "diverged); a loss must be finite")
    checked = checked_output({} if metrics is None else metrics, "evaluate_fn")
    return {"loss": float(loss), **{k: v for k, v in checked.items() if k != "loss"}}
