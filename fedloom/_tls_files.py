"""TLS files (PEM) read and checked before gRPC sees them, by the server and the client.

gRPC reports a bad file late and vaguely: a client whose key is not its certificate's
fails every handshake and fills gRPC's log with "Invalid private key", and a server
just fails to bind. `read_certificate_and_key` and `read_ca` check the files first and
raise `ConfigError` naming the setting and the file at fault: a file is missing,
unreadable or not PEM; a certificate or key does not parse; the key is not the
certificate's; or the certificate is not valid today.

``where`` is the settings' prefix: ``"tls"`` for the server's ``tls.cert``/``tls.key``,
``""`` for the client's ``cert``/``key``.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fedloom.errors import ConfigError


def _setting(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


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


def read_ca(path: str, setting: str) -> bytes:
    """A PEM file of one or more CA certificates, checked to parse."""
    data = read_pem(path, setting)
    try:
        x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise ConfigError(setting, f"{path!r} is not a PEM certificate: {exc}") from exc
    return data


def check_certificate_and_key(
    cert_pem: bytes, key_pem: bytes, where: str = "tls", cert_path: str = "", key_path: str = ""
) -> None:
    """Refuse a certificate that does not parse, is not valid now, or is not the key's.

    The paths, when given, are named in the messages beside the settings.
    """
    cert_setting, key_setting = _setting(where, "cert"), _setting(where, "key")
    cert_file = f" ({cert_path!r})" if cert_path else ""
    key_file = f" ({key_path!r})" if key_path else ""
    try:
        cert = x509.load_pem_x509_certificates(cert_pem)[0]
    except ValueError as exc:
        raise ConfigError(cert_setting, f"not a PEM certificate{cert_file}: {exc}") from exc
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            key_setting, f"not an unencrypted PEM private key{key_file}: {exc}"
        ) from exc
    if key.public_key() != cert.public_key():
        raise ConfigError(
            key_setting,
            f"is not the private key of {cert_setting}: the key{key_file} and the "
            f"certificate{cert_file} do not belong together; give the key that was made "
            "with this certificate (`fedloom certs` writes NAME.pem and NAME.key side by side)",
        )
    now = datetime.datetime.now(datetime.UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise ConfigError(
            cert_setting,
            f"{cert_path or 'the certificate'} is valid only from "
            f"{cert.not_valid_before_utc:%Y-%m-%d} to {cert.not_valid_after_utc:%Y-%m-%d}; "
            "issue a new one (`fedloom certs`)",
        )


def read_certificate_and_key(cert_path: str, key_path: str, where: str) -> tuple[bytes, bytes]:
    """The PEM bytes of a certificate and its private key, read and checked together."""
    cert = read_pem(cert_path, _setting(where, "cert"))
    key = read_pem(key_path, _setting(where, "key"))
    check_certificate_and_key(cert, key, where, cert_path, key_path)
    return cert, key
