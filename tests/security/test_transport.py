"""TLS and mutual TLS over loopback: a full round, the certificate as identity, and
every wrong pairing of client and server refused cleanly (a clear error, no hang)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import ScriptedClient, small_weights
from security_support import (
    MakeConfig,
    client_config,
    coordinator,
    join_once,
    make_pki,
    run_client_threads,
    server_tls,
    tls_settings,
)

from fedloom.certs import make_ca, make_client_cert, write_certificates, write_issued
from fedloom.client_sdk import start_client
from fedloom.client_sdk.connection import SEPARATE_UPLOAD_MIN_BYTES
from fedloom.config import AuthConfig
from fedloom.errors import TransportError
from fedloom.server import Server
from fedloom.weights import Weights


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_a_round_over_tls(server_config: MakeConfig, pki: Path) -> None:
    config = server_config(num_rounds=1, min_clients=2, min_fit_clients=2, **tls_settings(pki))
    handle = Server(config, initial_weights=small_weights()).start()
    clients = [ScriptedClient(seed=i, num_examples=5) for i in range(2)]
    configs = [client_config(handle.address, pki) for _ in clients]
    threads = run_client_threads(handle.address, clients, configs)
    history = handle.wait(60)
    for t in threads:
        t.join(10)
    assert history[-1].status == "ok" and history[-1].num_updates == 2
    expected = np.mean([c.sent[0][2]["w"] - c.sent[0][1]["w"] for c in clients], axis=0)
    np.testing.assert_allclose(coordinator(handle).global_weights["w"], expected, atol=1e-6)


def test_large_updates_over_mutual_tls_use_their_own_connections(
        server_config: MakeConfig, pki: Path) -> None:
    """Updates of 64 KiB or more go over a short-lived connection of their own: under
    mutual TLS it presents the same certificate, and the round is the same mean."""
    weights = Weights({"w": np.zeros((200, 100), np.float32)})  # 80 KB per update
    assert weights["w"].nbytes >= SEPARATE_UPLOAD_MIN_BYTES
    config = server_config(
        num_rounds=2, min_clients=2, min_fit_clients=2,
        **tls_settings(pki, tls=server_tls(pki, mutual=True), auth=AuthConfig()),
    )
    handle = Server(config, initial_weights=weights).start()
    clients = [ScriptedClient(seed=i, num_examples=5) for i in range(2)]
    configs = [client_config(handle.address, pki, f"site-{i + 1}") for i in range(2)]
    threads = run_client_threads(handle.address, clients, configs)
    history = handle.wait(60)
    for t in threads:
        t.join(10)
    assert [(r.status, r.num_updates) for r in history if r.round > 0] == [("ok", 2)] * 2
    expected = np.mean([c.sent[-1][2]["w"] for c in clients], axis=0)
    np.testing.assert_allclose(coordinator(handle).global_weights["w"], expected, atol=1e-5)


def test_mutual_tls_identity_is_the_certificate_cn(server_config: MakeConfig, pki: Path) -> None:
    config = server_config(
        num_rounds=1, min_clients=3, min_fit_clients=3,
        **tls_settings(pki, tls=server_tls(pki, mutual=True), auth=AuthConfig()),
    )
    handle = Server(config, initial_weights=small_weights()).start()
    try:
        grant = join_once(client_config(handle.address, pki, "site-1"))
        registry = coordinator(handle).registry
        assert [c.name for c in registry.infos()] == ["site-1"]
        # Without a name of its own, a client is named by its certificate as well.
        unnamed = dataclasses.replace(client_config(handle.address, pki, "site-2"), name="")
        grant = join_once(unnamed)
        names = {c.client_id: c.name for c in registry.infos()}
        assert names[grant.session.client_id] == "site-2"
    finally:
        handle.stop()
        handle.wait(30)


def test_mutual_tls_refuses_a_certificate_from_another_ca(server_config: MakeConfig, pki: Path,
                                                          tmp_path: Path) -> None:
    rogue = make_ca("rogue CA")
    write_issued(tmp_path, "site-1", make_client_cert(rogue, "site-1"))  # a forged name
    config = server_config(num_rounds=1, **tls_settings(pki, tls=server_tls(pki, mutual=True),
                                                       auth=AuthConfig()))
    handle = Server(config, initial_weights=small_weights()).start()
    try:
        forged = client_config(handle.address, pki, "site-1", cert=str(tmp_path / "site-1.pem"),
                               key=str(tmp_path / "site-1.key"))
        with pytest.raises(TransportError, match="UNAVAILABLE"):
            join_once(forged)
        no_cert = client_config(handle.address, pki)
        with pytest.raises(TransportError, match="UNAVAILABLE"):
            join_once(no_cert)
        # The server's own certificate is not a client certificate (extendedKeyUsage).
        as_client = client_config(handle.address, pki, cert=str(pki / "server.pem"),
                                  key=str(pki / "server.key"))
        with pytest.raises(TransportError):
            join_once(as_client)
        assert len(coordinator(handle).registry) == 0
    finally:
        handle.stop()
        handle.wait(30)


def test_plaintext_client_to_a_tls_server_fails_cleanly(
    server_config: MakeConfig, pki: Path
) -> None:
    config = server_config(num_rounds=1, **tls_settings(pki))
    handle = Server(config, initial_weights=small_weights()).start()
    try:
        plain = client_config(handle.address, None, max_reconnect_attempts=1)
        started = time.monotonic()
        with pytest.raises(TransportError, match="gave up after 1 reconnect"):
            start_client(handle.address, ScriptedClient(0, 1), config=plain,
                         handle_signals=False)
        assert time.monotonic() - started < 15
        assert len(coordinator(handle).registry) == 0
    finally:
        handle.stop()
        handle.wait(30)


def test_tls_client_to_a_plaintext_server_fails_with_a_hint(
    server_config: MakeConfig, pki: Path
) -> None:
    handle = Server(server_config(num_rounds=1), initial_weights=small_weights()).start()
    try:
        with pytest.raises(TransportError, match="TLS") as info:
            join_once(client_config(handle.address, pki))
        assert "UNAVAILABLE" in str(info.value)
    finally:
        handle.stop()
        handle.wait(30)


def test_the_server_certificate_must_name_the_address_dialled(server_config: MakeConfig,
                                                              tmp_path: Path) -> None:
    pki = tmp_path / "named"
    write_certificates(pki, hosts=["fl.example.org"])
    config = server_config(num_rounds=1, **tls_settings(pki))
    handle = Server(config, initial_weights=small_weights()).start()
    try:
        with pytest.raises(TransportError):
            join_once(client_config(handle.address, pki))  # dials 127.0.0.1: not named
        grant = join_once(client_config(handle.address, pki, server_name="fl.example.org"))
        assert grant.session.client_id
    finally:
        handle.stop()
        handle.wait(30)


def test_a_client_trusting_another_ca_refuses_the_server(server_config: MakeConfig, pki: Path,
                                                         tmp_path: Path) -> None:
    other = tmp_path / "other"
    write_certificates(other)
    config = server_config(num_rounds=1, **tls_settings(pki))
    handle = Server(config, initial_weights=small_weights()).start()
    try:
        with pytest.raises(TransportError, match="root_ca"):
            join_once(client_config(handle.address, other))
    finally:
        handle.stop()
        handle.wait(30)
