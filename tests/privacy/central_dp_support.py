"""Helpers of the `CentralDPStrategy` tests: a small model, deltas of a chosen norm, and
one round driven through configure_fit and aggregate_fit."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from fedloom import ClientInfo, ClientUpdate, Weights
from fedloom.config import SelectionConfig
from fedloom.privacy import PrivacyConfig
from fedloom.strategies import CentralDPStrategy, ComposedStrategy, FedAvg
from fedloom.types import AggregateResult

logging.getLogger("absl").setLevel(logging.ERROR)


TINY_Z = 1e-9  # noise std 1e-9 * C: negligible next to float32 rounding


def clients(n: int) -> list[ClientInfo]:
    return [ClientInfo(f"c{i:03d}", f"c{i:03d}") for i in range(n)]


def central(**overrides: Any) -> PrivacyConfig:
    settings: dict[str, Any] = dict(mode="central", noise_multiplier=TINY_Z, clip_norm=1.0,
                                    target_epsilon=0.0)
    settings.update(overrides)
    return PrivacyConfig(**settings)


def dp_strategy(inner: ComposedStrategy | None = None, *, seed: int = 0,
                **privacy: Any) -> CentralDPStrategy:
    inner = inner if inner is not None else FedAvg(selection=SelectionConfig(min_fit_clients=1))
    return CentralDPStrategy(inner, central(**privacy), rng=np.random.default_rng(seed))


def model() -> Weights:
    tensors: dict[str, np.ndarray] = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3),
                                      "b": np.full(5, 0.5, np.float32),
                                      "steps": np.array(7, np.int64)}
    return Weights(tensors)


def delta_of_norm(rng: np.random.Generator, norm: float) -> Weights:
    """A random delta whose float tensors have L2 norm ``norm``; a nonzero integer step."""
    w, b = rng.normal(size=(4, 3)), rng.normal(size=5)
    scale = norm / math.sqrt(float(np.sum(w**2) + np.sum(b**2)))
    tensors: dict[str, np.ndarray] = {"w": (w * scale).astype(np.float32),
                                      "b": (b * scale).astype(np.float32),
                                      "steps": np.array(3, np.int64)}
    return Weights(tensors)


def float_norm(d: Weights) -> float:
    return math.sqrt(sum(float(np.sum(d[k].astype(np.float64) ** 2)) for k in ("w", "b")))


def clipped(d: Weights, clip: float) -> dict[str, np.ndarray]:
    factor = min(1.0, clip / float_norm(d))
    return {k: d[k].astype(np.float64) * factor for k in ("w", "b")}


def run_round(strategy: Any, server_round: int, current: Weights, population: int,
              make_delta: Callable[[str], Weights | None],
              metrics: Callable[[str], dict[str, Any]] | None = None
              ) -> tuple[tuple[str, ...], AggregateResult]:
    """configure_fit, then each chosen client's update (None: it did not return one)."""
    plan = strategy.configure_fit(server_round, current, clients(population))
    updates = []
    for cid in plan.client_ids:
        d = make_delta(cid)
        if d is not None:
            updates.append(ClientUpdate(cid, d, 10, server_round - 1,
                                        metrics(cid) if metrics else {}))
    return plan.client_ids, strategy.aggregate_fit(server_round, current, iter(updates))
