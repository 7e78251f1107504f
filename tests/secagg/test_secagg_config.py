"""SecAggConfig: every refusal, with its reason, and the TOML table."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import pytest

from fedloom.config import from_mapping
from fedloom.errors import ConfigError, MessageRejectedError, SecureAggregationError
from fedloom.secagg import RoundId, RoundSetup, SecAggConfig, dropout_failure_bound

DIGEST = hashlib.sha256(b"test").digest()


def test_defaults_are_valid_and_documented_values() -> None:
    config = SecAggConfig()
    assert (config.neighbours, config.threshold, config.bits, config.max_participants) == (
        10, 6, 22, 1024)
    assert (config.min_survivors, config.colluding_clients, config.max_attempts,
            config.allow_unauthenticated) == (0, 1, 3, False)
    assert config.survivor_floor == 7  # min_survivors 0 means threshold + 1
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
        # c <= 2t - k - 1: k = 10, t = 6 protects against one colluder
        ({"colluding_clients": 2}, "colluding_clients", r"2t - k - 1 = 1\b"),
        ({"colluding_clients": -1}, "colluding_clients", "at most 2t - k - 1"),
        ({"threshold": 8, "colluding_clients": 6}, "colluding_clients", "= 5"),
        ({"colluding_clients": 1.0}, "colluding_clients", "integer"),
        ({"min_survivors": 6}, "min_survivors", r"between threshold \+ 1 = 7"),
        ({"min_survivors": 1025}, "min_survivors", "max_participants = 1024"),
        ({"min_survivors": True}, "min_survivors", "integer"),
        ({"max_attempts": 0}, "max_attempts", "1..16"),
        ({"max_attempts": 17}, "max_attempts", "1..16"),
        ({"allow_unauthenticated": 1}, "allow_unauthenticated", "true or false"),
        ({"enabled": "yes"}, "enabled", "true or false"),
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
    SecAggConfig(colluding_clients=0)
    SecAggConfig(neighbours=10, threshold=8, colluding_clients=5)  # 2t - k - 1 = 5
    SecAggConfig(neighbours=10, threshold=10, colluding_clients=9)
    SecAggConfig(min_survivors=7)  # t + 1
    SecAggConfig(min_survivors=1024)  # max_participants
    SecAggConfig(max_attempts=1)
    SecAggConfig(max_attempts=16)


def test_the_colluder_refusal_says_which_threshold_would_do() -> None:
    # c = 3 colluders with k = 10 need 2t - 10 - 1 >= 3, so t >= 7: (10 + 3) // 2 + 1
    with pytest.raises(ConfigError, match="raise threshold to 7"):
        SecAggConfig(colluding_clients=3)
    SecAggConfig(threshold=7, colluding_clients=3)


@pytest.mark.parametrize(("min_survivors", "floor"), [(0, 7), (7, 7), (8, 8), (40, 40)])
def test_survivor_floor_is_the_larger_of_t_plus_1_and_min_survivors(min_survivors: int,
                                                                     floor: int) -> None:
    assert SecAggConfig(min_survivors=min_survivors).survivor_floor == floor


def test_check_server_needs_a_pki_unless_unauthenticated_rounds_are_allowed() -> None:
    config = SecAggConfig(enabled=True)
    config.check_server(10)  # authenticated (mutual TLS) by default
    with pytest.raises(ConfigError, match=r"tls\.client_ca") as info:
        config.check_server(10, authenticated=False)
    assert info.value.setting == "secure_aggregation.allow_unauthenticated"
    SecAggConfig(enabled=True, allow_unauthenticated=True).check_server(10, authenticated=False)
    SecAggConfig(enabled=False).check_server(1, authenticated=False)  # not a secure server


def test_check_server_needs_min_fit_clients_at_the_survivor_floor() -> None:
    config = SecAggConfig(enabled=True, min_survivors=20)
    with pytest.raises(ConfigError, match="= 20 clients") as info:
        config.check_server(19)
    assert info.value.setting == "min_fit_clients"
    config.check_server(20)
    with pytest.raises(ConfigError, match=r"max\(threshold \+ 1, min_survivors\) = 7"):
        SecAggConfig(enabled=True).check_server(6)
    with pytest.raises(ConfigError, match="over-selection"):
        SecAggConfig(enabled=True).check_server(10, over_selection=1.5)
    with pytest.raises(ConfigError, match="below min_fit_clients"):
        SecAggConfig(enabled=True, max_participants=16, bits=20).check_server(17)


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
             "bits": 20, "max_weight": 500, "max_participants": 256, "min_survivors": 12,
             "colluding_clients": 0, "max_attempts": 2, "allow_unauthenticated": True}
    config = from_mapping(SecAggConfig, table, where="secure_aggregation.")
    assert config.clip_range == 2.0 and isinstance(config.clip_range, float)
    assert (config.min_survivors, config.colluding_clients, config.max_attempts,
            config.allow_unauthenticated) == (12, 0, 2, True)
    with pytest.raises(ConfigError, match="did you mean 'threshold'"):
        from_mapping(SecAggConfig, {"treshold": 5}, where="secure_aggregation.")


def test_round_setup_refuses_bad_parameters_from_the_wire() -> None:
    good = RoundSetup.create(SecAggConfig(neighbours=4, threshold=3), RoundId("r", 1, 0),
                             [f"c{i}" for i in range(6)], 10, model_digest=DIGEST,
                             config_digest=DIGEST)
    assert good.min_survivors == 4  # t + 1
    with pytest.raises(MessageRejectedError, match="exceed neighbours/2"):
        dataclasses.replace(good, threshold=2)
    with pytest.raises(MessageRejectedError, match="sorted"):
        dataclasses.replace(good, participants=tuple(reversed(good.participants)))
    with pytest.raises(MessageRejectedError, match="at least 4"):
        dataclasses.replace(good, participants=good.participants[:3],
                            identities=good.identities[:3])
    with pytest.raises(MessageRejectedError, match="every participant"):
        dataclasses.replace(good, identities=good.identities[:5])
    with pytest.raises(MessageRejectedError, match=r"min_survivors \(3\) must be between"):
        dataclasses.replace(good, min_survivors=3)
    with pytest.raises(MessageRejectedError, match="number of participants"):
        dataclasses.replace(good, min_survivors=7)
    with pytest.raises(MessageRejectedError, match="model_digest must be 32 bytes"):
        dataclasses.replace(good, model_digest=DIGEST[:31])
    with pytest.raises(MessageRejectedError, match="config_digest must be 32 bytes"):
        dataclasses.replace(good, config_digest=b"")
    with pytest.raises(MessageRejectedError, match="authenticated must be a bool"):
        dataclasses.replace(good, authenticated=1)
    # an authenticated round seats each certificate's identity once
    twice = tuple("same" if i < 2 else name for i, name in enumerate(good.identities))
    assert dataclasses.replace(good, identities=twice).identities == twice
    with pytest.raises(MessageRejectedError, match="every identity once"):
        dataclasses.replace(good, identities=twice, authenticated=True)


def test_round_setup_create_applies_the_survivor_floor() -> None:
    config = SecAggConfig(neighbours=4, threshold=3, min_survivors=8)
    ids = [f"c{i}" for i in range(8)]
    setup = RoundSetup.create(config, RoundId("r", 1, 0), ids, 10, model_digest=DIGEST,
                              config_digest=DIGEST, identities={"c3": "site-3"},
                              authenticated=True)
    assert setup.min_survivors == 8 and setup.authenticated
    assert setup.identity_of("c3") == "site-3" and setup.identity_of("c4") == "c4"
    with pytest.raises(ConfigError, match="survivor floor of 8") as info:
        RoundSetup.create(config, RoundId("r", 1, 0), ids[:7], 10, model_digest=DIGEST,
                          config_digest=DIGEST)
    assert info.value.setting == "secure_aggregation.min_survivors"


def test_dropout_failure_bound() -> None:
    # 5 clients, 4 neighbours each, t = 3, 10% dropout: a client fails when >= 2 of its
    # 4 neighbours vanish: P = 1 - 0.9**4 - 4 * 0.1 * 0.9**3 = 0.0523; union over 5
    assert dropout_failure_bound(5, 4, 3, 0.1) == pytest.approx(5 * (1 - 0.9**4 - 0.4 * 0.9**3))
    # the degree is capped at n - 1 (a complete graph)
    assert dropout_failure_bound(5, 10, 3, 0.1) == dropout_failure_bound(5, 4, 3, 0.1)
    assert dropout_failure_bound(5, 10, 6, 0.1) == 1.0  # t above the degree
    assert dropout_failure_bound(100, 30, 16, 0.2) < dropout_failure_bound(100, 20, 11, 0.2)
    assert dropout_failure_bound(50, 10, 6, 0.0) == 0.0
