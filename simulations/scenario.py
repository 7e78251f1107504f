"""`Scenario`: one simulated federated run, as frozen dataclasses loaded from TOML.

.. code-block:: toml

    name = "digits-dirichlet"
    seed = 0
    engine = "local"            # "vectorized" (torch.func), "flower" (Flower's, on Ray)
    num_clients = 100
    clients_per_round = 10
    rounds = 20
    local_epochs = 1
    evaluate_clients_per_round = 0   # federated evaluation (0: central test set only)
    over_selection = 1.0        # the server's: 1.3 issues ceil(1.3 m) tasks, keeps the first m

    [dataset]
    name = "digits"             # or "synthetic" (FedProx's Synthetic(alpha, beta))
    test_fraction = 0.2
    # alpha = 1.0, beta = 1.0, max_samples = 1000, iid = false   (synthetic only)

    [partition]
    name = "dirichlet"          # "iid", "dirichlet", "shards"; "natural" for synthetic
    alpha = 0.5
    min_size = 5
    # shards_per_client = 2

    [model]
    name = "mlp"
    hidden = 64

    [client]
    batch_size = 32
    lr = 0.05
    momentum = 0.9              # SGD's momentum
    optimizer = "sgd"           # or "adam" (torch's defaults, at lr)
    device = "cpu"

    [strategy]
    name = "fedavg"             # any name in fedloom.strategies.STRATEGIES, with its settings

    [secure_aggregation]        # SecAgg+ on the local engine (same keys as the server's)
    enabled = false
    neighbours = 6              # k; clients_per_round >= threshold + 1
    threshold = 4

    [privacy]                   # differential privacy (same keys as the server's)
    mode = "off"                # "central" (both engines) or "distributed" (with SecAgg+)

    [secure_dropout]            # clients that vanish mid-protocol (refused without SecAgg+)
    fraction = 0.0
    after = "share_keys"        # or "advertise_keys", "masked_input"

    [engine]                    # instead of engine = "...", to set the engine's options
    name = "local"
    workers = 1                 # local: processes that train a round's clients (1: this one)
    chunk_size = 64             # vectorized: clients trained in one batched computation
    threads = 1                 # vectorized: torch threads of that computation

    [compression]               # codecs on the simulated wire (simulations.compression)
    upload = ""                 # "fp16", "bf16", "q8", "q4", "topk" (error feedback)
    download = ""               # "fp16", "bf16"

    [flower]                    # engine = "flower" only
    num_cpus = 1.0              # per client (Ray resources)
    num_gpus = 0.0
    ray_address = ""            # "" starts a local Ray; "auto" or "ray://host:10001" joins one

    [speed]                     # fit durations on the virtual clock (simulations.speed)
    distribution = "constant"   # or "lognormal" (sigma); jitter, straggler_fraction/factor
    mean_s = 1.0

With a ``[rounds]`` table (the server's: ``mode``, ``concurrency``, ``buffer_size``,
``max_staleness``, the staleness weighting, ``total_updates``, ``evaluate_every``; see
`fedloom.config.RoundsConfig`) the number of rounds is written ``num_rounds = N``, as
in the server's configuration, since TOML cannot hold ``rounds = N`` beside the table;
``rounds = N`` alone still works. ``mode = "async"`` runs FedBuff on the local engine
(`fedloom.simulations.local_async`); ``num_rounds`` then counts model versions. It is
refused with the Flower engine, secure aggregation, privacy and over-selection.
Every run is timed on a virtual clock from ``[speed]`` (`fedloom.simulations.clock`);
its records carry ``virtual_time_s``.

Unknown keys and values of the wrong type are refused with a `ConfigError` naming the
setting (``partition.alpha``...). ``[strategy]`` plus the run's client selection
(`Scenario.selection`: ``clients_per_round`` and ``evaluate_clients_per_round`` as
fractions and minimums, ``seed``) build the strategy through
`fedloom.strategies.build_strategy`. Client settings a strategy sends in its fit
config win over the scenario's: FedOpt's ``eta_l`` replaces ``client.lr``, FedProx
adds ``proximal_mu``. Evaluation: every round (or every ``rounds.evaluate_every``, and
the last) on the central test set (digits' test split; for synthetic, the union of the
clients' test splits), and federated evaluation on ``evaluate_clients_per_round``
clients' local data when > 0.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedloom.config import (
    RoundsConfig,
    SelectionConfig,
    StrategyConfig,
    from_mapping,
    load_toml,
)
from fedloom.errors import ConfigError
from fedloom.privacy import PrivacyConfig
from fedloom.secagg import SecAggConfig
from fedloom.settings import check as _check
from fedloom.settings import check_numbers as _check_numbers
from fedloom.simulations.compression import CompressionSpec
from fedloom.simulations.secure_dropout import SecureDropout
from fedloom.simulations.speed import SpeedModel, SpeedSpec
from fedloom.strategies import aggregator_of, build_strategy, min_updates

DATASETS = ("digits", "synthetic")
PARTITIONS = ("auto", "iid", "dirichlet", "shards", "natural")
ENGINES = ("local", "vectorized", "flower")
MODELS = ("mlp",)
OPTIMIZERS = ("sgd", "adam")




def _check_tables(scenario: Scenario) -> None:
    """Refuse a plain mapping (or anything else) where a `Scenario` built in Python needs
    a table's dataclass: ``Scenario(partition={"name": "iid"})``."""
    hints = typing.get_type_hints(Scenario)
    for field in dataclasses.fields(scenario):
        kind, value = hints[field.name], getattr(scenario, field.name)
        if (isinstance(kind, type) and dataclasses.is_dataclass(kind)
                and not isinstance(value, kind)):
            setting = _TABLE_NAMES.get(field.name, field.name)
            raise ConfigError(setting, f"must be a {kind.__name__}, got "
                              f"{type(value).__name__} (scenario_from_mapping reads "
                              "plain tables)")


