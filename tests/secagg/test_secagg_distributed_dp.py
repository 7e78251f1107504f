"""Distributed DP under SecAgg+ over loopback gRPC and in the local engine.

The oracle is independent of the protocol: the plaintext mean of the survivors' clipped
deltas (numpy, here). With negligible noise the new model must equal it to within the
Skellam encoding's rounding; with real noise the error must have the announced spread,
no more (noise doubled) and no less (noise lost to a dropout).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from e2e_harness import (
    Behaviour,
    RecordingClient,
    checkpoints,
    secagg,
    start_runners,
    stop_runners,
    survivor_indices,
)
from helpers import small_weights

from fedloom.config import SelectionConfig
from fedloom.errors import ConfigError, SecureAggregationError
from fedloom.privacy import PrivacyConfig
from fedloom.privacy._distributed import (
    MIN_SURVIVORS_KEY,
    decode_secagg_total,
    encode_for_secagg,
    from_fit_config,
    to_fit_config,
)
from fedloom.privacy._skellam import calibrate
from fedloom.secagg import flatten
from fedloom.server import Server
from fedloom.strategies import FedAvg, FedMedian, apply_privacy
from fedloom.strategies._ddp import DistributedDPStrategy

CLIP = 3.0


def _clipped_mean(deltas: list[np.ndarray]) -> np.ndarray:
    clipped = [d * min(1.0, CLIP / np.linalg.norm(d)) for d in deltas]
    return np.mean(clipped, axis=0)


def _private(z: float, **overrides: Any) -> PrivacyConfig:
    return PrivacyConfig(mode="distributed", noise_multiplier=z, clip_norm=CLIP,
                         sampling="none", **overrides)


def test_a_grpc_round_unmasks_the_noised_mean_of_clipped_deltas(server_config, mtls, pki
                                                                 ) -> None:  # type: ignore[no-untyped-def]
    config = server_config(**mtls, num_rounds=1, min_clients=7, min_fit_clients=7,
                           fraction_evaluate=0.0, secure_aggregation=secagg(),
                           privacy=_private(1e-4))
    server = Server(config, initial_weights=small_weights())
    handle = server.start()
    clients = [RecordingClient(seed=i, num_examples=8 + 5 * i, scale=2.0) for i in range(7)]
    runners, threads = start_runners(handle.address, clients, {}, pki=pki)
    history = handle.wait(60)
    stop_runners(runners, threads)
    assert history[0].status == "ok", history
    fit = history[0].fit
    assert fit["num_updates"] == 7 and fit["privacy_epsilon"] > 0
    deltas = [clients[i].delta(1)[0] for i in survivor_indices(server, runners)]
    assert max(np.linalg.norm(d) for d in deltas) > CLIP  # clipping bites
    saved = checkpoints(config.state_dir)
    got = flatten(saved[1].subtract(saved[0]))
    expected = _clipped_mean(deltas)  # unweighted: num_examples do not matter
    assert np.abs(got - expected).max() < 1e-3
    # and it is not the example-weighted mean
    weights = np.array([8 + 5 * i for i in survivor_indices(server, runners)], float)
    weighted = np.average([d * min(1.0, CLIP / np.linalg.norm(d)) for d in deltas], axis=0,
                          weights=weights)
    assert np.abs(got - weighted).max() > 1e-2


def _encode_round(z: float, n: int, survivors: list[int], size: int = 1 << 14,
                  seed: int = 0) -> tuple[np.ndarray, np.ndarray, float]:
    """n clients calibrated for n; only ``survivors`` are summed. Returns (decoded mean
    - plaintext mean, the announced std of the mean's noise, scale)."""
    rng = np.random.default_rng(seed)
    params = calibrate(CLIP, size, n, z)
    rotation = b"r" * 16
    deltas = [rng.normal(size=size) * 0.05 for _ in range(n)]
    total = np.zeros(params.padded_dimension + 1, np.uint32)
    for i in survivors:
        total += encode_for_secagg(deltas[i], params, rotation,
                                   np.random.default_rng(seed * 1000 + i))
    decoded, count = decode_secagg_total(total, params, rotation)
    assert count == len(survivors)
    error = decoded / count - _clipped_mean([deltas[i] for i in survivors])
    # each survivor's noise Sk(mu) has variance 2 mu in the scaled domain
    std = math.sqrt(2 * params.client_noise_mu * len(survivors)) / params.scale / count
    return error, np.array(std), params.scale


@pytest.mark.parametrize("survivors", [list(range(10)), [0, 2, 3, 5, 6, 7, 9]])
def test_the_sum_carries_each_survivors_noise_once(survivors: list[int]) -> None:
    """The error's spread is the survivors' noise: not doubled, not lost with dropouts.
    (16k coordinates: the sample std is within 1.1% of the truth at 1e-6 odds, so a
    10% error in the scale fails.)"""
    error, std, _ = _encode_round(z=1.0, n=10, survivors=survivors)
    assert abs(error.mean()) < 5 * std / math.sqrt(error.size)
    assert error.std() == pytest.approx(float(std), rel=0.03)
    # the same check refuses a sum whose noise is 10% off
    assert error.std() * 1.1 != pytest.approx(float(std), rel=0.03)


def test_the_noise_of_the_full_round_is_the_central_noise() -> None:
    """n survivors of n sampled: the sum's noise std is z * C, as central DP's."""
    error, _, _ = _encode_round(z=0.5, n=10, survivors=list(range(10)), seed=4)
    assert error.std() * 10 == pytest.approx(0.5 * CLIP, rel=0.03)


def test_a_client_refuses_a_partial_or_malformed_announcement() -> None:
    params = calibrate(CLIP, 100, 5, 1.0)
    good = to_fit_config(params, b"s" * 16)
    assert from_fit_config(good, 100) is not None
    assert from_fit_config({}, 100) is None
    for broken in ({k: v for k, v in good.items() if k != "ddp_scale"},
                   {**good, "ddp_scale": "big"}, {**good, "ddp_client_mu": -1.0},
                   {**good, "ddp_rotation_seed": "00"}, {**good, "ddp_bits": 40},
                   # not numbers, though float() would take them; a 15-byte seed
                   {**good, "ddp_clip_norm": True}, {**good, "ddp_scale": "2.5"},
                   {**good, "ddp_rotation_seed": "ab" * 15}):
        with pytest.raises(SecureAggregationError):
            from_fit_config(broken, 100)


def test_the_strategy_announces_a_floor_and_accounts_the_survivors() -> None:
    from fedloom.types import ClientInfo

    strategy = apply_privacy(FedAvg(selection=SelectionConfig(min_fit_clients=10)),
                             _private(1.0, expected_dropout=0.2),
                             colluding_clients=1)
    assert isinstance(strategy, DistributedDPStrategy)
    clients = [ClientInfo(str(i)) for i in range(10)]
    weights = small_weights()
    plan = strategy.configure_fit(1, weights, clients)
    assert plan.config[MIN_SURVIVORS_KEY] == 8  # ceil(10 * 0.8)
    params, _ = from_fit_config(plan.config, sum(s.size for s in weights.specs()))
    # the projection assumes the floor's noise less one client and one colluder
    ledger = strategy.ledger
    assert ledger.epsilon_if(params, 8 - 1 - 1) > ledger.epsilon_if(params, 9)


def test_distributed_mode_is_refused_where_it_cannot_hold(server_config) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="secure_aggregation"):
        server_config(privacy=_private(1.0))
    with pytest.raises(ConfigError, match="sampling"):
        PrivacyConfig(mode="distributed", sampling="fixed")
    with pytest.raises(ConfigError, match="clipping"):
        PrivacyConfig(mode="distributed", clipping="adaptive", sampling="none")
    with pytest.raises(ConfigError):
        apply_privacy(FedMedian(), _private(1.0))
    strategy = apply_privacy(FedAvg(), _private(1.0))
    with pytest.raises(Exception, match="secure aggregation"):
        strategy.aggregate_fit(1, small_weights(), [])


