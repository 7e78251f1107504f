"""Fixtures of the secure-aggregation tests: a client PKI for authenticated rounds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedloom.certs import write_certificates
from fedloom.config import AuthConfig, TLSConfig

#: Client names with a certificate in the `pki` folder (client-0 ... client-15).
PKI_CLIENTS = tuple(f"client-{i}" for i in range(16))


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.pem/key, server.pem/key (localhost, 127.0.0.1), and client-i.pem/key."""
    folder = tmp_path_factory.mktemp("pki")
    write_certificates(folder, clients=PKI_CLIENTS)
    return folder


@pytest.fixture
def mtls(pki: Path) -> dict[str, Any]:
    """A server_config(...) fragment: mutual TLS with the pki's client CA (secure rounds
    are then authenticated)."""
    return {"insecure": False,
            "tls": TLSConfig(cert=str(pki / "server.pem"), key=str(pki / "server.key"),
                             client_ca=str(pki / "ca.pem")),
            "auth": AuthConfig()}
