"""Where a run's state lives: opening (new or resumed) and committing rounds.

Folder layout under ``state_dir``::

    fedloom.db                                   runs and rounds (SQLite)
    checkpoints/<run_id>/round-000007.safetensors  weights + strategy state
    models/<run_id>.safetensors                  the final model, when the run ends
    spool/<run_id>/upload-*.bin                  uploads being received

A new run commits round 0 (the initial weights and strategy state) before any client
trains, so a resumed run always has a verified checkpoint to start from (a run killed
before that first commit is started again under its id). On resume the newest committed
round whose file passes its digest is loaded; newer records whose files fail are
dropped with an error in the log, and temp files of a torn write are deleted.
"""

from __future__ import annotations

import json
import logging
import secrets
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedloom.config import ServerConfig
from fedloom.errors import CheckpointError, ConfigError
from fedloom.records import RoundRecord
from fedloom.server.checkpoint import (
    load_checkpoint,
    load_weights,
    save_weights,
    write_checkpoint,
)
from fedloom.server.crashpoints import crashpoint
from fedloom.server.state_lock import StateLock
from fedloom.server.store import DATABASE, ClientRow, RoundRow, RunStore
from fedloom.strategies import Strategy
from fedloom.weights import Weights

log = logging.getLogger("fedloom.server")


