"""`start_client`: the blocking loop an application runs to take part in training.

It joins, long-polls for tasks, runs them on the application's `Client`, pushes the
results, sends heartbeats from a background thread, and reconnects with exponential
backoff and full jitter when the server goes away (a restarted server forgets
sessions: the client simply joins again). It returns when the server says the run is
over, when ``stop`` is set, or on SIGINT/SIGTERM (when called from the main thread).

Example::

    from fedloom.client_sdk import start_client
    from fedloom.config import ClientConfig
    config = ClientConfig("fl.example.org:8080", root_ca="ca.pem",       # TLS
                          cert="hospital-7.pem", key="hospital-7.key")    # mutual TLS
    stats = start_client("fl.example.org:8080", MyClient(), config=config)
"""

from __future__ import annotations

import dataclasses
import logging
import random
import signal
import threading
import time
from types import FrameType
from typing import Any

import numpy as np

from fedloom.client_sdk._client import Client
from fedloom.client_sdk._compression import UpdateEncoder
from fedloom.client_sdk._progress import console_handler, log_task
from fedloom.client_sdk.connection import Connection
from fedloom.client_sdk.secure_fit import SecureFit
from fedloom.client_sdk.tls import HandshakeFailures
from fedloom.config import ClientConfig
from fedloom.errors import (
    FedloomError,
    ResultRefusedError,
    SecureAggregationError,
    SessionExpiredError,
    TransportError,
)
from fedloom.messages import JoinReply, NoTask, ResultHeader, Session, TaskHeader
from fedloom.secagg import (
    MaskedInputRequest,
    PeerVerifier,
    RoundLedger,
    SecAggConfig,
    SigningIdentity,
)
from fedloom.types import TaskKind
from fedloom.weights import Weights

log = logging.getLogger("fedloom.client")

PUSH_ATTEMPTS = 4


@dataclasses.dataclass
class ClientStats:
    """What a `start_client` call did."""

    fits: int = 0
    evaluations: int = 0
    failures: int = 0
    refused: int = 0
    reconnects: int = 0
    run_finished: bool = False


class Backoff:
    """Exponential backoff with full jitter: sleep U(0, min(max, initial * 2**n))."""

    def __init__(self, initial_s: float, max_s: float, rng: random.Random | None = None) -> None:
        self.initial_s, self.max_s = initial_s, max_s
        self.attempt = 0
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        cap = min(self.max_s, self.initial_s * (2.0**self.attempt))
        self.attempt += 1
        return self._rng.uniform(0.0, cap)

    def reset(self) -> None:
        self.attempt = 0


class _Heartbeat:
    def __init__(self, connection: Connection, interval_s: float, stop: threading.Event) -> None:
        self._connection, self._interval, self._stop = connection, interval_s, stop
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fedloom-heartbeat")
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self._interval) and not self._stop.is_set():
            try:
                self._connection.heartbeat()
            except TransportError as exc:
                log.debug("heartbeat failed: %s", exc)

    def close(self) -> None:
        self._done.set()


def _check_output(global_weights: Weights, new_weights: Weights) -> str:
    """Why the client's new weights cannot be sent ("" when they can)."""
    try:
        global_weights.check_same_layout(new_weights, what="the client's new weights")
    except ValueError as exc:
        return str(exc)
    for name, arr in new_weights.items():
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            return f"the client's new weights hold NaN or Inf in {name!r}"
    return ""


