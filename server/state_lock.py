"""One server per ``state_dir``: an exclusive lock held for as long as the run is open.

Two servers on one state folder (a rolling update that starts the new server before
the old one stops, a supervisor and a manual start) would both commit rounds: the
second to commit overwrites the first's checkpoint file, then fails on the database
row the first already wrote, leaving a committed round whose file no longer matches its
digest. The lock makes the second server refuse to start instead.

The lock is ``flock`` on ``<state_dir>/fedloom.lock``, which also records the holder's
pid and host for the refusal message. The kernel releases it when the holder's process
ends, however it ends (a crash, SIGKILL), so a stale lock file never blocks a restart.
It is advisory: `fedloom runs` and `fedloom export` read beside a running server and do
not take it. It holds on a local filesystem, and between processes on NFSv4 (where
Linux maps ``flock`` to byte-range locks, which belong to a process: two servers in one
process would both get it there); on platforms without ``fcntl`` no lock is taken.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from fedloom.errors import ConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - not a POSIX platform
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = "fedloom.lock"


class StateLock:
    """The exclusive lock on one state folder (`acquire`; `release` when done)."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def acquire(cls, state_dir: Path) -> StateLock:
        """Create ``state_dir`` if need be and lock it, or raise `ConfigError` naming
        the server that holds it (or why the folder cannot be used)."""
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            path = state_dir / LOCK_NAME
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConfigError(
                "state_dir", f"cannot use {state_dir}: {exc.strerror or exc}") from exc
        if fcntl is None:  # pragma: no cover - not a POSIX platform
            return cls(path, fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(
                "state_dir",
                f"{state_dir} is in use by another server ({holder}): one server per "
                "state_dir. Stop that server first, or give this one another state_dir"
            ) from exc
        with contextlib.suppress(OSError):  # the holder's name is a courtesy
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Release the lock (closing the descriptor releases it); idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return "".join(c if c.isprintable() else "?" for c in text) or "holder unknown"
