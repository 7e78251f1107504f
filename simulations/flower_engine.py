"""The Flower engine: a fedloom strategy and ClientApp on Flower's simulation runtime.

`run_flower` wraps the strategy in `FlowerStrategy`, runs it from a ``ServerApp``
under ``flwr.simulation.run_simulation`` (Ray backend: one machine, or a Ray cluster
through ``init_args={"address": ...}``) and records rounds through the same
`RoundRecorder` as the local engine. The ``ServerApp`` runs in a thread of this
process, so the strategy object and the recorder are the caller's own. Nodes are asked
their partition id only when the ClientApp answers that query
(`flower_client.answers_identity_query`): a plain Flower ClientApp is not sent it, so it
logs no error (see `flower_strategy`'s docstring).

Ray is started by `start_ray` before the simulation (Flower's backend then uses it): a
local Ray head that does not come up is retried with a fresh one instead of failing the
run.

When Flower's simulation runtime fails (Ray does not start, a backend crashes),
``run_simulation`` raises but its ServerApp thread — not a daemon — would go on waiting
for replies for the whole round timeout and keep the process from exiting. So the
ServerApp talks to the runtime through `_StoppableGrid`, whose waits end (with an
error, in that thread) as soon as ``run_simulation`` has returned or raised.

Example — any ``ClientApp`` (e.g. from `to_client_app`)::

    strategy = FedAvg(selection=SelectionConfig(fraction_fit=0.1, seed=0))
    history = run_flower(strategy, app, initial,
                         num_clients=100, num_rounds=5,
                         backend_config={"client_resources": {"num_cpus": 1}})
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation
from flwr.supercore.run import Run

from fedloom.simulations._ray_start import start_ray, stop_ray
from fedloom.simulations._records import arrays_to_weights, metrics_to_record, weights_to_arrays
from fedloom.simulations.clock import SyncClock
from fedloom.simulations.compression import SimulatedCompression
from fedloom.simulations.flower_client import answers_identity_query
from fedloom.simulations.flower_strategy import FlowerStrategy
from fedloom.simulations.history import History, RoundRecord, RoundRecorder
from fedloom.strategies import Strategy
from fedloom.types import AggregateResult, Metrics, Scalar
from fedloom.weights import Weights

EvaluateFn = Callable[[int, Weights], Metrics | None]


def run_flower(
    strategy: Strategy,
    client_app: ClientApp,
    initial: Weights,
    *,
    num_clients: int,
    num_rounds: int,
    base_seed: int = 0,
    fit_defaults: Mapping[str, Scalar] | None = None,
    evaluate_fn: EvaluateFn | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_model: Callable[[Weights], None] | None = None,
    backend_config: Mapping[str, Any] | None = None,
    timeout_s: float = 3600.0,
    verbose: bool = False,
    clock: SyncClock | None = None,
    evaluate_every: int = 1,
    compression: SimulatedCompression | None = None,
) -> History:
    """Run ``num_rounds`` rounds on ``num_clients`` virtual SuperNodes.

    Args mirror `run_local`; in addition:
        client_app: the ClientApp every SuperNode runs (partition ``i`` is the node
            whose ``node_config["partition-id"]`` is ``i``).
        backend_config: Flower's ``backend_config`` (``client_resources``,
            ``init_args`` for ``ray.init``...).
        timeout_s: how long a round waits for replies.
        verbose: Flower's DEBUG logging.
        clock: time the rounds on a virtual clock (`run_local`'s; the bridge sends
            train messages only to the clients it keeps).
        evaluate_every: rounds between evaluations (the last round is always evaluated).
        compression: the codecs between clients and server (`run_local`'s).
    """
    if evaluate_every < 1:
        raise ValueError("evaluate_every must be at least 1")
    started = time.perf_counter()
    recorder = RoundRecorder(on_round, on_model)

    def on_fit_round(_round: int, result: AggregateResult, failures: int) -> None:
        timing = clock.last if clock is not None else None
        traffic = bridge.compression.traffic()
        if timing is None:
            recorder.fit(result, failures, traffic=traffic)
        else:
            recorder.fit(result, failures, num_sampled=timing.num_sampled,
                         num_cancelled=timing.num_cancelled, traffic=traffic)

    bridge = FlowerStrategy(
        strategy,
        base_seed=base_seed,
        fit_defaults=fit_defaults,
        min_available_nodes=num_clients,
        identify_nodes=answers_identity_query(client_app),
        on_fit_round=on_fit_round,
        on_evaluate_round=lambda _r, metrics: recorder.evaluate(metrics),
        clock=clock,
        evaluate_every=evaluate_every,
        num_rounds=num_rounds,
        compression=compression,
    )
    final: dict[str, Weights] = {"weights": initial}

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        weights = arrays_to_weights(arrays)
        final["weights"] = weights
        metrics = None
        if evaluate_fn is not None and (server_round == 0 or bridge.evaluates(server_round)):
            metrics = evaluate_fn(server_round, weights)
        recorder.finish(server_round, metrics, clock.now if clock is not None else None,
                        weights)
        return metrics_to_record(metrics) if metrics else None

    server_app = ServerApp()
    runtime_ended = threading.Event()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        bridge.start(
            _StoppableGrid(grid, runtime_ended),
            weights_to_arrays(initial),
            num_rounds=num_rounds,
            timeout=timeout_s,
            evaluate_fn=central,
        )

    config = _plain(backend_config or {})
    started_ray = start_ray(config, verbose=verbose)
    try:
        run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=num_clients,
            backend_config=config,
            verbose_logging=verbose,
        )
    finally:
        runtime_ended.set()  # a ServerApp still waiting on a failed runtime stops now
        if started_ray:
            stop_ray()
    if len(recorder.records) != num_rounds + 1:
        raise RuntimeError(
            f"Flower's simulation ended after {len(recorder.records) - 1} of {num_rounds} "
            "rounds; see its log above"
        )
    return History("flower", recorder.records, final["weights"], time.perf_counter() - started)


class _StoppableGrid(Grid):
    """The simulation's Grid, with every wait ending once ``stopped`` is set (see the
    module docstring): replies are pulled every `PULL_INTERVAL_S` as Flower's in-memory
    Grid does, and a call made or waiting after the runtime ended raises RuntimeError."""

    PULL_INTERVAL_S = 0.1

    def __init__(self, grid: Grid, stopped: threading.Event) -> None:
        self._grid = grid
        self._stopped = stopped

    def _check(self) -> None:
        if self._stopped.is_set():
            raise RuntimeError("Flower's simulation runtime has ended; the ServerApp stops")

    def set_run(self, run: Run) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Run:
        return self._grid.run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return self._grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        self._check()
        return self._grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        self._check()
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        self._check()
        return self._grid.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push ``messages``, then pull replies until all came, ``timeout`` passed, or the
        runtime ended (RuntimeError)."""
        pending = set(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while pending:
            got = list(self.pull_messages(pending))
            replies.extend(got)
            pending.difference_update(m.metadata.reply_to_message_id for m in got)
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                break
            if self._stopped.wait(self.PULL_INTERVAL_S):
                self._check()
        return replies


def _plain(config: Mapping[str, Any]) -> Any:
    """A deep copy as plain dicts (Flower serialises ``backend_config`` to JSON)."""
    return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in config.items()}
