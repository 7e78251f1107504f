"""`History`: per-round metrics of a run, and the files a scenario writes.

Every engine records rounds through one `RoundRecorder`, as the server does, in
`fedloom.records.RoundRecord`s. A record's flat `RoundRecord.metrics` has the same keys
for every engine: the strategy's fit metrics (``train_loss``, ``num_updates``,
``num_examples``...), ``num_failures``, federated evaluation as ``federated_<key>``,
central evaluation (``test_loss``, ``test_accuracy``) and ``seconds`` (wall time of
the round; the only key that is not deterministic). Round 0 holds the evaluation of
the initial model. A run on a virtual clock (`fedloom.simulations.speed`: every
`run_scenario` run) adds ``virtual_time_s``, the virtual time at which the round (an
asynchronous run's model version) ended, to the record's ``server`` section: what the
server's own clock would read, so the flat metrics, the CSV and `History.over_time`
carry it. Round 0 is at 0.

`History.write` produces, in ``out_dir``: ``history.json`` (scenario, engine, rounds),
``history.csv`` (one row per round; in both, each round's ``status``, its flat metrics
and, from round 1, ``num_sampled``, ``num_updates`` and ``num_cancelled``),
``history.png`` (test accuracy and loss per round, and accuracy against virtual time
when the run has a clock) and
``final.safetensors`` (the final global weights, written atomically with
`fedloom.server.save_weights`, so a server can start from it).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fedloom.errors import ConfigError
from fedloom.records import RoundRecord
from fedloom.strategies import privacy_spent_metrics
from fedloom.types import AggregateResult, Metrics
from fedloom.weights import Weights

__all__ = ["History", "RoundRecord", "RoundRecorder"]


#: The metric holding the virtual time at which a round ended (see the module docstring).
VIRTUAL_TIME = "virtual_time_s"
#: The files `History.write` puts in a results folder.
RESULT_FILES = ("history.json", "history.csv", "history.png", "final.safetensors")


def prepare_out_dir(out_dir: str | Path, setting: str = "out_dir") -> list[str]:
    """Create the results folder and check that it takes files, before a run trains, so
    a folder that cannot be written costs no training. Returns the result files of an
    earlier run that this run's will replace.

    Raises:
        ConfigError: naming ``setting``, when the folder cannot be created or written.
    """
    folder = Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(setting, f"{str(folder)!r} is a file, not a folder: name a "
                          "folder for the results (it is created if missing)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".fedloom-write-check"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(setting, f"{str(folder)!r} cannot hold the results "
                          f"({exc.strerror or exc}): name a folder this user can create "
                          "and write") from exc
    return [name for name in RESULT_FILES if (folder / name).exists()]


@dataclasses.dataclass
class History:
    """What a run produced: its rounds, the final weights, and how long it took."""

    engine: str
    rounds: list[RoundRecord] = dataclasses.field(default_factory=list)
    weights: Weights | None = None
    wall_s: float = 0.0
    scenario: Mapping[str, Any] | None = None

    def series(self, key: str) -> list[tuple[int, float]]:
        """``(round, value)`` for every round that has a numeric ``key``."""
        out = []
        for r in self.rounds:
            value = r.metrics.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                out.append((r.round, float(value)))
        return out

    def over_time(self, key: str) -> list[tuple[float, float]]:
        """``(virtual_time_s, value)`` for every round that has both (see the module
        docstring); empty for a run without a virtual clock."""
        times = dict(self.series(VIRTUAL_TIME))
        return [(times[r], value) for r, value in self.series(key) if r in times]

    def final(self, key: str) -> float | None:
        points = self.series(key)
        return points[-1][1] if points else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "wall_s": self.wall_s,
            "scenario": dict(self.scenario) if self.scenario is not None else None,
            "rounds": [_jsonable(_row(r)) for r in self.rounds],
        }

    def write(self, out_dir: str | Path, plot: bool = True) -> dict[str, Path]:
        """Write history.json, history.csv, history.png and final.safetensors."""
        folder = Path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        json_name, csv_name, png_name, model_name = RESULT_FILES
        paths = {"json": folder / json_name, "csv": folder / csv_name}
        _atomic_text(paths["json"], json.dumps(self.to_dict(), indent=2) + "\n")
        _atomic_text(paths["csv"], self._csv())
        if plot:
            paths["png"] = folder / png_name
            self.plot(paths["png"])
        if self.weights is not None:
            from fedloom.server import save_weights

            paths["checkpoint"] = folder / model_name
            save_weights(paths["checkpoint"], self.weights)
        return paths

    def _csv(self) -> str:
        rows = [_row(r) for r in self.rounds]
        keys: list[str] = []
        for row in rows:
            keys.extend(k for k in row if k not in keys)
        buffer = io.StringIO(newline="")
        writer = csv.writer(buffer)
        writer.writerow(keys)
        for row in rows:
            writer.writerow([_cell(row.get(k)) for k in keys])
        return buffer.getvalue()

    def plot(self, path: str | Path) -> None:
        """Test accuracy and test loss per round, as a PNG (matplotlib, Agg backend)."""
        fig = self.figure()
        tmp = Path(path).with_name(f".{Path(path).name}.tmp")
        fig.savefig(tmp, format="png", dpi=100)
        _fsync_replace(tmp, Path(path))

    def figure(self) -> Any:
        """The matplotlib ``Figure`` that `plot` writes: test accuracy and loss per round,
        and test accuracy against virtual time when the rounds carry it."""
        import matplotlib

        matplotlib.use("Agg", force=True)
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        timed = self.over_time("test_accuracy")
        fig = Figure(figsize=(13.5 if timed else 9, 3.5))
        title = (self.scenario or {}).get("name", "run")
        axes = fig.subplots(1, 3 if timed else 2)
        for axis, key in zip(axes, ("test_accuracy", "test_loss"), strict=False):
            points = self.series(key) or self.series(f"federated_{key.removeprefix('test_')}")
            if points:
                axis.plot([p[0] for p in points], [p[1] for p in points], marker=".")
            axis.set_xlabel("round")
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # no round 2.5
            axis.set_ylabel(key)
            axis.grid(alpha=0.3)
        if timed:
            axis = axes[2]
            axis.plot([p[0] for p in timed], [p[1] for p in timed], marker=".")
            axis.set_xlabel("virtual time (s)")
            axis.set_ylabel("test_accuracy")
            axis.grid(alpha=0.3)
        fig.suptitle(f"{title} ({self.engine})")
        fig.tight_layout()
        return fig


def _row(record: RoundRecord) -> dict[str, Any]:
    """One round as history.json and history.csv write it: its number and status, the
    flat `RoundRecord.metrics` (a failed round's ``no_model_reason`` included) and,
    from round 1, the record's counts of tasks issued, updates aggregated and tasks
    cancelled (over-selection), which the flat metrics leave out."""
    row: dict[str, Any] = {"round": record.round, "status": record.status}
    row.update(record.metrics)
    if record.round > 0:
        row.update(num_sampled=record.num_sampled, num_updates=record.num_updates,
                   num_cancelled=record.num_cancelled)
    return row


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.hex()
    return value


def _jsonable(metrics: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, bytes):
            out[k] = v.hex()
        elif isinstance(v, float) and not math.isfinite(v):
            out[k] = None
        else:
            out[k] = v
    return out


def _fsync_replace(tmp: Path, target: Path) -> None:
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, target)


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    _fsync_replace(tmp, path)


def with_privacy_spent(result: AggregateResult, strategy: object) -> AggregateResult:
    """A failed round's result with a private ``strategy``'s ε spent so far, as the
    server records every round's (a release that then failed has spent budget, and the
    last round must not understate it); any other result as it is."""
    spent = privacy_spent_metrics(strategy)
    if result.weights is not None or not spent:
        return result
    return dataclasses.replace(result, metrics={**result.metrics, **spent})


class RoundRecorder:
    """Collects one round at a time from an engine, in the engines' shared order.

    An engine calls `fit`, then `evaluate` (when it ran federated evaluation), then
    `finish` with the central metrics and the round's global model; `finish` returns
    the `RoundRecord`, hands the model to ``on_model`` and then the record to
    ``on_round`` (so a caller that stops the run from ``on_round`` has both).
    """

    def __init__(self, on_round: Callable[[RoundRecord], None] | None = None,
                 on_model: Callable[[Weights], None] | None = None) -> None:
        self.on_round, self.on_model = on_round, on_model
        self.records: list[RoundRecord] = []
        self._pending: dict[str, Any] = {}
        self._started = time.perf_counter()

    def fit(self, result: AggregateResult, num_failures: int,
            num_sampled: int | None = None, num_cancelled: int = 0,
            traffic: Metrics | None = None, num_updates: int | None = None) -> None:
        """The round's fit: the strategy's result, the clients whose update did not count,
        how many were sampled (default: updates + failures), how many of those were
        cancelled when the round closed (over-selection), the bytes each client moved
        (`fedloom.simulations.compression`), recorded with the fit metrics, and the
        updates received (default: the strategy's ``num_updates`` metric; a failed
        aggregation reports none)."""
        if num_updates is None and result.weights is None:
            num_updates = result.num_updates  # what came in, as the server records it
        if num_updates is None:
            updates = result.metrics.get("num_updates", 0)
            num_updates = int(updates) if isinstance(updates, int | float) else 0
        self._pending.update(
            fit={**result.metrics, **(traffic or {})}, num_failures=num_failures,
            num_updates=num_updates,
            num_sampled=num_updates + num_failures if num_sampled is None else num_sampled,
            num_cancelled=num_cancelled,
            status="ok" if result.weights is not None else "failed",
            reason=result.reason if result.weights is None else "")

    def evaluate(self, metrics: Metrics) -> None:
        self._pending["evaluate"] = dict(metrics)

    def finish(self, server_round: int, central: Metrics | None,
               virtual_time_s: float | None = None,
               weights: Weights | None = None) -> RoundRecord:
        """Close the round with the central metrics, on a virtual clock the virtual time
        at which it ended, and the global model after it."""
        now = time.perf_counter()
        server = dict(central or {})
        if virtual_time_s is not None:
            server[VIRTUAL_TIME] = virtual_time_s
        record = RoundRecord(server_round, server=server,
                             duration_s=now - self._started, **self._pending)
        self._started = now
        self.records.append(record)
        self._pending = {}
        if weights is not None and self.on_model is not None:
            self.on_model(weights)
        if self.on_round is not None:
            self.on_round(record)
        return record
