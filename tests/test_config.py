"""Configuration validation: bad settings are refused with the setting named."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fedloom import ConfigError, ServerConfig, StrategyConfig
from fedloom.cli import build_parser, server_config_from_args
from fedloom.config import (
    ClientConfig,
    MetricsConfig,
    SelectionConfig,
    TransferConfig,
    from_mapping,
)
from fedloom.server.app import Server, grpc_server_options
from fedloom.settings import field_help
from fedloom.strategies import build_strategy
from fedloom.weights import Weights


@pytest.mark.parametrize(
    ("overrides", "setting"),
    [
        ({"address": "nonsense"}, "address"),
        ({"num_rounds": 0}, "num_rounds"),
        ({"fraction_fit": 0.0}, "fraction_fit"),
        ({"fraction_fit": 1.5}, "fraction_fit"),
        ({"min_fit_clients": 5, "min_clients": 2}, "min_fit_clients"),
        ({"round_timeout_s": -1.0}, "round_timeout_s"),
        ({"client_timeout_s": 1.0, "heartbeat_interval_s": 2.0}, "client_timeout_s"),
        ({"chunk_timeout_s": 0.0}, "chunk_timeout_s"),
        ({"transfer": {"stream_window_bytes": 1000}}, "stream_window_bytes"),
        ({"transfer": {"stream_window_bytes": 2**31}}, "stream_window_bytes"),
        ({"metrics": {"per_client": 1}}, "metrics.per_client"),
        ({"metrics": {"per_client": "no"}}, "metrics.per_client"),
        ({"metrics": {"per_clients": False}}, "metrics.per_clients"),
        ({"metrics": True}, "metrics"),
    ],
)
def test_bad_server_settings_name_the_setting(overrides, setting) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping(ServerConfig, overrides)
    assert info.value.setting == setting


def test_stream_window_reaches_the_grpc_server_only_when_set() -> None:
    default = dict(grpc_server_options(ServerConfig(insecure=True)))
    assert "grpc.http2.lookahead_bytes" not in default  # gRPC's own window
    config = from_mapping(
        ServerConfig, {"insecure": True, "transfer": {"stream_window_bytes": 4 << 20}}
    )
    assert dict(grpc_server_options(config))["grpc.http2.lookahead_bytes"] == 4 << 20
    args = build_parser().parse_args(
        ["server", "--insecure", "--stream-window-bytes", "2097152"]
    )
    assert server_config_from_args(args).transfer.stream_window_bytes == 2 << 20


def test_unknown_key_suggests_the_right_one() -> None:
    with pytest.raises(ConfigError, match="did you mean 'num_rounds'"):
        from_mapping(ServerConfig, {"num_round": 3})


def test_wrong_type_is_refused() -> None:
    with pytest.raises(ConfigError, match="must be an integer"):
        from_mapping(ServerConfig, {"num_rounds": "three"})


def test_unknown_strategy_and_setting() -> None:
    with pytest.raises(ConfigError, match="unknown strategy"):
        build_strategy(StrategyConfig("fedavgg"))
    with pytest.raises(ConfigError, match="no such setting"):
        build_strategy(StrategyConfig("fedavg", {"eta": 0.1}))
    with pytest.raises(ConfigError, match="top-level server setting"):
        build_strategy(StrategyConfig("fedavg", {"fraction_fit": 0.5}))


def test_toml_then_flags(tmp_path) -> None:
    path = tmp_path / "server.toml"
    path.write_text(
        "num_rounds = 7\nmin_clients = 4\n[transfer]\nchunk_size = 65536\n"
        'max_message_bytes = 200000\n[strategy]\nname = "fedavg"\n'
    )
    args = build_parser().parse_args(
        ["server", "--config", str(path), "--num-rounds", "9", "--insecure"]
    )
    config = server_config_from_args(args)
    assert config.num_rounds == 9 and config.min_clients == 4
    assert config.transfer.chunk_size == 65536
    assert config.strategy.name == "fedavg"


def test_missing_config_file_is_a_clear_error(tmp_path) -> None:
    args = build_parser().parse_args(["server", "--config", str(tmp_path / "nope.toml")])
    with pytest.raises(ConfigError, match="not found"):
        server_config_from_args(args)


def test_selection_is_built_from_the_server_settings_and_validated_once() -> None:
    config = from_mapping(ServerConfig, {"insecure": True, "min_clients": 4, "fraction_fit": 0.5,
                                         "min_fit_clients": 3, "fraction_evaluate": 0.0,
                                         "seed": 9})
    assert config.selection == SelectionConfig(fraction_fit=0.5, min_fit_clients=3,
                                               fraction_evaluate=0.0, seed=9)
    strategy = Server(config).strategy
    assert strategy.selection == config.selection  # type: ignore[attr-defined]
    with pytest.raises(ConfigError) as info:
        SelectionConfig(min_evaluate_clients=-1)
    assert info.value.setting == "min_evaluate_clients"


def test_server_selection_fields_share_the_selection_defaults_and_help() -> None:
    server = {f.name: f for f in dataclasses.fields(ServerConfig)}
    for field in dataclasses.fields(SelectionConfig):
        assert server[field.name].default == field.default
        assert field_help(server[field.name]) == field_help(field) != ""


@pytest.mark.parametrize("cls", [ServerConfig, TransferConfig, ClientConfig, SelectionConfig,
                                 MetricsConfig])
def test_every_scalar_setting_has_help_the_cli_prints(cls, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["server", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for field in dataclasses.fields(cls):
        if field.default_factory is not dataclasses.MISSING:
            continue  # a table of its own
        assert field_help(field), (cls.__name__, field.name)
        if cls is not ClientConfig and field.name != "insecure":
            assert " ".join(field_help(field).split()) in help_text, field.name


def test_client_config_has_no_long_poll_setting() -> None:
    # The server's long_poll_s, told to clients at Join, is the only long-poll hold.
    assert "long_poll_s" not in {f.name for f in dataclasses.fields(ClientConfig)}
    with pytest.raises(TypeError):
        ClientConfig(server_address="h:1", insecure=True, long_poll_s=2.0)  # type: ignore[call-arg]


def test_the_metrics_table_from_toml_and_flags(tmp_path) -> None:
    assert ServerConfig(insecure=True).metrics.per_client  # on by default
    path = tmp_path / "server.toml"
    path.write_text("[metrics]\nper_client = false\n")
    args = build_parser().parse_args(["server", "--config", str(path), "--insecure"])
    assert server_config_from_args(args).metrics == MetricsConfig(per_client=False)
    for flags, expected in ((["--metrics-per-client"], True),
                            (["--metrics-per-client", "false"], False)):
        args = build_parser().parse_args(["server", "--config", str(path), "--insecure",
                                          *flags])
        assert server_config_from_args(args).metrics.per_client is expected
    with pytest.raises(ConfigError, match="did you mean 'per_client'") as info:
        from_mapping(ServerConfig, {"metrics": {"per_clients": False}})
    assert info.value.setting == "metrics.per_clients"
    with pytest.raises(ConfigError, match="must be true or false, got 'yes'") as info:
        MetricsConfig(per_client="yes")  # type: ignore[arg-type]
    assert info.value.setting == "metrics.per_client"


def test_a_model_with_a_boolean_tensor_is_refused_when_the_server_is_made() -> None:
    # Every client's fit would fail on it (a delta of booleans has no meaning), round
    # after round; the server says so at start, naming the tensor.
    weights = Weights({"w": np.zeros(4, np.float32), "mask": np.ones(3, np.bool_)})
    with pytest.raises(ConfigError, match="tensor 'mask' is boolean") as info:
        Server(ServerConfig(insecure=True), initial_weights=weights)
    assert info.value.setting == "initial_weights"
    Server(ServerConfig(insecure=True),  # an integer mask goes
           initial_weights=Weights({"w": np.zeros(4, np.float32),
                                    "mask": np.ones(3, np.int8)}))
