"""`CentralDPStrategy`'s saved state: the ledger and the clip norm carry over, the noise
generator does not, and a state of other terms is refused."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from central_dp_support import delta_of_norm, dp_strategy, model, run_round

from fedloom import ConfigError, Weights
from fedloom.config import SelectionConfig
from fedloom.strategies import CentralDPStrategy, FedAvg, FedAvgM


def _rounds(strategy: CentralDPStrategy, rounds: Sequence[int], seed: int = 12) -> Weights:
    rng, current = np.random.default_rng(seed), model()
    for server_round in rounds:
        _, result = run_round(strategy, server_round, current, 5,
                              lambda cid: delta_of_norm(rng, float(rng.uniform(0.2, 3.0))))
        assert result.weights is not None
        current = result.weights
    return current


def _walk(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _walk(v)] + list(value)
    if isinstance(value, list | tuple):
        return [x for v in value for x in _walk(v)]
    return [value]


def test_state_continues_the_ledger_and_the_clip_norm() -> None:
    def make() -> CentralDPStrategy:
        inner = FedAvgM(server_momentum=0.5, selection=SelectionConfig(min_fit_clients=3,
                                                                       fraction_fit=0.6, seed=1))
        return dp_strategy(inner, noise_multiplier=1e-6, clipping="adaptive",
                           count_noise_std=1e-4)

    original = make()
    _rounds(original, (1, 2))
    state = copy.deepcopy(original.state_dict())
    assert original.clip_norm != 1.0  # C moved
    restored = make()
    restored.load_state_dict(state)
    assert restored.clip_norm == original.clip_norm
    assert restored.accountant.state_dict() == original.accountant.state_dict()
    assert restored.privacy_spent() == original.privacy_spent()
    # Round 3 goes the same way on both: same sample, same clip norm, same epsilon.
    a, b = _rounds(original, (3,), seed=13), _rounds(restored, (3,), seed=13)
    assert a.allclose(b, rtol=1e-5, atol=1e-5)
    assert restored.clip_norm == pytest.approx(original.clip_norm, rel=1e-4)  # count noise
    assert restored.privacy_spent() == original.privacy_spent()
    assert restored.accountant.num_rounds == 3


def test_the_noise_generator_is_not_in_the_state() -> None:
    a = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=3, fraction_fit=0.6, seed=1)),
                    seed=100,
                    noise_multiplier=1.0)
    b = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=3, fraction_fit=0.6, seed=1)),
                    seed=200,
                    noise_multiplier=1.0)
    wa, wb = _rounds(a, (1, 2)), _rounds(b, (1, 2))
    assert not wa.allclose(wb, rtol=0, atol=1e-3)  # different noise ...
    state = a.state_dict()
    assert json.dumps(state, sort_keys=True, default=str) == json.dumps(
        b.state_dict(), sort_keys=True, default=str)  # ... same state
    noise_state = a._rng.bit_generator.state["state"]
    values = {repr(v) for v in _walk(state)}
    assert repr(noise_state["state"]) not in values and repr(noise_state["inc"]) not in values


def test_a_state_without_privacy_is_refused() -> None:
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=2)))
    with pytest.raises(ConfigError) as info:
        strategy.load_state_dict(FedAvg(selection=SelectionConfig(min_fit_clients=2)).state_dict())
    assert info.value.setting == "privacy"


def test_a_state_of_other_accounting_terms_is_refused() -> None:
    source = dp_strategy(sampling="none")
    _rounds(source, (1,))
    target = dp_strategy(sampling="poisson")
    with pytest.raises(ConfigError):
        target.load_state_dict(copy.deepcopy(source.state_dict()))
