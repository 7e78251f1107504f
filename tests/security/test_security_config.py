"""Refusals: no plaintext by accident, no TLS server without a way to identify
clients, unreadable or mismatched TLS files named clearly."""

from __future__ import annotations

import datetime
import logging
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from helpers import small_weights
from security_support import make_pki, server_tls

from fedloom.certs import Issued, make_ca, write_issued
from fedloom.cli import build_parser, main, server_config_from_args
from fedloom.config import AuthConfig, ClientConfig, ServerConfig, TLSConfig, from_mapping
from fedloom.errors import ConfigError
from fedloom.server import Server
from fedloom.server.tls import server_credentials


def _setting(**kwargs) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as info:
        ServerConfig(**kwargs)
    return info.value.setting


def test_server_refuses_plaintext_unless_asked() -> None:
    with pytest.raises(ConfigError, match="--insecure") as info:
        ServerConfig()
    assert info.value.setting == "tls" and "fedloom certs" in str(info.value)
    assert ServerConfig(insecure=True).insecure


def test_server_setting_contradictions(tmp_path: Path) -> None:
    tls = TLSConfig(cert="s.pem", key="s.key")
    assert _setting(insecure=True, tls=tls) == "insecure"
    assert _setting(tls=tls) == "auth"  # TLS, but nothing says who the clients are
    assert _setting(tls=tls, auth=AuthConfig(allow=("a",), anonymous=True)) == "auth.allow"
    ServerConfig(tls=tls, auth=AuthConfig(anonymous=True))
    ServerConfig(tls=tls, auth=AuthConfig(tokens_file="t.toml", allow=("a",)))
    ServerConfig(tls=TLSConfig(cert="s.pem", key="s.key", client_ca="ca.pem"))
    with pytest.raises(ConfigError) as info:
        TLSConfig(cert="s.pem")
    assert info.value.setting == "tls.key"
    with pytest.raises(ConfigError) as info:
        TLSConfig(client_ca="ca.pem")
    assert info.value.setting == "tls.client_ca"
    with pytest.raises(ConfigError) as info:
        AuthConfig(allow=("ok", ""))
    assert info.value.setting == "auth.allow"


def test_client_needs_a_trust_anchor_or_insecure() -> None:
    def setting(**kwargs) -> str:  # type: ignore[no-untyped-def]
        with pytest.raises(ConfigError) as info:
            ClientConfig(server_address="h:1", **kwargs)
        return info.value.setting

    assert setting() == "root_ca"
    assert setting(insecure=True, root_ca="ca.pem") == "insecure"
    assert setting(insecure=True, cert="c.pem", key="c.key") == "insecure"
    assert setting(root_ca="ca.pem", cert="c.pem") == "key"
    assert setting(root_ca="ca.pem", key="c.key") == "cert"
    assert setting(root_ca="ca.pem", system_roots=True) == "system_roots"
    ClientConfig(server_address="h:1", insecure=True)
    ClientConfig(server_address="h:1", system_roots=True)
    ClientConfig(server_address="h:1", root_ca="ca.pem", cert="c.pem", key="c.key")


def test_toml_tables_and_flags(tmp_path: Path) -> None:
    config = from_mapping(
        ServerConfig,
        {
            "tls": {"cert": "s.pem", "key": "s.key", "client_ca": "ca.pem"},
            "auth": {"allow": ["site-1", "site-2"]},
        },
    )
    assert config.tls.client_ca == "ca.pem" and config.auth.allow == ("site-1", "site-2")
    with pytest.raises(ConfigError, match="did you mean 'client_ca'"):
        from_mapping(ServerConfig, {"tls": {"cert": "s", "key": "k", "clientca": "c"}})
    args = build_parser().parse_args(
        ["server", "--tls-cert", "s.pem", "--tls-key", "s.key", "--tokens-file", "t.toml",
         "--allow", "a", "--allow", "b"]
    )
    config = server_config_from_args(args)
    assert (config.tls.cert, config.tls.key) == ("s.pem", "s.key")
    assert config.auth.tokens_file == "t.toml"
    assert config.auth.allow == ("a", "b") and not config.insecure
    args = build_parser().parse_args(["server", "--insecure"])
    assert server_config_from_args(args).insecure


