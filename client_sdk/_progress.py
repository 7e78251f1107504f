"""What the SDK tells its user as it goes: one line per task answered, on a console
handler of its own when the application has configured no logging (as Flower's clients
print their rounds)."""

from __future__ import annotations

import logging

from fedloom.messages import ResultHeader, TaskHeader
from fedloom.secagg import MaskedInputRequest
from fedloom.types import TaskKind


def console_handler(log: logging.Logger) -> logging.Handler | None:
    """A stderr handler for this client's INFO lines (joined, each round's task, the end)
    when the application has configured no logging of its own (else None: its handlers
    and levels decide)."""
    if logging.getLogger().handlers or logging.getLogger("fedloom").handlers or log.handlers:
        return None
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s fedloom client: %(message)s"))
    handler.setLevel(logging.INFO)
    log.addHandler(handler)
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)
    return handler


def log_task(log: logging.Logger, task: TaskHeader, result: ResultHeader, seconds: float
             ) -> None:
    """One INFO line per task answered (failures are logged where they happen)."""
    if result.kind is None:
        return
    if task.kind is TaskKind.FIT:
        log.info("round %d: trained on %d examples, update sent (%.1f s)", task.round,
                 result.num_examples, seconds)
    elif task.kind is TaskKind.EVALUATE:
        log.info("round %d: evaluated on %d examples, loss %.4f (%.1f s)", task.round,
                 result.num_examples, result.loss, seconds)
    elif isinstance(task.secagg, MaskedInputRequest):
        log.info("round %d: trained, masked update sent (secure aggregation, %.1f s)",
                 task.round, seconds)
    else:
        log.debug("round %d: secure aggregation stage answered (%.1f s)", task.round, seconds)
