"""``[secure_aggregation]`` in the server's configuration: TOML, flags, every refusal
with its reason, and the strategies that compose (or are refused).

These servers talk plaintext, so secure aggregation needs ``allow_unauthenticated``
(`_config` sets it unless told otherwise); the refusal without it is tested too."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import small_weights

from fedloom.cli import build_parser, server_config_from_args
from fedloom.config import ServerConfig, StrategyConfig, from_mapping
from fedloom.errors import ConfigError
from fedloom.secagg import SecAggConfig
from fedloom.server import Server

BASE: dict[str, Any] = {"insecure": True, "min_clients": 8, "min_fit_clients": 8}


def _config(secure: dict[str, Any], **top: Any) -> ServerConfig:
    table = {"allow_unauthenticated": True, **secure}
    return from_mapping(ServerConfig, {**BASE, **top, "secure_aggregation": table})


def test_the_toml_table_builds_a_validated_secagg_config() -> None:
    config = _config({"enabled": True, "neighbours": 6, "threshold": 4, "clip_range": 2,
                      "bits": 20, "max_weight": 500, "max_participants": 100,
                      "stage_timeout_s": 15})
    assert config.secure_aggregation == SecAggConfig(
        enabled=True, neighbours=6, threshold=4, clip_range=2.0, bits=20, max_weight=500.0,
        max_participants=100, stage_timeout_s=15.0, allow_unauthenticated=True)
    assert ServerConfig(insecure=True).secure_aggregation.enabled is False  # off by default


def test_flags_fill_the_table() -> None:
    args = build_parser().parse_args([
        "server", "--insecure", "--min-clients", "5", "--min-fit-clients", "5",
        "--secure-aggregation", "true", "--secagg-neighbours", "4", "--secagg-threshold", "3",
        "--secagg-clip-range", "1.5", "--secagg-stage-timeout-s", "9",
        "--secagg-allow-unauthenticated", "true", "--secagg-min-survivors", "5",
        "--secagg-max-attempts", "2", "--secagg-colluding-clients", "0"])
    config = server_config_from_args(args).secure_aggregation
    assert (config.enabled, config.neighbours, config.threshold) == (True, 4, 3)
    assert (config.clip_range, config.stage_timeout_s) == (1.5, 9.0)
    assert (config.allow_unauthenticated, config.min_survivors, config.max_attempts,
            config.colluding_clients) == (True, 5, 2, 0)


@pytest.mark.parametrize(
    ("secure", "top", "setting", "reason"),
    [
        ({"threshold": 5}, {}, "secure_aggregation.threshold", "not the client itself"),
        ({"threshold": 11}, {}, "secure_aggregation.threshold", "cannot exceed neighbours"),
        ({"neighbours": 7, "threshold": 5}, {}, "secure_aggregation.neighbours", "even"),
        ({"bits": 24}, {}, "secure_aggregation.bits", "could wrap"),  # 24 + 10 > 32
        ({"max_participants": 2048}, {}, "secure_aggregation.bits", "could wrap"),
        ({"stage_timeout_s": 0}, {}, "secure_aggregation.stage_timeout_s", "positive"),
        ({"enabld": True}, {}, "secure_aggregation.enabld", "did you mean 'enabled'"),
        ({}, {"min_clients": 6, "min_fit_clients": 6}, "min_fit_clients",
         r"max\(threshold \+ 1, min_survivors\) = 7"),
        ({"min_survivors": 9}, {}, "min_fit_clients", r"min_survivors\) = 9"),
        ({"min_survivors": 3}, {}, "secure_aggregation.min_survivors", "threshold \\+ 1 = 7"),
        ({"colluding_clients": 2}, {}, "secure_aggregation.colluding_clients",
         "2t - k - 1 = 1"),
        ({"max_attempts": 0}, {}, "secure_aggregation.max_attempts", "1..16"),
        ({"allow_unauthenticated": False}, {}, "secure_aggregation.allow_unauthenticated",
         "honest-but-curious"),
        ({"max_participants": 6, "bits": 20}, {}, "secure_aggregation.max_participants",
         "below min_fit_clients"),
        ({}, {"over_selection": 1.3}, "over_selection", "set over_selection = 1"),
    ],
)
def test_refusals_name_the_setting_and_say_why(secure: dict[str, Any], top: dict[str, Any],
                                               setting: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason) as info:
        _config({"enabled": True, **secure}, **top)
    assert info.value.setting == setting


def test_the_round_size_rules_are_only_checked_when_enabled() -> None:
    _config({"enabled": False}, min_clients=2, min_fit_clients=2)
    _config({"enabled": False}, over_selection=1.3)


def test_a_server_with_mutual_tls_runs_authenticated_secure_rounds(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import concurrent.futures

    from fedloom.certs import write_certificates
    from fedloom.config import AuthConfig, TLSConfig
    from fedloom.server.driver import RoundParts
    from fedloom.server.fleet import Fleet
    from fedloom.server.progress import RoundReporter
    from fedloom.server.secure import SecureRounds
    from fedloom.server.tasks import TaskBook

    write_certificates(tmp_path, clients=("a",))
    tls = TLSConfig(cert=str(tmp_path / "server.pem"), key=str(tmp_path / "server.key"),
                    client_ca=str(tmp_path / "ca.pem"))
    config = ServerConfig(min_clients=8, min_fit_clients=8, tls=tls, state_dir=str(tmp_path),
                          progress=False, secure_aggregation=SecAggConfig(enabled=True))
    assert config.mutual_tls
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fleet = Fleet(config, "run")
        parts = RoundParts(config, "run", None, fleet, TaskBook(fleet.wake), None,  # type: ignore[arg-type]
                           pool, tmp_path, RoundReporter(enabled=False))
        rounds = SecureRounds(parts)
        rounds.close()
    assert rounds.authenticated
    # TLS without client certificates (tokens, anonymous) is not a client PKI
    with pytest.raises(ConfigError, match="allow_unauthenticated"):
        ServerConfig(min_clients=8, min_fit_clients=8, state_dir=str(tmp_path),
                     tls=TLSConfig(cert=tls.cert, key=tls.key), auth=AuthConfig(anonymous=True),
                     secure_aggregation=SecAggConfig(enabled=True))


@pytest.mark.parametrize(("attempts", "warned"), [(5, True), (3, False)])
def test_more_attempts_than_clients_take_part_in_is_warned_at_start(
        tmp_path, caplog: pytest.LogCaptureFixture, attempts: int, warned: bool) -> None:  # type: ignore[no-untyped-def]
    import concurrent.futures
    import logging

    from fedloom.server.driver import RoundParts
    from fedloom.server.fleet import Fleet
    from fedloom.server.progress import RoundReporter
    from fedloom.server.secure import SecureRounds
    from fedloom.server.tasks import TaskBook

    config = _config({"enabled": True, "max_attempts": attempts}, state_dir=str(tmp_path),
                     progress=False)
    with caplog.at_level(logging.WARNING, logger="fedloom.server"), \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        fleet = Fleet(config, "run")
        parts = RoundParts(config, "run", None, fleet, TaskBook(fleet.wake), None,  # type: ignore[arg-type]
                           pool, tmp_path, RoundReporter(enabled=False))
        SecureRounds(parts).close()
    said = [r.getMessage() for r in caplog.records if "SDK clients take part" in r.getMessage()]
    assert bool(said) is warned
    if warned:
        assert "--secagg-max-attempts 5" in said[0]


def _server(tmp_path, strategy: StrategyConfig) -> Server:  # type: ignore[no-untyped-def]
    config = ServerConfig(insecure=True, min_clients=8, min_fit_clients=8,
                          state_dir=str(tmp_path), progress=False, strategy=strategy,
                          secure_aggregation=SecAggConfig(enabled=True,
                                                          allow_unauthenticated=True))
    return Server(config, initial_weights=small_weights())


@pytest.mark.parametrize("name", ["fedmedian", "fedtrimmedavg", "krum", "multikrum", "bulyan"])
def test_robust_strategies_are_refused_with_the_reason(tmp_path, name: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="only ever holds the sum") as info:
        _server(tmp_path, StrategyConfig(name))
    assert info.value.setting == "strategy.name"
    assert "fedavg, fedavgm, fedprox, fedadagrad, fedadam or fedyogi" in str(info.value)


@pytest.mark.parametrize("name", ["fedavg", "fedavgm", "fedprox", "fedadagrad", "fedadam",
                                  "fedyogi"])
def test_mean_strategies_compose(tmp_path, name: str) -> None:  # type: ignore[no-untyped-def]
    _server(tmp_path, StrategyConfig(name))


def test_a_norm_bound_must_clip_not_reject(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _server(tmp_path, StrategyConfig("fedavg", {"max_update_norm": 1.0}))
    with pytest.raises(ConfigError, match="never sees one") as info:
        _server(tmp_path, StrategyConfig("fedavg", {"max_update_norm": 1.0,
                                                    "norm_bound_mode": "reject"}))
    assert info.value.setting == "strategy.norm_bound_mode"
