"""Settings of the client SDK, and the transfer limits that it and the server both enforce.

Re-exported by `fedloom.config`; import them from there.
"""

from __future__ import annotations

import dataclasses
import math

from fedloom.compression import DOWNLOAD_CODECS, UPLOAD_CODECS, require_zstd, stage_names
from fedloom.payload import DEFAULT_CHUNK_SIZE
from fedloom.settings import check, check_address, described

_MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class TransferConfig:
    """Chunking and size limits for moving weights; both sides validate against them."""

    chunk_size: int = described(DEFAULT_CHUNK_SIZE, "bytes per weights chunk on the wire")
    max_message_bytes: int = described(
        2 * DEFAULT_CHUNK_SIZE + 64 * 1024,
        "largest gRPC message accepted (keep near 2x chunk_size)")
    max_model_bytes: int = described(8 * 1024 * _MiB,
                                     "largest model or update accepted, in bytes")
    stream_window_bytes: int = described(
        0, "server's HTTP/2 receive window per upload stream (0: gRPC's default); raise it "
        "(e.g. 4194304) for clients on high-latency links")
    inline_payloads: bool = described(
        True, "send payloads of at most min(chunk_size, 32 KiB) inside their task or result "
        "header (one message instead of two) when both sides allow it: the 'inline' "
        "capability, asked at Join by a client and granted by a server with this on")

    def __post_init__(self) -> None:
        check(self.chunk_size >= 1024, "chunk_size", "must be at least 1024 bytes")
        check(
            self.stream_window_bytes == 0 or 64 * 1024 <= self.stream_window_bytes < 2**31,
            "stream_window_bytes",
            "must be 0 (gRPC's default) or from 65536 to 2147483647 bytes",
        )
        check(
            self.max_message_bytes >= self.chunk_size + 16 * 1024,
            "max_message_bytes",
            f"must exceed chunk_size ({self.chunk_size}) by at least 16 KiB of headroom",
        )
        check(self.max_model_bytes > 0, "max_model_bytes", "must be positive")


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """Settings of the client SDK's connection loop (each field's help is its metadata).

    TLS needs one of ``root_ca`` (the CA that signed the server's certificate, ``ca.pem``
    from ``fedloom certs``), ``system_roots`` or ``insecure``; ``cert`` and ``key`` add
    mutual TLS. ``separate_upload_connection`` and ``task_stream`` are advanced settings
    whose trade-offs docs/operations.md describes.
    """

    server_address: str = dataclasses.field(metadata={"help": "HOST:PORT of the server"})
    name: str = described("", "a stable name for this client")
    rpc_timeout_s: float = described(30.0, "time limit of one call, in seconds (a task's "
                                           "download: this, plus 1 s per 16 KiB of weights)")
    stop_timeout_s: float = described(
        20.0, "after a stop (SIGTERM, SIGINT, request_stop, the stop event): the time, from "
        "the stop, for the task in progress to finish and its result to go out; then a call "
        "still in flight (a push, a join) is cancelled and a result not yet sent is dropped. "
        "The Leave that follows waits at most 5 s more: keep the two under the platform's "
        "grace period (Kubernetes: 30 s)")
    reconnect_initial_s: float = described(0.5, "first reconnect delay (doubles, jittered)")
    reconnect_max_s: float = described(30.0, "longest reconnect delay")
    max_reconnect_attempts: int | None = described(
        None, "give up after this many failed reconnects in a row: connection problems, "
              "and joins whose session never served a call (unset: retry forever); a "
              "session that served and then expired, as after a server restart, is "
              "joined again without counting")
    transfer: TransferConfig = dataclasses.field(default_factory=TransferConfig)
    root_ca: str = described("", "PEM file of the CA that signed the server's certificate")
    system_roots: bool = described(False, "trust gRPC's default public CAs instead of root_ca")
    cert: str = described("", "this client's certificate (PEM) for mutual TLS")
    key: str = described("", "the private key of cert")
    server_name: str = described(
        "", "name checked against the server's certificate, when dialling an address the "
        "certificate does not name")
    peer_ca: str = described(
        "", "CA of the other clients' certificates, which secure aggregation checks their "
        "signed keys against (default: root_ca); only a client with cert and key takes part "
        "in secure rounds whose keys are signed (docs/secure-aggregation.md)")
    insecure: bool = described(False, "talk plaintext (test servers only)")
    separate_upload_connection: bool = described(
        True, "push a result of 64 KiB or more over a short-lived connection of its own, so "
        "the server's gRPC does not keep upload-sized buffers per client (advanced)")
    task_stream: bool = described(
        True, "read tasks from one long-lived Tasks stream; off: one long-poll Pull per task "
        "(advanced: for proxies that cut long streams)")
    secagg_max_attempts: int = described(
        3, "secure rounds: the most attempts of one round this client takes part in "
        "(1..16; a server whose secure_aggregation.max_attempts is higher retries without "
        "it past that). A secure_aggregation policy given to start_client sets it instead")
    min_noise_multiplier: float = described(
        0.0, "distributed DP: refuse a round whose announced Skellam noise, as the server's "
        "accountant counts it over the round's survivor floor, is below this noise "
        "multiplier z (0: take the server's word; docs/privacy.md)")
    upload_codecs: tuple[str, ...] = described(
        (), "codecs to send updates in, most wanted first; the server grants the first it "
        f"accepts, or none ({', '.join(UPLOAD_CODECS)}; each may end in +zstd for the "
        "lossless zstd stage, and zstd alone compresses plain float32; docs/compression.md)")
    download_codecs: tuple[str, ...] = described(
        (), "codecs to receive the model in, most wanted first "
        f"({', '.join(DOWNLOAD_CODECS)}, with or without +zstd, or zstd)")
    state_dir: str = described(
        "", "folder for this client's own state (top-k's error-feedback residual, which "
        "then survives a restart); empty: kept in memory only")

    def __post_init__(self) -> None:
        check_address("server_address", self.server_address)
        _check_codecs(self)
        check(not isinstance(self.secagg_max_attempts, bool)
              and isinstance(self.secagg_max_attempts, int)
              and 1 <= self.secagg_max_attempts <= 16,
              "secagg_max_attempts", f"must be an integer in 1..16, got "
              f"{self.secagg_max_attempts!r}")
        check(math.isfinite(self.min_noise_multiplier) and self.min_noise_multiplier >= 0,
              "min_noise_multiplier", "must be a number >= 0 (0: no floor)")
        _check_client_tls(self)
        for name in ("rpc_timeout_s", "stop_timeout_s", "reconnect_initial_s",
                     "reconnect_max_s"):
            value = getattr(self, name)
            check(math.isfinite(value) and value > 0, name, "must be a positive number")
        check(
            self.reconnect_max_s >= self.reconnect_initial_s,
            "reconnect_max_s",
            "must be at least reconnect_initial_s",
        )
        check(
            self.max_reconnect_attempts is None or self.max_reconnect_attempts >= 0,
            "max_reconnect_attempts",
            "must be >= 0, or unset to retry forever",
        )


