"""The run store: runs and their committed rounds in SQLite.

A round is committed in one transaction after its checkpoint file is durable, so the
database never names a file that is not whole. On restart, the latest committed round
of an unfinished run says where to resume. A round's per-client metrics
(``client_metrics``, `ClientRow`) are written in the round's own transaction: a round
is recorded with all of them or not at all.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedloom.errors import ConfigError

#: The run store's file name in a server's ``state_dir``.
DATABASE = "fedloom.db"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('running', 'finished')),
    num_rounds INTEGER NOT NULL,
    config TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS rounds (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    round INTEGER NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('ok', 'failed')),
    checkpoint TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    metrics TEXT NOT NULL,
    started_at REAL NOT NULL,
    finished_at REAL NOT NULL,
    PRIMARY KEY (run_id, round)
);
CREATE TABLE IF NOT EXISTS client_metrics (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    round INTEGER NOT NULL,
    phase TEXT NOT NULL CHECK (phase IN ('fit', 'evaluate')),
    position INTEGER NOT NULL,
    client_id TEXT NOT NULL,
    client_name TEXT NOT NULL,
    num_examples INTEGER NOT NULL,
    loss REAL,
    metrics TEXT NOT NULL,
    PRIMARY KEY (run_id, round, phase, position)
);
CREATE TABLE IF NOT EXISTS buffered_updates (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    version INTEGER NOT NULL,
    client_id TEXT NOT NULL,
    base_round INTEGER NOT NULL,
    num_examples INTEGER NOT NULL,
    metrics TEXT NOT NULL,
    path TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    codec TEXT NOT NULL DEFAULT '',
    contributor TEXT NOT NULL DEFAULT ''
);
"""


@dataclasses.dataclass(frozen=True)
class RunRecord:
    run_id: str
    created_at: float
    status: str
    num_rounds: int
    config: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class RoundRow:
    """A committed round as stored; ``metrics`` is its `fedloom.records.RoundRecord`'s
    JSON form."""

    run_id: str
    round: int
    status: str
    checkpoint: str
    sha256: str
    metrics: dict[str, Any]
    started_at: float
    finished_at: float


@dataclasses.dataclass(frozen=True)
class ClientRow:
    """One client's result in a round's ``phase`` ("fit" or "evaluate"), as it sent it:
    its examples, its metrics, and (evaluate) its loss. ``position`` orders a round's
    rows of a phase (the order they were accepted)."""

    phase: str
    client_id: str
    client_name: str
    num_examples: int
    metrics: dict[str, Any]
    loss: float | None = None
    position: int = 0


def _metrics_json(metrics: dict[str, Any]) -> str:
    """Client metrics as JSON: a ``bytes`` value becomes ``{"bytes_hex": ...}``."""
    return json.dumps({k: {"bytes_hex": v.hex()} if isinstance(v, bytes) else v
                       for k, v in metrics.items()})


def _client_rows(run_id: str, server_round: int, clients: Sequence[ClientRow]
                 ) -> list[tuple[Any, ...]]:
    """The ``client_metrics`` rows of a round's ``clients``, positioned in order."""
    return [(run_id, server_round, c.phase, position, c.client_id, c.client_name,
             c.num_examples, c.loss, _metrics_json(c.metrics))
            for position, c in enumerate(clients)]


def _metrics_from_json(text: str) -> dict[str, Any]:
    return {k: bytes.fromhex(v["bytes_hex"]) if isinstance(v, dict) else v
            for k, v in json.loads(text).items()}


@dataclasses.dataclass(frozen=True)
class BufferedRow:
    """An acknowledged asynchronous update waiting for its server step
    (`fedloom.server.async_buffer`): ``path`` is relative to the state folder; ``codec``
    is the update's codec and settings as JSON ("" for a plain update); ``contributor``
    is who counts against ``rounds.max_updates_per_client`` (the client's identity, else
    its session id)."""

    version: int
    client_id: str
    base_round: int
    num_examples: int
    metrics: dict[str, Any]
    path: str
    sha256: str
    seq: int = 0
    codec: str = ""
    contributor: str = ""


