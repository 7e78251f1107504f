"""Configuration types for the server and the client SDK.

Frozen dataclasses validated in their constructors: a bad value raises `ConfigError`
naming the setting and the fix; each field's help text is its metadata
(`fedloom.settings.described`). `load_toml` reads a server TOML file whose top-level
keys are `ServerConfig` fields (client selection among them) and whose ``[strategy]``
table selects the strategy; a relative path in it (``state_dir``, ``tls.cert``,
``tls.key``, ``tls.client_ca``, ``auth.tokens_file``) is relative to the file's folder
(`fedloom._config_files`).

.. code-block:: toml

    address = "127.0.0.1:8080"
    num_rounds = 20
    min_clients = 6
    fraction_fit = 0.5       # client selection: ServerConfig.selection
    min_fit_clients = 4

    [strategy]
    name = "fedavg"
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from fedloom._client_config import ClientConfig, TransferConfig
from fedloom._compression_config import CompressionConfig, check_compression
from fedloom._config_files import load_toml
from fedloom._metrics_config import MetricsConfig
from fedloom._rounds_config import RoundsConfig
from fedloom.errors import ConfigError
from fedloom.privacy._config import PrivacyConfig
from fedloom.secagg import SecAggConfig
from fedloom.settings import check, check_address, check_numbers, described, from_mapping

__all__ = [
    "AuthConfig",
    "ClientConfig",
    "CompressionConfig",
    "MetricsConfig",
    "RoundsConfig",
    "SelectionConfig",
    "ServerConfig",
    "StrategyConfig",
    "TLSConfig",
    "TransferConfig",
    "from_mapping",
    "load_toml",
]


@dataclasses.dataclass(frozen=True)
class StrategyConfig:
    """Which strategy the server runs, and its hyperparameters (validated on build)."""

    name: str = "fedavg"
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_table(cls, table: Mapping[str, Any], setting: str = "strategy") -> StrategyConfig:
        """A ``[strategy]`` table: ``name`` plus the strategy's settings, side by side."""
        params = dict(table)
        name = params.pop("name", "fedavg")
        if not isinstance(name, str):
            raise ConfigError(f"{setting}.name", "must be a string")
        return cls(name=name, params=params)


@dataclasses.dataclass(frozen=True)
class SelectionConfig:
    """Which clients each round samples; a strategy receives it and samples with it.

    The server builds it from its own top-level settings (`ServerConfig.selection`), a
    simulation from its scenario, so a strategy samples exactly what its runner waits
    for. Sampling is seeded and checkpointed (`fedloom.strategies.ClientSampler`), except
    under central differential privacy, which samples secretly (`ClientSampler.secret`).

    >>> SelectionConfig(fraction_fit=0.5, min_fit_clients=3, seed=1).fraction_evaluate
    1.0
    """

    fraction_fit: float = described(
        1.0, "share of connected clients sampled to train each round, in (0, 1]")
    min_fit_clients: int = described(
        2, "fewest clients sampled to train (when connected), and fewest updates a server "
           "round accepts at its deadline")
    fraction_evaluate: float = described(
        1.0, "share of clients sampled for federated evaluation (0 disables it)")
    min_evaluate_clients: int = described(
        0, "fewest clients sampled for federated evaluation, when it is enabled")
    seed: int = described(0, "seed of client sampling (checkpointed, so a resumed run "
                             "samples alike; central DP samples secretly instead)")

    def __post_init__(self) -> None:
        check(math.isfinite(self.fraction_fit) and 0.0 < self.fraction_fit <= 1.0,
              "fraction_fit", f"must be in (0, 1], got {self.fraction_fit}")
        check(self.min_fit_clients >= 1, "min_fit_clients",
              f"must be at least 1, got {self.min_fit_clients}")
        check(math.isfinite(self.fraction_evaluate) and 0.0 <= self.fraction_evaluate <= 1.0,
              "fraction_evaluate", f"must be in [0, 1], got {self.fraction_evaluate}")
        check(self.min_evaluate_clients >= 0, "min_evaluate_clients",
              f"must be >= 0, got {self.min_evaluate_clients}")