class ClientRunner:
    """The state of one `start_client` call (usable directly for finer control).

    Attributes:
        stats: what the loop did so far (`ClientStats`).
        secagg_cpu_s: CPU seconds spent in secure rounds, by ``"train"`` (the
            application's fit) and by stage (each `fedloom.secagg.Stage`'s value: the
            protocol's own cost). A measurement only, which the SDK never reads: the
            secure-aggregation benchmark reports it (``benchmarks/_secagg_grpc.py``)
            and the end-to-end test checks it (``tests/secagg/test_secagg_e2e.py``).
    """

    def __init__(
        self,
        client: Client,
        config: ClientConfig,
        token: str = "",
        stop: threading.Event | None = None,
        secure_aggregation: SecAggConfig | None = None,
    ) -> None:
        self.client = client
        self.config = config
        self.token = token
        self.stop = stop or threading.Event()
        self.stats = ClientStats()
        self.secure_aggregation = secure_aggregation  # parameters a secure round must use
        self.secagg_cpu_s: dict[str, float] = {}
        self._connection: Connection | None = None
        self._joined: JoinReply | None = None  # this session's grant (run, codecs)
        self._encoder = UpdateEncoder(config.state_dir)
        self._secure: SecureFit | None = None
        # what this client remembers of each secure round, across its sessions: a server
        # that ends a session cannot make it forget that it revealed shares in a round
        self._rounds = RoundLedger()

    def request_stop(self) -> None:
        self.stop.set()
        if self._connection is not None:
            self._connection.cancel_active()

    def run(self) -> ClientStats:
        backoff = Backoff(self.config.reconnect_initial_s, self.config.reconnect_max_s)
        failures_in_a_row = 0
        # Refused handshakes look like any outage to the loop: explain them once.
        handshakes = HandshakeFailures(self.config)
        previous: Session | None = None  # the session a re-join replaces
        while not self.stop.is_set():
            connection = Connection(self.config)
            self._connection = connection
            heartbeat: _Heartbeat | None = None
            try:
                grant = self._joined = connection.join(self.config.name, self.token)
                log.info(
                    "joined %s as %s (run %s)",
                    self.config.server_address,
                    grant.session.client_id,
                    grant.run_id,
                )
                backoff.reset()
                failures_in_a_row = 0
                handshakes.joined()
                if previous is not None:
                    # The server may still hold it (a blink, not a restart): without a
                    # proven identity it cannot tell that this join replaces it.
                    connection.leave("joined again", previous)
                previous = grant.session
                heartbeat = _Heartbeat(connection, grant.heartbeat_interval_s, self.stop)
                if self._serve(connection, grant.session):
                    connection.leave("run finished")
                    self.stats.run_finished = True
                    return self.stats
            except SessionExpiredError as exc:
                log.info("session expired (%s); joining again", exc)
                continue
            except TransportError as exc:
                failures_in_a_row += 1
                handshakes.failed(exc)
                limit = self.config.max_reconnect_attempts
                if limit is not None and failures_in_a_row > limit:
                    raise TransportError(
                        f"gave up after {limit} reconnect attempts: {exc}"
                    ) from exc
                delay = backoff.next_delay()
                log.warning("connection problem (%s); retrying in %.1f s", exc, delay)
                self.stats.reconnects += 1
                self.stop.wait(delay)
            finally:
                if heartbeat is not None:
                    heartbeat.close()
                if self.stop.is_set():
                    connection.leave("client stopping")
                connection.close()
                self._connection = None
        return self.stats

    def _serve(self, connection: Connection, session: Session) -> bool:
        """Pull and run tasks until the run finishes (True) or ``stop`` is set (False)."""
        while not self.stop.is_set():
            try:
                outcome = connection.pull()
            except ResultRefusedError as exc:
                log.error("task refused by this client: %s", exc)
                self.stats.refused += 1
                self.stop.wait(1.0)
                continue
            if isinstance(outcome, NoTask):
                if outcome.run_finished:
                    log.info("the server says the run is finished")
                    return True
                if outcome.retry_after_s:
                    self.stop.wait(outcome.retry_after_s)
                continue
            task, weights = outcome
            started = time.monotonic()
            result, payload = self._execute(session, task, weights)
            self._push(connection, result, payload)
            log_task(log, task, result, time.monotonic() - started)
        return False

    def _push(
        self, connection: Connection, result: ResultHeader, payload: memoryview | None
    ) -> None:
        """Push, retrying transient failures: a repeated result is idempotent server-side."""
        backoff = Backoff(self.config.reconnect_initial_s, self.config.reconnect_max_s)
        for attempt in range(PUSH_ATTEMPTS):
            try:
                connection.push(result, payload)
                return
            except ResultRefusedError as exc:
                log.warning("server refused the result of task %s: %s", result.task_id[:8], exc)
                self.stats.refused += 1
                return
            except SessionExpiredError:
                raise
            except TransportError as exc:
                if attempt == PUSH_ATTEMPTS - 1 or self.stop.is_set():
                    raise
                delay = backoff.next_delay()
                log.warning("push failed (%s); retrying in %.1f s", exc, delay)
                self.stop.wait(delay)

    def _execute(
        self, session: Session, task: TaskHeader, weights: Weights
    ) -> tuple[ResultHeader, memoryview | None]:
        try:
            if task.kind is TaskKind.SECAGG:  # a secure round's stage (secure_fit.py)
                result = self._secure_fit(session).execute(session, task, weights)
                if result[0].kind is None:
                    self.stats.failures += 1
                elif isinstance(task.secagg, MaskedInputRequest):
                    self.stats.fits += 1  # a secure fit, counted like a plain one
                return result
            if task.kind is TaskKind.FIT:
                fit = self.client.fit(weights, task.config)
                problem = _check_output(weights, fit.weights)
                if problem:
                    raise ValueError(problem)
                joined = self._joined
                payload, info, codec = self._encoder.update(
                    joined.run_id if joined else "", joined.upload_codec if joined else None,
                    fit.weights, weights, zstd=joined is not None and joined.upload_zstd)
                self.stats.fits += 1
                return ResultHeader(
                    session,
                    task.task_id,
                    task.round,
                    TaskKind.FIT,
                    num_examples=fit.num_examples,
                    base_round=task.round - 1,
                    metrics=fit.metrics,
                    update=info,
                    codec=codec,
                ), payload
            evaluation = self.client.evaluate(weights, task.config)
            self.stats.evaluations += 1
            return ResultHeader(
                session,
                task.task_id,
                task.round,
                TaskKind.EVALUATE,
                num_examples=evaluation.num_examples,
                loss=float(evaluation.loss),
                metrics=evaluation.metrics,
            ), None
        except (FedloomError, ValueError, TypeError, RuntimeError, ArithmeticError) as exc:
            log.exception("task %s (%s, round %d) failed", task.task_id[:8], task.kind, task.round)
            self.stats.failures += 1
            message = f"{type(exc).__name__}: {exc}"
            return ResultHeader(session, task.task_id, task.round, None, failure=message), None


    def _secure_fit(self, session: Session) -> SecureFit:
        """The secure-aggregation state of this session (a new one after a re-join).

        With a client certificate (mutual TLS) the client signs its keys with it and
        checks the other participants against ``peer_ca`` (default ``root_ca``).
        """
        if self._secure is None or self._secure.client_id != session.client_id:
            identity, peers = self._signing()
            self._secure = SecureFit(self.client, session.client_id, self.secure_aggregation,
                                     self.secagg_cpu_s, identity=identity, peers=peers,
                                     ledger=self._rounds,
                                     min_noise_multiplier=self.config.min_noise_multiplier)
        return self._secure

    def _signing(self) -> tuple[SigningIdentity | None, PeerVerifier | None]:
        config = self.config
        if not (config.cert and config.key):
            return None, None
        ca = config.peer_ca or config.root_ca
        if not ca:
            raise SecureAggregationError(
                "secure aggregation checks the other clients' certificates against their CA: "
                "set ClientConfig.peer_ca (--peer-ca) to the client CA's PEM file")
        return SigningIdentity.from_files(config.cert, config.key), PeerVerifier.from_pem_file(ca)


