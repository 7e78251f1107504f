"""Named crash points for recovery tests.

When the environment variable ``FEDLOOM_CRASH_AT`` names a point, the process dies
there at once (``os._exit``, as abrupt as SIGKILL: no cleanup, no flush), so tests can
kill the server between any two steps of a commit. Unset, a crash point costs one
dictionary lookup.
"""

from __future__ import annotations

import os

#: Every named point, in the order a round reaches them.
POINTS = (
    "mid_aggregation",  # after the first update was folded into the aggregate
    "checkpoint_temp_written",  # the temp checkpoint is durable, not yet renamed
    "checkpoint_renamed",  # the checkpoint file is in place, the database not yet updated
    "round_committed",  # the database records the round
)

EXIT_CODE = 86


def crashpoint(name: str) -> None:
    if os.environ.get("FEDLOOM_CRASH_AT") == name:
        os._exit(EXIT_CODE)
