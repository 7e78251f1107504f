"""Configuration types for the server and the client SDK.

Frozen dataclasses validated in their constructors: a bad value raises `ConfigError`
naming the setting and the fix. `load_toml` reads a server TOML file whose top-level
keys are `ServerConfig` fields and whose ``[strategy]`` table selects the strategy.

.. code-block:: toml

    address = "127.0.0.1:8080"
    num_rounds = 20
    min_fit_clients = 4

    [strategy]
    name = "fedavg"
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from fedloom.errors import ConfigError
from fedloom.payload import DEFAULT_CHUNK_SIZE
from fedloom.privacy._config import PrivacyConfig
from fedloom.secagg import SecAggConfig

_MiB = 1 << 20


def _check(cond: bool, setting: str, problem: str) -> None:
    if not cond:
        raise ConfigError(setting, problem)


def check_address(setting: str, address: str) -> None:
    host, sep, port = address.rpartition(":")
    _check(
        bool(sep) and bool(host) and port.isdigit() and 0 <= int(port) <= 65535,
        setting,
        f"{address!r} is not HOST:PORT (e.g. 127.0.0.1:8080; port 0 picks a free one)",
    )


@dataclasses.dataclass(frozen=True)
class StrategyConfig:
    """Which strategy the server runs, and its hyperparameters (validated on build)."""

    name: str = "fedavg"
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class TransferConfig:
    """Chunking and size limits for moving weights; both sides validate against them."""

    chunk_size: int = DEFAULT_CHUNK_SIZE
    max_message_bytes: int = 2 * DEFAULT_CHUNK_SIZE + 64 * 1024
    max_model_bytes: int = 8 * 1024 * _MiB
    stream_window_bytes: int = 0

    def __post_init__(self) -> None:
        _check(self.chunk_size >= 1024, "chunk_size", "must be at least 1024 bytes")
        _check(
            self.stream_window_bytes == 0 or 64 * 1024 <= self.stream_window_bytes < 2**31,
            "stream_window_bytes",
            "must be 0 (gRPC's default) or from 65536 to 2147483647 bytes",
        )
        _check(
            self.max_message_bytes >= self.chunk_size + 16 * 1024,
            "max_message_bytes",
            f"must exceed chunk_size ({self.chunk_size}) by at least 16 KiB of headroom",
        )
        _check(self.max_model_bytes > 0, "max_model_bytes", "must be positive")


@dataclasses.dataclass(frozen=True)
class TLSConfig:
    """The server's TLS files (PEM paths); ``client_ca`` turns on mutual TLS.

    With ``client_ca`` set, every client must present a certificate signed by it (the
    TLS handshake refuses any other), and the certificate's CN is the client's
    identity. ``fedloom certs`` makes a matching set (see docs/security.md).
    """

    cert: str = ""
    key: str = ""
    client_ca: str = ""

    def __post_init__(self) -> None:
        _check(bool(self.key) or not self.cert, "tls.key", "tls.cert needs its private key")
        _check(bool(self.cert) or not self.key, "tls.cert", "tls.key needs its certificate")
        _check(
            bool(self.cert) or not self.client_ca,
            "tls.client_ca",
            "mutual TLS needs the server's own tls.cert and tls.key too",
        )

    @property
    def enabled(self) -> bool:
        return bool(self.cert)


@dataclasses.dataclass(frozen=True)
class AuthConfig:
    """Who may join: identities come from client certificates (``tls.client_ca``)
    and/or per-client tokens (``tokens_file``, written by ``fedloom tokens add``).

    ``allow`` (when not empty) lists the identities admitted; any other authenticated
    client is refused with PERMISSION_DENIED. ``anonymous = true`` admits clients
    without credentials (a TLS server with neither source of identity needs it).
    """

    tokens_file: str = ""
    allow: tuple[str, ...] = ()
    anonymous: bool = False

    def __post_init__(self) -> None:
        allow = self.allow
        _check(
            isinstance(allow, list | tuple) and all(isinstance(a, str) and a for a in allow),
            "auth.allow",
            "must be a list of client names (certificate CNs or token names)",
        )
        object.__setattr__(self, "allow", tuple(allow))


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Every setting of ``fedloom server``; each is also a command-line flag."""

    address: str = "127.0.0.1:8080"
    num_rounds: int = 10
    min_clients: int = 2
    fraction_fit: float = 1.0
    min_fit_clients: int = 2
    fraction_evaluate: float = 1.0
    min_evaluate_clients: int = 0
    round_timeout_s: float = 300.0
    over_selection: float = 1.0
    evaluate_timeout_s: float = 120.0
    seed: int = 0
    state_dir: str = "fedloom-state"
    resume: bool = True
    keep_checkpoints: int = 3
    max_num_examples: int = 10_000_000
    long_poll_s: float = 20.0
    heartbeat_interval_s: float = 5.0
    client_timeout_s: float = 30.0
    stream_timeout_s: float = 600.0
    chunk_timeout_s: float = 30.0
    quarantine_after: int = 10
    quarantine_s: float = 60.0
    max_clients: int = 10_000
    progress: bool = True
    metrics_address: str = ""
    reflection: bool = True
    transfer: TransferConfig = dataclasses.field(default_factory=TransferConfig)
    strategy: StrategyConfig = dataclasses.field(default_factory=StrategyConfig)
    insecure: bool = False
    tls: TLSConfig = dataclasses.field(default_factory=TLSConfig)
    auth: AuthConfig = dataclasses.field(default_factory=AuthConfig)
    secure_aggregation: SecAggConfig = dataclasses.field(default_factory=SecAggConfig)
    privacy: PrivacyConfig = dataclasses.field(default_factory=PrivacyConfig)

    def __post_init__(self) -> None:
        check_address("address", self.address)
        _check(self.num_rounds >= 1, "num_rounds", "must be at least 1")
        _check(self.min_clients >= 1, "min_clients", "must be at least 1")
        _check(0.0 < self.fraction_fit <= 1.0, "fraction_fit", "must be in (0, 1]")
        _check(self.min_fit_clients >= 1, "min_fit_clients", "must be at least 1")
        _check(
            self.min_fit_clients <= self.min_clients,
            "min_fit_clients",
            f"({self.min_fit_clients}) cannot exceed min_clients ({self.min_clients}); "
            "raise min_clients or lower min_fit_clients",
        )
        _check(0.0 <= self.fraction_evaluate <= 1.0, "fraction_evaluate", "must be in [0, 1]")
        _check(self.min_evaluate_clients >= 0, "min_evaluate_clients", "must be >= 0")
        _check(
            self.min_evaluate_clients <= self.min_clients,
            "min_evaluate_clients",
            f"({self.min_evaluate_clients}) cannot exceed min_clients ({self.min_clients})",
        )
        for name in (
            "round_timeout_s",
            "evaluate_timeout_s",
            "long_poll_s",
            "heartbeat_interval_s",
            "client_timeout_s",
            "stream_timeout_s",
            "chunk_timeout_s",
            "quarantine_s",
        ):
            value = getattr(self, name)
            _check(math.isfinite(value) and value > 0, name, "must be a positive number")
        _check(
            self.client_timeout_s > self.heartbeat_interval_s,
            "client_timeout_s",
            f"must exceed heartbeat_interval_s ({self.heartbeat_interval_s})",
        )
        _check(
            self.client_timeout_s > self.long_poll_s,
            "client_timeout_s",
            f"must exceed long_poll_s ({self.long_poll_s}) so a waiting client is not dropped",
        )
        _check(
            math.isfinite(self.over_selection) and self.over_selection >= 1.0,
            "over_selection",
            "must be a number >= 1 (1.3 issues 30% more fit tasks than the round needs)",
        )
        _check(self.keep_checkpoints >= 1, "keep_checkpoints", "must be at least 1")
        _check(self.max_num_examples >= 1, "max_num_examples", "must be at least 1")
        _check(self.max_clients >= 1, "max_clients", "must be at least 1")
        _check(self.quarantine_after >= 0, "quarantine_after", "must be >= 0 (0 disables it)")
        _check(bool(self.state_dir), "state_dir", "must name a folder")
        if self.metrics_address:
            check_address("metrics_address", self.metrics_address)
        _check_security(self.insecure, self.tls, self.auth)
        self.secure_aggregation.check_server(self.min_fit_clients, self.over_selection,
                                             authenticated=self.mutual_tls)
        self.privacy.check_server(secure=self.secure_aggregation.enabled,
                                  over_selection=self.over_selection)

    @property
    def mutual_tls(self) -> bool:
        """Clients hold certificates of ``tls.client_ca`` (their identity is proven)."""
        return bool(self.tls.client_ca) and not self.insecure


