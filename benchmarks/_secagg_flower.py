"""Flower 1.42's side of benchmarks/secagg.py: plain FedAvg and SecAgg+ in one simulation.

Both on Flower's legacy API (Flower 1.42 has SecAgg+ only there):
a ``ServerApp`` whose main runs, phase after phase, ``DefaultWorkflow`` with the default
fit workflow (plain) or ``SecAggPlusWorkflow(num_shares, reconstruction_threshold)``,
over a legacy ``FedAvg`` and a ``ClientApp`` of ``NumPyClient`` s with
``secaggplus_mod``. One ``run_simulation`` (one Ray start) holds every phase.

Like fedloom's benchmark clients, a client's "training" adds a fixed random step to the
parameters. Measured per phase:

- seconds per round: the wall time of each call of the fit workflow (the whole round:
  Flower then evaluates nothing);
- client CPU seconds per stage: ``time.thread_time`` around the rest of the mod chain
  in the ClientApp (``setup``, ``share_keys``, ``collect_masked_vectors``, which
  includes fitting, ``unmask``; ``fit`` for plain rounds), written by each Ray actor to
  a JSON-lines file and attributed to phases by wall-clock time;
- bytes sent per client: the payload of every reply (array bytes, config-record bytes,
  8 bytes per number, keys): what Flower's protobuf carries, less framing.

Dropouts: the strategy marks every fifth client it samples (``drop`` in the fit config)
and ``SecAggPlusWorkflow``'s ring is kept in the sampled order (its ``random.shuffle``
is replaced by a no-op; the sample itself is random), so the marked clients are spread
around the ring, as `fedloom.simulations.local_secure.spread_dropouts` spreads fedloom's.
A marked client answers setup and share keys, then replies with an error to the
collect-masked-vectors message (it drops after sharing its keys); in a plain round it
replies with an error to its fit message.
"""

from __future__ import annotations

import json
import os
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flwr.server.workflow.secure_aggregation.secaggplus_workflow as secaggplus_workflow
import numpy as np
from flwr.app import Context, Error, Message
from flwr.client import NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import FitIns, ndarrays_to_parameters
from flwr.server import LegacyContext, ServerApp, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.server.workflow.default_workflows import default_fit_workflow
from flwr.simulation import run_simulation

SECAGG_CONFIGS = "secaggplus_configs"  # flwr.common.secure_aggregation.secaggplus_constants
NUM_EXAMPLES = 100
STEP = 0.01


def payload_size(content: Any) -> int:
    """Bytes a RecordDict carries: arrays, bytes, strings, 8 per number, plus its keys."""
    total = 0
    for name, record in content.array_records.items():
        total += len(name) + sum(len(k) + len(a.data) for k, a in record.items())
    for records in (content.config_records, content.metric_records):
        for name, record in records.items():
            total += len(name)
            for key, value in record.items():
                total += len(key) + _value_size(value)
    return total


def _value_size(value: Any) -> int:
    if isinstance(value, bytes | str):
        return len(value)
    if isinstance(value, list):
        return sum(_value_size(v) for v in value)
    return 8


class BenchClient(NumPyClient):
    """Adds a fixed random step (seeded by the partition id) to the parameters."""

    def __init__(self, partition: int) -> None:
        self.partition = partition
        self.steps: dict[int, np.ndarray] = {}

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]
            ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        size = parameters[0].size
        if size not in self.steps:  # as fedloom's benchmark clients (_secagg_grpc)
            rng = np.random.default_rng(self.partition)
            self.steps[size] = (rng.random(size, dtype=np.float32) - np.float32(0.5)) * (
                np.float32(2 * STEP))
        return [parameters[0] + self.steps[size]], NUM_EXAMPLES, {}


