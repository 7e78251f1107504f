"""SecAggConfig: every refusal, with its reason, and the TOML table."""

from __future__ import annotations

from typing import Any

import pytest

from fedloom.config import from_mapping
from fedloom.errors import ConfigError, MessageRejectedError, SecureAggregationError
from fedloom.secagg import RoundId, RoundSetup, SecAggConfig, dropout_failure_bound


def test_defaults_are_valid_and_documented_values() -> None:
    config = SecAggConfig()
    assert (config.neighbours, config.threshold, config.bits, config.max_participants) == (
        10, 6, 22, 1024)
    assert config.bits + (config.max_participants - 1).bit_length() <= 32
    assert config.quantum == pytest.approx(16.0 / (2**22 - 1))


@pytest.mark.parametrize(
    ("changes", "setting", "reason"),
    [
        ({"neighbours": 9}, "neighbours", "even"),
        ({"neighbours": 0, "threshold": 1}, "neighbours", "even"),
        ({"threshold": 5}, "threshold", "exceed neighbours/2"),  # 5 = k/2 is not > k/2
        ({"threshold": 11}, "threshold", "cannot exceed neighbours"),
        ({"bits": 23}, "bits", "could wrap"),  # 23 + ceil(log2 1024) = 33
        ({"max_participants": 1025}, "bits", "could wrap"),  # 22 + 11 = 33
        ({"bits": 0}, "bits", "1..31"),
        ({"clip_range": 0.0}, "clip_range", "positive"),
        ({"clip_range": float("inf")}, "clip_range", "positive"),
        ({"max_weight": -1.0}, "max_weight", "positive"),
        ({"max_participants": 1}, "max_participants", "at least 2"),
        ({"neighbours": 10.0}, "neighbours", "integer"),
    ],
)
def test_refusals_name_the_setting_and_the_reason(changes: dict[str, Any], setting: str,
                                                  reason: str) -> None:
    with pytest.raises(ConfigError, match=reason) as info:
        SecAggConfig(**changes)
    assert info.value.setting == f"secure_aggregation.{setting}"


def test_boundaries_that_are_accepted() -> None:
    SecAggConfig(neighbours=10, threshold=10)  # t = k
    SecAggConfig(neighbours=2, threshold=2)
    SecAggConfig(bits=22, max_participants=1024)  # exactly 32
    SecAggConfig(bits=16, max_participants=65536)


def test_round_size_checks() -> None:
    config = SecAggConfig(max_participants=64, bits=20)
    config.check_round_size(64)
    config.check_round_size(7)  # t + 1
    with pytest.raises(ConfigError, match="exceeds max_participants"):
        config.check_round_size(65)
    with pytest.raises(ConfigError, match="at least 7"):
        config.check_round_size(6)


def test_weight_claims() -> None:
    config = SecAggConfig(max_weight=100.0)
    assert config.weight_of(100) == 1.0
    assert config.weight_of(25) == 0.25
    for bad in (101, 0, -3):
        with pytest.raises(SecureAggregationError):
            config.weight_of(bad)


def test_toml_table_builds_the_config() -> None:
    table = {"enabled": True, "neighbours": 8, "threshold": 5, "clip_range": 2,
             "bits": 20, "max_weight": 500, "max_participants": 256}
    config = from_mapping(SecAggConfig, table, where="secure_aggregation.")
    assert config.clip_range == 2.0 and isinstance(config.clip_range, float)
    with pytest.raises(ConfigError, match="did you mean 'threshold'"):
        from_mapping(SecAggConfig, {"treshold": 5}, where="secure_aggregation.")


def test_round_setup_refuses_bad_parameters_from_the_wire() -> None:
    good = RoundSetup.create(SecAggConfig(neighbours=4, threshold=3), RoundId("r", 1, 0),
                             [f"c{i}" for i in range(6)], 10)
    with pytest.raises(MessageRejectedError, match="exceed neighbours/2"):
        RoundSetup(good.round_id, good.participants, 4, 2, 8.0, 22, 10.0, 10, good.graph_seed)
    with pytest.raises(MessageRejectedError, match="sorted"):
        RoundSetup(good.round_id, tuple(reversed(good.participants)), 4, 3, 8.0, 22, 10.0,
                   10, good.graph_seed)
    with pytest.raises(MessageRejectedError, match="at least 4"):
        RoundSetup(good.round_id, good.participants[:3], 4, 3, 8.0, 22, 10.0, 10,
                   good.graph_seed)


def test_dropout_failure_bound() -> None:
    # 5 clients, 4 neighbours each, t = 3, 10% dropout: a client fails when >= 2 of its
    # 4 neighbours vanish: P = 1 - 0.9**4 - 4 * 0.1 * 0.9**3 = 0.0523; union over 5
    assert dropout_failure_bound(5, 4, 3, 0.1) == pytest.approx(5 * (1 - 0.9**4 - 0.4 * 0.9**3))
    # the degree is capped at n - 1 (a complete graph)
    assert dropout_failure_bound(5, 10, 3, 0.1) == dropout_failure_bound(5, 4, 3, 0.1)
    assert dropout_failure_bound(5, 10, 6, 0.1) == 1.0  # t above the degree
    assert dropout_failure_bound(100, 30, 16, 0.2) < dropout_failure_bound(100, 20, 11, 0.2)
    assert dropout_failure_bound(50, 10, 6, 0.0) == 0.0
