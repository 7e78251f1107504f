"""The noise of benchmarks/privacy.py's runs: z for a target ε, central (dp-accounting)
and distributed (the `SkellamLedger`), and the client's Skellam encoding time."""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from fedloom.privacy import calibrate_noise_multiplier
from fedloom.privacy._distributed import SkellamLedger, encode_for_secagg, noisy_shares
from fedloom.privacy._skellam import calibrate, skellam_epsilon
from fedloom.secagg import SecAggConfig

DELTA = 1e-5
SECAGG = SecAggConfig(enabled=True, neighbours=10, threshold=6, max_participants=1024)


def central_z(epsilon: float, args: argparse.Namespace, sampling: str) -> float:
    rate = args.per_round / args.clients
    if sampling == "poisson":
        return calibrate_noise_multiplier(epsilon, DELTA, args.rounds, sampling="poisson",
                                          rate=rate, accountant="rdp")
    return calibrate_noise_multiplier(epsilon, DELTA, args.rounds, sampling="fixed",
                                      sampled=args.per_round, population=args.clients)


def distributed_epsilon(z: float, clip: float, dimension: int, args: argparse.Namespace) -> float:
    """The ε a distributed run's `SkellamLedger` reports after all rounds (no dropout)."""
    ledger = SkellamLedger(DELTA)
    params = calibrate(clip, dimension, args.per_round, z)
    noisy = noisy_shares(args.per_round, SECAGG.colluding_clients)
    rdp = ledger.round_rdp(params, noisy) * args.rounds  # RDP composes by addition
    return skellam_epsilon(ledger.orders, rdp, DELTA)[0]


def distributed_z(epsilon: float, clip: float, dimension: int, args: argparse.Namespace) -> float:
    """The smallest z (to 0.1%) whose distributed run spends at most ``epsilon``."""
    low, high = 0.1, 1000.0
    while high / low > 1.001:  # bisection on log z; ε falls as z grows
        mid = math.sqrt(low * high)
        if distributed_epsilon(mid, clip, dimension, args) > epsilon:
            low = mid
        else:
            high = mid
    return high


def encode_seconds(clip: float, dimension: int, z: float, per_round: int) -> float:
    """CPU seconds of one client's Skellam encoding of a d-parameter delta (median)."""
    params = calibrate(clip, dimension, per_round, z)
    rng = np.random.default_rng(0)
    update = rng.normal(0.0, clip / math.sqrt(dimension), dimension)
    seconds = []
    for i in range(50):
        started = time.thread_time()
        encode_for_secagg(update, params, i.to_bytes(16, "big"), rng=rng)
        seconds.append(time.thread_time() - started)
    return statistics.median(seconds)
