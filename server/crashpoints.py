"""Named crash points for recovery tests.

When the environment variable ``FEDLOOM_CRASH_AT`` names a point, the process dies
there at once (``os._exit``, as abrupt as SIGKILL: no cleanup, no flush), so tests can
kill the server between any two steps of a commit. ``NAME:N`` dies the N-th time the
point is reached (``checkpoint_renamed:3`` is round 2's commit, round 0 being the
first); plain ``NAME`` means ``NAME:1``. Unset, a crash point costs one dictionary
lookup.

Example::

    FEDLOOM_CRASH_AT=checkpoint_temp_written:3 fedloom server --config run.toml  # exits 86
    fedloom server --config run.toml        # the same command resumes after round 1
"""

from __future__ import annotations

import os
import threading

#: Every named point, in the order a round reaches them.
POINTS = (
    "mid_aggregation",  # after an update was folded into the aggregate (one hit per update)
    # Between two stages of a secure-aggregation round (one hit per stage closed). Named
    # here for the recovery tests; the secure round calls it once it is wired in.
    "mid_secure_aggregation",
    # An asynchronous update is durable (file and row), not yet acknowledged (one hit
    # per update taken).
    "async_update_kept",
    "checkpoint_temp_written",  # the temp checkpoint is durable, not yet renamed
    "checkpoint_renamed",  # the checkpoint file is in place, the database not yet updated
    "round_committed",  # the database records the round
    # An evaluation result was taken, the round's evaluation not yet recorded (one hit
    # per result; the round is committed before its model is evaluated).
    "mid_evaluation",
)

EXIT_CODE = 86
ENV = "FEDLOOM_CRASH_AT"

_hits: dict[str, int] = {}
_lock = threading.Lock()  # points are reached from the event loop and worker threads


def parse(spec: str) -> tuple[str, int]:
    """``"name:3"`` -> ``("name", 3)``; raises ValueError for an unknown point or count."""
    name, _, count = spec.partition(":")
    if name not in POINTS:
        raise ValueError(f"{ENV}={spec!r}: unknown crash point; one of {', '.join(POINTS)}")
    hit = int(count) if count else 1
    if hit < 1:
        raise ValueError(f"{ENV}={spec!r}: the hit count must be at least 1")
    return name, hit


def crashpoint(name: str) -> None:
    """Die here (exit code 86) when ``FEDLOOM_CRASH_AT`` names this point and hit."""
    spec = os.environ.get(ENV)
    if not spec or not spec.startswith(name):
        return
    target, hit = parse(spec)
    if target != name:
        return
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        if _hits[name] == hit:
            os._exit(EXIT_CODE)
