"""A relative path in a server configuration file is relative to the file's folder, so
the file means the same from any working directory; flags stay relative to the working
directory, and absolute paths are kept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from security_support import make_pki

from fedloom import ServerConfig
from fedloom._config_files import FILE_SETTINGS
from fedloom.cli import build_parser, server_config_from_args
from fedloom.config import load_toml
from fedloom.errors import ConfigError
from fedloom.server.tls import server_credentials

SERVER_TOML = """\
state_dir = "state"

[tls]
cert = "pki/server.pem"
key = "pki/server.key"
client_ca = "pki/ca.pem"

[auth]
tokens_file = "tokens.toml"
"""


def _config(*argv: str) -> ServerConfig:
    return server_config_from_args(build_parser().parse_args(["server", *argv]))


@pytest.fixture
def layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """conf/server.toml beside conf/pki; the working directory is elsewhere/."""
    conf = tmp_path / "conf"
    make_pki(conf / "pki", clients=())
    (conf / "server.toml").write_text(SERVER_TOML)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    return conf


def test_paths_in_the_file_are_relative_to_the_file(layout: Path) -> None:
    for written in (str(layout / "server.toml"), os.path.join("..", "conf", "server.toml")):
        config = _config("--config", written)
        assert config.tls.cert == str(layout / "pki" / "server.pem")
        assert config.tls.key == str(layout / "pki" / "server.key")
        assert config.tls.client_ca == str(layout / "pki" / "ca.pem")
        assert config.auth.tokens_file == str(layout / "tokens.toml")
        assert config.state_dir == str(layout / "state")
    assert set(FILE_SETTINGS) == {"state_dir", "tls.cert", "tls.key", "tls.client_ca",
                                  "auth.tokens_file"}  # each checked above
    # ... and the server reads its certificate from there, not from elsewhere/pki.
    assert server_credentials(config) is not None


def test_flags_absolute_and_empty_paths_are_kept(layout: Path, tmp_path: Path) -> None:
    config = _config("--config", str(layout / "server.toml"), "--tls-cert", "mine/server.pem",
                     "--state-dir", "here")
    assert config.tls.cert == "mine/server.pem" and config.state_dir == "here"
    assert config.tls.key == str(layout / "pki" / "server.key")  # from the file
    path = tmp_path / "absolute.toml"
    path.write_text(f'state_dir = "{tmp_path / "s"}"\n[tls]\ncert = "/etc/pki/s.pem"\n'
                    'key = "/etc/pki/s.key"\nclient_ca = ""\n')
    data = load_toml(path)
    assert data["state_dir"] == str(tmp_path / "s") and data["tls"]["client_ca"] == ""
    assert (data["tls"]["cert"], data["tls"]["key"]) == ("/etc/pki/s.pem", "/etc/pki/s.key")


def test_a_state_folder_of_the_same_name_in_the_working_directory_is_not_left_behind(
        layout: Path) -> None:
    Path("state").mkdir()  # in elsewhere/: runs a server started here may have kept
    with pytest.raises(ConfigError) as info:
        _config("--config", str(layout / "server.toml"))
    assert info.value.setting == "state_dir"
    assert str(layout / "state") in str(info.value) and str(Path("state").absolute()) in str(
        info.value)
    (layout / "state").mkdir()  # once the file's own folder exists, it is the one
    assert _config("--config", str(layout / "server.toml")).state_dir == str(layout / "state")
