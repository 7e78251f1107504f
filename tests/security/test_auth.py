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
from fedloom.config import AuthConfig, ServerConfig, TLSConfig
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


def test_the_unreadable_tokens_file_is_named_in_the_log(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    store = TokenStore(tmp_path / "t.toml")
    token = store.add("site-1")
    auth = Authenticator(tokens=TokenStore.load(store.path))
    store.path.write_text("this is = = not toml")
    with (
        caplog.at_level(logging.ERROR, logger="fedloom.server"),
        pytest.raises(MessageRejectedError) as info,
    ):
        auth.identify("", token, {})
    # The client learns only that the server cannot read the file; the operator's log
    # says which file and why (the ConfigError's text).
    assert str(info.value) == "the server cannot read its tokens file"
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    message = record.getMessage()
    assert message.startswith(f"refusing joins: auth.tokens_file: cannot read {store.path}: ")


# -- what each refusal tells the client (the text crosses the wire as the gRPC
# status details and ends up in the client's AccessDeniedError) ----------------------
def test_each_refusal_says_what_to_fix(tmp_path: Path) -> None:
    store = TokenStore(tmp_path / "t.toml")
    one, two, three = store.add("site-1"), store.add("site-2"), store.add("site-3")
    tokens = TokenStore.load(store.path)
    certificates = Authenticator(mutual_tls=True)
    both = Authenticator(mutual_tls=True, tokens=tokens)
    allowed = Authenticator(tokens=tokens, allow=["site-1", "site-2"])
    # A hostile name is cut to its first 64 characters in the reply.
    long_name = "x" * 64 + "y" * 1000
    cases = [
        (certificates, "", "", NO_CERT, RejectReason.UNKNOWN_CLIENT,
         "this server requires a client certificate with a CN (mutual TLS)"),
        (allowed, "", "", {}, RejectReason.UNKNOWN_CLIENT,
         "this server requires a token: pass token=... (--token)"),
        (allowed, "", one[:-2] + "xx", {}, RejectReason.UNKNOWN_CLIENT,
         "unknown or revoked token (ask the operator for a new one: "
         "`fedloom tokens add NAME`)"),
        (both, "", two, _cert_context("site-1"), RejectReason.FORBIDDEN,
         "the token names 'site-2' but the client certificate names 'site-1'; "
         "use the token issued to this certificate's name"),
        (allowed, "site-2", one, {}, RejectReason.FORBIDDEN,
         "joining as 'site-2', but the credentials are those of 'site-1'; "
         "join under that name (or leave the name empty)"),
        (allowed, long_name, one, {}, RejectReason.FORBIDDEN,
         f"joining as {'x' * 64!r}, but the credentials are those of 'site-1'; "
         "join under that name (or leave the name empty)"),
        (allowed, "", three, {}, RejectReason.FORBIDDEN,
         "client 'site-3' is not on this server's allow-list"),
    ]
    for auth, name, token, context, reason, message in cases:
        with pytest.raises(MessageRejectedError) as info:
            auth.identify(name, token, context)
        assert (info.value.reason, str(info.value)) == (reason, message)


# -- the operator's warnings at start-up ---------------------------------------------
def _startup_warnings(config: ServerConfig, caplog) -> list[str]:  # type: ignore[no-untyped-def]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedloom.server"):
        Authenticator.from_config(config)
    return [r.getMessage() for r in caplog.records if r.name == "fedloom.server"]


PLAINTEXT = "tokens travel in plaintext (--insecure): anyone on the path can copy them"


def test_from_config_warns_about_settings_that_lock_clients_out(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    # A plaintext server without tokens has nothing to warn about.
    assert _startup_warnings(ServerConfig(insecure=True), caplog) == []
    anonymous_tls = ServerConfig(tls=TLSConfig(cert="c.pem", key="c.key"),
                                 auth=AuthConfig(anonymous=True))
    assert _startup_warnings(anonymous_tls, caplog) == []
    # An empty tokens file: nobody can join.
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    config = ServerConfig(insecure=True, auth=AuthConfig(tokens_file=str(empty)))
    assert _startup_warnings(config, caplog) == [
        f"the tokens file {empty} holds no tokens: no client can join", PLAINTEXT,
    ]
    # Allowed names without a token can never join (tokens are the only identity).
    store = TokenStore(tmp_path / "t.toml")
    store.add("site-1")
    allow = AuthConfig(tokens_file=str(store.path), allow=("site-4", "site-1", "site-3"))
    assert _startup_warnings(ServerConfig(insecure=True, auth=allow), caplog) == [
        PLAINTEXT, "auth.allow names clients without a token: site-3, site-4",
    ]
    # Over TLS the tokens are safe on the wire, and every allowed name has a token.
    covered = AuthConfig(tokens_file=str(store.path), allow=("site-1",))
    tls = TLSConfig(cert="c.pem", key="c.key")
    assert _startup_warnings(ServerConfig(tls=tls, auth=covered), caplog) == []
    # With mutual TLS and tokens both are required: an allowed name without a token
    # still cannot join, whatever its certificate.
    mutual = TLSConfig(cert="c.pem", key="c.key", client_ca="ca.pem")
    assert _startup_warnings(ServerConfig(tls=mutual, auth=allow), caplog) == [
        "auth.allow names clients without a token: site-3, site-4",
    ]


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
