"""Authentication and authorisation at Join: tokens and certificates, the allow-list,
one session per identity, and no secret in the logs."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
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

from fedloom.client_sdk import AccessDeniedError, start_client
from fedloom.client_sdk.connection import Connection, SessionExpiredError
from fedloom.config import AuthConfig
from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.server import Server
from fedloom.server.auth import Authenticator, certificate_identity
from fedloom.tokens import TokenStore


def _cert_context(cn: str) -> dict[str, list[bytes]]:
    return {"transport_security_type": [b"ssl"], "x509_common_name": [cn.encode()]}


NO_CERT: dict[str, list[bytes]] = {"transport_security_type": [b"ssl"]}


def _reason(auth: Authenticator, name: str, token: str, context) -> RejectReason:  # type: ignore[no-untyped-def]
    with pytest.raises(MessageRejectedError) as info:
        auth.identify(name, token, context)
    return info.value.reason


# -- the rules, on the authenticator itself -----------------------------------------
def test_certificate_identity_reads_cn_then_san() -> None:
    assert certificate_identity(_cert_context("site-1")) == "site-1"
    san = {"transport_security_type": [b"ssl"], "x509_subject_alternative_name": [b"a.b"]}
    assert certificate_identity(san) == "a.b"
    assert certificate_identity({"transport_security_type": [b"insecure"]}) is None
    assert certificate_identity({}) is None


def test_anonymous_server_takes_any_client() -> None:
    assert Authenticator().identify("whoever", "", {}) is None


def test_certificate_rules() -> None:
    auth = Authenticator(mutual_tls=True, allow=["site-1", "site-2"])
    assert auth.identify("", "", _cert_context("site-1")) == "site-1"
    assert auth.identify("site-2", "", _cert_context("site-2")) == "site-2"
    assert _reason(auth, "", "", NO_CERT) is RejectReason.UNKNOWN_CLIENT
    assert _reason(auth, "", "", _cert_context("site-3")) is RejectReason.FORBIDDEN
    assert _reason(auth, "site-2", "", _cert_context("site-1")) is RejectReason.FORBIDDEN


def test_token_rules(tmp_path: Path) -> None:
    store = TokenStore(tmp_path / "t.toml")
    one, three = store.add("site-1"), store.add("site-3")
    auth = Authenticator(tokens=TokenStore.load(store.path), allow=["site-1"])
    assert auth.identify("", one, {}) == "site-1"
    assert _reason(auth, "", "", {}) is RejectReason.UNKNOWN_CLIENT
    assert _reason(auth, "", one[:-2] + "xx", {}) is RejectReason.UNKNOWN_CLIENT
    assert _reason(auth, "", "site-9.abc", {}) is RejectReason.UNKNOWN_CLIENT
    assert _reason(auth, "", three, {}) is RejectReason.FORBIDDEN  # known, not allowed
    assert _reason(auth, "site-3", one, {}) is RejectReason.FORBIDDEN  # not its own name


def test_certificate_and_token_must_agree(tmp_path: Path) -> None:
    store = TokenStore(tmp_path / "t.toml")
    one, two = store.add("site-1"), store.add("site-2")
    auth = Authenticator(mutual_tls=True, tokens=TokenStore.load(store.path))
    assert auth.identify("", one, _cert_context("site-1")) == "site-1"
    assert _reason(auth, "", two, _cert_context("site-1")) is RejectReason.FORBIDDEN
    assert _reason(auth, "", "", _cert_context("site-1")) is RejectReason.UNKNOWN_CLIENT


def test_an_unreadable_tokens_file_fails_closed(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    store = TokenStore(tmp_path / "t.toml")
    token = store.add("site-1")
    auth = Authenticator(tokens=TokenStore.load(store.path))
    store.path.write_text("this is = = not toml")
    with caplog.at_level(logging.ERROR, logger="fedloom.server"):
        assert _reason(auth, "", token, {}) is RejectReason.UNKNOWN_CLIENT
    assert "refusing joins" in caplog.text


# -- over gRPC ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_tokens_over_tls(server_config: MakeConfig, pki: Path, tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    store = TokenStore(tmp_path / "tokens.toml")
    tokens = {name: store.add(name) for name in ("site-1", "site-2", "site-3")}
    config = server_config(
        num_rounds=1, min_clients=2, min_fit_clients=2,
        **tls_settings(pki, auth=AuthConfig(tokens_file=str(store.path),
                                            allow=("site-1", "site-2"))),
    )
    caplog.set_level(logging.DEBUG, logger="fedloom")
    handle = Server(config, initial_weights=small_weights()).start()
    address = handle.address

    def refused(token: str, name: str = "") -> grpc.StatusCode:
        with pytest.raises(AccessDeniedError) as info:
            join_once(client_config(address, pki, name), token)
        return info.value.code

    assert refused("") is grpc.StatusCode.UNAUTHENTICATED
    assert refused("site-1.not-the-secret") is grpc.StatusCode.UNAUTHENTICATED
    assert refused(tokens["site-3"]) is grpc.StatusCode.PERMISSION_DENIED  # not allowed
    assert refused(tokens["site-1"], name="site-2") is grpc.StatusCode.PERMISSION_DENIED
    # A client with a bad token stops at once with the reason (it does not retry).
    with pytest.raises(AccessDeniedError, match="UNAUTHENTICATED"):
        start_client(address, ScriptedClient(0, 1), token="nope.nope",
                     config=client_config(address, pki), handle_signals=False)
    # The right tokens: a whole round, each session named by its token.
    clients = [ScriptedClient(seed=i, num_examples=3) for i in range(2)]
    threads = run_client_threads(
        address, clients, [client_config(address, pki) for _ in clients],
        tokens=[tokens["site-1"], tokens["site-2"]],
    )
    history = handle.wait(60)
    for t in threads:
        t.join(10)
    assert history[-1].status == "ok" and history[-1].num_updates == 2
    assert "site-1" in caplog.text and "site-2" in caplog.text  # joined under their names
    for token in tokens.values():  # never a token or its secret in the logs
        assert token not in caplog.text and token.rpartition(".")[2] not in caplog.text


def test_mutual_tls_allow_list(server_config: MakeConfig, pki: Path) -> None:
    config = server_config(
        num_rounds=1,
        **tls_settings(pki, tls=server_tls(pki, mutual=True),
                       auth=AuthConfig(allow=("site-1", "site-2"))),
    )
    handle = Server(config, initial_weights=small_weights()).start()
    try:
        with pytest.raises(AccessDeniedError) as info:
            join_once(client_config(handle.address, pki, "site-3"))
        assert info.value.code is grpc.StatusCode.PERMISSION_DENIED
        assert "allow-list" in str(info.value)
        assert join_once(client_config(handle.address, pki, "site-1")).session.client_id
    finally:
        handle.stop()
        handle.wait(30)


def test_one_session_per_identity(server_config: MakeConfig, pki: Path) -> None:
    config = server_config(
        num_rounds=1,
        **tls_settings(pki, tls=server_tls(pki, mutual=True), auth=AuthConfig()),
    )
    handle = Server(config, initial_weights=small_weights()).start()
    first = Connection(client_config(handle.address, pki, "site-1"))
    try:
        old = first.join("site-1")
        new = join_once(client_config(handle.address, pki, "site-1"))
        registry = coordinator(handle).registry
        assert old.session.client_id not in registry and new.session.client_id in registry
        with pytest.raises(SessionExpiredError):  # the replaced session is over
            first.heartbeat()
        assert [c.name for c in registry.infos()] == ["site-1"]
    finally:
        first.close()
        handle.stop()
        handle.wait(30)
