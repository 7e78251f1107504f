"""``[rounds]``: its settings, what async mode cannot be combined with, and the
staleness weightings against their formulas."""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from fedloom import Weights
from fedloom.cli import build_parser, server_config_from_args
from fedloom.config import RoundsConfig, ServerConfig
from fedloom.errors import ConfigError
from fedloom.privacy import PrivacyConfig
from fedloom.secagg import SecAggConfig
from fedloom.strategies import StalenessWeighting, scale_delta

ASYNC = RoundsConfig(mode="async")


def _server(**overrides: object) -> ServerConfig:
    return ServerConfig(insecure=True, min_clients=4, min_fit_clients=4, **overrides)  # type: ignore[arg-type]


@pytest.mark.parametrize(("setting", "value", "expected"), [
    ("mode", "fast", "rounds.mode"),
    ("concurrency", 0, "rounds.concurrency"),
    ("buffer_size", 0, "rounds.buffer_size"),
    ("max_staleness", -1, "rounds.max_staleness"),
    ("staleness_weighting", "linear", "rounds.staleness_weighting"),
    ("staleness_exponent", -0.5, "rounds.staleness_exponent"),
    ("staleness_exponent", math.nan, "rounds.staleness_exponent"),
    ("hinge_slope", -1.0, "rounds.hinge_slope"),
    ("hinge_after", -1, "rounds.hinge_after"),
    ("total_updates", -1, "rounds.total_updates"),
    ("evaluate_every", 0, "rounds.evaluate_every"),
])
def test_bad_settings_name_themselves(setting: str, value: object, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        RoundsConfig(**{setting: value})  # type: ignore[arg-type]
    assert info.value.setting == expected


def test_async_refuses_secure_aggregation_and_says_why() -> None:
    secure = SecAggConfig(enabled=True, neighbours=6, threshold=4, allow_unauthenticated=True)
    ServerConfig(insecure=True, min_clients=8, min_fit_clients=8, secure_aggregation=secure)
    with pytest.raises(ConfigError) as info:
        ServerConfig(insecure=True, min_clients=8, min_fit_clients=8, rounds=ASYNC,
                     secure_aggregation=secure)
    assert info.value.setting == "rounds.mode"
    assert "fixed cohort" in str(info.value)


def test_async_refuses_differential_privacy_and_over_selection() -> None:
    with pytest.raises(ConfigError, match="accountant assumes rounds"):
        _server(rounds=ASYNC, privacy=PrivacyConfig(mode="central"))
    with pytest.raises(ConfigError) as info:
        _server(rounds=ASYNC, over_selection=1.3)
    assert info.value.setting == "over_selection"


def test_last_round_counts_steps_of_buffer_size() -> None:
    assert RoundsConfig(mode="async", buffer_size=10, total_updates=95).last_round(100) == 10
    assert RoundsConfig(mode="async", buffer_size=10, total_updates=95).last_round(4) == 4
    assert RoundsConfig(mode="async", buffer_size=10).last_round(7) == 7
    assert RoundsConfig(buffer_size=10, total_updates=95).last_round(100) == 100  # sync


def test_evaluates_every_n_and_the_last() -> None:
    rounds = RoundsConfig(evaluate_every=3)
    assert [r for r in range(1, 11) if rounds.evaluates(r, 10)] == [3, 6, 9, 10]


def test_the_server_command_reads_rounds_flags_and_table(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text('insecure = true\n[rounds]\nmode = "async"\nbuffer_size = 7\n')
    parser: argparse.ArgumentParser = build_parser()
    args = parser.parse_args(["server", "--config", str(config), "--rounds-concurrency", "30",
                              "--rounds-staleness-weighting", "hinge"])
    rounds = server_config_from_args(args).rounds
    assert (rounds.mode, rounds.buffer_size, rounds.concurrency,
            rounds.staleness_weighting) == ("async", 7, 30, "hinge")


@pytest.mark.parametrize("staleness", range(0, 12))
def test_weightings_follow_their_formulas(staleness: int) -> None:
    assert StalenessWeighting("constant")(staleness) == 1.0
    assert StalenessWeighting("polynomial", exponent=0.5)(staleness) == pytest.approx(
        1.0 / math.sqrt(1.0 + staleness))
    assert StalenessWeighting("polynomial", exponent=2.0)(staleness) == pytest.approx(
        1.0 / (1.0 + staleness) ** 2)
    hinge = StalenessWeighting("hinge", slope=10.0, after=4)(staleness)
    assert hinge == (1.0 if staleness <= 4 else pytest.approx(1.0 / (10.0 * (staleness - 4)
                                                                      + 1.0)))


def test_weightings_never_grow_with_staleness() -> None:
    for kind in ("constant", "polynomial", "hinge"):
        weights = [StalenessWeighting(kind)(s) for s in range(50)]
        assert all(a >= b for a, b in itertools.pairwise(weights)), kind
        assert all(0.0 < w <= 1.0 for w in weights), kind


def test_a_negative_staleness_is_an_error() -> None:
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        StalenessWeighting()(-1)


def test_scaling_touches_float_tensors_only() -> None:
    delta = Weights({"w": np.array([1.0, -2.0], np.float32), "steps": np.array(3, np.int64)})
    scaled = scale_delta(delta, 0.5)
    np.testing.assert_array_equal(scaled["w"], np.array([0.5, -1.0], np.float32))
    assert scaled["w"].dtype == np.float32 and scaled["steps"] == 3
    assert scale_delta(delta, 1.0) is delta
