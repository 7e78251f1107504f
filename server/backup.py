"""``fedloom backup``: a consistent copy of a state folder, beside a running server or not.

A restore needs the run store (runs, rounds, per-client rows, the acknowledged updates
of asynchronous rounds), each run's kept checkpoints, its final model, and the files of
its acknowledged updates. A plain file copy of a live folder gets none of that reliably:
committed rounds may still be in ``fedloom.db-wal``, and a checkpoint can be pruned or
written between two copies. The method:

1. the run store is copied with SQLite's online backup API, read-only: a consistent
   snapshot, rounds still in the write-ahead log included, while the server writes on;
2. the files that snapshot names are copied — checkpoints of its rounds, verified
   against the digests it records; buffered updates, verified too; final models as
   they are. Older rounds' checkpoints the server has pruned (``keep_checkpoints``,
   perhaps between the snapshot and the copy) are absent from the copy as from the
   folder; one that fails its digest is reported and left out; each run's newest
   round must be copied whole, or the backup fails (run it again);
3. everything goes into ``.<out>.tmp``, is fsynced, and is renamed to ``<out>``: a
   backup is whole or absent.

To restore, stop the server and point its ``state_dir`` at the backup folder (or move
the folder into place); it resumes from the newest round the backup holds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import sqlite3
from pathlib import Path

from fedloom.errors import ConfigError
from fedloom.server.checkpoint import fsync_dir
from fedloom.server.persistence import model_file
from fedloom.server.store import DATABASE, RunStore, unusable_database

_NOT_KEPT = "is no longer kept"


@dataclasses.dataclass
class BackupReport:
    """What a backup holds, and what it left out (with why)."""

    path: Path
    runs: int = 0
    checkpoints: int = 0
    files: int = 0
    bytes: int = 0
    left_out: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        return (f"backed up {self.runs} run(s), {self.checkpoints} checkpoint(s) and "
                f"{self.files} file(s) in all ({self.bytes / 1e6:.1f} MB) to {self.path}")


def backup_state(state_dir: str | Path, out: str | Path) -> BackupReport:
    """Copy the state folder ``state_dir`` to the new folder ``out`` (module docstring).

    Raises:
        ConfigError: no run store in ``state_dir``, ``out`` exists, the run store cannot
            be read, or a run's newest checkpoint is missing or fails its digest.
    """
    source, target = Path(state_dir), Path(out)
    database = source / DATABASE
    if not database.is_file():
        raise ConfigError("--state-dir", f"{source} holds no fedloom run store ({DATABASE})")
    if target.exists():
        raise ConfigError("out", f"{target} exists: name a new folder for the backup")
    staging = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)  # left by a backup that was killed
    try:
        staging.mkdir(parents=True)
        _snapshot(database, staging / DATABASE)
        report = BackupReport(target)
        report.bytes += (staging / DATABASE).stat().st_size
        store = RunStore(staging / DATABASE, readonly=True)
        try:
            _copy_files(store, source, staging, report)
        finally:
            store.close()
        _fsync_tree(staging)
        os.replace(staging, target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report


def _snapshot(database: Path, copy: Path) -> None:
    """SQLite's online backup of ``database`` (opened read-only) into ``copy``."""
    try:
        source = sqlite3.connect(f"{database.resolve().as_uri()}?mode=ro", uri=True)
        try:
            target = sqlite3.connect(copy)
            try:
                source.backup(target)
            finally:
                target.close()
        finally:
            source.close()
    except sqlite3.Error as exc:
        raise ConfigError("--state-dir", unusable_database(database, exc)) from exc


def _copy_files(store: RunStore, source: Path, staging: Path, report: BackupReport) -> None:
    for run in store.runs():
        report.runs += 1
        rounds = store.rounds(run.run_id)
        for row in rounds:
            problem = _copy_verified(source / row.checkpoint, staging / row.checkpoint,
                                     row.sha256, report)
            if problem is None:
                report.checkpoints += 1
            elif problem == _NOT_KEPT and row is not rounds[-1]:
                continue  # pruned (keep_checkpoints), by the server, as in the folder
            elif row is rounds[-1]:
                raise ConfigError(
                    "--state-dir", f"the newest checkpoint of run {run.run_id} (round "
                    f"{row.round}, {row.checkpoint}) {problem}: run the backup again; if it "
                    "fails again, the folder itself needs repair (docs/operations.md)")
            else:
                report.left_out.append(f"run {run.run_id} round {row.round}: {problem}")
        for buffered in store.buffered_updates(run.run_id):
            problem = _copy_verified(source / buffered.path, staging / buffered.path,
                                     buffered.sha256, report)
            if problem is not None:
                report.left_out.append(f"run {run.run_id}, an acknowledged update for "
                                       f"version {buffered.version}: {problem}")
        model = model_file(run.run_id)
        if (source / model).is_file():
            _copy_verified(source / model, staging / model, None, report)


def _copy_verified(path: Path, copy: Path, sha256: str | None, report: BackupReport
                   ) -> str | None:
    """Copy ``path`` to ``copy``, checking the copied bytes against ``sha256`` (when
    given); None when copied, else what was wrong (nothing is left at ``copy``)."""
    digest = hashlib.sha256()
    copy.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(path, "rb") as src, open(copy, "wb") as dst:
            for block in iter(lambda: src.read(1 << 22), b""):
                digest.update(block)
                dst.write(block)
    except FileNotFoundError:
        copy.unlink(missing_ok=True)
        return _NOT_KEPT
    if sha256 is not None and digest.hexdigest() != sha256:
        copy.unlink(missing_ok=True)
        return "fails its digest (torn or altered)"
    report.files += 1
    report.bytes += copy.stat().st_size
    return None


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb+") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(folder))