#: Scenario fields whose TOML table has another name.
_TABLE_NAMES = {"engine_options": "engine", "rounds_config": "rounds"}


def _one_of(value: str, allowed: tuple[str, ...], setting: str) -> None:
    _check(value in allowed, setting, f"{value!r} is not one of {', '.join(allowed)}")


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """Which data set; the Synthetic(alpha, beta) settings apply to ``synthetic`` only."""

    name: str = "digits"
    test_fraction: float = 0.2
    alpha: float = 1.0
    beta: float = 1.0
    max_samples: int | None = None
    iid: bool = False

    def __post_init__(self) -> None:
        _check_numbers(self, "dataset.")
        _one_of(self.name, DATASETS, "dataset.name")
        _check(0.0 < self.test_fraction < 1.0, "dataset.test_fraction", "must be in (0, 1)")
        for key in ("alpha", "beta"):
            value = getattr(self, key)
            _check(math.isfinite(value) and value >= 0, f"dataset.{key}", "must be >= 0")
        _check(self.max_samples is None or self.max_samples >= 50, "dataset.max_samples",
               "must be at least 50 (Synthetic's minimum per client)")


@dataclasses.dataclass(frozen=True)
class PartitionSpec:
    """How the training set is split among clients (``auto``: iid, or natural for synthetic)."""

    name: str = "auto"
    alpha: float = 0.5
    min_size: int = 2
    max_retries: int = 100
    shards_per_client: int = 2

    def __post_init__(self) -> None:
        _check_numbers(self, "partition.")
        _one_of(self.name, PARTITIONS, "partition.name")
        _check(math.isfinite(self.alpha) and self.alpha > 0, "partition.alpha", "must be > 0")
        _check(self.min_size >= 1, "partition.min_size", "must be at least 1")
        _check(self.max_retries >= 1, "partition.max_retries", "must be at least 1")
        _check(self.shards_per_client >= 1, "partition.shards_per_client", "must be >= 1")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The network every client trains (a one-hidden-layer MLP)."""

    name: str = "mlp"
    hidden: int = 64

    def __post_init__(self) -> None:
        _check_numbers(self, "model.")
        _one_of(self.name, MODELS, "model.name")
        _check(self.hidden >= 1, "model.hidden", "must be at least 1")


@dataclasses.dataclass(frozen=True)
class ClientSpec:
    """Local training settings: SGD with momentum (the default) or Adam.

    ``momentum`` applies to SGD only; Adam runs with torch's defaults (betas 0.9 and
    0.999, eps 1e-8) at learning rate ``lr``. Each fit starts a fresh optimizer.
    """

    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    device: str = "cpu"
    optimizer: str = "sgd"

    def __post_init__(self) -> None:
        _check_numbers(self, "client.")
        _check(self.batch_size >= 1, "client.batch_size", "must be at least 1")
        _check(math.isfinite(self.lr) and self.lr > 0, "client.lr", "must be > 0")
        _check(0.0 <= self.momentum < 1.0, "client.momentum", "must be in [0, 1)")
        _check(bool(self.device), "client.device", "must name a torch device or 'auto'")
        _one_of(self.optimizer, OPTIMIZERS, "client.optimizer")


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Options of the in-process engines (TOML ``[engine]``, beside its ``name``).

    ``workers`` > 1 spreads a round's clients over that many processes, this one and
    ``workers - 1`` worker processes (`fedloom.simulations.parallel`); ``chunk_size``
    bounds how many clients the vectorized engine trains in one batched computation
    (its memory grows with it); ``threads`` is how many torch threads the vectorized
    engine's batched computation uses (1, the default, runs the kernels every engine
    runs; more use more cores, with results within the vectorized engine's tolerance).
    """

    workers: int = 1
    chunk_size: int = 64
    threads: int = 1

    def __post_init__(self) -> None:
        _check_numbers(self, "engine.")
        _check(self.workers >= 1, "engine.workers", "must be at least 1")
        _check(self.chunk_size >= 1, "engine.chunk_size", "must be at least 1")
        _check(self.threads >= 1, "engine.threads", "must be at least 1")


