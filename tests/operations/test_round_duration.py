"""What a round's duration counts, and when the round metrics move.

``duration_s`` (the record, the JSON log, ``fedloom runs``, the Prometheus histogram)
is the wall time from the round's first sample to its commit: the wait for
``min_clients`` before it and the evaluation after it are not the round's. The round
counters and ``fedloom_last_round`` move when the round commits, not after its
evaluation (which can take up to ``evaluate_timeout_s``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from helpers import run_to_end, scripted, small_weights

from fedloom.server import Server
from fedloom.server.metrics import ServerMetrics

LATE_S = 1.5  # the client joins this long after the server starts
EVALUATION_S = 1.0


def _sample(name: str, **labels: str) -> float:
    return ServerMetrics.registry.get_sample_value(name, labels or None) or 0.0


def test_duration_is_from_sample_to_commit_and_metrics_move_at_commit(server_config) -> None:  # type: ignore[no-untyped-def]
    config = server_config(num_rounds=1, min_clients=1, min_fit_clients=1,
                           fraction_evaluate=0.0, finished_grace_s=0.0)
    evaluating = threading.Event()
    seen_at_evaluation: dict[str, float] = {}
    before = _sample("fedloom_rounds_total", status="ok")

    def evaluate(server_round: int, weights: Any) -> tuple[float, dict[str, float]] | None:
        if server_round == 0:
            return None
        seen_at_evaluation["rounds"] = _sample("fedloom_rounds_total", status="ok") - before
        seen_at_evaluation["last"] = _sample("fedloom_last_round")
        evaluating.set()
        time.sleep(EVALUATION_S)
        return 0.5, {}

    handle = Server(config, initial_weights=small_weights(), evaluate_fn=evaluate).start()
    time.sleep(LATE_S)
    (record,) = run_to_end(handle, scripted(1))
    assert record.status == "ok" and record.server == {"loss": 0.5}
    assert evaluating.is_set()
    assert record.duration_s < min(LATE_S, EVALUATION_S)  # neither the wait nor the evaluation
    assert seen_at_evaluation == {"rounds": 1.0, "last": 1.0}  # counted at the commit
