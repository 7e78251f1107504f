"""``fedloom export``: any committed round's model as a plain safetensors file.

The run's final model is written at its end (``<state_dir>/models/<run_id>.safetensors``);
this reads any round whose checkpoint is still kept (``keep_checkpoints``), verified
against its recorded digest, and writes its weights alone — no strategy state — where
`fedloom.server.load_weights`, ``safetensors.torch.load_file`` or any other reader
takes them.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from fedloom.errors import ConfigError
from fedloom.server.checkpoint import load_checkpoint, save_weights
from fedloom.server.run_report import find_run
from fedloom.server.store import DATABASE, RunStore, unusable_database


def export_model(state_dir: str | Path, out: str | Path, run: str = "",
                 server_round: int | None = None) -> tuple[str, int]:
    """Write round ``server_round`` (default: the last committed) of run ``run`` (an id or
    a unique prefix; default: the newest run) to ``out``; returns (run id, round).

    Raises:
        ConfigError: no run database there, no such run or round, or a round whose
            checkpoint is no longer kept (the message lists those that are).
        CheckpointError: the checkpoint fails its digest, or ``out`` cannot be written.
    """
    folder = Path(state_dir)
    database = folder / DATABASE
    if not database.is_file():
        raise ConfigError("--state-dir", f"{folder} holds no fedloom run database ({DATABASE})")
    store = RunStore(database, readonly=True)
    try:
        runs = store.runs()
        if not runs:
            raise ConfigError("--state-dir", f"{folder} holds no runs")
        record = find_run(store, run) if run else runs[-1]
        rows = {row.round: row for row in store.rounds(record.run_id)}
    except sqlite3.Error as exc:
        raise ConfigError("--state-dir", unusable_database(database, exc)) from exc
    finally:
        store.close()
    if not rows:
        raise ConfigError("--run", f"run {record.run_id} has committed no round")
    chosen = max(rows) if server_round is None else server_round
    kept = sorted(r for r, row in rows.items() if (folder / row.checkpoint).is_file())
    if chosen not in rows:
        raise ConfigError("--round", f"run {record.run_id} has no committed round {chosen} "
                                     f"(rounds 0..{max(rows)})")
    if chosen not in kept:
        raise ConfigError("--round", f"the checkpoint of round {chosen} is no longer kept "
                                     f"(keep_checkpoints keeps the newest); rounds kept: {kept}")
    row = rows[chosen]
    checkpoint = load_checkpoint(folder / row.checkpoint, row.sha256)
    save_weights(out, checkpoint.weights)
    return record.run_id, chosen
