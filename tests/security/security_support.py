"""Shared pieces of the security tests: a certificate folder, TLS client threads, a
raw Join over a chosen channel."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from fedloom.certs import write_certificates
from fedloom.client_sdk import Client, start_client
from fedloom.client_sdk.connection import Connection
from fedloom.config import AuthConfig, ClientConfig, ServerConfig, TLSConfig
from fedloom.messages import JoinReply
from fedloom.server import ServerHandle
from fedloom.server.coordinator import Coordinator

#: The ``server_config`` fixture of tests/conftest.py.
MakeConfig = Callable[..., ServerConfig]

CLIENTS = ("site-1", "site-2", "site-3")


def make_pki(folder: Path, clients: tuple[str, ...] = CLIENTS) -> Path:
    """ca.pem/key, server.pem/key (localhost, 127.0.0.1) and one pair per client."""
    write_certificates(folder, clients=clients)
    return folder


def server_tls(pki: Path, mutual: bool = False) -> TLSConfig:
    return TLSConfig(
        cert=str(pki / "server.pem"),
        key=str(pki / "server.key"),
        client_ca=str(pki / "ca.pem") if mutual else "",
    )


def tls_settings(pki: Path, **overrides: Any) -> dict[str, Any]:
    """A server_config(...) fragment: TLS, and by default anonymous clients."""
    settings: dict[str, Any] = {
        "insecure": False,
        "tls": server_tls(pki),
        "auth": AuthConfig(anonymous=True),
    }
    settings.update(overrides)
    return settings


def client_config(address: str, pki: Path | None, name: str = "", **overrides: Any) -> ClientConfig:
    """Fast-retrying client settings; TLS against pki's CA, with ``name``'s certificate
    when that file exists (pki=None: plaintext)."""
    settings: dict[str, Any] = dict(
        server_address=address,
        name=name,
        rpc_timeout_s=10.0,
        reconnect_initial_s=0.05,
        reconnect_max_s=0.5,
    )
    if pki is None:
        settings["insecure"] = True
    else:
        settings["root_ca"] = str(pki / "ca.pem")
        if name and (pki / f"{name}.pem").exists():
            settings["cert"] = str(pki / f"{name}.pem")
            settings["key"] = str(pki / f"{name}.key")
    settings.update(overrides)
    return ClientConfig(**settings)


def run_client_threads(
    address: str,
    clients: Sequence[Client],
    configs: Sequence[ClientConfig],
    tokens: Sequence[str] | None = None,
) -> list[threading.Thread]:
    threads = []
    for i, (client, config) in enumerate(zip(clients, configs, strict=True)):
        t = threading.Thread(
            target=start_client,
            args=(address, client),
            kwargs={
                "config": config,
                "token": tokens[i] if tokens else "",
                "handle_signals": False,
            },
            daemon=True,
        )
        t.start()
        threads.append(t)
    return threads


def join_once(config: ClientConfig, token: str = "") -> JoinReply:
    """One Join over a fresh connection (raises what Connection.join raises)."""
    connection = Connection(config)
    try:
        return connection.join(config.name, token)
    finally:
        connection.close()


def rpc_code(exc: BaseException) -> grpc.StatusCode | None:
    """The gRPC status behind an SDK error, where there is one."""
    cause = exc.__cause__
    return cause.code() if isinstance(cause, grpc.RpcError) else getattr(exc, "code", None)


def coordinator(handle: ServerHandle) -> Coordinator:
    """The coordinator of a started server."""
    assert handle.server.coordinator is not None
    return handle.server.coordinator