def test_the_local_engine_runs_distributed_dp_and_stops_at_the_budget() -> None:
    from fedloom.simulations.local_engine import run_local
    from fedloom.simulations.local_secure import LocalSecureAggregation

    secure = secagg(max_weight=200.0)
    clients = {i: RecordingClient(seed=i, num_examples=10) for i in range(8)}
    ledger_probe = _private(2.0)
    strategy = apply_privacy(FedAvg(selection=SelectionConfig(min_fit_clients=8)), ledger_probe)
    history = run_local(strategy, lambda i: clients[i], small_weights(), num_clients=8,
                        num_rounds=3, secure_aggregation=LocalSecureAggregation(secure, seed=1))
    eps = [r.metrics["privacy_epsilon"] for r in history.rounds[1:]]
    assert len(eps) == 3 and eps[0] < eps[1] < eps[2]
    budget = (eps[1] + eps[2]) / 2  # allows two rounds, not three
    clients = {i: RecordingClient(seed=i, num_examples=10) for i in range(8)}
    strategy = apply_privacy(FedAvg(selection=SelectionConfig(min_fit_clients=8)),
                             _private(2.0, target_epsilon=budget))
    history = run_local(strategy, lambda i: clients[i], small_weights(), num_clients=8,
                        num_rounds=3, secure_aggregation=LocalSecureAggregation(secure, seed=1))
    assert [r.round for r in history.rounds] == [0, 1, 2]
    assert history.rounds[-1].metrics["privacy_epsilon"] == pytest.approx(eps[1])


