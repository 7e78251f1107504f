"""The client's transport credentials: TLS (optionally with a client certificate) or,
when asked for, plaintext.

`open_channel` reads the PEM files named in `ClientConfig` each time it opens a
channel (so a renewed certificate is picked up at the next reconnect) and turns a
missing or unreadable file into a `ConfigError` naming the setting.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import grpc

from fedloom.config import ClientConfig
from fedloom.errors import ConfigError

log = logging.getLogger("fedloom.client")

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _read(path: str, setting: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(setting, f"cannot read {path!r}: {exc}") from exc
    if b"-----BEGIN" not in data:
        raise ConfigError(setting, f"{path!r} is not a PEM file")
    return data


def channel_credentials(config: ClientConfig) -> grpc.ChannelCredentials | None:
    """TLS credentials for ``config``; None when it asks for plaintext."""
    if config.insecure:
        return None
    root = _read(config.root_ca, "root_ca") if config.root_ca else None  # None: system CAs
    key = _read(config.key, "key") if config.key else None
    cert = _read(config.cert, "cert") if config.cert else None
    return grpc.ssl_channel_credentials(root, key, cert)


def open_channel(config: ClientConfig, options: list[tuple[str, Any]]) -> grpc.Channel:
    """A channel to ``config.server_address``: TLS unless ``config.insecure``."""
    credentials = channel_credentials(config)
    if credentials is None:
        with _warned_lock:
            first = config.server_address not in _warned
            _warned.add(config.server_address)
        if first:
            log.warning(
                "talking PLAINTEXT to %s (insecure): the model, the updates and any token "
                "can be read and altered on the way; use TLS outside a trusted test network",
                config.server_address,
            )
        return grpc.insecure_channel(config.server_address, options=options)
    if config.server_name:
        options = [*options, ("grpc.ssl_target_name_override", config.server_name)]
    return grpc.secure_channel(config.server_address, credentials, options=options)


def handshake_hint(details: str) -> str:
    """Advice for a TLS failure in a gRPC error's details ("" when it is not one)."""
    text = details.lower()
    if "certificate_verify_failed" in text or "unsupported certificate purpose" in text:
        return (
            " (TLS: the server's certificate is not signed by root_ca, or it is not a "
            "server certificate)"
        )
    if "peer name" in text or "hostname" in text:
        return " (TLS: the certificate does not name the address dialled; see server_name)"
    if "handshake" in text or "ssl" in text or "tls" in text:
        return (
            " (TLS handshake failed: is the server serving TLS, does it require a client "
            "certificate, and is this one signed by its client CA?)"
        )
    return ""