def test_cli_server_without_tls_or_insecure_says_how_to_fix(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["server", "--num-rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert "tls" in err and "--insecure" in err and "fedloom certs" in err


def test_cli_client_without_tls_or_insecure_says_how_to_fix(capsys) -> None:  # type: ignore[no-untyped-def]
    # Refused before the app is even loaded (this one would fail to build).
    code = main(["client", "--server", "127.0.0.1:1", "--app", "helpers:ScriptedClient"])
    assert code == 2
    err = capsys.readouterr().err
    assert "root_ca" in err and "--insecure" in err and "--root-ca" in err


def test_client_flags_build_a_tls_config() -> None:
    from fedloom.security_cli import client_config_from_args

    args = build_parser().parse_args(
        ["client", "--server", "h:1", "--app", "m:a", "--root-ca", "ca.pem", "--cert", "c.pem",
         "--key", "c.key", "--server-name", "fl.example.org"]
    )
    config = client_config_from_args(args)
    assert (config.root_ca, config.cert, config.key, config.server_name) == (
        "ca.pem", "c.pem", "c.key", "fl.example.org"
    )
    args = build_parser().parse_args(["client", "--server", "h:1", "--app", "m:a", "--insecure"])
    assert client_config_from_args(args).insecure


def _tls_config(cert: Path, key: Path, client_ca: str = "") -> ServerConfig:
    return ServerConfig(
        tls=TLSConfig(cert=str(cert), key=str(key), client_ca=client_ca),
        auth=AuthConfig(anonymous=not client_ca),
    )


def test_server_credentials_check_the_files(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki", clients=("site-1",))
    assert server_credentials(_tls_config(pki / "server.pem", pki / "server.key")) is not None

    def setting(config: ServerConfig) -> str:
        with pytest.raises(ConfigError) as info:
            server_credentials(config)
        return info.value.setting

    assert setting(_tls_config(tmp_path / "nope.pem", pki / "server.key")) == "tls.cert"
    assert setting(_tls_config(pki / "server.pem", pki / "site-1.key")) == "tls.key"  # not its key
    (tmp_path / "junk.pem").write_text("hello")
    assert setting(_tls_config(pki / "server.pem", tmp_path / "junk.pem")) == "tls.key"
    assert setting(_tls_config(pki / "server.pem", pki / "server.key", str(tmp_path / "x"))) == (
        "tls.client_ca"
    )


def test_an_expired_certificate_is_refused(tmp_path: Path) -> None:
    ca = make_ca()
    old = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "localhost")])
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(ca.cert.subject)
        .public_key(key.public_key()).serial_number(1)
        .not_valid_before(old).not_valid_after(old + datetime.timedelta(days=1))
        .sign(ca.key, hashes.SHA256())
    )
    write_issued(tmp_path, "expired", Issued(cert, key))
    with pytest.raises(ConfigError, match="valid only from 2020-01-01") as info:
        server_credentials(_tls_config(tmp_path / "expired.pem", tmp_path / "expired.key"))
    assert info.value.setting == "tls.cert"


def test_plaintext_is_warned_with_the_port_it_bound(caplog, tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert server_credentials(ServerConfig(insecure=True)) is None
    config = ServerConfig(address="127.0.0.1:0", insecure=True, num_rounds=1,
                          state_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="fedloom.server"):
        handle = Server(config, initial_weights=small_weights()).start()
        try:
            port = handle.server.port
        finally:
            handle.stop()
            handle.wait(30)
    warnings = [r.getMessage() for r in caplog.records if "PLAINTEXT" in r.getMessage()]
    assert port and warnings == [f"serving PLAINTEXT on 127.0.0.1:{port} (insecure): anyone "
                                 "on the network can read and alter models and updates and "
                                 "pose as a client; use TLS outside a trusted test network"]


def test_server_tls_helper_matches(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki", clients=())
    assert server_tls(pki, mutual=True).client_ca.endswith("ca.pem")