@dataclasses.dataclass(frozen=True)
class FlowerSpec:
    """Options passed to Flower's simulation engine (``engine = "flower"``)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    ray_address: str = ""
    timeout_s: float = 3600.0
    verbose: bool = False

    def __post_init__(self) -> None:
        _check_numbers(self, "flower.")
        _check(self.num_cpus > 0, "flower.num_cpus", "must be > 0 (CPUs per client)")
        _check(self.num_gpus >= 0, "flower.num_gpus", "must be >= 0 (GPU share per client)")
        _check(self.timeout_s > 0, "flower.timeout_s", "must be > 0")

    def backend_config(self) -> dict[str, Any]:
        """The ``backend_config`` of ``flwr.simulation.run_simulation``."""
        init_args: dict[str, Any] = {"address": self.ray_address} if self.ray_address else {}
        return {
            "client_resources": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            "init_args": init_args,
        }


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A whole simulated run; see the module docstring for the TOML form."""

    name: str = "scenario"
    seed: int = 0
    engine: str = "local"
    num_clients: int = 10
    clients_per_round: int = 10
    rounds: int = 5
    local_epochs: int = 1
    evaluate_clients_per_round: int = 0
    progress: bool = True
    dataset: DatasetSpec = dataclasses.field(default_factory=DatasetSpec)
    partition: PartitionSpec = dataclasses.field(default_factory=PartitionSpec)
    model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
    client: ClientSpec = dataclasses.field(default_factory=ClientSpec)
    strategy: StrategyConfig = dataclasses.field(default_factory=StrategyConfig)
    flower: FlowerSpec = dataclasses.field(default_factory=FlowerSpec)
    engine_options: EngineSpec = dataclasses.field(default_factory=EngineSpec)  # [engine]
    compression: CompressionSpec = dataclasses.field(default_factory=CompressionSpec)
    secure_aggregation: SecAggConfig = dataclasses.field(default_factory=SecAggConfig)
    secure_dropout: SecureDropout = dataclasses.field(default_factory=SecureDropout)
    privacy: PrivacyConfig = dataclasses.field(default_factory=PrivacyConfig)
    over_selection: float = 1.0  # the server's: sample ceil(m * it), keep the first m
    speed: SpeedSpec = dataclasses.field(default_factory=SpeedSpec)
    rounds_config: RoundsConfig = dataclasses.field(default_factory=RoundsConfig)  # [rounds]

    def __post_init__(self) -> None:
        _check_numbers(self)  # Scenario(...) in Python: the checks a TOML file gets
        _check_tables(self)
        _check(bool(self.name) and "/" not in self.name, "name", "must be a plain file name")
        _check(self.seed >= 0, "seed", "must be >= 0")
        _one_of(self.engine, ENGINES, "engine")
        _check(self.engine_options.workers == 1 or self.engine == "local", "engine.workers",
               f'worker processes serve engine = "local" only, not {self.engine!r}: '
               "set workers = 1")
        _check(self.engine_options.threads == 1 or self.engine == "vectorized", "engine.threads",
               f'torch threads serve engine = "vectorized" only, not {self.engine!r}: the '
               "other engines train each client on one thread, as Ray's actors do; set "
               "threads = 1")
        _check(self.num_clients >= 1, "num_clients", "must be at least 1")
        _check(  # asynchronous rounds take no cohort: only its lower bound matters there
            1 <= self.clients_per_round <= (
                self.clients_per_round if self.rounds_config.asynchronous
                else self.num_clients),
            "clients_per_round",
            f"must be in 1..num_clients ({self.num_clients})",
        )
        _check(self.rounds >= 1, "rounds", "must be at least 1")
        _check(self.local_epochs >= 1, "local_epochs", "must be at least 1")
        _check(
            0 <= self.evaluate_clients_per_round <= self.num_clients,
            "evaluate_clients_per_round",
            f"must be in 0..num_clients ({self.num_clients})",
        )
        if self.secure_aggregation.enabled:  # fedloom.simulations.local_secure
            secure = self.secure_aggregation
            _check(self.engine != "flower", "engine",
                   "secure aggregation runs on the in-process engines only (local, vectorized)")
            _check(secure.threshold + 1 <= self.clients_per_round <= secure.max_participants,
                   "clients_per_round", f"must be in threshold + 1 .. max_participants "
                   f"({secure.threshold + 1}..{secure.max_participants}) under secure "
                   "aggregation: every survivor needs threshold surviving neighbours")
        _check(self.secure_aggregation.enabled or self.secure_dropout.fraction == 0.0,
               "secure_dropout.fraction", "simulates clients that vanish mid-protocol in "
               "secure rounds only, and secure aggregation is off: set "
               "secure_aggregation.enabled = true, or leave secure_dropout out")
        _check(math.isfinite(self.over_selection) and self.over_selection >= 1.0,
               "over_selection", "must be a number >= 1 (1.3 samples 30% more clients and "
               "closes each round at the first clients_per_round updates; 1: off)")
        if self.secure_aggregation.enabled:
            _check(not self.compression.enabled, "compression",
                   "cannot be used with secure aggregation, as on the server: SecAgg+ "
                   "quantizes each update into its own field before masking, and a lossy "
                   "codec does not commute with the masks; set [compression] upload and "
                   'download to ""')
            _check(self.over_selection == 1.0, "over_selection",
                   "must be 1 with secure aggregation: a secure round cannot cancel the "
                   "slow clients once keys are shared (it tolerates dropouts instead)")
        self.privacy.check_server(secure=self.secure_aggregation.enabled,
                                  over_selection=self.over_selection)
        if self.rounds_config.asynchronous:
            self._check_async()
        else:
            self._check_robust_rounds()
        synthetic = self.dataset.name == "synthetic"
        if synthetic:
            _check(self.partition.name in ("auto", "natural"), "partition.name",
                   "synthetic data comes per client; use 'natural' (or leave it 'auto')")
        else:
            _check(self.partition.name != "natural", "partition.name",
                   f"{self.dataset.name} has no natural clients; use iid, dirichlet or shards")

    def _check_robust_rounds(self) -> None:
        """A rule that needs more updates than a round brings (Krum's ``2f + 3``,
        Bulyan's ``4f + 3``: `fedloom.strategies.Aggregator.min_updates`) would fail every
        synchronous round, which brings ``clients_per_round`` at most: refused before the
        run starts."""
        try:
            strategy = build_strategy(self.strategy, SelectionConfig())
        except ConfigError:
            return  # a bad strategy setting: refused, by name, when the run builds it
        need, aggregator = min_updates(strategy), aggregator_of(strategy)
        _check(self.clients_per_round >= need, "clients_per_round",
               f"must be at least {need} for strategy {self.strategy.name!r} (every round of "
               f"{type(aggregator).__name__} needs {need} updates), got "
               f"{self.clients_per_round}: raise clients_per_round, or change the strategy's "
               "settings (num_malicious_nodes, num_nodes_to_select, beta, "
               "enforce_preconditions)")

    def _check_async(self) -> None:
        """What FedBuff on a simulation cannot be combined with (the server refuses the
        same, for the same reasons, in `fedloom.config`)."""
        _check(self.engine == "local" and self.engine_options.workers == 1, "engine",
               'rounds.mode = "async" runs on the local engine in one process only (its '
               "virtual clock hands out one client's task at a time; Flower's simulation "
               'loop runs rounds of a sampled cohort): set engine = "local", workers = 1')
        _check(not self.secure_aggregation.enabled, "rounds.mode",
               '"async" cannot run under secure aggregation: SecAgg+ masks cancel only in '
               "the sum of a fixed cohort, while asynchronous updates arrive one at a time "
               'on different models. Set rounds.mode = "sync" or '
               "secure_aggregation.enabled = false")
        _check(not self.privacy.enabled, "rounds.mode",
               '"async" cannot run with differential privacy: the accountant assumes '
               "rounds that sample a cohort, and asynchronous updates come from whoever "
               'answers. Set rounds.mode = "sync" or privacy.mode = "off"')
        _check(not self.compression.enabled, "compression",
               'is not simulated with rounds.mode = "async" (the server does run it): '
               'use rounds.mode = "sync" to study a codec, or set [compression] upload '
               'and download to ""')
        _check(self.over_selection == 1.0, "over_selection",
               'has no use with rounds.mode = "async" (every update is taken as it '
               "arrives; rounds.concurrency sets how many clients train): leave it at 1")

    @property
    def last_round(self) -> int:
        """The run's last round (async: version), ``rounds`` or fewer (total_updates)."""
        return self.rounds_config.last_round(self.rounds)

    def speed_model(self) -> SpeedModel:
        """The clients' fit durations, drawn from ``[speed]`` and the seed."""
        return SpeedModel.from_spec(self.speed, self.num_clients, self.seed)

    @property
    def partition_name(self) -> str:
        """The partition actually used (``auto`` resolved)."""
        if self.partition.name != "auto":
            return self.partition.name
        return "natural" if self.dataset.name == "synthetic" else "iid"

    @property
    def selection(self) -> SelectionConfig:
        """The client selection this scenario's strategy samples with."""
        per_round = min(self.clients_per_round, self.num_clients)  # async: not a cohort
        return SelectionConfig(
            fraction_fit=per_round / self.num_clients,
            min_fit_clients=per_round,
            fraction_evaluate=self.evaluate_clients_per_round / self.num_clients,
            min_evaluate_clients=self.evaluate_clients_per_round,
            seed=self.seed,
        )

    def replace(self, **changes: Any) -> Scenario:
        """A copy with top-level fields changed (e.g. ``engine="flower"``)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (strategy params included)."""
        out = dataclasses.asdict(self)
        out["strategy"] = {"name": self.strategy.name, **dict(self.strategy.params)}
        return out


