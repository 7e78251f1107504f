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
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from fedloom.client_sdk._backoff import Backoff
from fedloom.client_sdk._client import Client
from fedloom.client_sdk._compression import UpdateEncoder
from fedloom.client_sdk._heartbeat import Heartbeat
from fedloom.client_sdk._middleware import (
    Middleware,
    PushListener,
    TaskContext,
    TaskResult,
    check_listener,
    check_middleware,
    compose,
)
from fedloom.client_sdk._plain_task import run_evaluate, run_fit
from fedloom.client_sdk._progress import console_handler, log_task
from fedloom.client_sdk._stop_watch import StopWatch
from fedloom.client_sdk.connection import Connection
from fedloom.client_sdk.secure_fit import SecureFit
from fedloom.client_sdk.tls import HandshakeFailures
from fedloom.compression import stage_name
from fedloom.config import ClientConfig
from fedloom.errors import (
    FedloomError,
    ResultRefusedError,
    SecureAggregationError,
    SessionExpiredError,
    TransportError,
)
from fedloom.messages import JoinReply, NoTask, ResultHeader, Session
from fedloom.secagg import (
    MaskedInputRequest,
    PeerVerifier,
    RoundLedger,
    SecAggConfig,
    SigningIdentity,
)
from fedloom.types import TaskKind

log = logging.getLogger("fedloom.client")

PUSH_ATTEMPTS = 4
#: What a failing task (or middleware) raises that the runner reports as its failure;
#: anything else ends `ClientRunner.run`.
_TASK_ERRORS = (FedloomError, ValueError, TypeError, RuntimeError, ArithmeticError)


@dataclasses.dataclass
class ClientStats:
    """What a `start_client` call did."""

    fits: int = 0
    evaluations: int = 0
    failures: int = 0
    refused: int = 0
    reconnects: int = 0
    run_finished: bool = False


