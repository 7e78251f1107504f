"""`Server`: the aggregation server's public entry point.

Embed it in Python::

    from fedloom.server import Server
    tls = TLSConfig(cert="pki/server.pem", key="pki/server.key",
                    client_ca="pki/ca.pem")     # mutual TLS (docs/security.md)
    server = Server(ServerConfig(num_rounds=5, tls=tls), initial_weights=weights,
                    evaluate_fn=my_eval)        # evaluate_fn(round, weights) -> (loss, metrics)
    history = server.run()                      # blocks; SIGINT/SIGTERM stop it cleanly
    history[-1].server["accuracy"]              # a RoundRecord per round (fedloom.records)

(``ServerConfig(insecure=True)`` serves plaintext, for loopback tests), or start it in a
background thread (tests, demos)::

    handle = server.start()                     # returns once the port is bound
    ...                                         # clients connect to 127.0.0.1:handle.port
    history = handle.wait()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from typing import Any

import grpc

from fedloom.config import ServerConfig
from fedloom.errors import AggregationError, ConfigError
from fedloom.records import RoundRecord
from fedloom.server.auth import Authenticator
from fedloom.server.coordinator import Coordinator, EvaluateFn
from fedloom.server.memory import tune_allocator
from fedloom.server.observability import MetricsEndpoint, Probes
from fedloom.server.persistence import RunPersistence
from fedloom.server.progress import RoundReporter
from fedloom.server.servicer import FleetServicer
from fedloom.server.tls import server_credentials, warn_plaintext
from fedloom.server.wire import add_fleet_servicer
from fedloom.strategies import (
    Strategy,
    aggregator_of,
    apply_privacy,
    build_strategy,
    check_aggregatable,
    check_robust_async,
    check_secure_strategy,
    min_updates,
)
from fedloom.weights import Weights

log = logging.getLogger("fedloom.server")


def grpc_server_options(config: ServerConfig) -> list[tuple[str, Any]]:
    t = config.transfer
    pending = max(1_000, 2 * config.max_clients)  # a client has one or two calls waiting
    return [
        ("grpc.max_receive_message_length", t.max_message_bytes),
        ("grpc.max_send_message_length", t.max_message_bytes),
        # Our own pings find dead peers; clients may ping every 5 s or slower without
        # data (the SDK pings every 20 s), so idle long-polls never earn a GOAWAY.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 3),
        # Never share a port with another process silently.
        ("grpc.so_reuseport", 0),
        # Calls that arrived and wait for the event loop to pick them up: past gRPC's
        # default of 1,000, it refuses more and more of them (the client sees CANCELLED),
        # and a round's results from a thousand clients, with their heartbeats, come as
        # one burst. Past twice the clients' share, a flood is still refused.
        ("grpc.server.max_pending_requests", pending),
        ("grpc.server.max_pending_requests_hard_limit", 2 * pending),
        # Fixed stream windows (gRPC's initial size, or `stream_window_bytes`): with BDP
        # probing, every upload waiting for its turn (server/transfer_slots.py) filled a
        # window of megabytes in gRPC's buffers, so memory grew with the clients. Larger
        # windows speed uploads over high-latency links at that cost (benchmarks/wan.py).
        ("grpc.http2.bdp_probe", 0),
        *([("grpc.http2.lookahead_bytes", t.stream_window_bytes)] if t.stream_window_bytes else []),
    ]


class Server:
    """The aggregation server: gRPC Fleet service + coordinator + run store."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        initial_weights: Weights | None = None,
        strategy: Strategy | None = None,
        evaluate_fn: EvaluateFn | None = None,
    ) -> None:
        self.config = config
        tune_allocator()  # the process's heap stays small through the rounds (memory.py)
        self.strategy = (
            strategy
            if strategy is not None
            else build_strategy(config.strategy, config.selection)
        )
        # [privacy] wraps the strategy (a differentially private mean; refused for rules
        # that cannot be made private), before the secure-aggregation check sees it.
        self.strategy = apply_privacy(
            self.strategy, config.privacy,
            colluding_clients=config.secure_aggregation.colluding_clients)
        check_secure_strategy(self.strategy, config.secure_aggregation)
        check_robust_async(self.strategy, config.rounds)
        _warn_below_minimum(self.strategy, config)
        if initial_weights is not None:
            try:  # every client's fit would fail on it, round after round
                check_aggregatable(initial_weights)
            except AggregationError as exc:
                raise ConfigError("initial_weights", str(exc)) from exc
        self.initial_weights = initial_weights
        self.evaluate_fn = evaluate_fn
        self.credentials = server_credentials(config)  # None: plaintext (insecure = true)
        self.auth = Authenticator.from_config(config)
        self.port: int | None = None
        self.metrics_port: int | None = None  # set when metrics_address serves /metrics
        self.coordinator: Coordinator | None = None
        self._ready = threading.Event()

    @property
    def weights(self) -> Weights | None:
        """The global model: the final one once `run` returns (None before a run
        started). It is also written as ``<state_dir>/models/<run_id>.safetensors``."""
        return self.coordinator.global_weights if self.coordinator is not None else None

    async def serve(self) -> list[RoundRecord]:
        """Run the whole federated run; returns the per-round history."""
        server = grpc.aio.server(options=grpc_server_options(self.config))
        # The ports first: a server that cannot listen must not open (or start) a run.
        try:
            port = (
                server.add_secure_port(self.config.address, self.credentials)
                if self.credentials is not None
                else server.add_insecure_port(self.config.address)
            )
            metrics = MetricsEndpoint.start_if(self.config.metrics_address)
        except (RuntimeError, ConfigError) as exc:
            await _stop_unstarted(server)
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError("address", f"cannot listen on {self.config.address}: {exc}") from exc
        persistence: RunPersistence | None = None
        reporter: RoundReporter | None = None
        probes: Probes | None = None
        started = False
        try:
            persistence = RunPersistence.open(self.config, self.initial_weights, self.strategy)
            # Round 0 is committed (or the run resumed): the initial model is on disk now,
            # and holding it would cost one model of memory for the whole run.
            self.initial_weights = None
            reporter = RoundReporter(enabled=self.config.progress)
            coordinator = Coordinator(self.config, self.strategy, persistence,
                                      evaluate_fn=self.evaluate_fn, reporter=reporter)
            self.coordinator = coordinator
            # Parses requests in the handlers: malformed protobuf gets INVALID_ARGUMENT.
            add_fleet_servicer(FleetServicer(coordinator, self.auth), server)
            probes = Probes(server, reflection_enabled=self.config.reflection)
            await server.start()
            started = True
            await probes.serving()
            self.metrics_port = metrics.port if metrics else None
            self.port = port
            self._ready.set()
            bound = self.config.address.rsplit(":", 1)[0] + f":{port}"
            if self.credentials is None:
                warn_plaintext(bound)
            log.info(
                "fedloom server listening on %s (run %s, %d rounds)",
                bound, coordinator.run_id, self.config.num_rounds,
            )
            await coordinator.run()
            if coordinator.found_over:
                log.info("run %s is over; telling its clients for up to %g s",
                         coordinator.run_id, self.config.finished_grace_s)
            await coordinator.linger()
        finally:
            await _close(server, started, metrics, reporter, probes, persistence)
        return coordinator.history

    @property
    def run_finished(self) -> bool:
        """Whether the run is over (all its rounds, or a spent privacy budget), as
        opposed to a server stopped (signal, `ServerHandle.stop`) with rounds to go."""
        return self.coordinator is not None and self.coordinator.finished.is_set()

    def run(self) -> list[RoundRecord]:
        """Serve in this thread until the run ends; SIGINT/SIGTERM stop it cleanly."""

        async def main() -> list[RoundRecord]:
            task = asyncio.current_task()
            loop = asyncio.get_running_loop()
            assert task is not None
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, task.cancel)
            return await self.serve()

        try:
            return asyncio.run(main())
        except asyncio.CancelledError:
            if self.run_finished:
                log.info("server stopped by signal; the run had finished")
            else:
                log.info("server stopped by signal before the run finished; started "
                         "again, it resumes from the last committed round")
            return self.coordinator.history if self.coordinator else []

    def start(self, timeout_s: float = 30.0) -> ServerHandle:
        """Serve in a background thread; returns once the port is bound."""
        handle = ServerHandle(self)
        handle.thread.start()
        if not self._ready.wait(timeout_s):
            handle.raise_if_failed()
            raise RuntimeError("server did not start in time")
        handle.raise_if_failed()  # it failed before serving (the state_dir, a setting)
        return handle