def _check_codecs(c: ClientConfig) -> None:
    for setting, allowed in (("upload_codecs", UPLOAD_CODECS),
                             ("download_codecs", DOWNLOAD_CODECS)):
        names = getattr(c, setting)
        check(isinstance(names, list | tuple) and all(n in stage_names(allowed) for n in names),
              setting, f"must list codecs among {', '.join(map(repr, allowed))} (each may end "
              f"in '+zstd', or 'zstd' alone), got {names!r}")
        object.__setattr__(c, setting, tuple(names))
        require_zstd(setting, names)


def _check_client_tls(c: ClientConfig) -> None:
    check(bool(c.key) or not c.cert, "key", "cert (the client certificate) needs its key")
    check(bool(c.cert) or not c.key, "cert", "key needs its client certificate")
    tls_settings = [n for n in ("root_ca", "system_roots", "cert", "server_name") if getattr(c, n)]
    check(
        not (c.insecure and tls_settings),
        "insecure",
        f"contradicts {', '.join(tls_settings)}: drop insecure to use TLS",
    )
    check(not (c.root_ca and c.system_roots), "system_roots", "contradicts root_ca: pick one")
    check(not c.peer_ca or bool(c.cert), "peer_ca",
          "checks other clients' signatures, which only a client with its own certificate "
          "(cert and key) takes part in")
    check(
        c.insecure or bool(c.root_ca) or c.system_roots,
        "root_ca",
        "no way to verify the server: set root_ca to the CA file that signed its "
        "certificate (ca.pem from `fedloom certs`; flag --root-ca), system_roots=True "
        "(--system-roots) for a publicly trusted certificate, or insecure=True "
        "(--insecure) to talk plaintext to a test server",
    )