def unusable_database(path: Path, exc: BaseException) -> str:
    """Why the run store at ``path`` cannot be used, and what to do (one line)."""
    reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    if isinstance(exc, sqlite3.DatabaseError) and "not a database" in reason:
        return (f"{path} is not a fedloom run store ({reason}): restore it from a backup "
                "(with its -wal file), or use another state_dir")
    return f"cannot use the run store {path}: {reason}"


class RunStore:
    """SQLite-backed record of runs and rounds (``<state_dir>/fedloom.db``).

    One connection, shared by the event loop and the aggregation thread: every
    transaction holds the store's lock.
    """

    def __init__(self, path: Path, *, readonly: bool = False) -> None:
        self.path = path
        self._lock = threading.RLock()
        try:
            if readonly:  # for readers beside a running server (`fedloom runs`): no writes
                uri = f"{path.resolve().as_uri()}?mode=ro"
                self._db = sqlite3.connect(uri, uri=True, isolation_level=None)
                self._db.execute("SELECT count(*) FROM sqlite_master").fetchone()
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            self._add_missing_columns()
        except (sqlite3.Error, OSError) as exc:
            raise ConfigError("state_dir", unusable_database(path, exc)) from exc

    def _add_missing_columns(self) -> None:
        """Bring a database written before a column existed up to the schema."""
        with self._lock:
            columns = {row[1] for row in
                       self._db.execute("PRAGMA table_info(buffered_updates)").fetchall()}
            for column in ("codec", "contributor"):
                if column not in columns:
                    self._db.execute(f"ALTER TABLE buffered_updates ADD COLUMN {column} "
                                     "TEXT NOT NULL DEFAULT ''")

    def close(self) -> None:
        # Under the lock: a commit still running in the aggregation thread finishes first
        # (closing the connection under it can crash the process).
        with self._lock:
            self._db.close()

    def create_run(self, run_id: str, num_rounds: int, config: dict[str, Any]) -> RunRecord:
        record = RunRecord(run_id, time.time(), "running", num_rounds, config)
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT INTO runs VALUES (?, ?, ?, ?, ?)",
                (run_id, record.created_at, "running", num_rounds, json.dumps(config)),
            )
        return record

    def update_run(self, run_id: str, num_rounds: int, config: dict[str, Any]) -> None:
        """Record a resumed run's new settings (its rounds and status stay)."""
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.execute("UPDATE runs SET num_rounds = ?, config = ? WHERE run_id = ?",
                             (num_rounds, json.dumps(config), run_id))

    def latest_run(self) -> RunRecord | None:
        """The newest run, finished or not."""
        row = self._db.execute("SELECT * FROM runs ORDER BY created_at DESC LIMIT 1").fetchone()
        return self._run(row) if row else None

    def runs(self) -> list[RunRecord]:
        rows = self._db.execute("SELECT * FROM runs ORDER BY created_at").fetchall()
        return [self._run(r) for r in rows]

    def finish_run(self, run_id: str) -> None:
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.execute("UPDATE runs SET status = 'finished' WHERE run_id = ?", (run_id,))

    def commit_round(self, record: RoundRow, clients: Sequence[ClientRow] = ()) -> None:
        """Record a round whose checkpoint file is already durable, with its clients'
        rows (one transaction)."""
        client_rows = _client_rows(record.run_id, record.round, clients)
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany(
                "INSERT INTO client_metrics VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", client_rows)
            self._db.execute(
                "INSERT INTO rounds VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.run_id,
                    record.round,
                    record.status,
                    record.checkpoint,
                    record.sha256,
                    json.dumps(record.metrics),
                    record.started_at,
                    record.finished_at,
                ),
            )

    def record_evaluation(self, run_id: str, server_round: int, metrics: dict[str, Any],
                          finished_at: float, clients: Sequence[ClientRow] = ()) -> None:
        """Replace a committed round's metrics with its evaluated form and add its
        clients' evaluate rows (one transaction). The round must be committed."""
        client_rows = _client_rows(run_id, server_round, clients)
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            cursor = self._db.execute(
                "UPDATE rounds SET metrics = ?, finished_at = ? WHERE run_id = ? AND round = ?",
                (json.dumps(metrics), finished_at, run_id, server_round))
            if cursor.rowcount != 1:
                raise ValueError(f"round {server_round} of run {run_id} is not committed")
            self._db.executemany(
                "INSERT INTO client_metrics VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", client_rows)

    def forget_rounds_after(self, run_id: str, server_round: int) -> None:
        """Drop round records after ``server_round`` (their checkpoints are unusable)."""
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            for table in ("rounds", "client_metrics"):
                self._db.execute(
                    f"DELETE FROM {table} WHERE run_id = ? AND round > ?", (run_id, server_round)
                )

    def buffer_update(self, run_id: str, row: BufferedRow) -> int:
        """Record an acknowledged asynchronous update (its file is already durable)."""
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            cursor = self._db.execute(
                "INSERT INTO buffered_updates (run_id, version, client_id, base_round, "
                "num_examples, metrics, path, sha256, codec, contributor) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, row.version, row.client_id, row.base_round, row.num_examples,
                 _metrics_json(row.metrics), row.path, row.sha256, row.codec,
                 row.contributor),
            )
            return int(cursor.lastrowid or 0)

    def buffered_updates(self, run_id: str) -> list[BufferedRow]:
        """The run's recorded asynchronous updates, in the order they were acknowledged."""
        with self._lock:
            rows = self._db.execute(
                "SELECT version, client_id, base_round, num_examples, metrics, path, sha256, "
                "seq, codec, contributor FROM buffered_updates WHERE run_id = ? ORDER BY seq",
                (run_id,)
            ).fetchall()
        return [BufferedRow(r[0], r[1], r[2], r[3], _metrics_from_json(r[4]), r[5], r[6], r[7],
                            r[8], r[9]) for r in rows]

    def forget_buffered(self, run_id: str, through_version: int | None = None) -> None:
        """Drop the recorded updates of versions up to ``through_version`` (all: None)."""
        limit = through_version if through_version is not None else 2**62
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("DELETE FROM buffered_updates WHERE run_id = ? AND version <= ?",
                             (run_id, limit))

    def rounds(self, run_id: str) -> list[RoundRow]:
        rows = self._db.execute(
            "SELECT * FROM rounds WHERE run_id = ? ORDER BY round", (run_id,)
        ).fetchall()
        return [self._round(r) for r in rows]

    def client_rows(self, run_id: str) -> dict[int, list[ClientRow]]:
        """The run's per-client rows by round (fit, then evaluate, each in order)."""
        if not self._has_table("client_metrics"):  # a database older than the table
            return {}
        rows = self._db.execute(
            "SELECT round, phase, client_id, client_name, num_examples, metrics, loss, "
            "position FROM client_metrics WHERE run_id = ? ORDER BY round, phase != 'fit', "
            "position", (run_id,)
        ).fetchall()
        out: dict[int, list[ClientRow]] = {}
        for r in rows:
            out.setdefault(r[0], []).append(
                ClientRow(r[1], r[2], r[3], r[4], _metrics_from_json(r[5]), r[6], r[7]))
        return out

    def _has_table(self, name: str) -> bool:
        row = self._db.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)
        ).fetchone()
        return row is not None

    def latest_round(self, run_id: str) -> RoundRow | None:
        row = self._db.execute(
            "SELECT * FROM rounds WHERE run_id = ? ORDER BY round DESC LIMIT 1", (run_id,)
        ).fetchone()
        return self._round(row) if row else None

    @staticmethod
    def _run(row: tuple[Any, ...]) -> RunRecord:
        return RunRecord(row[0], row[1], row[2], row[3], json.loads(row[4]))

    @staticmethod
    def _round(row: tuple[Any, ...]) -> RoundRow:
        return RoundRow(
            row[0], row[1], row[2], row[3], row[4], json.loads(row[5]), row[6], row[7]
        )
