"""SecAgg+ in the local engine: the secure run against the plain run and a hand-computed
weighted mean, dropouts at each stage, failed rounds, refusals, and scenarios.

The reference for each round is independent of the protocol: the plaintext weighted mean
of the deltas the clients actually returned (numpy, here). The decoded secure mean must
be within the quantization bound of it (`mean_bound`); the plain local run is checked
against the same reference, so secure and plain agree within that bound.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fedloom.client_sdk import Client, EvaluateOutput, FitOutput
from fedloom.config import StrategyConfig
from fedloom.errors import ConfigError
from fedloom.secagg import SecAggConfig, Stage, neighbour_graph
from fedloom.simulations.history import History
from fedloom.simulations.local_engine import run_local
from fedloom.simulations.local_secure import (
    PARALLEL_LENGTH,
    LocalSecureAggregation,
    SecureDropout,
    payload_bytes,
    spread_dropouts,
)
from fedloom.simulations.plan import fit_seed
from fedloom.simulations.runner import run_scenario
from fedloom.simulations.scenario import Scenario, load_scenario
from fedloom.strategies import FedAdam, FedAvg, FedMedian, NormBoundedStrategy, Strategy
from fedloom.types import Config
from fedloom.weights import Weights

SECURE = SecAggConfig(enabled=True, neighbours=6, threshold=4, clip_range=4.0, bits=24,
                      max_weight=200.0, max_participants=64)
#: The same, without a client PKI: honest-but-curious only, no consistency stage.
UNAUTHENTICATED = SecAggConfig(enabled=True, neighbours=6, threshold=4, clip_range=4.0,
                               bits=24, max_weight=200.0, max_participants=64,
                               allow_unauthenticated=True)


class StepClient(Client):
    """Client i returns weights + a step drawn from its fit seed (independent of the
    weights, so each round's plaintext mean is known without running the protocol),
    and reports 10 + 7 i examples."""

    def __init__(self, index: int, scale: float = 0.5) -> None:
        self.index, self.scale = index, scale
        self.sent: dict[int, tuple[Weights, int]] = {}  # round -> (delta, examples)

    def fit(self, weights: Weights, config: Config) -> FitOutput:
        rng = np.random.default_rng(int(config["seed"]))
        delta = Weights((k, (self.scale * rng.normal(size=v.shape)).astype(v.dtype))
                        for k, v in weights.items())
        self.sent[int(config["server_round"])] = (delta, 10 + 7 * self.index)
        return FitOutput(Weights((k, v + delta[k]) for k, v in weights.items()),
                         10 + 7 * self.index)

    def evaluate(self, weights: Weights, config: Config) -> EvaluateOutput:
        return EvaluateOutput(0.0, 1)


def initial() -> Weights:
    arrays: dict[str, np.ndarray] = {"w": np.zeros((40, 5), np.float32),
                                     "b": np.zeros(5, np.float64)}
    return Weights(arrays)


def flat(weights: Weights) -> np.ndarray:
    return np.concatenate([np.asarray(v, np.float64).ravel() for v in weights.values()])


def plaintext_mean(clients: list[StepClient], ids: list[int], server_round: int,
                   config: SecAggConfig) -> tuple[np.ndarray, np.ndarray, float]:
    """(mean, weighted sum, total weight) of the clipped deltas of ``ids`` in a round."""
    weighted, total = 0.0, 0.0
    for i in ids:
        delta, n = clients[i].sent[server_round]
        w = n / config.max_weight
        weighted = weighted + w * np.clip(flat(delta), -config.clip_range, config.clip_range)
        total += w
    assert isinstance(weighted, np.ndarray)
    return weighted / total, weighted, total


def mean_bound(weighted: np.ndarray, total: float, count: int, config: SecAggConfig) -> np.ndarray:
    """Largest |decoded mean - plaintext mean| per coordinate.

    Each of ``count`` clients is off by less than one quantum q = 2c / L per coordinate
    and 1 / L in its weight (stochastic rounding), so the decoded sums are S' = S + e,
    |e| < count q, and W' = W + f, |f| < count / L. Then |S'/W' - S/W| =
    |e W - S f| / (W W') <= count (q W + |S| / L) / (W (W - count / L)).
    """
    levels = config.levels
    return count * (config.quantum * total + np.abs(weighted) / levels) / (
        total * (total - count / levels))


def run(n: int = 12, rounds: int = 3, secure: LocalSecureAggregation | None = None,
        strategy: Strategy | None = None) -> tuple[History, list[StepClient]]:
    clients = [StepClient(i) for i in range(n)]
    history = run_local(strategy or FedAvg(), clients.__getitem__,
                        initial(), num_clients=n, num_rounds=rounds, base_seed=3,
                        secure_aggregation=secure)
    return history, clients


@pytest.mark.parametrize("config", [SECURE, UNAUTHENTICATED], ids=["signed", "unsigned"])
def test_secure_run_equals_plain_run_within_the_quantization_bound(config: SecAggConfig
                                                                    ) -> None:
    secure = LocalSecureAggregation(config, seed=1)
    got, clients = run(secure=secure)
    plain, _plain_clients = run()
    assert got.weights is not None and plain.weights is not None
    models, total_bound = {0: flat(initial())}, np.zeros(205)
    for r in (1, 2, 3):
        ids = list(range(12))
        mean, weighted, total = plaintext_mean(clients, ids, r, SECURE)
        bound = mean_bound(weighted, total, 12, SECURE)
        assert bound.max() < 1e-5  # tight enough to mean something
        total_bound = total_bound + bound  # FedAvg adds each round's mean
        models[r] = models[r - 1] + mean
        record = got.rounds[r]
        assert record.get("num_updates") == 12 and record.get("num_failures") == 0
        assert record.get("num_examples") == sum(10 + 7 * i for i in ids)
        assert secure.reports[r - 1].survivors == tuple(sorted(str(i) for i in ids))
        stages = {str(s) for s in Stage}
        if config.allow_unauthenticated:
            stages.discard(str(Stage.CONSISTENCY))
        assert set(secure.reports[r - 1].stage_s) == stages
        assert secure.reports[r - 1].attempts == 1
    # FedAvg's step is the mean itself: each round's model is the sum of the means
    assert np.all(np.abs(flat(got.weights) - models[3]) <= total_bound + 1e-6)
    # the plain run trains on the same seeds, so its model is the same sum (exactly)
    np.testing.assert_allclose(flat(plain.weights), models[3], atol=1e-5)
    assert np.all(np.abs(flat(got.weights) - flat(plain.weights)) <= total_bound + 2e-5)
    # and the check can fail: leaving one client out of the reference is far off
    wrong, _, _ = plaintext_mean(clients, ids[1:], 3, SECURE)
    assert np.abs(flat(got.weights) - (models[2] + wrong)).max() > 1e-2


def test_secure_runs_are_reproducible() -> None:
    a, _ = run(secure=LocalSecureAggregation(SECURE, seed=5), rounds=2)
    b, _ = run(secure=LocalSecureAggregation(SECURE, seed=5), rounds=2)
    c, _ = run(secure=LocalSecureAggregation(SECURE, seed=6), rounds=2)
    assert a.weights is not None and b.weights is not None and c.weights is not None
    assert a.weights.allclose(b.weights, rtol=0, atol=0)  # fresh keys, same rounding
    assert not a.weights.allclose(c.weights, rtol=0, atol=0)


def test_masked_inputs_computed_in_threads_give_the_same_model() -> None:
    # large enough (PARALLEL_LENGTH) for the masked inputs and the unmasking to run in
    # threads: the same model as one client at a time, with and without dropouts
    big = Weights({"w": np.zeros(PARALLEL_LENGTH + 5, np.float32)})
    for dropout in (SecureDropout(), SecureDropout(fraction=0.2, after="share_keys")):
        models = []
        for workers in (1, 3):
            clients = [StepClient(i, scale=0.01) for i in range(10)]
            secure = LocalSecureAggregation(SECURE, dropout, seed=5, workers=workers)
            history = run_local(FedAvg(), clients.__getitem__, big, num_clients=10,
                                num_rounds=1, secure_aggregation=secure)
            assert history.weights is not None and not secure.reports[0].failure
            models.append(history.weights)
        assert models[0].allclose(models[1], rtol=0, atol=0)


@pytest.mark.parametrize("config", [SECURE, UNAUTHENTICATED], ids=["signed", "unsigned"])
@pytest.mark.parametrize("after", ["advertise_keys", "share_keys", "masked_input"])
def test_dropouts_at_each_stage(after: str, config: SecAggConfig) -> None:
    """A fifth of the clients vanish after ``after``: left out (advertise_keys), dropped
    with their masks removed (share_keys), or, after masked_input, survivors whose seeds
    are reconstructed without them (unauthenticated) or who never confirm the survivor
    set, so that the attempt is retried without them (authenticated). The result is the
    plaintext mean over the survivors."""
    secure = LocalSecureAggregation(config, SecureDropout(fraction=0.2, after=after), seed=2)
    history, clients = run(n=15, rounds=1, secure=secure)
    report = secure.reports[0]
    assert len(report.vanished) == 3
    vanished = {int(c) for c in report.vanished}
    retried = after == "masked_input" and not config.allow_unauthenticated
    kept = after == "masked_input" and not retried
    assert report.attempts == (2 if retried else 1)
    if retried:
        assert "did not confirm the survivor set" in report.failures[0]
    inputs = [i for i in range(15) if kept or i not in vanished]
    assert report.survivors == tuple(sorted(str(i) for i in inputs))
    assert set(report.dropped) == (set(report.vanished) if after == "share_keys" else set())
    record = history.rounds[1]
    assert record.get("num_updates") == len(inputs)
    assert record.get("num_failures") == 15 - len(inputs)
    assert record.get("secagg_dropped") == len(report.dropped)
    mean, weighted, total = plaintext_mean(clients, inputs, 1, SECURE)
    bound = mean_bound(weighted, total, len(inputs), SECURE)
    assert history.weights is not None
    assert np.all(np.abs(flat(history.weights) - mean) <= bound + 1e-7)
    everyone, _, _ = plaintext_mean(clients, list(range(15)), 1, SECURE)
    assert kept or np.abs(flat(history.weights) - everyone).max() > 1e-3


def test_too_many_dropouts_fail_the_round_cleanly_and_the_next_one_runs() -> None:
    # 60% vanish after sharing keys in round 1 only: 6 of 15 survive, fewer than a
    # survivor's t = 4 surviving neighbours somewhere (k = 6), or too few to unmask.
    # With one attempt a round allows, round 1 fails.
    once = dataclasses.replace(SECURE, max_attempts=1)
    secure = LocalSecureAggregation(
        once, SecureDropout(fraction=0.6, after="share_keys", choice="random", rounds=(1,)))
    history, clients = run(n=15, rounds=2, secure=secure)
    assert secure.reports[0].failure and secure.reports[0].attempts == 1
    first = history.rounds[1]
    assert first.get("no_model_reason", "").startswith("secure aggregation failed")
    assert first.get("num_failures") == 15
    # round 2 starts from the unchanged initial model and has no dropouts
    mean, weighted, total = plaintext_mean(clients, list(range(15)), 2, SECURE)
    assert history.weights is not None
    assert np.all(np.abs(flat(history.weights) - mean)
                  <= mean_bound(weighted, total, 15, SECURE) + 1e-7)


def test_a_failed_attempt_is_retried_without_the_clients_that_vanished() -> None:
    # the same dropouts with the default max_attempts: the round's second attempt runs
    # over the 6 clients that stayed (fresh keys) and the round aggregates them
    secure = LocalSecureAggregation(
        SECURE, SecureDropout(fraction=0.6, after="share_keys", choice="random", rounds=(1,)))
    history, clients = run(n=15, rounds=1, secure=secure)
    report = secure.reports[0]
    assert report.attempts == 2 and len(report.failures) == 1 and not report.failure
    stayed = sorted(set(str(i) for i in range(15)) - set(report.vanished), key=int)
    assert len(stayed) == 6 and report.survivors == tuple(sorted(stayed))
    ids = [int(c) for c in stayed]
    mean, weighted, total = plaintext_mean(clients, ids, 1, SECURE)
    assert history.weights is not None
    assert np.all(np.abs(flat(history.weights) - mean)
                  <= mean_bound(weighted, total, 6, SECURE) + 1e-7)
    assert history.rounds[1].get("num_updates") == 6


def test_spread_dropouts_leave_every_client_threshold_neighbours() -> None:
    for n, seed in ((50, b"a"), (50, b"b"), (20, b"c"), (11, b"d")):
        ids = [f"c{i:02d}" for i in range(n)]
        graph = neighbour_graph(ids, 10, seed * 32)
        chosen = spread_dropouts(graph, 6, ids, n // 5)
        assert len(chosen) == n // 5
        assert all(len(graph[u] - chosen) >= 6 for u in ids)
        assert chosen == spread_dropouts(graph, 6, reversed(ids), n // 5)  # deterministic


def test_fedadam_under_secure_aggregation_takes_the_secure_mean() -> None:
    # FedAdam's step from the secure mean equals its step from the plain mean, within
    # what the bound on the mean allows after Adam's normalisation: compare the runs.
    secure, plain = (run(rounds=2, strategy=FedAdam(eta=0.1),
                         secure=LocalSecureAggregation(SECURE) if s else None)[0]
                     for s in (True, False))
    assert secure.weights is not None and plain.weights is not None
    assert np.abs(flat(secure.weights) - flat(plain.weights)).max() < 1e-3
    assert np.abs(flat(plain.weights)).max() > 0.05  # it moved


def test_a_norm_bound_becomes_clipping_on_the_client() -> None:
    bound = 1.0
    strategy = NormBoundedStrategy(FedAvg(), max_update_norm=bound)
    history, clients = run(rounds=1, strategy=strategy,
                           secure=LocalSecureAggregation(SECURE))
    plain, _ = run(rounds=1, strategy=NormBoundedStrategy(FedAvg(), bound))
    # reference: each delta scaled to norm <= 1, then the weighted mean
    total, acc = 0.0, 0.0
    for c in clients:
        delta, n = c.sent[1]
        vec = flat(delta)
        acc = acc + n * vec * min(1.0, bound / np.linalg.norm(vec))
        total += n
    assert history.weights is not None and plain.weights is not None
    np.testing.assert_allclose(flat(history.weights), acc / total, atol=1e-5)
    np.testing.assert_allclose(flat(plain.weights), acc / total, atol=1e-6)
    assert np.abs(acc / total).max() < np.abs(plaintext_mean(clients, list(range(12)), 1,
                                                              SECURE)[0]).max()


def test_robust_strategies_and_disabled_configs_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"strategy\.name"):
        run(rounds=1, strategy=FedMedian(), secure=LocalSecureAggregation(SECURE))
    with pytest.raises(ConfigError, match="enabled"):
        LocalSecureAggregation(SecAggConfig())
    with pytest.raises(ConfigError, match=r"secure_dropout\.after"):
        SecureDropout(fraction=0.1, after="unmask")
    with pytest.raises(ConfigError, match=r"secure_dropout\.fraction"):
        SecureDropout(fraction=1.0)


def test_payload_bytes_of_a_round() -> None:
    secure = LocalSecureAggregation(UNAUTHENTICATED)
    run(rounds=1, secure=secure)
    report = secure.reports[0]
    length = 40 * 5 + 5
    # with 12 participants and k = 6, every client has 6 neighbours
    neighbours = [c for c in report.participants if c != "3"][:6]
    # client "3" sends its keys (id + 2 x 32 bytes), a sealed share per neighbour
    # (sender, receiver, 12-byte nonce, 2 x 66 + 16 bytes) with two 32-byte commitments,
    # its 32-byte self-mask commitment, its masked vector (id + uint32[length + 1]) and,
    # in unmask, up to one revealed share per neighbour (owner + 66 bytes): unmask
    # closes as soon as every secret has t shares.
    fixed = ((1 + 64) + sum(1 + len(v) + 12 + 148 + 64 for v in neighbours) + 32
             + 1 + 4 * (length + 1))
    sent = report.bytes_sent["3"]
    assert fixed <= sent <= fixed + sum(len(v) + 66 for v in neighbours)
    # signed: the certificate and the signature come with the keys, and a signature of
    # the survivor set with the consistency reply
    signed = LocalSecureAggregation(SECURE)
    run(rounds=1, secure=signed)
    extra = signed.reports[0].bytes_sent["3"] - sent
    assert 300 < extra < 2000, extra
    with pytest.raises(TypeError):
        payload_bytes(object())


SCENARIO = textwrap.dedent("""
    name = "secure-small"
    seed = 1
    num_clients = 10
    clients_per_round = 10
    rounds = 2
    progress = false

    [secure_aggregation]
    enabled = true
    neighbours = 6
    threshold = 4
    bits = 24
    max_weight = 200.0
    max_participants = 16

    [secure_dropout]
    fraction = 0.2
    after = "share_keys"
    rounds = [2]
""")


def test_a_scenario_with_secure_aggregation_runs_like_the_plain_one(tmp_path: Path) -> None:
    path = tmp_path / "secure.toml"
    path.write_text(SCENARIO)
    scenario = load_scenario(path)
    assert scenario.secure_aggregation.enabled and scenario.secure_dropout.rounds == (2,)
    history = run_scenario(scenario.replace(rounds=1), None)
    plain = run_scenario(scenario.replace(rounds=1, secure_aggregation=SecAggConfig(),
                                          secure_dropout=SecureDropout()), None)
    assert history.weights is not None and plain.weights is not None
    # digits MLP, 10 clients of ~144 examples each: weights ~0.7, so W ~ 7 and the mean
    # is within about 10 * (2 * 8 / 2**24) * 7 / 7**2 ~ 1.4e-6 of the plain mean
    assert history.weights.allclose(plain.weights, rtol=0, atol=1e-5)
    assert not history.weights.allclose(plain.weights, rtol=0, atol=0)  # it was quantized
    both = run_scenario(scenario, tmp_path / "out")
    assert both.rounds[2].get("num_updates") == 8 and both.rounds[2].get("secagg_dropped") == 2
    loss = both.final("test_loss")
    assert both.final("test_accuracy") is not None and loss is not None and math.isfinite(loss)


def test_scenario_settings_are_validated() -> None:
    on = SecAggConfig(enabled=True, neighbours=6, threshold=4)
    with pytest.raises(ConfigError, match="engine"):
        Scenario(engine="flower", secure_aggregation=on)
    with pytest.raises(ConfigError, match="clients_per_round"):
        Scenario(num_clients=10, clients_per_round=4, secure_aggregation=on)
    with pytest.raises(ConfigError, match=r"secure_dropout\.choise"):
        from fedloom.simulations.scenario import scenario_from_mapping

        scenario_from_mapping({"secure_dropout": {"choise": "random"}})
    # a robust strategy is refused before any client trains
    with pytest.raises(ConfigError, match=r"strategy\.name"):
        run_scenario(Scenario(progress=False, secure_aggregation=on,
                              strategy=StrategyConfig("fedmedian")), None)


def test_fit_configs_are_those_of_a_plain_round() -> None:
    _, clients = run(rounds=1, secure=LocalSecureAggregation(SECURE))
    _, plain = run(rounds=1)
    for a, b in zip(clients, plain, strict=True):
        assert flat(a.sent[1][0]).tolist() == flat(b.sent[1][0]).tolist()
    assert fit_seed(3, 0, 1) >= 0
