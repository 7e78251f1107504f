"""The client's transport credentials: TLS (optionally with a client certificate) or,
when asked for, plaintext; and what to say when handshakes keep failing.

`open_channel` reads the PEM files named in `ClientConfig` each time it opens a
channel (so a renewed certificate is picked up at the next reconnect) and checks them
before any connection is attempted (`fedloom._tls_files`): a missing or unreadable
file, a ``root_ca`` or ``cert`` that does not parse, a ``key`` that is not ``cert``'s,
or a certificate that is not valid today raises `ConfigError` naming the setting and
the file. Replace a renewed certificate and its key together (write both, then
rename), or a reconnect in between meets a mismatched pair and stops the client.

A certificate the *other* side refuses cannot be seen in the files: the handshake
fails, the call raises `TransportError`, and the runner retries. `HandshakeFailures`
counts such failures in a row and, at the `HANDSHAKE_ADVICE_AFTER`th, logs their likely
causes once.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import grpc

from fedloom._tls_files import read_ca, read_certificate_and_key
from fedloom.config import ClientConfig

log = logging.getLogger("fedloom.client")

#: Connection failures in a row that look like refused TLS handshakes before the client
#: logs their likely causes (sooner when ``max_reconnect_attempts`` gives up sooner).
HANDSHAKE_ADVICE_AFTER = 3

_warned: set[str] = set()
_warned_lock = threading.Lock()


def channel_credentials(config: ClientConfig) -> grpc.ChannelCredentials | None:
    """TLS credentials for ``config``, its files checked; None when it asks for plaintext."""
    if config.insecure:
        return None
    root = read_ca(config.root_ca, "root_ca") if config.root_ca else None  # None: system CAs
    cert = key = None
    if config.cert:
        cert, key = read_certificate_and_key(config.cert, config.key, where="")
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


def looks_like_handshake_failure(message: str) -> bool:
    """Whether a failed call's message is a connection that failed while being set up in
    a way TLS explains: a handshake error, or the peer closing the socket, which is how
    a TLS server refuses a client certificate (and a plaintext client)."""
    text = message.lower()
    marks = ("socket closed", "handshake", "ssl", "certificate", "hostname verification")
    return "failed to connect" in text and any(mark in text for mark in marks)


class HandshakeFailures:
    """Connection failures in a row that look like refused handshakes; at the
    ``after``th (or at the last one before ``max_reconnect_attempts`` gives up, if that
    comes first) it logs their likely causes, once until the client joins again."""

    def __init__(self, config: ClientConfig, after: int = HANDSHAKE_ADVICE_AFTER) -> None:
        limit = config.max_reconnect_attempts
        self._config = config
        self._after = after if limit is None else max(1, min(after, limit + 1))
        self._count = 0
        self._advised = False

    def failed(self, error: BaseException) -> None:
        """Count a failed connection or call (any other failure ends the streak)."""
        message = str(error)
        if not looks_like_handshake_failure(message):
            self._count = 0
            return
        self._count += 1
        if self._count >= self._after and not self._advised:
            self._advised = True
            log.error("%s", handshake_advice(self._config, self._count, message))

    def joined(self) -> None:
        self._count = 0
        self._advised = False


def handshake_advice(config: ClientConfig, failures: int, last: str) -> str:
    """The likely causes of ``failures`` refused handshakes in a row, in plain words."""
    address = config.server_address
    if config.insecure:
        causes = [
            "this client talks plaintext (insecure), and a TLS server closes plaintext "
            "connections this way: drop insecure (--insecure) and set root_ca (--root-ca) "
            "to the CA file that signed the server's certificate",
        ]
    else:
        refused = (f"does not trust this client's certificate ({config.cert}), which must "
                   "be signed by the CA the server trusts" if config.cert else
                   "this client has none: set cert and key to a certificate signed by the "
                   "CA the server trusts")
        trusted = (f"the CA in this client's root_ca ({config.root_ca})" if config.root_ca
                   else "a public CA (this client trusts system_roots)")
        dialled = (f"server_name ({config.server_name})" if config.server_name
                   else f"the host dialled ({address.rpartition(':')[0]}); set server_name "
                        "to a name it lists")
        causes = [
            "the server requires client certificates (mutual TLS: its tls.client_ca) and "
            + refused,
            f"the server's certificate is not signed by {trusted}",
            f"the server's certificate does not name {dialled}",
            "the server serves plaintext (--insecure) while this client talks TLS",
        ]
        likely = _likely_cause(last)
        if likely is not None:
            causes.insert(0, "most likely, by the last error: " + causes.pop(likely))
    limit = config.max_reconnect_attempts
    if limit is None:
        retry = (f"This client keeps retrying, waiting at most {config.reconnect_max_s:g} s "
                 "(reconnect_max_s) between tries, until it is stopped (Ctrl-C or SIGTERM; "
                 "start_client's `stop` event); set ClientConfig.max_reconnect_attempts to "
                 "make it give up.")
    else:
        retry = (f"This client gives up after {limit} failed reconnects in a row "
                 "(max_reconnect_attempts).")
    lines = [f"could not connect to {address} {failures} times in a row, each time "
             f"refused while setting up the connection; the last error: {last}",
             "Likely causes:", *(f"  - {cause}" for cause in causes), retry]
    return "\n".join(lines)


#: Marks of the last error that point at one of the TLS causes (by their index).
_CAUSE_MARKS = (("socket closed", 0), ("certificate_verify_failed", 1),
                ("hostname verification", 2), ("wrong_version_number", 3))


def _likely_cause(last: str) -> int | None:
    text = last.lower()
    return next((index for mark, index in _CAUSE_MARKS if mark in text), None)