def _setup(min_survivors: int, participants: int = 10) -> Any:
    import dataclasses

    from fedloom.secagg import RoundId, RoundSetup

    config = dataclasses.replace(secagg(), min_survivors=min_survivors)
    return RoundSetup.create(config, RoundId("run", 1, 1), [f"c{i}" for i in range(participants)],
                             1 << 10, model_digest=b"m" * 32, config_digest=b"c" * 32)


def test_a_client_refuses_noise_below_its_floor_or_a_setup_below_the_survivor_floor() -> None:
    """A server that announces less noise than the client requires, or would unmask a
    sum over fewer survivors than the noise was calibrated for, is refused."""
    from fedloom.client_sdk.secure_fit import SecureFit
    from fedloom.privacy._distributed import (
        accounted_noise_multiplier,
        noise_multiplier_of,
        noisy_shares,
    )

    params = calibrate(CLIP, 1000, 10, 1.0)
    assert noise_multiplier_of(params, 10) == pytest.approx(1.0, rel=1e-6)
    # what the ledger counts: 10 - 1 - 1 colluding shares, over Δ2
    accounted = accounted_noise_multiplier(params, noisy_shares(10, 1))
    assert accounted == pytest.approx(np.sqrt(8 / 10), rel=1e-3)
    strict = SecureFit(RecordingClient(0, 1), "c0", min_noise_multiplier=accounted * 1.01)
    with pytest.raises(SecureAggregationError, match="requires at least"):
        strict._check_noise(params, _setup(10), floor=10)
    lenient = SecureFit(RecordingClient(0, 1), "c0", min_noise_multiplier=accounted * 0.99)
    lenient._check_noise(params, _setup(10), floor=10)  # accepted
    with pytest.raises(SecureAggregationError, match="survivors"):
        lenient._check_noise(params, _setup(5), floor=10)


