"""Poisson sampling under `CentralDPStrategy`: each client with probability
fraction_fit, and the mean over the expected cohort size."""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import pytest
from central_dp_support import (
    TINY_Z,
    central,
    clients,
    clipped,
    delta_of_norm,
    dp_strategy,
    model,
    run_round,
)

from fedloom.config import SelectionConfig
from fedloom.strategies import FedAvg


def test_poisson_sampling_picks_each_client_with_probability_fraction_fit() -> None:
    n, q, rounds = 200, 0.3, 200
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(fraction_fit=q, min_fit_clients=1,
                                                            seed=9)), sampling="poisson")
    counts, per_client = [], dict.fromkeys((c.client_id for c in clients(n)), 0)
    for server_round in range(1, rounds + 1):
        plan = strategy.configure_fit(server_round, model(), clients(n))
        counts.append(len(plan.client_ids))
        for cid in plan.client_ids:
            per_client[cid] += 1
    total, expected = sum(counts), n * q * rounds
    assert abs(total - expected) < 5 * math.sqrt(n * rounds * q * (1 - q))
    # The cohort size is Binomial(n, q), not fixed: its variance is n q (1 - q)
    # (the sample variance of 200 rounds has a relative standard error of 0.1).
    assert 0.6 < np.var(counts, ddof=1) / (n * q * (1 - q)) < 1.4
    # Every client near q: Binomial(rounds, q) per client, 5 standard errors.
    spread = 5 * math.sqrt(rounds * q * (1 - q))
    assert all(abs(k - rounds * q) < spread for k in per_client.values())


def test_poisson_rounds_divide_by_the_expected_count_and_record_the_rate() -> None:
    n, q, clip = 20, 0.25, 1.0
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(fraction_fit=q, min_fit_clients=1,
                                                            seed=4)),
                           sampling="poisson", clip_norm=clip)
    rng, current = np.random.default_rng(10), model()
    for server_round in (1, 2):
        deltas = {c.client_id: delta_of_norm(rng, 2.0) for c in clients(n)}
        chosen, result = run_round(strategy, server_round, current, n, deltas.__getitem__)
        assert chosen and result.weights is not None
        for k in ("w", "b"):
            total = sum(clipped(deltas[cid], clip)[k] for cid in chosen)
            expected = current[k].astype(np.float64) + total / (q * n)  # not / len(chosen)
            np.testing.assert_allclose(result.weights[k], expected, rtol=1e-6, atol=1e-6)
        current = result.weights
    assert strategy.accountant.state_dict()["events"] == [[[TINY_Z, 0, n, q], 2]]


def test_a_deployed_run_samples_secretly_and_never_checkpoints_the_sampler() -> None:
    """Amplification by sampling assumes nobody knows who was sampled. With the seeded
    sampler (seed 0 by default) anyone holding the config or a checkpoint would: every
    round would then cost the sampled clients their unamplified ε. A strategy built for
    a deployment (`apply_privacy`, no test generator) samples from a CSPRNG-seeded
    generator and checkpoints none of its state."""
    from fedloom.strategies import apply_privacy

    population = clients(200)

    def build() -> Any:
        return apply_privacy(FedAvg(selection=SelectionConfig(fraction_fit=0.1, seed=0)),
                             central(sampling="poisson"))

    a, b = build(), build()
    picks = [s.configure_fit(1, model(), population).client_ids for s in (a, b)]
    assert picks[0] != picks[1]  # the same config and seed, two unpredictable samples
    state = a.state_dict()
    assert state["inner"]["sampler"] == {"secret": True}
    resumed = build()
    resumed.load_state_dict(state)
    assert resumed.inner.sampler.is_secret
    again = [resumed.configure_fit(2, model(), population).client_ids for _ in range(2)]
    assert again[0] != again[1]
    # a test or study that passes its own generator keeps the seeded, replayable sampler
    seeded = dp_strategy(FedAvg(selection=SelectionConfig(fraction_fit=0.1, seed=0)),
                         sampling="poisson")
    assert not seeded.inner.sampler.is_secret and "bit_generator" in seeded.state_dict(
    )["inner"]["sampler"]


@pytest.mark.parametrize(("fraction", "population", "halved"), [
    (1.0, 3, False),   # everyone, at any number of clients: an added one adds C
    (0.5, 6, True),    # 3 of 6: an added client may be sampled in place of one who was in
    (0.5, 3, True),    # 3 of 3 only because min_fit_clients is 3; at 4 clients, 3 of 4
])
def test_none_halves_z_when_an_added_client_could_displace_one(
        fraction: float, population: int, halved: bool) -> None:
    from fedloom.privacy import PrivacyAccountant, RoundEvent

    strategy = dp_strategy(FedAvg(selection=SelectionConfig(fraction_fit=fraction,
                                                             min_fit_clients=3)),
                           sampling="none", noise_multiplier=2.0)
    chosen, result = run_round(strategy, 1, model(), population,
                               lambda cid: delta_of_norm(np.random.default_rng(0), 0.5))
    assert len(chosen) == 3 and result.weights is not None
    reference = PrivacyAccountant("rdp", "none", strategy.privacy.delta)
    reference.record(RoundEvent(1.0 if halved else 2.0, 3, population))
    assert strategy.accountant.epsilon() == pytest.approx(reference.epsilon(), rel=1e-12)


def test_an_empty_poisson_draw_is_a_failed_round_that_says_why() -> None:
    """Nobody drawn: the round releases nothing and spends nothing, and says so (it is
    not an unconfigured round)."""
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(fraction_fit=1e-9)),
                           sampling="poisson")
    chosen, result = run_round(strategy, 1, model(), 5, lambda cid: None)
    assert chosen == () and result.weights is None
    assert "Poisson draw was empty" in result.reason
    assert strategy.accountant.num_rounds == 0


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
            and r.getMessage().startswith("[privacy]")]


def test_a_delta_of_one_over_n_or_more_is_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    strategy = dp_strategy(delta=0.5)
    with caplog.at_level(logging.WARNING):
        for server_round in (1, 2):
            strategy.configure_fit(server_round, model(), clients(3))
    [warning] = _warnings(caplog)
    assert "delta = 0.5 is at least 1/n for the 3 clients" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        dp_strategy(delta=1e-5).configure_fit(1, model(), clients(3))
    assert _warnings(caplog) == []


@pytest.mark.parametrize(("n", "rate", "warned"), [(10, 0.5, True), (20, 0.25, True),
                                                   (1000, 0.05, False)])
def test_an_empty_poisson_draw_likelier_than_delta_is_warned(
        n: int, rate: float, warned: bool, caplog: pytest.LogCaptureFixture) -> None:
    """q (1 - q)^(n - 1) is what a held-back empty draw leaks beyond the accounting: at
    q n = 5 with ten clients about 1e-3 a round, a hundred times delta."""
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(fraction_fit=rate,
                                                            min_fit_clients=1)),
                           sampling="poisson", accountant="pld")
    with caplog.at_level(logging.WARNING):
        strategy.configure_fit(1, model(), clients(n))
    messages = [m for m in _warnings(caplog) if "Poisson draw is empty" in m]
    assert bool(messages) is warned
    if warned:
        leak = rate * (1 - rate) ** (n - 1)
        assert f"leaks up to {leak:.2g} a round" in messages[0]