def _check_security(insecure: bool, tls: TLSConfig, auth: AuthConfig) -> None:
    """Plaintext only when asked for; every TLS server says how clients prove who they are."""
    _check(
        insecure or tls.enabled,
        "tls",
        "no TLS certificate: set tls.cert and tls.key (`fedloom certs` makes a set; "
        "flags --tls-cert/--tls-key), or set insecure = true (--insecure) to serve "
        "plaintext on a trusted network",
    )
    _check(
        not (insecure and tls.enabled),
        "insecure",
        "contradicts tls.cert: drop insecure to serve TLS, or drop the tls settings",
    )
    identified = bool(tls.client_ca or auth.tokens_file)
    _check(
        identified or auth.anonymous or insecure,
        "auth",
        "clients have no way to prove who they are: set tls.client_ca (mutual TLS), "
        "auth.tokens_file (`fedloom tokens add NAME`), or auth.anonymous = true to admit "
        "anyone who can reach the port",
    )
    _check(
        identified or not auth.allow,
        "auth.allow",
        "an allow-list needs identities: set tls.client_ca or auth.tokens_file",
    )


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """Settings of the client SDK's connection loop.

    TLS: ``root_ca`` is the PEM file of the CA that signed the server's certificate
    (``ca.pem`` from ``fedloom certs``), or ``system_roots=True`` trusts gRPC's default
    public CAs; ``cert`` and ``key`` are this client's certificate for mutual TLS;
    ``server_name`` overrides the name checked against the server's certificate (when
    dialling an address the certificate does not name). ``insecure=True`` talks
    plaintext (test servers only); one of the three is required.

    ``separate_upload_connection`` (default on): a result whose payload is 64 KiB or
    more is pushed over a connection of its own, closed when the push ends. gRPC keeps
    read buffers sized to the largest messages a connection has received (about 1 MB
    per connection after 1 MiB chunks) until that connection closes, so on the
    long-lived channel the server's memory would grow by that much for every client
    that has uploaded. The connection is opened when a task with a large model arrives,
    so its set-up (TCP, and TLS when on) overlaps the training; turn it off only when the
    server has memory to spare for its clients.

    ``peer_ca``: the CA of the other clients' certificates, which secure aggregation
    checks their signed keys and confirmations against (default: ``root_ca``, the
    single CA ``fedloom certs`` makes). A client with ``cert`` and ``key`` takes part
    only in secure rounds whose keys are signed (see docs/secure-aggregation.md).

    ``task_stream`` (default on): read tasks from one long-lived Tasks stream instead of
    one Pull call per task. A call costs both sides about a millisecond of CPU to set up
    in Python gRPC, and a secure round has four tasks per client; off, every task is a
    Pull (for proxies that cut long streams, or to compare).

    ``min_noise_multiplier`` (distributed differential privacy, docs/privacy.md): the
    client refuses a round whose announced Skellam noise, summed over the round's survivor
    floor, is below this noise multiplier z; 0 (default) takes the server's word for it.
    """

    server_address: str
    name: str = ""
    long_poll_s: float = 20.0
    rpc_timeout_s: float = 30.0
    reconnect_initial_s: float = 0.5
    reconnect_max_s: float = 30.0
    max_reconnect_attempts: int | None = None
    transfer: TransferConfig = dataclasses.field(default_factory=TransferConfig)
    root_ca: str = ""
    system_roots: bool = False
    cert: str = ""
    key: str = ""
    server_name: str = ""
    peer_ca: str = ""
    insecure: bool = False
    separate_upload_connection: bool = True
    task_stream: bool = True
    min_noise_multiplier: float = 0.0

    def __post_init__(self) -> None:
        check_address("server_address", self.server_address)
        _check(math.isfinite(self.min_noise_multiplier) and self.min_noise_multiplier >= 0,
               "min_noise_multiplier", "must be a number >= 0 (0: no floor)")
        _check_client_tls(self)
        for name in ("long_poll_s", "rpc_timeout_s", "reconnect_initial_s", "reconnect_max_s"):
            value = getattr(self, name)
            _check(math.isfinite(value) and value > 0, name, "must be a positive number")
        _check(
            self.reconnect_max_s >= self.reconnect_initial_s,
            "reconnect_max_s",
            "must be at least reconnect_initial_s",
        )
        _check(
            self.max_reconnect_attempts is None or self.max_reconnect_attempts >= 0,
            "max_reconnect_attempts",
            "must be >= 0, or unset to retry forever",
        )