class ClientRunner:
    """The state of one `start_client` call (usable directly for finer control).

    Args:
        client, config, token, stop, secure_aggregation: as for `start_client`.
        middleware: callables that wrap each task, the first outermost (`Middleware`,
            docs/client.md): each gets the `TaskContext` and ``call_next`` and returns
            the `TaskResult` to push. An exception from one is reported to the server
            as the task's failure, as a failing ``fit`` is.
        on_pushed: called on the loop's thread with each task's context and result once
            its push is over (``refused=True``: the server would not take it), not when
            the push failed for the connection (`PushListener`). An exception from it
            ends `run`.

    Raises:
        TypeError: ``middleware`` is not a list of callables taking
            ``(context, call_next)``, or ``on_pushed`` does not take
            ``(context, result, *, refused)``.

    Attributes:
        stats: what the loop did so far (`ClientStats`).
        middleware, on_pushed: as given (the middleware as a tuple), read for each task.
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
        *,
        middleware: Sequence[Middleware] = (),
        on_pushed: PushListener | None = None,
    ) -> None:
        self.middleware = check_middleware(middleware)
        self.on_pushed = check_listener(on_pushed)
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
        self._aborted = threading.Event()

    def request_stop(self) -> None:
        """Stop after the current task, leaving the session (a Leave to the server)."""
        self.stop.set()
        if self._connection is not None:
            self._connection.cancel_active()

    def abort(self) -> None:
        """Stop now, as a killed process would: the connection is closed without a Leave
        and nothing more is sent, not even the result of the task in progress.

        The server finds out from the broken task stream, or from missing heartbeats.
        For a process that must go at once (its platform is about to kill it, the
        network is gone and a Leave would only wait out ``rpc_timeout_s``) and for
        testing how a federation copes with clients that vanish. `run` returns once the
        application's ``fit`` or ``evaluate`` in progress, if any, returns: it cannot be
        interrupted. Safe from any thread; `run` may be called again afterwards (clear
        ``stop`` first), as a new session.
        """
        self._aborted.set()
        self.stop.set()
        connection = self._connection
        if connection is not None:
            connection.close()

    def run(self) -> ClientStats:
        """Take part until the run is over or a stop; see the module docstring."""
        self._aborted.clear()
        watch = StopWatch(self.stop, lambda: self._connection, self.config.stop_timeout_s,
                          self._aborted)
        try:
            return self._run()
        finally:
            watch.close()

    def _run(self) -> ClientStats:
        backoff = Backoff(self.config.reconnect_initial_s, self.config.reconnect_max_s)
        failures_in_a_row = 0
        # Refused handshakes look like any outage to the loop: explain them once.
        handshakes = HandshakeFailures(self.config)
        previous: Session | None = None  # the session a re-join replaces

        served = False

        def worked() -> None:
            # A session that served (a pull answered) ends a run of failures; a join
            # alone does not: a server that accepts every join and refuses every call
            # must not hold the client in a loop without backoff.
            nonlocal failures_in_a_row, served
            backoff.reset()
            failures_in_a_row = 0
            served = True

        def give_up_after(exc: Exception) -> None:
            nonlocal failures_in_a_row
            failures_in_a_row += 1
            limit = self.config.max_reconnect_attempts
            if limit is not None and failures_in_a_row > limit:
                raise TransportError(f"gave up after {limit} reconnect attempts: {exc}") from exc

        while not self.stop.is_set():
            connection = Connection(self.config)
            self._connection = connection
            heartbeat: Heartbeat | None = None
            served = False
            try:
                grant = self._joined = connection.join(self.config.name, self.token)
                log.info(
                    "joined %s as %s (run %s)%s",
                    self.config.server_address,
                    grant.session.client_id,
                    grant.run_id,
                    _granted_codecs(grant),
                )
                handshakes.joined()
                if previous is not None:
                    # The server may still hold it (a blink, not a restart): without a
                    # proven identity it cannot tell that this join replaces it.
                    connection.leave("joined again", previous)
                previous = grant.session
                heartbeat = Heartbeat(connection, grant.heartbeat_interval_s, self.stop)
                if self._serve(connection, grant.session, worked):
                    connection.leave("run finished")
                    self.stats.run_finished = True
                    return self.stats
            except SessionExpiredError as exc:
                if self.stop.is_set():
                    break
                # Only a join that never served counts: a restart expires sessions that did.
                if not served:
                    give_up_after(exc)
                delay = backoff.next_delay()
                log.info("session expired (%s); joining again in %.1f s", exc, delay)
                self.stats.reconnects += 1
                self.stop.wait(delay)
            except TransportError as exc:
                if self.stop.is_set():  # stopping or aborted: the connection's end is expected
                    break
                handshakes.failed(exc)
                give_up_after(exc)
                delay = backoff.next_delay()
                log.warning("connection problem (%s); retrying in %.1f s", exc, delay)
                self.stats.reconnects += 1
                self.stop.wait(delay)
            except Exception:
                if self._aborted.is_set():  # a closed channel fails in its own ways
                    break
                raise
            finally:
                if heartbeat is not None:
                    heartbeat.close()
                if self.stop.is_set() and not self._aborted.is_set():
                    connection.leave("client stopping")
                connection.close()
                self._connection = None
        return self.stats

    def _serve(self, connection: Connection, session: Session,
               worked: Callable[[], None]) -> bool:
        """Pull and run tasks until the run finishes (True) or ``stop`` is set (False);
        ``worked`` is called at the first pull the server answers."""
        answered = False
        while not self.stop.is_set():
            try:
                outcome = connection.pull()
            except ResultRefusedError as exc:
                log.error("task refused by this client: %s", exc)
                self.stats.refused += 1
                if not answered:  # the server answered, with a task this client refused
                    answered = True
                    worked()
                self.stop.wait(1.0)
                continue
            if not answered:
                answered = True
                worked()
            if isinstance(outcome, NoTask):
                if outcome.run_finished:
                    log.info("the server says the run is finished")
                    return True
                if outcome.retry_after_s:
                    self.stop.wait(outcome.retry_after_s)
                continue
            task, weights = outcome
            started = time.monotonic()
            context = TaskContext(session, task, weights)
            result = self._answer(context)
            if self._aborted.is_set():
                return False  # a killed process sends nothing
            refused = self._push(connection, *result)
            if self.on_pushed is not None:
                self.on_pushed(context, result, refused=refused)
            if not refused:  # counted and logged as sent only once the server has it
                self._count(context, result)
                log_task(log, task, result.header, time.monotonic() - started)
        return False

    def _push(
        self, connection: Connection, result: ResultHeader, payload: memoryview | None
    ) -> bool:
        """Push, retrying transient failures: a repeated result is idempotent server-side.
        True when the server refused the result."""
        backoff = Backoff(self.config.reconnect_initial_s, self.config.reconnect_max_s)
        for attempt in range(PUSH_ATTEMPTS):
            try:
                connection.push(result, payload)
                return False
            except ResultRefusedError as exc:
                log.warning("server refused the result of task %s: %s", result.task_id[:8], exc)
                self.stats.refused += 1
                return True
            except SessionExpiredError:
                raise
            except TransportError as exc:
                if attempt == PUSH_ATTEMPTS - 1 or self.stop.is_set():
                    raise
                delay = backoff.next_delay()
                log.warning("push failed (%s); retrying in %.1f s", exc, delay)
                self.stop.wait(delay)
        return False  # not reached: the last attempt returns or raises

    def _answer(self, context: TaskContext) -> TaskResult:
        """The task's result through the middleware."""
        try:
            return compose(self.middleware, self._run_task)(context)
        except _TASK_ERRORS as exc:
            return _failed(context, exc)

    def _count(self, context: TaskContext, result: TaskResult) -> None:
        """Count a result the server took, in `stats` (a refused or lost one is not)."""
        header, task = result.header, context.task
        if header.kind is None:
            self.stats.failures += 1
        elif header.kind is TaskKind.FIT or isinstance(task.secagg, MaskedInputRequest):
            self.stats.fits += 1  # a secure fit is counted like a plain one
        elif header.kind is TaskKind.EVALUATE:
            self.stats.evaluations += 1

    def _run_task(self, context: TaskContext) -> TaskResult:
        """The innermost step: run the task on the `Client` (or a secure round's stage)."""
        session, task, weights = context.session, context.task, context.weights
        try:
            if task.kind is TaskKind.SECAGG:  # a secure round's stage (secure_fit.py)
                return TaskResult(*self._secure_fit(session).execute(session, task, weights))
            if task.kind is TaskKind.FIT:
                return run_fit(self.client, self._encoder, self._joined, context)
            return run_evaluate(self.client, context)
        except _TASK_ERRORS as exc:
            return _failed(context, exc)

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
                                     min_noise_multiplier=self.config.min_noise_multiplier,
                                     max_attempts=self.config.secagg_max_attempts)
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