def client_app(log_dir: str) -> ClientApp:
    """The ClientApp: measure → drop-if-marked → SecAgg+ (only for its messages) → fit."""
    clients: dict[int, BenchClient] = {}

    def client_fn(context: Context) -> Any:
        partition = int(context.node_config["partition-id"])
        if partition not in clients:
            clients[partition] = BenchClient(partition)
        return clients[partition].to_client()

    def measure(msg: Message, ctxt: Context, call_next: Callable[..., Message]) -> Message:
        configs = msg.content.config_records.get(SECAGG_CONFIGS)
        stage = str(configs["stage"]) if configs is not None else "fit"
        received = payload_size(msg.content)
        started, wall = time.thread_time(), time.time()
        out = call_next(msg, ctxt)
        cpu = time.thread_time() - started
        sent = payload_size(out.content) if out.has_content() else 0
        line = {"t": wall, "node": msg.metadata.dst_node_id, "stage": stage, "cpu_s": cpu,
                "sent": sent, "received": received, "error": out.has_error()}
        with open(Path(log_dir) / f"{os.getpid()}.jsonl", "a") as fh:
            fh.write(json.dumps(line) + "\n")
        return out

    def drop_or_secagg(msg: Message, ctxt: Context,
                       call_next: Callable[..., Message]) -> Message:
        fit_config = msg.content.config_records.get("fitins.config")
        if fit_config is not None and fit_config.get("drop"):
            return Message(Error(code=0, reason="benchmark dropout"), reply_to=msg)
        if SECAGG_CONFIGS in msg.content.config_records:
            return secaggplus_mod(msg, ctxt, call_next)
        return call_next(msg, ctxt)

    return ClientApp(client_fn=client_fn, mods=[measure, drop_or_secagg])


class MarkingFedAvg(FedAvg):
    """FedAvg that marks every fifth sampled client to drop (when ``drop``)."""

    def __init__(self, drop: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.drop = drop

    def configure_fit(self, server_round: int, parameters: Any,
                      client_manager: Any) -> list[tuple[Any, FitIns]]:
        pairs = super().configure_fit(server_round, parameters, client_manager)
        out = []
        for i, (proxy, fitins) in enumerate(pairs):
            config = dict(fitins.config)
            if self.drop and i % 5 == 0:
                config["drop"] = 1
            out.append((proxy, FitIns(fitins.parameters, config)))
        return out


class TimedFit:
    """Wraps a fit workflow; records each round's start and end (wall clock)."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        self.rounds: list[tuple[float, float]] = []

    def __call__(self, grid: Any, context: Any) -> None:
        started = time.time()
        self.inner(grid, context)
        self.rounds.append((started, time.time()))


def run_phases(phases: list[dict[str, Any]], num_supernodes: int, rounds: int,
               secagg: dict[str, Any], log_dir: Path) -> list[dict[str, Any]]:
    """Run each phase ({"mode", "clients", "params", "dropout"}) for ``rounds`` rounds;
    returns the phases with their round times and the actors' measurements."""
    log_dir.mkdir(parents=True, exist_ok=True)
    # Keep SecAgg+'s ring in the (random) sampled order, so marked clients are spread.
    secaggplus_workflow.random = types.SimpleNamespace(  # type: ignore[assignment]
        shuffle=lambda _ids: None)
    app = ServerApp()
    done: list[dict[str, Any]] = []

    @app.main()
    def main(grid: Any, context: Context) -> None:
        for phase in phases:
            n, params = phase["clients"], phase["params"]
            strategy = MarkingFedAvg(
                drop=phase["dropout"] > 0, fraction_fit=n / num_supernodes,
                fraction_evaluate=0.0, min_fit_clients=n, min_evaluate_clients=0,
                min_available_clients=num_supernodes,
                initial_parameters=ndarrays_to_parameters([np.zeros(params, np.float32)]))
            inner = (SecAggPlusWorkflow(**secagg) if phase["mode"] == "secure"
                     else default_fit_workflow)
            timed = TimedFit(inner)
            legacy = LegacyContext(context, config=ServerConfig(num_rounds=rounds),
                                   strategy=strategy)
            DefaultWorkflow(fit_workflow=timed)(grid, legacy)
            done.append({**phase, "round_times": timed.rounds})

    backend: dict[str, Any] = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}}
    run_simulation(app, client_app(str(log_dir)), num_supernodes=num_supernodes,
                   backend_config=backend)
    if len(done) != len(phases):
        raise RuntimeError("Flower's simulation stopped early; see its log")
    records = [json.loads(line) for path in sorted(log_dir.glob("*.jsonl"))
               for line in path.read_text().splitlines()]
    for phase in done:
        start, end = phase["round_times"][0][0], phase["round_times"][-1][1]
        phase["messages"] = [r for r in records if start <= r["t"] <= end]
    return done