class RunPersistence:
    """The durable side of one run: its checkpoints and its rows in the run store."""

    def __init__(
        self,
        state_dir: Path,
        store: RunStore,
        run_id: str,
        weights: Weights,
        completed_round: int,
        keep_checkpoints: int,
    ) -> None:
        self.state_dir = state_dir
        self.store = store
        self.run_id = run_id
        self.weights = weights
        self.completed_round = completed_round
        self.keep_checkpoints = keep_checkpoints
        #: The run is over (recorded so): no round is run, its clients are told.
        self.finished = False
        #: The state folder's lock (`StateLock`), released by `close`.
        self.lock: StateLock | None = None

    @classmethod
    def open(
        cls, config: ServerConfig, initial_weights: Weights | None, strategy: Strategy
    ) -> RunPersistence:
        """Resume the latest run of ``state_dir`` when ``config.resume``, else start one.

        A latest run that has finished is opened as it ended (`finished`: there is
        nothing to train, and its clients are told so) unless ``config.new_run`` asks
        for a new run: a restart after the end of a run must not quietly train the
        initial model again.
        """
        state_dir = Path(config.state_dir)
        lock = StateLock.acquire(state_dir)
        try:
            persistence = cls._open(config, initial_weights, strategy, state_dir)
        except BaseException:
            lock.release()
            raise
        persistence.lock = lock
        return persistence

    @classmethod
    def _open(cls, config: ServerConfig, initial_weights: Weights | None, strategy: Strategy,
              state_dir: Path) -> RunPersistence:
        store = RunStore(state_dir / DATABASE)
        try:
            return cls._open_in(config, initial_weights, strategy, state_dir, store)
        except BaseException:
            store.close()
            raise

    @classmethod
    def _open_in(cls, config: ServerConfig, initial_weights: Weights | None,
                 strategy: Strategy, state_dir: Path, store: RunStore) -> RunPersistence:
        run = store.latest_run() if config.resume else None
        if run is not None and run.status == "finished":
            if not config.new_run:
                return cls._open_finished(config, store, run.run_id, strategy)
            run = None
        # A run whose round 0 never committed (the server died while writing it) holds
        # nothing yet: start it again from the initial weights, under the same id.
        unstarted = run is not None and store.latest_round(run.run_id) is None
        summary = _config_summary(config, strategy)
        if run is not None and not unstarted:
            changed = _check_resumed_settings(summary, run)
            persistence = cls._resume(config, store, run.run_id, initial_weights, strategy)
            if changed:  # recorded once the run has resumed, not by a refused resume
                log.warning("resuming run %s with changed settings: %s", run.run_id, changed)
                store.update_run(run.run_id, config.num_rounds, summary)
            return persistence
        if initial_weights is None:
            raise ConfigError(
                "initial_weights",
                "a new run needs initial weights: pass --initial-weights FILE.safetensors "
                "(write one with fedloom.server.save_weights) or Server(initial_weights=...)",
            )
        if run is not None:
            run_id = run.run_id
            log.warning("run %s never committed round 0; starting it again", run_id)
            store.update_run(run_id, config.num_rounds, summary)
        else:
            run_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
            store.create_run(run_id, config.num_rounds, summary)
        persistence = cls(state_dir, store, run_id, initial_weights, 0, config.keep_checkpoints)
        persistence.commit(
            RoundRecord(0), initial_weights, strategy.state_dict(), time.time()
        )
        log.info("started run %s in %s", run_id, state_dir)
        return persistence

    @classmethod
    def _open_finished(cls, config: ServerConfig, store: RunStore, run_id: str,
                       strategy: Strategy) -> RunPersistence:
        """A finished run, as it ended: nothing is trained and nothing is written. Its
        model is the final one it wrote (``models/``), else its newest checkpoint that
        verifies (a torn newest one is logged, and stays on record)."""
        state_dir = Path(config.state_dir)
        rows = store.rounds(run_id)
        last = rows[-1].round if rows else 0
        model = state_dir / model_file(run_id)
        try:
            weights = load_weights(model) if model.is_file() else None
        except CheckpointError as exc:
            log.error("run %s's final model %s is not usable: %s", run_id, model, exc)
            weights = None
        if weights is None:  # the newest checkpoint that verifies, as that round
            persistence = cls._resume(config, store, run_id, None, strategy, finished=True)
        else:
            persistence = cls(state_dir, store, run_id, weights, last, config.keep_checkpoints)
        persistence.finished = True
        log.warning(
            "run %s in %s has finished (its last round is %d): nothing to train. This server "
            "tells its clients that the run is over, then exits. To start a new run here, "
            "pass --new-run (new_run = true) once", run_id, state_dir, last)
        return persistence

    @classmethod
    def _resume(
        cls,
        config: ServerConfig,
        store: RunStore,
        run_id: str,
        initial_weights: Weights | None,
        strategy: Strategy,
        finished: bool = False,
    ) -> RunPersistence:
        state_dir = Path(config.state_dir)
        lost: list[int] = []  # newer rounds whose checkpoints cannot be used
        for record in reversed(store.rounds(run_id)):
            if lost and config.privacy.enabled and not finished:  # finished: trains nothing
                raise ConfigError(
                    "state_dir",
                    f"run {run_id} is private and its newest checkpoints (rounds "
                    f"{', '.join(map(str, sorted(lost)))}) are not usable: resuming from an "
                    "older one would forget the privacy those rounds spent (their models "
                    "were released). Restore the checkpoints, or start a new run with a "
                    "new budget (resume = false)")
            try:
                checkpoint = load_checkpoint(state_dir / record.checkpoint, record.sha256)
            except CheckpointError as exc:
                log.error("round %d of run %s is not usable: %s", record.round, run_id, exc)
                lost.append(record.round)
                continue
            if checkpoint.run_id != run_id or checkpoint.round != record.round:
                log.error(
                    "checkpoint %s belongs to run %s round %d; skipping",
                    record.checkpoint,
                    checkpoint.run_id,
                    checkpoint.round,
                )
                lost.append(record.round)
                continue
            if initial_weights is not None:
                try:
                    initial_weights.check_same_layout(checkpoint.weights, what="checkpoint")
                except ValueError as exc:
                    raise ConfigError(
                        "state_dir",
                        f"run {run_id} there holds a different model ({exc}); use another "
                        "state_dir, or set resume = false to start a new run",
                    ) from exc
            if not finished:  # a finished run trains nothing: its record stays as it is
                store.forget_rounds_after(run_id, record.round)
                _remove_torn_temp_files(state_dir / "checkpoints" / run_id)
            try:
                strategy.load_state_dict(checkpoint.strategy_state)
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(
                    "strategy", f"run {run_id}'s checkpoint holds another strategy's state "
                    f"({exc}); resume with the run's strategy, or start a new run "
                    "(resume = false)") from exc
            persistence = cls(state_dir, store, run_id, checkpoint.weights, record.round,
                              config.keep_checkpoints)
            if not finished:
                log.info("resuming run %s after round %d", run_id, record.round)
            return persistence
        raise CheckpointError(
            f"run {run_id} in {state_dir} has no checkpoint that passes verification; "
            "set resume = false to start a new run"
        )

    def checkpoint_path(self, server_round: int) -> Path:
        return Path("checkpoints") / self.run_id / f"round-{server_round:06d}.safetensors"

    def commit(
        self,
        record: RoundRecord,
        weights: Weights,
        strategy_state: Any,
        started_at: float,
        clients: Sequence[ClientRow] = (),
    ) -> None:
        """The round's commit point: durable checkpoint, then one SQLite transaction
        (the round's record and its ``clients``' rows)."""
        server_round = record.round
        relative = self.checkpoint_path(server_round)
        digest = write_checkpoint(
            self.state_dir / relative,
            run_id=self.run_id,
            server_round=server_round,
            weights=weights,
            strategy_state=strategy_state,
        )
        row = RoundRow(self.run_id, server_round, record.status, str(relative), digest,
                       record.to_dict(), started_at, time.time())
        try:
            self.store.commit_round(row, clients)
        except sqlite3.OperationalError as exc:  # a full disk, a read-only folder
            raise CheckpointError(
                f"could not record round {server_round} in {self.store.path} ({exc}); the "
                f"run's last committed round is {self.completed_round}. Free the space (or "
                "fix the folder) and start the server again: it resumes from there") from exc
        crashpoint("round_committed")
        self.completed_round = server_round
        self._prune(server_round)

    def record_evaluation(self, record: RoundRecord, clients: Sequence[ClientRow] = ()) -> None:
        """Record the evaluation of the committed round ``record.round``: the record, now
        with its evaluation sections, replaces the committed one, and the evaluate rows
        of ``clients`` join it (one transaction; the checkpoint is not touched)."""
        self.store.record_evaluation(self.run_id, record.round, record.to_dict(), time.time(),
                                     clients)

    def _prune(self, server_round: int) -> None:
        oldest_kept = server_round - self.keep_checkpoints + 1
        folder = self.state_dir / "checkpoints" / self.run_id
        for path in folder.glob("round-*.safetensors"):
            try:
                number = int(path.stem.split("-")[1])
            except (IndexError, ValueError):
                continue
            if number < oldest_kept:
                path.unlink(missing_ok=True)

    def history(self) -> list[RoundRecord]:
        """The committed rounds after round 0."""
        return [RoundRecord.from_dict(r.metrics) for r in self.store.rounds(self.run_id)
                if r.round > 0]

    @property
    def model_path(self) -> Path:
        """Where the run's final model is written (`write_model`)."""
        return self.state_dir / model_file(self.run_id)

    def write_model(self, weights: Weights) -> Path:
        """Write the run's final model as a plain safetensors file (atomically), for
        whoever serves it: `fedloom.server.load_weights` or any safetensors reader."""
        path = self.model_path
        save_weights(path, weights)
        return path

    def finish(self) -> None:
        self.store.finish_run(self.run_id)
        self.finished = True

    def close(self) -> None:
        self.store.close()
        if self.lock is not None:
            self.lock.release()


