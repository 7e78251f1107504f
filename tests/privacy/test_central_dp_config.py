"""Privacy settings that cannot run are refused, naming the setting."""

from __future__ import annotations

from typing import Any

import pytest
from central_dp_support import central

from fedloom import ConfigError, ServerConfig
from fedloom.privacy import PrivacyConfig
from fedloom.secagg import SecAggConfig


@pytest.mark.parametrize(("settings", "setting"), [
    ({"mode": "on"}, "mode"),
    ({"clipping": "auto"}, "clipping"),
    ({"sampling": "uniform"}, "sampling"),
    ({"accountant": "moments"}, "accountant"),
    ({"noise_multiplier": 0.0}, "noise_multiplier"),
    ({"noise_multiplier": -1.0}, "noise_multiplier"),
    ({"noise_multiplier": float("nan")}, "noise_multiplier"),
    ({"noise_multiplier": float("inf")}, "noise_multiplier"),
    ({"clip_norm": 0.0}, "clip_norm"),
    ({"clip_norm": float("inf")}, "clip_norm"),
    ({"clip_learning_rate": 0.0}, "clip_learning_rate"),
    ({"target_quantile": 0.0}, "target_quantile"),
    ({"target_quantile": 1.0}, "target_quantile"),
    ({"count_noise_std": -0.1}, "count_noise_std"),
    ({"count_noise_std": float("nan")}, "count_noise_std"),
    ({"delta": 0.0}, "delta"),
    ({"delta": 1.0}, "delta"),
    ({"target_epsilon": -1.0}, "target_epsilon"),
    ({"target_epsilon": float("inf")}, "target_epsilon"),
    ({"target_epsilon": float("nan")}, "target_epsilon"),
    ({"expected_dropout": 1.0}, "expected_dropout"),
    ({"expected_dropout": -0.1}, "expected_dropout"),
    ({"accountant": "pld", "sampling": "fixed"}, "accountant"),
    ({"mode": "distributed", "clipping": "adaptive", "sampling": "none"}, "clipping"),
    ({"mode": "distributed", "sampling": "fixed"}, "sampling"),
    ({"mode": "distributed", "sampling": "poisson"}, "sampling"),
])
def test_privacy_config_refusals_name_the_setting(settings: dict[str, Any], setting: str) -> None:
    with pytest.raises(ConfigError) as info:
        PrivacyConfig(**settings)
    assert info.value.setting == f"privacy.{setting}"


def _server(tmp_path: Any, privacy: PrivacyConfig, **overrides: Any) -> ServerConfig:
    settings: dict[str, Any] = dict(insecure=True, min_clients=8, min_fit_clients=8,
                                    state_dir=str(tmp_path), progress=False, privacy=privacy)
    settings.update(overrides)
    return ServerConfig(**settings)


SECURE = SecAggConfig(enabled=True, allow_unauthenticated=True)


def test_server_config_refusals_name_the_setting(tmp_path: Any) -> None:
    with pytest.raises(ConfigError) as info:
        _server(tmp_path, central(), over_selection=1.3)
    assert info.value.setting == "over_selection" and "[privacy]" in info.value.problem
    distributed = PrivacyConfig(mode="distributed", sampling="none")
    with pytest.raises(ConfigError) as info:
        _server(tmp_path, distributed)
    assert info.value.setting == "privacy.mode" and "secure_aggregation" in info.value.problem
    with pytest.raises(ConfigError) as info:
        _server(tmp_path, central(), secure_aggregation=SECURE)
    assert info.value.setting == "privacy.mode"
    # What is allowed: each mode where it can run, and over-selection without privacy.
    _server(tmp_path, central())
    _server(tmp_path, distributed, secure_aggregation=SECURE)
    _server(tmp_path, PrivacyConfig(), over_selection=1.3)


def test_poisson_sampling_releases_every_round(server_config) -> None:  # type: ignore[no-untyped-def]
    """A round held back for too few updates, or drawn again, would make the released
    rounds likelier to hold a given client than the accountant counts: a retry is
    refused with any sampling (a round drawn again until it succeeds favours the clients
    that answer), a held-back round with "poisson"; "fixed" sampling keeps its
    min_fit_clients."""
    poisson = PrivacyConfig(mode="central", noise_multiplier=1.0, clip_norm=1.0,
                            sampling="poisson")
    with pytest.raises(ConfigError, match=r"min_fit_clients.*every round must be released"):
        server_config(privacy=poisson, min_fit_clients=3)
    server_config(privacy=poisson, min_fit_clients=1)  # accepted
    fixed = PrivacyConfig(mode="central", noise_multiplier=1.0, clip_norm=1.0,
                          sampling="fixed")
    for private in (poisson, fixed):
        with pytest.raises(ConfigError, match=r"round_retries.*must be 0 with \[privacy\]"):
            server_config(privacy=private, min_fit_clients=1, round_retries=2)
    server_config(privacy=fixed, min_fit_clients=3)  # accepted