def _granted_codecs(grant: JoinReply) -> str:
    """What the join line says of the codecs the server granted ("" for none)."""
    said = [f"{direction} {name}" for direction, codec, zstd in (
        ("upload", grant.upload_codec, grant.upload_zstd),
        ("download", grant.download_codec, grant.download_zstd))
        if (name := stage_name(str(codec) if codec is not None else "", zstd))]
    return f"; codecs granted: {', '.join(said)}" if said else ""


def _failed(context: TaskContext, exc: Exception) -> TaskResult:
    task = context.task
    log.exception("task %s (%s, round %d) failed", task.task_id[:8], task.kind, task.round)
    return context.failure(f"{type(exc).__name__}: {exc}")


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
    middleware: Sequence[Middleware] = (),
    on_pushed: PushListener | None = None,
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
        middleware: callables that wrap each task, the first outermost: see
            `ClientRunner` and docs/client.md.
        on_pushed: called with each task's context and result once it is pushed: see
            `ClientRunner`.

    Raises:
        AccessDeniedError: the server refused this client's credentials at Join.
        ConfigError: no TLS settings (and not insecure), or a TLS file is unreadable,
            or ``key`` is not the private key of ``cert`` (checked before connecting).
        TypeError: ``middleware`` or ``on_pushed`` is not callable as described.
    """
    base = config or ClientConfig(server_address=server_address)
    settings = dataclasses.replace(base, server_address=server_address, name=name or base.name)
    runner = ClientRunner(client, settings, token, stop, secure_aggregation,
                          middleware=middleware, on_pushed=on_pushed)
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