#: Settings a resumed run must keep: they decide what its rounds compute and what its
#: checkpoints hold (the strategy's state, the privacy ledger, the asynchronous buffer),
#: and a secure run must not go on in the clear or with weaker client checks.
_FIXED_SETTINGS = ("strategy_class", "privacy", "rounds.mode", "secure_aggregation.enabled",
                   "secure_aggregation.allow_unauthenticated")
#: Settings that say where and how this server runs, not what the run is.
_PLACE_SETTINGS = frozenset({"address", "state_dir", "resume", "new_run", "progress",
                             "metrics_address", "reflection", "tls", "auth", "insecure"})


def _flat(summary: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name != "strategy":
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def _check_resumed_settings(summary: dict[str, Any], run: Any) -> str:
    """Refuse a resume whose settings change what the run is (`_FIXED_SETTINGS`); the
    other changes, as a line for the log ("" when none).

    Compared only where both records have the setting (a run recorded by an older
    version lacks some), and ``privacy.*`` only where either side is private (the
    fields of an unused ``[privacy]`` table do not matter). The strategy is compared
    by the class that aggregates (``strategy_class``: the same for ``FedAdam`` and
    ``fedadam``, or a strategy object passed in Python); its parameters may change.
    """
    now, then = _flat(summary), _flat(run.config)
    private = now.get("privacy.mode", "off") != "off" or then.get("privacy.mode", "off") != "off"
    changed = sorted(k for k in now.keys() & then.keys()
                     if now[k] != then[k] and k.split(".")[0] not in _PLACE_SETTINGS
                     and (private or not k.startswith("privacy.")))
    fixed = [k for k in changed if k in _FIXED_SETTINGS
             or any(k.startswith(f"{f}.") for f in _FIXED_SETTINGS)]
    if fixed:
        differences = "; ".join(f"{k}: {then[k]!r} then, {now[k]!r} now" for k in fixed)
        raise ConfigError(
            fixed[0], f"run {run.run_id} was started with other settings ({differences}). "
            "A run keeps its strategy, privacy, round mode and secure aggregation: start "
            "this server with the run's settings, or start a new run (resume = false)")
    return ", ".join(f"{k} {then[k]!r} -> {now[k]!r}" for k in changed)


def model_file(run_id: str) -> Path:
    """Where run ``run_id``'s final model is written, relative to the state folder."""
    return Path("models") / f"{run_id}.safetensors"


def _remove_torn_temp_files(folder: Path) -> None:
    """Delete checkpoint temp files a killed server left behind (never loaded)."""
    for path in folder.glob(".round-*.safetensors.tmp"):
        log.info("removing %s, left by a server that stopped mid-write", path.name)
        path.unlink(missing_ok=True)


def _strategy_class(strategy: Any) -> str:
    """The class that aggregates: the strategy's own, under any privacy wrapper."""
    while hasattr(strategy, "inner"):
        strategy = strategy.inner
    return type(strategy).__qualname__


def _config_summary(config: ServerConfig, strategy: Any) -> dict[str, Any]:
    """The run's settings as recorded (JSON values: paths and other objects as text)."""
    import dataclasses

    summary = dataclasses.asdict(config)
    summary["strategy"] = {"name": config.strategy.name, **dict(config.strategy.params)}
    summary["strategy_class"] = _strategy_class(strategy)
    return dict(json.loads(json.dumps(summary, default=str)))
