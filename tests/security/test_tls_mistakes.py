"""TLS mistakes explain themselves: a key that is not the certificate's stops the client
before it connects, and handshakes the other side refuses are explained once, after
`HANDSHAKE_ADVICE_AFTER` failures in a row, with whether the client keeps retrying."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ScriptedClient, small_weights
from security_support import MakeConfig, client_config, make_pki, server_tls, tls_settings

from fedloom import cli
from fedloom.certs import make_ca, make_client_cert, write_certificates, write_issued
from fedloom.client_sdk import start_client
from fedloom.client_sdk.tls import HANDSHAKE_ADVICE_AFTER, HandshakeFailures
from fedloom.config import AuthConfig, ClientConfig
from fedloom.errors import ConfigError, TransportError
from fedloom.server import Server, ServerHandle

ADVICE = "Likely causes:"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


class _Records(logging.Handler):
    """The client's log records, and an event set when the advice arrives."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.advised = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if ADVICE in record.getMessage():
            self.advised.set()

    def advice(self) -> list[str]:
        return [r.getMessage() for r in self.records if ADVICE in r.getMessage()]

    def retries(self) -> int:
        return sum("retrying in" in r.getMessage() for r in self.records)

    def retries_before_advice(self) -> int:
        messages = [r.getMessage() for r in self.records]
        first = next(i for i, m in enumerate(messages) if ADVICE in m)
        return sum("retrying in" in m for m in messages[:first])


@pytest.fixture
def client_log() -> Iterator[_Records]:
    handler = _Records()
    logger = logging.getLogger("fedloom.client")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _mutual_tls_server(server_config: MakeConfig, pki: Path) -> ServerHandle:
    config = server_config(num_rounds=1, **tls_settings(pki, tls=server_tls(pki, mutual=True),
                                                       auth=AuthConfig()))
    return Server(config, initial_weights=small_weights()).start()


def _fail(config: ClientConfig) -> BaseException:
    """What start_client raises for ``config`` (which must make it give up)."""
    with pytest.raises((TransportError, ConfigError)) as info:
        start_client(config.server_address, ScriptedClient(0, 1), config=config,
                     handle_signals=False, log_to_console=False)
    return info.value


