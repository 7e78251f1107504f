"""The task of benchmarks/privacy.py: one seed's federation of digits clients on the local
engine, its plain FedAvg, and the accuracy, ε and clip norm of a run."""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np
import torch

from fedloom.client_sdk.torch_trainer import TorchClient
from fedloom.simulations.job import Job
from fedloom.simulations.local_engine import run_local
from fedloom.simulations.local_secure import LocalSecureAggregation
from fedloom.simulations.plan import client_fit_config, client_infos
from fedloom.simulations.scenario import ClientSpec, PartitionSpec, Scenario
from fedloom.strategies import FedAvg, SelectionConfig, Strategy
from fedloom.weights import Weights


def scenario(args: argparse.Namespace, seed: int) -> Scenario:
    return Scenario(
        name="privacy", seed=seed, num_clients=args.clients, clients_per_round=args.per_round,
        rounds=args.rounds, local_epochs=args.local_epochs, progress=False,
        partition=PartitionSpec(name="iid"),
        client=ClientSpec(batch_size=args.batch_size, lr=args.lr, momentum=0.9))


class Federation:
    """One seed's job, its clients (cached, one shared torch module) and evaluation."""

    def __init__(self, args: argparse.Namespace, seed: int) -> None:
        self.args, self.seed = args, seed
        self.job = Job.from_scenario(scenario(args, seed))
        self.initial = self.job.initial_weights()
        self._shared = self.job.make_model()
        self._clients: dict[int, TorchClient] = {}

    def client(self, index: int) -> TorchClient:
        if index not in self._clients:
            self._clients[index] = self.job.make_client(index, model=self._shared)
        return self._clients[index]

    @property
    def dimension(self) -> int:
        return sum(spec.size for spec in self.initial.specs())

    def first_round_norms(self) -> list[float]:
        """L2 norms of the deltas of the clients plain FedAvg samples in round 1."""
        plan = self.fedavg().configure_fit(1, self.initial, client_infos(self.args.clients))
        norms = []
        for cid in plan.client_ids:
            config = client_fit_config(plan.config, base_seed=self.seed, client_index=int(cid),
                                       server_round=1, defaults=self.job.fit_defaults())
            out = self.client(int(cid)).fit(self.initial, config)
            norms.append(_norm(out.weights, self.initial))
        return norms

    def fedavg(self) -> FedAvg:
        a = self.args
        return FedAvg(selection=SelectionConfig(
            fraction_fit=a.per_round / a.clients, min_fit_clients=a.per_round,
            fraction_evaluate=0.0, seed=self.seed))

    def run(self, strategy: Strategy, secure: LocalSecureAggregation | None = None
            ) -> dict[str, Any]:
        started = time.perf_counter()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            history = run_local(
                strategy, self.client, self.initial, num_clients=self.args.clients,
                num_rounds=self.args.rounds, base_seed=self.seed,
                fit_defaults=self.job.fit_defaults(),
                evaluate_fn=lambda _r, w: self.job.central_evaluate(w),
                secure_aggregation=secure)
        finally:
            torch.set_num_threads(threads)
        accuracy = [a for r, a in history.series("test_accuracy") if r > 0]
        epsilon = [e for _, e in history.series("privacy_epsilon")]
        clip = [c for _, c in history.series("clip_norm")]
        updated = [r for r in history.rounds[1:] if r.get("num_updates")]
        return {"accuracy": accuracy[-1], "accuracy_last5": float(np.mean(accuracy[-5:])),
                "accuracy_curve": accuracy, "spent_epsilon": epsilon[-1] if epsilon else None,
                "final_clip_norm": clip[-1] if clip else None,
                "rounds_updated": len(updated), "seconds": time.perf_counter() - started}


def _norm(new: Weights, base: Weights) -> float:
    return math.sqrt(sum(float(np.sum((new[k].astype(np.float64) - base[k]) ** 2))
                         for k in base if base[k].dtype.kind == "f"))
