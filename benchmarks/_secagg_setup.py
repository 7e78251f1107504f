"""The settings every system of benchmarks/secagg.py shares: the SecAgg+ parameters on
both sides, the stage names, the initial model and the steady round time."""

from __future__ import annotations

import statistics

import numpy as np

from fedloom.privacy import PrivacyConfig
from fedloom.secagg import SecAggConfig
from fedloom.weights import Weights

NEIGHBOURS, THRESHOLD = 10, 6
FLOWER_SECAGG = {"num_shares": NEIGHBOURS + 1, "reconstruction_threshold": THRESHOLD,
                 "max_weight": 100.0, "clipping_range": 8.0, "quantization_range": 2**22}
STAGES = ("train", "advertise_keys", "share_keys", "masked_input", "consistency", "unmask",
          "update", "push")
FLOWER_STAGES = ("fit", "setup", "share_keys", "collect_masked_vectors", "unmask")


def secagg_config() -> SecAggConfig:
    return SecAggConfig(enabled=True, neighbours=NEIGHBOURS, threshold=THRESHOLD,
                        clip_range=8.0, bits=22, max_weight=100.0, max_participants=64,
                        stage_timeout_s=120.0)


def ddp_config(dropout: float) -> PrivacyConfig:
    """Distributed DP at z = 1; the clip bound does not bind the benchmark's step."""
    return PrivacyConfig(mode="distributed", noise_multiplier=1.0, clip_norm=1e4,
                         sampling="none", expected_dropout=dropout)


def steady(seconds: list[float]) -> float:
    """Median seconds per round after the first (warm-up) round."""
    return statistics.median(seconds[1:] if len(seconds) > 1 else seconds)


def initial(params: int) -> Weights:
    return Weights({"w": np.zeros(params, np.float32)})