# -- a key that is not the certificate's ----------------------------------------------
def test_a_key_that_is_not_the_certificates_stops_the_client_before_it_connects(
        pki: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        # max_reconnect_attempts bounds the test should the pair be sent to the server.
        config = client_config(address, pki, "site-1", key=str(pki / "site-2.key"),
                               max_reconnect_attempts=1)
        started = time.monotonic()
        error = _fail(config)
        assert time.monotonic() - started < 2
        assert isinstance(error, ConfigError) and error.setting == "key"
        message = str(error)
        assert str(pki / "site-2.key") in message and str(pki / "site-1.pem") in message
        assert "do not belong together" in message
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody dialled
    finally:
        listener.close()


def test_fedloom_client_refuses_a_mismatched_pair(pki: Path, tmp_path: Path, capsys,  # type: ignore[no-untyped-def]
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tls_mistakes_app.py").write_text(
        "from helpers import ScriptedClient\n\n\ndef make_client():\n"
        "    return ScriptedClient(0, 1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        argv = ["client", "--server", address, "--app", "tls_mistakes_app:make_client",
                "--root-ca", str(pki / "ca.pem"), "--cert", str(pki / "site-1.pem"),
                "--key", str(pki / "site-2.key")]
        status: list[int] = []
        # A thread, so that a client that retries forever fails the test instead of hanging it.
        thread = threading.Thread(target=lambda: status.append(cli.main(argv)), daemon=True)
        thread.start()
        thread.join(10)
    assert status == [cli.EXIT_REFUSED]
    err = capsys.readouterr().err
    assert "do not belong together" in err and "site-1.pem" in err and "site-2.key" in err


# -- handshakes the other side refuses ------------------------------------------------
def test_a_client_certificate_from_another_ca_is_explained_once(
        server_config: MakeConfig, pki: Path, tmp_path: Path, client_log: _Records) -> None:
    write_issued(tmp_path, "site-1", make_client_cert(make_ca("rogue CA"), "site-1"))
    handle = _mutual_tls_server(server_config, pki)
    stop = threading.Event()
    config = client_config(handle.address, pki, "site-1", cert=str(tmp_path / "site-1.pem"),
                           key=str(tmp_path / "site-1.key"), reconnect_max_s=0.1)
    thread = threading.Thread(
        target=start_client, args=(handle.address, ScriptedClient(0, 1)),
        kwargs={"config": config, "stop": stop, "handle_signals": False,
                "log_to_console": False},
        daemon=True)
    try:
        thread.start()
        assert client_log.advised.wait(10), "no explanation of the refused handshakes"
        retries_then = client_log.retries()
        deadline = time.monotonic() + 5
        while client_log.retries() < retries_then + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client_log.retries() >= retries_then + 2  # it went on retrying ...
    finally:
        stop.set()
        thread.join(10)
        handle.stop()
        handle.wait(30)
    [advice] = client_log.advice()  # ... and said it once
    # Logged at the failure that made the streak, before that failure's "retrying" line.
    assert client_log.retries_before_advice() == HANDSHAKE_ADVICE_AFTER - 1
    assert f"{HANDSHAKE_ADVICE_AFTER} times in a row" in advice
    first = advice.split("\n")[2]
    assert first.startswith("  - most likely") and "client certificate" in first
    assert str(tmp_path / "site-1.pem") in first
    assert "root_ca" in advice and "server_name" in advice and "plaintext" in advice
    assert "keeps retrying" in advice and "max_reconnect_attempts" in advice
    assert all(r.levelno >= logging.WARNING for r in client_log.records
               if ADVICE in r.getMessage())


def test_a_server_outside_root_ca_is_explained_before_the_client_gives_up(
        server_config: MakeConfig, pki: Path, tmp_path: Path, client_log: _Records) -> None:
    other = tmp_path / "other"
    write_certificates(other)
    handle = _mutual_tls_server(server_config, pki)
    try:
        # Its own certificate is good (pki's); the server's is not from other/ca.pem.
        config = client_config(handle.address, other, root_ca=str(other / "ca.pem"),
                               cert=str(pki / "site-1.pem"), key=str(pki / "site-1.key"),
                               max_reconnect_attempts=1)
        error = _fail(config)
    finally:
        handle.stop()
        handle.wait(30)
    assert isinstance(error, TransportError) and "gave up after 1" in str(error)
    [advice] = client_log.advice()  # at the last failure, sooner than the usual 3
    assert "2 times in a row" in advice
    first = advice.split("\n")[2]
    assert "most likely" in first and f"root_ca ({other / 'ca.pem'})" in first
    assert "gives up after 1 failed reconnects" in advice


@pytest.mark.parametrize("mistake", ["server name", "plaintext server", "plaintext client"])
def test_the_other_mistakes_are_named(server_config: MakeConfig, tmp_path: Path,
                                      client_log: _Records, mistake: str) -> None:
    pki = tmp_path / "pki"
    write_certificates(pki, hosts=["fl.example.org"] if mistake == "server name" else None)
    settings = {} if mistake == "plaintext server" else tls_settings(pki)
    handle = Server(server_config(num_rounds=1, **settings),
                    initial_weights=small_weights()).start()
    try:
        config = client_config(handle.address, None if mistake == "plaintext client" else pki,
                               max_reconnect_attempts=HANDSHAKE_ADVICE_AFTER)
        _fail(config)
    finally:
        handle.stop()
        handle.wait(30)
    [advice] = client_log.advice()
    first = advice.split("\n")[2]
    expected = {"server name": "does not name the host dialled (127.0.0.1); set server_name",
                "plaintext server": "the server serves plaintext",
                "plaintext client": "this client talks plaintext (insecure)"}[mistake]
    assert expected in first


def test_the_streak_ends_at_a_join_or_another_failure(pki: Path, client_log: _Records) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"  # closed again: nobody listens
    _fail(client_config(address, pki, max_reconnect_attempts=HANDSHAKE_ADVICE_AFTER + 1))
    assert client_log.retries() == HANDSHAKE_ADVICE_AFTER + 1  # refused: not a TLS problem
    assert client_log.advice() == []
    refused = TransportError("join: UNAVAILABLE: failed to connect to all addresses; last "
                             "error: UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed")
    outage = TransportError("join: UNAVAILABLE: failed to connect to all addresses; last "
                            "error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused")
    failures = HandshakeFailures(ClientConfig("127.0.0.1:1", root_ca="ca.pem"), after=2)
    for error in (refused, outage, refused):
        failures.failed(error)
    assert client_log.advice() == []  # never two in a row
    failures.failed(refused)
    failures.failed(refused)
    assert len(client_log.advice()) == 1  # once per streak ...
    failures.joined()
    failures.failed(refused)
    failures.failed(refused)
    assert len(client_log.advice()) == 2  # ... and again after the client had joined
