"""The ``[compression]`` settings: checked when the server starts, each refusal naming
the setting and the fix; nothing accepted by default; refused under SecAgg+."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedloom.cli import EXIT_REFUSED, build_parser, main, server_config_from_args
from fedloom.compression import CodecSpec
from fedloom.config import ClientConfig, CompressionConfig, ServerConfig, from_mapping
from fedloom.errors import ConfigError


def _server(**compression: object) -> ServerConfig:
    return from_mapping(ServerConfig, {"insecure": True, "compression": compression})


def test_nothing_is_accepted_by_default() -> None:
    config = ServerConfig(insecure=True).compression
    assert config == CompressionConfig()
    assert not config.enabled and config.upload_specs == () and config.download_specs == ()


def test_a_table_builds_the_server_fixed_codecs() -> None:
    config = _server(upload=["q8", "topk"], download=["fp16"], quantize_block=128,
                     topk_fraction=0.05).compression
    assert config.upload_specs == (CodecSpec("q8", block=128), CodecSpec("topk", fraction=0.05))
    assert config.download_specs == (CodecSpec("fp16"),)


@pytest.mark.parametrize(("table", "setting", "hint"), [
    ({"upload": ["q3"]}, "compression.upload", "unknown codec 'q3'"),
    ({"download": ["q8"]}, "compression.download", "list 'q8' under compression.upload"),
    ({"download": ["topk"]}, "compression.download", "updates only"),
    ({"upload": ["q8", "q8"]}, "compression.upload", "twice"),
    ({"upload": "q8"}, "compression.upload", "must be a list"),
    ({"quantize_block": 0}, "compression.quantize_block", "from 1 to"),
    ({"quantize_block": 1 << 21}, "compression.quantize_block", "from 1 to"),
    ({"topk_fraction": 0.0}, "compression.topk_fraction", "(0, 1]"),
    ({"topk_fraction": 1.5}, "compression.topk_fraction", "(0, 1]"),
    ({"topk_fraction": float("nan")}, "compression.topk_fraction", "(0, 1]"),
    ({"uplaod": ["q8"]}, "compression.uplaod", "did you mean 'upload'"),
])
def test_bad_settings_are_refused_naming_the_fix(table: dict[str, object], setting: str,
                                                  hint: str) -> None:
    with pytest.raises(ConfigError) as info:
        _server(**table)
    assert info.value.setting == setting
    assert hint in str(info.value)


def _secure(**compression: object) -> ServerConfig:
    return from_mapping(ServerConfig, {
        "insecure": True, "min_clients": 8, "min_fit_clients": 8, "compression": compression,
        "secure_aggregation": {"enabled": True, "allow_unauthenticated": True}})


def test_secure_aggregation_runs_without_compression() -> None:
    assert _secure().secure_aggregation.enabled


@pytest.mark.parametrize("codec", ["q8", "q4", "topk", "fp16", "bf16"])
def test_any_upload_codec_is_refused_under_secure_aggregation(codec: str) -> None:
    with pytest.raises(ConfigError) as info:
        _secure(upload=[codec])
    assert info.value.setting == "compression.upload"
    assert "secure_aggregation.bits" in str(info.value)  # SecAgg+ quantizes already
    assert "commute" in str(info.value)


def test_a_download_codec_is_refused_under_secure_aggregation() -> None:
    with pytest.raises(ConfigError) as info:
        _secure(download=["fp16"])
    assert info.value.setting == "compression.download"
    assert "model_digest" in str(info.value)


def test_the_server_command_refuses_secure_aggregation_with_a_codec(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "server.toml"
    path.write_text("insecure = true\nmin_clients = 8\nmin_fit_clients = 8\n"
                    "[secure_aggregation]\nenabled = true\nallow_unauthenticated = true\n")
    status = main(["server", "--config", str(path), "--compression-upload", "q8",
                   "--state-dir", str(tmp_path / "state")])
    assert status == EXIT_REFUSED
    assert "compression.upload" in capsys.readouterr().err


def test_flags_fill_the_table_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "server.toml"
    path.write_text('insecure = true\n[compression]\nupload = ["topk"]\ntopk_fraction = 0.1\n')
    args = build_parser().parse_args([
        "server", "--config", str(path), "--compression-upload", "q4, q8",
        "--compression-download", "bf16", "--compression-quantize-block", "64"])
    config = server_config_from_args(args).compression
    assert config.upload == ("q4", "q8") and config.download == ("bf16",)
    assert config.quantize_block == 64 and config.topk_fraction == 0.1
    args = build_parser().parse_args(["server", "--config", str(path),
                                      "--compression-upload", ""])
    assert server_config_from_args(args).compression.upload == ()


def test_client_settings_are_checked_and_the_command_sets_them() -> None:
    config = ClientConfig("h:1", insecure=True, upload_codecs=["topk", "q8"],  # type: ignore[arg-type]
                          download_codecs=("bf16",), state_dir="client-state")
    assert config.upload_codecs == ("topk", "q8")
    with pytest.raises(ConfigError, match="download_codecs"):
        ClientConfig("h:1", insecure=True, download_codecs=("q8",))
    with pytest.raises(ConfigError, match="upload_codecs"):
        ClientConfig("h:1", insecure=True, upload_codecs=("gzip",))
    args = build_parser().parse_args([
        "client", "--server", "h:1", "--app", "x:y", "--insecure", "--upload-codecs", "q8",
        "--download-codecs", "fp16", "--state-dir", "s"])
    assert (args.upload_codecs, args.download_codecs, args.state_dir) == (["q8"], ["fp16"], "s")
