"""Middleware: application code that wraps each task the client loop runs.

In the spirit of Flower's client "mods": `ClientRunner` (and `start_client`) take an
ordered list of middleware. Each one receives the task (a `TaskContext`) and
``call_next``, the rest of the chain, and returns the task's result (a `TaskResult`,
what the runner pushes). It may look at the task, delay it, answer it without calling
``call_next``, replace or change the result, or raise: an exception is handled as one
from a failing ``fit`` is (the task's failure, reported to the server). The first
middleware of the list is the outermost; the innermost ``call_next`` runs the task
itself (the application's `Client`, or a secure-aggregation stage). docs/client.md has
a runnable example.

A `PushListener` hears each result once its push is over (taken or refused by the
server).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from fedloom.messages import ResultHeader, Session, TaskHeader
from fedloom.secagg import STAGE_OF, Stage
from fedloom.weights import Weights


class TaskResult(NamedTuple):
    """A task's answer: the header and, for an update, its payload (None for none)."""

    header: ResultHeader
    payload: memoryview | None = None


@dataclasses.dataclass(frozen=True)
class TaskContext:
    """One task as the client loop received it; read it, do not change it in place.

    A middleware may pass a changed copy on (``dataclasses.replace(context, ...)``).

    Attributes:
        session: the session the task came on (``session.client_id`` names this client
            to the server until it joins again).
        task: the task's header: ``task.kind`` (fit, evaluate or a secure-aggregation
            stage), ``task.round``, ``task.config`` (the fit or evaluate config).
        weights: the global weights the task carries (empty for the secure-aggregation
            stages other than the masked input).
    """

    session: Session
    task: TaskHeader
    weights: Weights

    @property
    def stage(self) -> Stage | None:
        """The secure-aggregation stage of this task, None for a plain fit or evaluate."""
        request = self.task.secagg
        return STAGE_OF.get(type(request)) if request is not None else None

    def failure(self, message: str) -> TaskResult:
        """A result that reports this task as failed, saying ``message`` to the server
        (which counts this client out of the round, as for a failing ``fit``)."""
        task = self.task
        return TaskResult(ResultHeader(self.session, task.task_id, task.round, None,
                                       failure=message))


#: The rest of the chain, as a middleware sees it: run the task, get its result.
CallNext = Callable[[TaskContext], TaskResult]


class Middleware(Protocol):
    """Wraps each task: returns ``call_next(context)``'s result, or another one.

    Example::

        def timed(context: TaskContext, call_next: CallNext) -> TaskResult:
            started = time.monotonic()
            result = call_next(context)
            log.info("round %d: %.1f s", context.task.round, time.monotonic() - started)
            return result

        start_client(address, client, config=config, middleware=[timed])
    """

    def __call__(self, context: TaskContext, call_next: CallNext, /) -> TaskResult: ...


class PushListener(Protocol):
    """Hears each result after its push: ``refused`` when the server would not take it."""

    def __call__(self, context: TaskContext, result: TaskResult, /, *, refused: bool) -> None: ...


def compose(middleware: Sequence[Middleware], run_task: CallNext) -> CallNext:
    """``run_task`` wrapped in ``middleware``, the first of the list outermost; each
    layer's answer is checked to be a `TaskResult`."""
    call = run_task
    for layer in reversed(middleware):
        call = _layer(layer, call)
    return call


def _layer(layer: Middleware, call_next: CallNext) -> CallNext:
    def call(context: TaskContext) -> TaskResult:
        return _checked(layer(context, call_next), layer)

    return call


def _checked(result: Any, layer: Middleware) -> TaskResult:
    """``result`` as a `TaskResult` (a plain ``(header, payload)`` tuple is accepted)."""
    if (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], ResultHeader)
            and (result[1] is None or isinstance(result[1], memoryview))):
        return TaskResult(*result)
    raise TypeError(f"middleware {_name(layer)} returned {type(result).__name__}, not a "
                    "TaskResult: return call_next(context)'s result, or one of your own")


def check_middleware(middleware: Sequence[Middleware]) -> tuple[Middleware, ...]:
    """``middleware`` as a tuple, each checked to take ``(context, call_next)``."""
    if callable(middleware):
        raise TypeError("middleware takes a list of callables: write "
                        f"middleware=[{_name(middleware)}]")
    if not isinstance(middleware, Sequence) or isinstance(middleware, str | bytes):
        raise TypeError(f"middleware takes a list of callables, not {type(middleware).__name__}")
    for index, layer in enumerate(middleware):
        _check_callable(layer, f"middleware[{index}]", "(context, call_next)", (None, None), {})
    return tuple(middleware)


def check_listener(listener: PushListener | None) -> PushListener | None:
    """``listener`` (None or a callable taking ``(context, result, *, refused)``)."""
    if listener is not None:
        _check_callable(listener, "on_pushed", "(context, result, *, refused)", (None, None),
                        {"refused": False})
    return listener


def _check_callable(value: Any, what: str, shape: str, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> None:
    if not callable(value):
        raise TypeError(f"{what} must be a callable taking {shape}, not {type(value).__name__}")
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):  # some builtins have none: trust them
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{what} ({_name(value)}) must take {shape}; its signature is "
                        f"{signature}: {exc}") from None


def _name(value: Any) -> str:
    return getattr(value, "__qualname__", None) or type(value).__name__