def scenario_from_mapping(data: Mapping[str, Any]) -> Scenario:
    """Build a `Scenario` from a parsed TOML mapping (``rounds = N``, or the server's
    ``num_rounds = N`` with a ``[rounds]`` table: see the module docstring)."""
    data = dict(data)
    if "num_rounds" in data:
        if "rounds" in data and not isinstance(data["rounds"], Mapping):
            raise ConfigError("num_rounds", "is the same setting as rounds = N: give one")
        table = data.pop("rounds", None)
        data["rounds"] = data.pop("num_rounds")
        if table is not None:
            data["rounds_config"] = table
    elif isinstance(data.get("rounds"), Mapping):
        data["rounds_config"] = data.pop("rounds")  # the count keeps its default
    if isinstance(data.get("engine"), Mapping):  # [engine]: its name and options
        options = dict(data["engine"])
        data["engine"] = options.pop("name", "local")
        data["engine_options"] = from_mapping(EngineSpec, options, where="engine.")
    if isinstance(data.get("rounds_config"), Mapping):  # errors name it [rounds], as in TOML
        data["rounds_config"] = from_mapping(RoundsConfig, data["rounds_config"],
                                             where="rounds.")
    return from_mapping(Scenario, data)


def load_scenario(path: str | Path) -> Scenario:
    """Read a scenario TOML file; the file's stem is the default ``name``."""
    data = dict(load_toml(path, "scenario"))
    data.setdefault("name", Path(path).stem)
    return scenario_from_mapping(data)
