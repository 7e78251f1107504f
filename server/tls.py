"""The server's transport credentials: TLS, mutual TLS, or (asked for) plaintext.

`server_credentials` reads the PEM files named in ``ServerConfig.tls`` and checks them
before gRPC sees them (gRPC's own errors for a bad file are a bare "could not bind"):
the certificate and key exist, parse, match each other, and the certificate is
currently valid. A plaintext server logs a warning on every start.
"""

from __future__ import annotations

import datetime
import logging
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fedloom.config import ServerConfig
from fedloom.errors import ConfigError

log = logging.getLogger("fedloom.server")


def read_pem(path: str, setting: str) -> bytes:
    """The bytes of a PEM file, or `ConfigError` naming ``setting``."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError as exc:
        raise ConfigError(setting, f"{path!r} not found") from exc
    except OSError as exc:
        raise ConfigError(setting, f"cannot read {path!r}: {exc}") from exc
    if b"-----BEGIN" not in data:
        raise ConfigError(setting, f"{path!r} is not a PEM file")
    return data


def check_certificate_and_key(cert_pem: bytes, key_pem: bytes, where: str = "tls") -> None:
    """Refuse a certificate that does not parse, is not valid now, or is not the key's."""
    try:
        cert = x509.load_pem_x509_certificates(cert_pem)[0]
    except ValueError as exc:
        raise ConfigError(f"{where}.cert", f"not a PEM certificate: {exc}") from exc
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"{where}.key", f"not an unencrypted PEM private key: {exc}"
        ) from exc
    if key.public_key() != cert.public_key():
        raise ConfigError(f"{where}.key", f"is not the private key of {where}.cert")
    now = datetime.datetime.now(datetime.UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise ConfigError(
            f"{where}.cert",
            f"is valid only from {cert.not_valid_before_utc:%Y-%m-%d} to "
            f"{cert.not_valid_after_utc:%Y-%m-%d}; issue a new one (`fedloom certs`)",
        )


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
    cert = read_pem(tls.cert, "tls.cert")
    key = read_pem(tls.key, "tls.key")
    check_certificate_and_key(cert, key)
    client_ca = read_pem(tls.client_ca, "tls.client_ca") if tls.client_ca else None
    if client_ca is not None:
        try:
            x509.load_pem_x509_certificates(client_ca)
        except ValueError as exc:
            raise ConfigError("tls.client_ca", f"not a PEM certificate: {exc}") from exc
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )
