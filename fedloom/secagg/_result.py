"""What a SecAgg+ round attempt ends as: its status, and the sums the server learns."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np


class SecAggStatus(enum.StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class SecAggResult:
    """What the server learns: sums over the survivors, and their mean.

    Attributes:
        mean: ``sum(w_v * clip(x_v)) / sum(w_v)`` over the survivors, float64.
        weighted_sum: ``sum(w_v * clip(x_v))``, float64.
        total_weight: ``sum(w_v)``, with ``w_v = num_examples_v / max_weight``.
        total_examples: ``total_weight * max_weight`` (the survivors' examples, to
            within quantization).
        survivors: clients whose masked input is in the sum.
        dropped: clients that shared keys but whose input is not in the sum.
        total: the unmasked sum itself, uint32 (modulo 2**32): what a round whose
            clients encoded their own vectors (distributed DP) decodes.
    """

    mean: np.ndarray
    weighted_sum: np.ndarray
    total_weight: float
    total_examples: float
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    total: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.uint32))
