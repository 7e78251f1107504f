"""fedloom's local engine for benchmarks/secagg.py: `run_local` in this process, plain or
with `LocalSecureAggregation`, over in-process clients that add the gRPC benchmark's
fixed step."""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import numpy as np
from _secagg_grpc import fixed_step
from _secagg_setup import ddp_config, initial, secagg_config, steady

from fedloom.client_sdk import Client, EvaluateOutput, FitOutput
from fedloom.simulations.local_engine import run_local
from fedloom.simulations.local_secure import LocalSecureAggregation, SecureDropout
from fedloom.strategies import FedAvg, SelectionConfig, apply_privacy
from fedloom.weights import Weights


class LocalClient(Client):
    """The gRPC benchmark's client, in-process: a fixed step; a plain dropout raises."""

    def __init__(self, index: int, dropout: float, cpu: dict[str, float]) -> None:
        self.index, self.dropout, self.cpu = index, dropout, cpu
        self.steps: dict[int, np.ndarray] = {}

    def fit(self, weights: Weights, config: Any) -> FitOutput:
        arr = weights["w"]
        step = self.steps.get(arr.size)
        if step is None:  # made once per size, not counted as training
            step = self.steps[arr.size] = fixed_step(self.index, arr.size)
        started = time.thread_time()
        out = FitOutput(Weights({"w": arr + step}), 100)
        self.cpu["train"] = self.cpu.get("train", 0.0) + time.thread_time() - started
        if self.dropout and (self.index + int(config["server_round"])) % 5 == 0:
            raise RuntimeError("benchmark dropout")  # trained, then vanished
        return out

    def evaluate(self, weights: Weights, config: Any) -> EvaluateOutput:
        return EvaluateOutput(0.0, 100)


def run_local_mode(mode: str, n: int, params: int, dropout: float,
                   rounds: int) -> dict[str, Any]:
    cpu: dict[str, float] = {}
    secure = (LocalSecureAggregation(secagg_config(), SecureDropout(dropout, "share_keys"))
              if mode != "plain" else None)
    clients = [LocalClient(i, dropout if secure is None else 0.0, cpu) for i in range(n)]
    logging.getLogger("fedloom.simulations").setLevel(logging.ERROR)
    strategy = FedAvg(selection=SelectionConfig(min_fit_clients=n, fraction_evaluate=0.0))
    if mode == "secure-ddp":
        strategy = apply_privacy(strategy, ddp_config(dropout))
    history = run_local(strategy, clients.__getitem__, initial(params), num_clients=n,
                        num_rounds=rounds, secure_aggregation=secure)
    seconds = [float(r.get("seconds")) for r in history.rounds[1:]]
    per = n * rounds
    out: dict[str, Any] = {"round_s": steady(seconds), "rounds_s": seconds,
                           "updates": [r.get("num_updates") for r in history.rounds[1:]]}
    if secure is None:
        out["client_cpu_s"] = {"train": cpu.get("train", 0.0) / per}
        out["sent_bytes"] = 4.0 * params * (n - round(dropout * n)) / n  # float32 delta
        return out
    totals: dict[str, float] = {}
    for report in secure.reports:
        for stage, value in report.client_cpu_s.items():
            totals[stage] = totals.get(stage, 0.0) + value
        if report.failure:
            raise RuntimeError(f"local secure round failed: {report.failure}")
    out["client_cpu_s"] = {k: v / per for k, v in totals.items()}
    out["sent_bytes"] = sum(sum(r.bytes_sent.values()) for r in secure.reports) / per
    reports = secure.reports[1:] or secure.reports
    out["stage_s"] = {s: statistics.median(r.stage_s[s] for r in reports)
                      for s in reports[0].stage_s}
    return out