def start_client(
    server_address: str,
    client: Client,
    *,
    name: str = "",
    token: str = "",
    config: ClientConfig | None = None,
    stop: threading.Event | None = None,
    handle_signals: bool = True,
    secure_aggregation: SecAggConfig | None = None,
    log_to_console: bool = True,
) -> ClientStats:
    """Take part in federated training until the run ends; see the module docstring.

    Args:
        server_address: ``HOST:PORT`` of the fedloom server.
        client: the application's `Client` (e.g. a `TorchClient`).
        name: a stable name for this client (shown in the server's logs).
        token: a credential, when the server requires one.
        config: connection settings (TLS files, or ``insecure=True``: one is required);
            ``server_address`` and ``name`` override its own.
        stop: set it (from another thread) to stop after the current task.
        handle_signals: install SIGINT/SIGTERM handlers that stop the loop cleanly
            (only from the main thread; the previous handlers are restored after).
        secure_aggregation: when given, this client takes part in secure rounds only
            with exactly these parameters (k, t, clip_range, bits, max_weight); by
            default it accepts any that pass `SecAggConfig`'s rules.
        log_to_console: when the application has configured no logging, print this
            client's progress (joined, one line per round's task, the end) to stderr;
            False keeps it quiet. An application's own logging set-up always wins.

    Raises:
        AccessDeniedError: the server refused this client's credentials at Join.
        ConfigError: no TLS settings (and not insecure), or a TLS file is unreadable,
            or ``key`` is not the private key of ``cert`` (checked before connecting).
    """
    base = config or ClientConfig(server_address=server_address)
    settings = dataclasses.replace(base, server_address=server_address, name=name or base.name)
    runner = ClientRunner(client, settings, token, stop, secure_aggregation)
    console = console_handler(log) if log_to_console else None
    previous: dict[signal.Signals, Any] = {}
    if handle_signals and threading.current_thread() is threading.main_thread():

        def on_signal(signum: int, frame: FrameType | None) -> None:
            log.info("signal %d: stopping", signum)
            runner.request_stop()

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        return runner.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if console is not None:
            log.removeHandler(console)