async def _stop_unstarted(server: grpc.aio.Server) -> None:
    """Release the ports of a server that never started: gRPC keeps an added port bound
    (and accepting) until the server has run, whatever ``stop`` or garbage collection."""
    with contextlib.suppress(Exception):  # it could not start: nothing listens then
        await server.start()
    await server.stop(None)


async def _close(server: grpc.aio.Server, started: bool, metrics: MetricsEndpoint | None,
                 reporter: RoundReporter | None, probes: Probes | None,
                 persistence: RunPersistence | None) -> None:
    """Stop serving and close the run, whatever stage `Server.serve` reached. The run's
    store (and its state folder's lock) is closed last, after the handlers have
    stopped, and whatever happens before: a second cancel during the awaits (a second
    Ctrl-C) must not leave the folder locked."""
    try:
        if reporter is not None:
            reporter.close()
        if metrics is not None:
            metrics.close()
        if not started:
            await _stop_unstarted(server)
            return
        if probes is not None:
            await probes.shutting_down()
        await server.stop(grace=1.0)
    finally:
        if persistence is not None:
            persistence.close()


class ServerHandle:
    """A server running in a background thread."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.history: list[RoundRecord] = []
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[list[RoundRecord]] | None = None
        self.thread = threading.Thread(target=self._main, name="fedloom-server", daemon=True)

    @property
    def port(self) -> int:
        assert self.server.port is not None
        return self.server.port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _main(self) -> None:
        # The Runner's close, as asyncio.run's, cancels and awaits what is still
        # scheduled when serve() returns (e.g. the last step of an RPC that gRPC's stop
        # cut short), then closes the loop: no task is left to be destroyed pending.
        with asyncio.Runner() as runner:
            loop = self._loop = runner.get_loop()
            try:
                self._task = loop.create_task(self.server.serve())
                self.history = loop.run_until_complete(self._task)
            except asyncio.CancelledError:
                coordinator = self.server.coordinator
                self.history = coordinator.history if coordinator else []
            except BaseException as exc:  # reported by wait()
                self.error = exc
                self.server._ready.set()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        """Stop serving now (as a crash between rounds would, minus the crash)."""
        if self._loop is not None and self._task is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._task.cancel)

    def wait(self, timeout_s: float | None = None) -> list[RoundRecord]:
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError("server still running")
        self.raise_if_failed()
        return self.history


def _warn_below_minimum(strategy: Strategy, config: ServerConfig) -> None:
    """Say at start when a round may sample fewer clients than the strategy's rule needs
    (Krum's ``2f + 3``, say): each such round fails, and a run can end having failed them
    all. A warning, not a refusal: ``fraction_fit`` of a larger fleet may sample enough."""
    need, have = min_updates(strategy), config.selection.min_fit_clients
    if have < need and not config.rounds.asynchronous:
        log.warning("%s needs at least %d updates a round, but min_fit_clients is %d: a "
                    "round that samples fewer than %d clients fails; raise min_fit_clients "
                    "(and min_clients) to %d", type(aggregator_of(strategy)).__name__, need,
                    have, need, need)

