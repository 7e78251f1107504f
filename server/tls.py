"""The server's transport credentials: TLS, mutual TLS, or (asked for) plaintext.

`server_credentials` reads the PEM files named in ``ServerConfig.tls`` and checks them
before gRPC sees them (gRPC's own errors for a bad file are a bare "could not bind"):
the certificate and key exist, parse, match each other, and the certificate is
currently valid (`fedloom._tls_files`, which the client SDK checks its files with too).
A plaintext server logs a warning on every start.
"""

from __future__ import annotations

import logging

import grpc

from fedloom._tls_files import read_ca, read_certificate_and_key
from fedloom.config import ServerConfig

log = logging.getLogger("fedloom.server")


def warn_plaintext(address: str) -> None:
    """The warning a plaintext server logs on every start, naming the address it bound
    (the real port, also when the configuration asked for port 0)."""
    log.warning(
        "serving PLAINTEXT on %s (insecure): anyone on the network can read and alter "
        "models and updates and pose as a client; use TLS outside a trusted test network",
        address,
    )


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for ``config``, or None for a plaintext server (the server then
    calls `warn_plaintext` with the address it bound)."""
    tls = config.tls
    if not tls.enabled:
        return None
    cert, key = read_certificate_and_key(tls.cert, tls.key, where="tls")
    client_ca = read_ca(tls.client_ca, "tls.client_ca") if tls.client_ca else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )
