"""Throwaway certificates for ``fedloom demo``: the demo runs over mutual TLS.

A temporary folder gets a CA, a server certificate for ``localhost``/``127.0.0.1`` and
one client certificate per demo client (`fedloom.certs`); the server admits exactly
those clients (their certificate CNs are its allow-list). The folder is deleted when
the demo ends. A real deployment makes its certificates once with ``fedloom certs``
(see docs/security.md).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from fedloom.certs import write_certificates
from fedloom.config import AuthConfig, ClientConfig, TLSConfig


class ThrowawayPKI:
    """A CA, a loopback server certificate and client certificates in a temp folder."""

    def __init__(self, client_names: Sequence[str]) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="fedloom-demo-certs-"))
        self.client_names = tuple(client_names)
        write_certificates(self.folder, clients=self.client_names)

    def server_tls(self) -> TLSConfig:
        f = self.folder
        return TLSConfig(cert=str(f / "server.pem"), key=str(f / "server.key"),
                         client_ca=str(f / "ca.pem"))

    def server_auth(self) -> AuthConfig:
        return AuthConfig(allow=self.client_names)

    def cleanup(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def client_tls_config(address: str, folder: str | Path, name: str) -> ClientConfig:
    """The demo client ``name``'s connection settings: mutual TLS with its certificate."""
    f = Path(folder)
    return ClientConfig(server_address=address, name=name, root_ca=str(f / "ca.pem"),
                        cert=str(f / f"{name}.pem"), key=str(f / f"{name}.key"))