def test_a_rounds_survivor_floor_only_ever_raises_the_runs() -> None:
    """The announced floor raises the secure round's survivor floor when it is above the
    run's (threshold + 1, or a configured min_survivors); a lower one leaves the run's
    floor as it is, and a round without one runs at the run's settings."""
    from fedloom.privacy._distributed import round_secagg, survivor_floor

    run = secagg(min_survivors=7)  # threshold 3, so the run's floor is 7
    assert survivor_floor({}) == 0 and survivor_floor({MIN_SURVIVORS_KEY: 0}) == 0
    assert round_secagg(run, {}).survivor_floor == 7
    assert round_secagg(run, {MIN_SURVIVORS_KEY: 5}).survivor_floor == 7
    assert round_secagg(run, {MIN_SURVIVORS_KEY: 9}).survivor_floor == 9
    assert round_secagg(secagg(), {MIN_SURVIVORS_KEY: 5}).survivor_floor == 5


@pytest.mark.parametrize("floor", [-1, True, 2.0, "3", None])
def test_a_malformed_survivor_floor_is_refused(floor: Any) -> None:
    from fedloom.privacy._distributed import survivor_floor

    with pytest.raises(SecureAggregationError, match=MIN_SURVIVORS_KEY):
        survivor_floor({MIN_SURVIVORS_KEY: floor})


def test_reserved_noise_is_handed_over_once_and_only_for_its_round_shape() -> None:
    from fedloom.privacy._noise_reserve import NoiseReserve

    reserve = NoiseReserve()
    assert reserve.take(100.0, 1 << 16) is None  # nothing drawn ahead
    reserve.refill(100.0, 1 << 16)
    noise = reserve.take(100.0, 1 << 16)
    assert noise is not None and noise.shape == (1 << 16,) and noise.dtype == np.int64
    assert noise.var() == pytest.approx(200.0, rel=0.03)  # Sk(mu): variance 2 mu
    assert reserve.take(100.0, 1 << 16) is None  # used once
    reserve.refill(100.0, 1 << 16)
    assert reserve.take(50.0, 1 << 16) is None  # another round's noise: dropped
    assert reserve.take(100.0, 1 << 16) is None
    reserve.refill(100.0, 1 << 10)
    reserve.refill(100.0, 1 << 10)
    first = reserve.take(100.0, 1 << 10)
    reserve.refill(100.0, 1 << 10)
    second = reserve.take(100.0, 1 << 10)
    assert first is not None and second is not None and not np.array_equal(first, second)