def _selection_field(name: str) -> Any:
    """A `ServerConfig` field that is `SelectionConfig`'s: the same default and help."""
    spec = SelectionConfig.__dataclass_fields__[name]
    return dataclasses.field(default=spec.default, metadata=spec.metadata)


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
        check(bool(self.key) or not self.cert, "tls.key", "tls.cert needs its private key")
        check(bool(self.cert) or not self.key, "tls.cert", "tls.key needs its certificate")
        check(
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
        check(
            isinstance(allow, list | tuple) and all(isinstance(a, str) and a for a in allow),
            "auth.allow",
            "must be a list of client names (certificate CNs or token names)",
        )
        object.__setattr__(self, "allow", tuple(allow))


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Every setting of ``fedloom server``; each scalar is also a command-line flag."""

    address: str = described("127.0.0.1:8080", "HOST:PORT to listen on (port 0 picks a free "
                                               "port)")
    num_rounds: int = described(10, "rounds of training in the run")
    min_clients: int = described(2, "connected clients needed before a round starts")
    min_clients_wait_s: float = described(
        0.0, "seconds a round waits for min_clients before the server stops, to be "
        "restarted when clients can come (exit status 75); 0: wait as long as it takes")
    fraction_fit: float = _selection_field("fraction_fit")
    min_fit_clients: int = _selection_field("min_fit_clients")
    fraction_evaluate: float = _selection_field("fraction_evaluate")
    min_evaluate_clients: int = _selection_field("min_evaluate_clients")
    round_timeout_s: float = described(300.0, "seconds a round waits for updates before "
                                              "closing")
    over_selection: float = described(
        1.0, "issue this many times the fit tasks a round needs; close it with the first "
             "enough updates (1.3: 30 percent more; 1: off)")
    evaluate_timeout_s: float = described(120.0, "seconds federated evaluation waits for "
                                                 "results")
    round_retries: int = described(0, "times a failed round is run again (new sample, new "
                                      "tasks) before it is committed as failed and the next "
                                      "round starts; synchronous rounds")
    seed: int = _selection_field("seed")
    state_dir: str = described("fedloom-state", "folder for the run database, checkpoints "
                                                "and upload spool")
    resume: bool = described(True, "resume the latest unfinished run in state_dir")
    new_run: bool = described(
        False, "start a new run even though the last run in state_dir finished (without "
               "it the server tells that run's clients it is over and exits); pass it once, "
               "not in a supervisor's restart command")
    finished_grace_s: float = described(
        60.0, "seconds a server started on a run that is over (a restart after its last "
              "commit, or of a finished run) answers 'run finished' to the clients that "
              "come back (0: exit at once)")
    keep_checkpoints: int = described(3, "checkpoints kept per run (the newest)")
    max_num_examples: int = described(10_000_000, "largest num_examples a client may claim")
    long_poll_s: float = described(20.0, "seconds a Pull waits for a task before answering "
                                         "'no task yet' (on a Tasks stream: the keep-alive "
                                         "period); clients learn it at Join")
    heartbeat_interval_s: float = described(5.0, "seconds between client heartbeats")
    client_timeout_s: float = described(30.0, "seconds of silence after which a client is "
                                              "dropped")
    stream_timeout_s: float = described(600.0, "time limit of one upload or download "
                                               "stream, in seconds")
    chunk_timeout_s: float = described(30.0, "seconds a model stream holding a transfer "
                                             "turn may go without moving a chunk")
    min_transfer_rate: int = described(
        65536, "bytes per second a model stream holding a transfer turn must keep up, with "
               "transfer_window_s of slack (a turn is held at most transfer_window_s + "
               "size / rate); slower streams are cut and count as strikes (0: no minimum)")
    transfer_window_s: float = described(
        10.0, "seconds a model stream holding a transfer turn may fall behind "
              "min_transfer_rate")
    quarantine_after: int = described(10, "refused messages within quarantine_s that "
                                          "quarantine a client (0: never)")
    quarantine_s: float = described(60.0, "seconds a quarantined client is refused (and "
                                           "the window strikes count in)")
    max_clients: int = described(10_000, "most clients connected at once")
    progress: bool = described(True, "show the live progress display")
    metrics_address: str = described("", "HOST:PORT serving Prometheus /metrics (empty: "
                                          "off)")
    reflection: bool = described(True, "serve gRPC server reflection (for grpcurl and "
                                        "similar tools)")
    transfer: TransferConfig = dataclasses.field(default_factory=TransferConfig)
    strategy: StrategyConfig = dataclasses.field(default_factory=StrategyConfig)
    insecure: bool = described(False, "serve plaintext (trusted test networks only)")
    tls: TLSConfig = dataclasses.field(default_factory=TLSConfig)
    auth: AuthConfig = dataclasses.field(default_factory=AuthConfig)
    secure_aggregation: SecAggConfig = dataclasses.field(default_factory=SecAggConfig)
    privacy: PrivacyConfig = dataclasses.field(default_factory=PrivacyConfig)
    rounds: RoundsConfig = dataclasses.field(default_factory=RoundsConfig)
    compression: CompressionConfig = dataclasses.field(default_factory=CompressionConfig)
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        check_numbers(self)
        check_address("address", self.address)
        check(self.num_rounds >= 1, "num_rounds", "must be at least 1")
        check(self.min_clients >= 1, "min_clients", "must be at least 1")
        selection = self.selection  # validates the five selection settings
        check(
            selection.min_fit_clients <= self.min_clients,
            "min_fit_clients",
            f"({selection.min_fit_clients}) cannot exceed min_clients ({self.min_clients}); "
            "raise min_clients or lower min_fit_clients",
        )
        check(
            selection.min_evaluate_clients <= self.min_clients,
            "min_evaluate_clients",
            f"({selection.min_evaluate_clients}) cannot exceed min_clients "
            f"({self.min_clients})",
        )
        for name in (
            "round_timeout_s",
            "evaluate_timeout_s",
            "long_poll_s",
            "heartbeat_interval_s",
            "client_timeout_s",
            "stream_timeout_s",
            "chunk_timeout_s",
            "transfer_window_s",
            "quarantine_s",
        ):
            value = getattr(self, name)
            check(math.isfinite(value) and value > 0, name, "must be a positive number")
        for name in ("long_poll_s", "heartbeat_interval_s"):  # what clients accept
            check(0.1 <= getattr(self, name) <= 3600, name, "must be in 0.1..3600 s (clients "
                  "refuse a server that would have them call it more often, or wait longer)")
        check(
            self.client_timeout_s > self.heartbeat_interval_s,
            "client_timeout_s",
            f"must exceed heartbeat_interval_s ({self.heartbeat_interval_s})",
        )
        check(
            self.client_timeout_s > self.long_poll_s,
            "client_timeout_s",
            f"must exceed long_poll_s ({self.long_poll_s}) so a waiting client is not dropped",
        )
        check(
            math.isfinite(self.over_selection) and self.over_selection >= 1.0,
            "over_selection",
            "must be a number >= 1 (1.3 issues 30% more fit tasks than the round needs)",
        )
        check(
            math.isfinite(self.finished_grace_s) and self.finished_grace_s >= 0,
            "finished_grace_s",
            "must be a number of seconds >= 0 (keep it above the clients' reconnect_max_s "
            "so that every client hears that the run is over)",
        )
        check(
            self.min_transfer_rate >= 0,
            "min_transfer_rate",
            "must be a number of bytes per second >= 0 (0: no minimum)",
        )
        check(self.keep_checkpoints >= 1, "keep_checkpoints", "must be at least 1")
        check(math.isfinite(self.min_clients_wait_s) and self.min_clients_wait_s >= 0,
              "min_clients_wait_s", "must be a number of seconds >= 0 (0: no limit)")
        check(self.round_retries >= 0, "round_retries", "must be >= 0 (0: a failed round "
                                                        "counts, and the run goes on)")
        check(self.max_num_examples >= 1, "max_num_examples", "must be at least 1")
        check(self.max_clients >= 1, "max_clients", "must be at least 1")
        check(self.quarantine_after >= 0, "quarantine_after", "must be >= 0 (0 disables it)")
        check(bool(self.state_dir), "state_dir", "must name a folder")
        if self.metrics_address:
            check_address("metrics_address", self.metrics_address)
        _check_security(self.insecure, self.tls, self.auth)
        self.secure_aggregation.check_server(self.min_fit_clients, self.over_selection,
                                             authenticated=self.mutual_tls)
        self.privacy.check_server(secure=self.secure_aggregation.enabled,
                                  over_selection=self.over_selection,
                                  min_fit_clients=self.min_fit_clients,
                                  round_retries=self.round_retries)
        if self.rounds.asynchronous:
            _check_async(self)
        check_compression(self.compression, secure=self.secure_aggregation.enabled)

    @property
    def selection(self) -> SelectionConfig:
        """The client selection the server's strategy is built with."""
        return SelectionConfig(
            fraction_fit=self.fraction_fit,
            min_fit_clients=self.min_fit_clients,
            fraction_evaluate=self.fraction_evaluate,
            min_evaluate_clients=self.min_evaluate_clients,
            seed=self.seed,
        )

    @property
    def mutual_tls(self) -> bool:
        """Clients hold certificates of ``tls.client_ca`` (their identity is proven)."""
        return bool(self.tls.client_ca) and not self.insecure


def _check_async(config: ServerConfig) -> None:
    """What buffered asynchronous rounds cannot be combined with, and why."""
    check(
        not config.secure_aggregation.enabled,
        "rounds.mode",
        '"async" cannot run under secure aggregation: SecAgg+ masks cancel only in the sum '
        "of a fixed cohort that answers each stage together, while asynchronous updates "
        'arrive one at a time on different models. Set rounds.mode = "sync" or '
        "secure_aggregation.enabled = false",
    )
    check(
        config.privacy.mode == "off",
        "rounds.mode",
        '"async" cannot run with differential privacy: the accountant assumes rounds that '
        "sample a cohort from the connected clients, and asynchronous updates are taken "
        'from whoever answers. Set rounds.mode = "sync" or privacy.mode = "off"',
    )
    rounds = config.rounds
    cap = rounds.max_updates_per_client
    check(
        cap == 0 or config.min_clients * cap >= rounds.buffer_size,
        "rounds.max_updates_per_client",
        f"{cap} update(s) from each of min_clients = {config.min_clients} clients cannot "
        f"fill a buffer of rounds.buffer_size = {rounds.buffer_size}: raise min_clients to "
        f"{-(-rounds.buffer_size // max(cap, 1))}, raise max_updates_per_client, or set it "
        "to 0 (no limit)",
    )
    check(
        config.over_selection == 1.0,
        "over_selection",
        'has no use with rounds.mode = "async" (every update is taken as it arrives; '
        "rounds.concurrency sets how many clients train): leave it at 1",
    )


def _check_security(insecure: bool, tls: TLSConfig, auth: AuthConfig) -> None:
    """Plaintext only when asked for; every TLS server says how clients prove who they are."""
    check(
        insecure or tls.enabled,
        "tls",
        "no TLS certificate: set tls.cert and tls.key (`fedloom certs` makes a set; "
        "flags --tls-cert/--tls-key), or set insecure = true (--insecure) to serve "
        "plaintext on a trusted network",
    )
    check(
        not (insecure and tls.enabled),
        "insecure",
        "contradicts tls.cert: drop insecure to serve TLS, or drop the tls settings",
    )
    identified = bool(tls.client_ca or auth.tokens_file)
    check(
        identified or auth.anonymous or insecure,
        "auth",
        "clients have no way to prove who they are: set tls.client_ca (mutual TLS), "
        "auth.tokens_file (`fedloom tokens add NAME`), or auth.anonymous = true to admit "
        "anyone who can reach the port",
    )
    check(
        identified or not auth.allow,
        "auth.allow",
        "an allow-list needs identities: set tls.client_ca or auth.tokens_file",
    )
