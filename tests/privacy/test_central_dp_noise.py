"""`CentralDPStrategy`'s noise on the mean: Gaussian with std z C / m, checked by
statistics, from a CSPRNG-seeded generator by default."""

from __future__ import annotations

import math

import numpy as np
import pytest
from central_dp_support import central, dp_strategy, run_round

from fedloom import Weights
from fedloom.config import SelectionConfig
from fedloom.strategies import CentralDPStrategy, FedAvg


def gaussian_problems(samples: np.ndarray, std: float) -> list[str]:
    """Why ``samples`` are not N(0, std**2) i.i.d.; empty when they pass.

    With N samples: the mean's standard error is std / sqrt(N), the sample std's relative
    standard error sqrt(1 / (2N)), the share within one std has standard error
    sqrt(p (1 - p) / N) with p = 0.6827 (a uniform of the same std gives 0.577). Each
    threshold is over 5 standard errors, and far below a 10% error in the scale.
    """
    x = samples.astype(np.float64).ravel()
    n, problems = x.size, []
    if abs(x.mean()) > 5 * std / math.sqrt(n):
        problems.append(f"mean {x.mean():g} is not 0 (std {std:g})")
    ratio = x.std() / std
    if abs(ratio - 1) > 0.03:
        problems.append(f"std is {ratio:.4f} of {std:g}")
    within = float(np.mean(np.abs(x) < std))
    if abs(within - 0.6827) > 0.01:
        problems.append(f"{within:.4f} of the samples within one std, not 0.6827")
    return problems


def test_the_noise_check_rejects_a_scale_off_by_ten_percent() -> None:
    noise = np.random.default_rng(5).normal(0.0, 0.25, 60_000)
    assert gaussian_problems(noise, 0.25) == []
    assert gaussian_problems(noise * 1.1, 0.25)
    assert gaussian_problems(noise * 0.9, 0.25)
    assert gaussian_problems(noise + 0.01, 0.25)  # a bias of 4% of the std
    uniform = np.random.default_rng(5).uniform(-0.25 * math.sqrt(3), 0.25 * math.sqrt(3), 60_000)
    assert gaussian_problems(uniform, 0.25)  # same std, not Gaussian


def _noise_of_one_round(strategy: CentralDPStrategy, population: int) -> np.ndarray:
    """The noise on the mean: every sampled client returns a zero delta."""
    current = Weights({"w": np.zeros(60_000, np.float64)})
    _, result = run_round(strategy, 1, current, population,
                          lambda cid: Weights({"w": np.zeros(60_000, np.float64)}))
    assert result.weights is not None
    return np.asarray(result.weights["w"])


@pytest.mark.parametrize(("z", "clip", "m"), [(1.0, 1.0, 4), (0.6, 2.5, 10), (3.0, 0.1, 1)])
def test_noise_on_the_mean_is_gaussian_with_std_z_c_over_m(z: float, clip: float,
                                                           m: int) -> None:
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=m)), seed=11,
                           noise_multiplier=z,
                           clip_norm=clip)
    noise = _noise_of_one_round(strategy, m)
    assert gaussian_problems(noise, z * clip / m) == []


def test_adaptive_clipping_noises_the_sum_with_the_split_multiplier() -> None:
    z, clip, m, count_std = 1.0, 1.0, 20, 1.0
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=m)), seed=12,
                           noise_multiplier=z,
                           clip_norm=clip, clipping="adaptive", count_noise_std=count_std)
    noise = _noise_of_one_round(strategy, m)
    z_delta = 1 / math.sqrt(z**-2 - (2 * count_std) ** -2)
    assert z_delta > 1.15 * z  # far from z for the check
    assert gaussian_problems(noise, z_delta * clip / m) == []


def test_default_noise_comes_from_a_csprng_seeded_generator() -> None:
    privacy = central(noise_multiplier=1.0)
    a = CentralDPStrategy(FedAvg(selection=SelectionConfig(min_fit_clients=2)), privacy)
    b = CentralDPStrategy(FedAvg(selection=SelectionConfig(min_fit_clients=2)), privacy)
    noise_a, noise_b = _noise_of_one_round(a, 2), _noise_of_one_round(b, 2)
    assert not np.allclose(noise_a, noise_b)
    assert gaussian_problems(noise_a, 0.5) == [] and gaussian_problems(noise_b, 0.5) == []
    # Not a fixed seed either: not the noise of default_rng(0) .. default_rng(9).
    for seed in range(10):
        seeded = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=2)), seed=seed,
                             noise_multiplier=1.0)
        assert not np.allclose(_noise_of_one_round(seeded, 2), noise_a)