def test_rotation_seeds_are_fresh_unless_a_simulation_seeds_them() -> None:
    from fedloom.privacy._distributed import SEED_KEY
    from fedloom.types import ClientInfo

    clients = [ClientInfo(str(i)) for i in range(6)]

    def seed_of(strategy: DistributedDPStrategy) -> str:
        return str(strategy.configure_fit(1, small_weights(), clients).config[SEED_KEY])

    def build(rng: np.random.Generator | None) -> DistributedDPStrategy:
        return DistributedDPStrategy(FedAvg(selection=SelectionConfig(min_fit_clients=6)),
                                     _private(1.0), rng=rng)

    assert seed_of(build(None)) != seed_of(build(None))  # the OS CSPRNG
    seeded = [seed_of(build(np.random.default_rng(7))) for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_an_unmasked_sum_is_accounted_even_when_the_round_cannot_use_it() -> None:
    """The server holds the noised sum once it is unmasked: a round that then fails (a
    contributor count that does not match, too few survivors) still spent budget."""
    from fedloom.errors import AggregationError
    from fedloom.secagg import SecAggResult
    from fedloom.types import ClientInfo

    strategy = DistributedDPStrategy(FedAvg(selection=SelectionConfig(min_fit_clients=6)),
                                     _private(1.0), rng=np.random.default_rng(0))
    weights = small_weights()
    clients = [ClientInfo(str(i)) for i in range(6)]
    plan = strategy.configure_fit(1, weights, clients)
    params, seed = from_fit_config(plan.config, sum(s.size for s in weights.specs()))
    encoded = [encode_for_secagg(np.zeros(params.dimension), params, seed,
                                 np.random.default_rng(i)) for i in range(6)]
    total = np.sum(encoded, axis=0, dtype=np.uint32)
    empty = np.zeros(0)

    def outcome(survivors: int) -> SecAggResult:
        return SecAggResult(empty, empty, 0.0, 0.0, tuple(map(str, range(survivors))), (),
                            total)

    assert strategy.ledger.num_rounds == 0
    with pytest.raises(AggregationError, match="counts 6 contributors, but 5 survived"):
        strategy.aggregate_secure_sum(1, weights, outcome(5))
    assert strategy.ledger.num_rounds == 1
    first = strategy.ledger.epsilon()
    assert math.isfinite(first) and first > 0
    result = strategy.aggregate_secure_sum(1, weights, outcome(6))  # the round's retry
    assert result.weights is not None and strategy.ledger.num_rounds == 2
    assert result.metrics["privacy_epsilon"] == pytest.approx(strategy.ledger.epsilon())
    assert strategy.ledger.epsilon() > first


def _eight_client_ddp_run(server_config: Any, mtls: Any, rounds: int) -> tuple[Any, list[Any]]:
    """A started server for ``rounds`` distributed-DP rounds of 8 clients (floor 6), and
    the 8 clients to run against it."""
    config = server_config(**mtls, num_rounds=rounds, min_clients=8, min_fit_clients=8,
                           fraction_evaluate=0.0, secure_aggregation=secagg(),
                           privacy=_private(1e-4, expected_dropout=0.25))
    handle = Server(config, initial_weights=small_weights()).start()
    return handle, [RecordingClient(seed=i, num_examples=10) for i in range(8)]


def test_a_distributed_dp_attempt_that_fails_after_consistency_is_not_retried_with_its_confirmers(
        server_config, mtls, pki) -> None:  # type: ignore[no-untyped-def]
    """One client vanishes after its masked input: it never confirms, so the attempt fails
    at consistency. Its confirmers' inputs may already be unmasked by their neighbours,
    so as distributed-DP clients they take part in no retry of the round, and the server
    does not ask them: the round fails after one attempt (the next one runs as usual)."""
    from fedloom.secagg import Stage

    handle, clients = _eight_client_ddp_run(server_config, mtls, rounds=2)
    # the others answer masked input 1 s later: the victim is gone before the stage
    # closes, with its masked input in (a survivor that will never confirm)
    behaviours = {i: Behaviour(delay={Stage.MASKED_INPUT: 1.0}) for i in range(1, 8)}
    behaviours[0] = Behaviour(vanish_after=Stage.MASKED_INPUT, stay_away=False)
    runners, threads = start_runners(handle.address, clients, behaviours, pki=pki)
    history = handle.wait(90)
    stop_runners(runners, threads)
    assert behaviours[0].vanished.is_set()
    first = history[0].secure_aggregation
    assert history[0].status == "failed", history
    assert first["attempts"] == 1
    assert "did not confirm the survivor set" in first["failure"]
    assert history[1].status == "ok", history


def test_a_sum_that_fails_its_checks_fails_the_round_not_the_server(
        server_config, mtls, pki, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every client claims two contributors in its encoding (a bug, or a client out to
    stop the server): the unmasked sum's count does not match its survivors. Each round
    fails and is committed as failed, the server carries on, and the checkpointed ledger
    holds both unmasked sums (the server saw them)."""
    from pathlib import Path

    import fedloom.client_sdk.secure_fit as secure_fit
    from fedloom.server.checkpoint import load_checkpoint
    from fedloom.server.store import RunStore

    honest = secure_fit.encode_for_secagg

    def lying(*args: Any, **kwargs: Any) -> np.ndarray:
        encoded = honest(*args, **kwargs)
        encoded[-1] = 2
        return encoded

    monkeypatch.setattr(secure_fit, "encode_for_secagg", lying)
    config = server_config(**mtls, num_rounds=2, min_clients=7, min_fit_clients=7,
                           fraction_evaluate=0.0, secure_aggregation=secagg(),
                           privacy=_private(1e-4))
    server = Server(config, initial_weights=small_weights())
    handle = server.start()
    clients = [RecordingClient(seed=i, num_examples=10) for i in range(7)]
    runners, threads = start_runners(handle.address, clients, {}, pki=pki)
    history = handle.wait(60)
    stop_runners(runners, threads)
    assert [r.status for r in history] == ["failed", "failed"]
    assert "counts 14 contributors, but 7 survived" in history[0].secure_aggregation["failure"]
    store = RunStore(Path(config.state_dir) / "fedloom.db")
    last = store.latest_round(store.runs()[-1].run_id)
    store.close()
    assert last is not None and last.round == 2
    state = load_checkpoint(Path(config.state_dir) / last.checkpoint, last.sha256)
    rounds = state.strategy_state["privacy"]["ledger"]["rounds"]
    assert int(np.asarray(rounds).reshape(-1)[0]) == 2


@pytest.mark.parametrize("private", [True, False])
def test_the_local_engine_leaves_out_distributed_dp_confirmers_as_the_server_does(
        private: bool) -> None:
    """A client vanishes after its masked input: attempt 1 fails at consistency. As over
    gRPC, a distributed-DP round does not retry with the clients that confirmed (their
    inputs may be unmasked already); a plain secure round retries without the one gone."""
    from fedloom.simulations.local_engine import run_local
    from fedloom.simulations.local_secure import LocalSecureAggregation
    from fedloom.simulations.secure_dropout import SecureDropout

    secure = LocalSecureAggregation(secagg(max_weight=200.0), seed=1,
                                    dropout=SecureDropout(fraction=0.125, after="masked_input"))
    clients = {i: RecordingClient(seed=i, num_examples=10) for i in range(8)}
    inner = FedAvg(selection=SelectionConfig(min_fit_clients=8))
    strategy = apply_privacy(inner, _private(1.0, expected_dropout=0.25)) if private else inner
    history = run_local(strategy, lambda i: clients[i], small_weights(), num_clients=8,
                        num_rounds=1, secure_aggregation=secure)
    report = secure.reports[0]
    assert "did not confirm the survivor set" in report.failures[0]
    if private:
        assert report.attempts == 1 and history.rounds[1].metrics.get("num_updates", 0) == 0
    else:
        assert report.attempts == 2 and len(report.survivors) == 7


def test_a_client_that_refuses_to_confirm_sits_out_the_next_rounds(
        server_config, mtls, pki, caplog) -> None:  # type: ignore[no-untyped-def]
    """Threat model: one client answers every consistency task with a refusal (an honest
    server's survivor set is one every honest client confirms). In a distributed-DP round
    that fails the round (the confirmers join no retry). The refuser gets a strike and
    sits out the next rounds, so the run goes on without it instead of failing again."""
    import logging
    import threading

    import e2e_harness
    from e2e_harness import HarnessRunner

    from fedloom.secagg import Stage

    class Refuser(HarnessRunner):
        def _misbehave(self, context: Any, call_next: Any) -> Any:
            if context.stage is Stage.CONSISTENCY:
                return context.failure("this client refuses to confirm")
            return super()._misbehave(context, call_next)

    caplog.set_level(logging.WARNING, logger="fedloom")
    handle, clients = _eight_client_ddp_run(server_config, mtls, rounds=3)
    runners = [(Refuser if i == 0 else HarnessRunner)(
        c, e2e_harness.client_config(handle.address, pki, i), Behaviour())
        for i, c in enumerate(clients)]
    threads = [threading.Thread(target=r.run, daemon=True) for r in runners]
    for thread in threads:
        thread.start()
    history = handle.wait(120)
    stop_runners(runners, threads)
    assert [r.status for r in history] == ["failed", "ok", "ok"], history
    assert history[0].secure_aggregation["attempts"] == 1
    assert all(r.num_updates == 7 for r in history[1:])
    assert any("refused to confirm the survivor set; it sits out 5 rounds" in r.getMessage()
               for r in caplog.records)
