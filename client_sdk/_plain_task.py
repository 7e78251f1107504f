"""A plain task on the application's `Client`, as the result the runner pushes: a fit
(its new weights checked, the update encoded for upload) or an evaluation."""

from __future__ import annotations

import numpy as np

from fedloom.client_sdk._client import Client, EvaluateOutput, FitOutput
from fedloom.client_sdk._compression import UpdateEncoder
from fedloom.client_sdk._middleware import TaskContext, TaskResult
from fedloom.messages import JoinReply, ResultHeader
from fedloom.types import TaskKind
from fedloom.weights import Weights


def run_fit(client: Client, encoder: UpdateEncoder, joined: JoinReply | None,
            context: TaskContext) -> TaskResult:
    """Train, check the new weights, encode the update as this session's grant says.

    Raises:
        ValueError: the client's new weights cannot be sent (layout, NaN or Inf).
    """
    task, weights = context.task, context.weights
    fit = checked_fit(client, client.fit(weights, task.config))
    problem = _check_output(weights, fit.weights)
    if problem:
        raise ValueError(problem)
    payload, info, codec = encoder.update(
        joined.run_id if joined else "", joined.upload_codec if joined else None,
        fit.weights, weights, zstd=joined is not None and joined.upload_zstd)
    header = ResultHeader(context.session, task.task_id, task.round, TaskKind.FIT,
                          num_examples=fit.num_examples, base_round=task.round - 1,
                          metrics=fit.metrics, update=info, codec=codec)
    return TaskResult(header, payload)


def checked_fit(client: Client, fit: object) -> FitOutput:
    """``fit``, what ``client.fit`` returned, once it is a `FitOutput`.

    Raises:
        ValueError: it is not (a task failure, not an AttributeError in the SDK).
    """
    if not isinstance(fit, FitOutput):
        raise ValueError(f"{type(client).__name__}.fit returned {type(fit).__name__}, "
                         "not a FitOutput(weights, num_examples, metrics)")
    return fit


def run_evaluate(client: Client, context: TaskContext) -> TaskResult:
    """Evaluate the global weights on the client's data."""
    task = context.task
    evaluation = client.evaluate(context.weights, task.config)
    if not isinstance(evaluation, EvaluateOutput):
        raise ValueError(f"{type(client).__name__}.evaluate returned "
                         f"{type(evaluation).__name__}, not an EvaluateOutput(loss, "
                         "num_examples, metrics)")
    return TaskResult(ResultHeader(context.session, task.task_id, task.round,
                                   TaskKind.EVALUATE, num_examples=evaluation.num_examples,
                                   loss=float(evaluation.loss), metrics=evaluation.metrics))


def _check_output(global_weights: Weights, new_weights: Weights) -> str:
    """Why the client's new weights cannot be sent ("" when they can)."""
    try:
        global_weights.check_same_layout(new_weights, what="the client's new weights")
    except ValueError as exc:
        return str(exc)
    for name, arr in new_weights.items():
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            return f"the client's new weights hold NaN or Inf in {name!r}"
    return ""