def _check_client_tls(c: ClientConfig) -> None:
    _check(bool(c.key) or not c.cert, "key", "cert (the client certificate) needs its key")
    _check(bool(c.cert) or not c.key, "cert", "key needs its client certificate")
    tls_settings = [n for n in ("root_ca", "system_roots", "cert", "server_name") if getattr(c, n)]
    _check(
        not (c.insecure and tls_settings),
        "insecure",
        f"contradicts {', '.join(tls_settings)}: drop insecure to use TLS",
    )
    _check(not (c.root_ca and c.system_roots), "system_roots", "contradicts root_ca: pick one")
    _check(not c.peer_ca or bool(c.cert), "peer_ca",
           "checks other clients' signatures, which only a client with its own certificate "
           "(cert and key) takes part in")
    _check(
        c.insecure or bool(c.root_ca) or c.system_roots,
        "root_ca",
        "no way to verify the server: set root_ca to the CA file that signed its "
        "certificate (ca.pem from `fedloom certs`; flag --root-ca), system_roots=True "
        "(--system-roots) for a publicly trusted certificate, or insecure=True "
        "(--insecure) to talk plaintext to a test server",
    )


T = TypeVar("T")


def from_mapping(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Build a config dataclass from a (TOML) mapping, refusing unknown keys and types."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        setting = f"{where}{key}"
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(setting, f"unknown setting{hint}")
        kwargs[key] = _coerce(hints[key], value, setting)
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, setting: str) -> Any:
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if isinstance(value, hint):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(setting, f"must be a table, got {type(value).__name__}")
        if hint is StrategyConfig:
            params = dict(value)
            name = params.pop("name", "fedavg")
            if not isinstance(name, str):
                raise ConfigError(f"{setting}.name", "must be a string")
            return StrategyConfig(name=name, params=params)
        return from_mapping(hint, value, where=f"{setting}.")
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, setting)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(setting, f"must be a number, got {value!r}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(setting, f"must be an integer, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(setting, f"must be true or false, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(setting, f"must be a string, got {value!r}")
        return value
    return value


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file, turning parse errors into `ConfigError`."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError("--config", f"file {str(path)!r} not found") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--config", f"{path} is not valid TOML: {exc}") from exc
