"""`History`: per-round metrics of a run, and the files a scenario writes.

Every engine records rounds through one `RoundRecorder`, as the server does, in
`fedloom.records.RoundRecord`s. A record's flat `RoundRecord.metrics` has the same keys
for every engine: the strategy's fit metrics (``train_loss``, ``num_updates``,
``num_examples``...), ``num_failures``, federated evaluation as ``federated_<key>``,
central evaluation (``test_loss``, ``test_accuracy``) and ``seconds`` (wall time of
the round; the only key that is not deterministic). Round 0 holds the evaluation of
the initial model.

`History.write` produces, in ``out_dir``: ``history.json`` (scenario, engine, rounds),
``history.csv`` (one row per round), ``history.png`` (test accuracy and loss per
round) and ``final.safetensors`` (the final global weights, written atomically with
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

from fedloom.records import RoundRecord
from fedloom.types import AggregateResult, Metrics
from fedloom.weights import Weights

__all__ = ["History", "RoundRecord", "RoundRecorder"]


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

    def final(self, key: str) -> float | None:
        points = self.series(key)
        return points[-1][1] if points else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "wall_s": self.wall_s,
            "scenario": dict(self.scenario) if self.scenario is not None else None,
            "rounds": [{"round": r.round, **_jsonable(r.metrics)} for r in self.rounds],
        }

    def write(self, out_dir: str | Path, plot: bool = True) -> dict[str, Path]:
        """Write history.json, history.csv, history.png and final.safetensors."""
        folder = Path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        paths = {"json": folder / "history.json", "csv": folder / "history.csv"}
        _atomic_text(paths["json"], json.dumps(self.to_dict(), indent=2) + "\n")
        _atomic_text(paths["csv"], self._csv())
        if plot:
            paths["png"] = folder / "history.png"
            self.plot(paths["png"])
        if self.weights is not None:
            from fedloom.server import save_weights

            paths["checkpoint"] = folder / "final.safetensors"
            save_weights(paths["checkpoint"], self.weights)
        return paths

    def _csv(self) -> str:
        keys: list[str] = []
        for r in self.rounds:
            keys.extend(k for k in r.metrics if k not in keys)
        buffer = io.StringIO(newline="")
        writer = csv.writer(buffer)
        writer.writerow(["round", *keys])
        for r in self.rounds:
            writer.writerow([r.round, *(_cell(r.metrics.get(k)) for k in keys)])
        return buffer.getvalue()

    def plot(self, path: str | Path) -> None:
        """Test accuracy and test loss per round, as a PNG (matplotlib, Agg backend)."""
        fig = self.figure()
        tmp = Path(path).with_name(f".{Path(path).name}.tmp")
        fig.savefig(tmp, format="png", dpi=100)
        _fsync_replace(tmp, Path(path))

    def figure(self) -> Any:
        """The matplotlib ``Figure`` that `plot` writes: test accuracy and loss per round."""
        import matplotlib

        matplotlib.use("Agg", force=True)
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        fig = Figure(figsize=(9, 3.5))
        title = (self.scenario or {}).get("name", "run")
        for axis, key in zip(fig.subplots(1, 2), ("test_accuracy", "test_loss"), strict=True):
            points = self.series(key) or self.series(f"federated_{key.removeprefix('test_')}")
            if points:
                axis.plot([p[0] for p in points], [p[1] for p in points], marker=".")
            axis.set_xlabel("round")
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # no round 2.5
            axis.set_ylabel(key)
            axis.grid(alpha=0.3)
        fig.suptitle(f"{title} ({self.engine})")
        fig.tight_layout()
        return fig


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


class RoundRecorder:
    """Collects one round at a time from an engine, in the engines' shared order.

    An engine calls `fit`, then `evaluate` (when it ran federated evaluation), then
    `finish` with the central metrics; `finish` returns the `RoundRecord` and hands it
    to ``on_round``.
    """

    def __init__(self, on_round: Callable[[RoundRecord], None] | None = None) -> None:
        self.on_round = on_round
        self.records: list[RoundRecord] = []
        self._pending: dict[str, Any] = {}
        self._started = time.perf_counter()

    def fit(self, result: AggregateResult, num_failures: int,
            num_sampled: int | None = None) -> None:
        """The round's fit: the strategy's result, the clients whose update did not count,
        and how many were sampled (default: updates + failures)."""
        updates = result.metrics.get("num_updates", 0)
        num_updates = int(updates) if isinstance(updates, int | float) else 0
        self._pending.update(
            fit=dict(result.metrics), num_failures=num_failures, num_updates=num_updates,
            num_sampled=num_updates + num_failures if num_sampled is None else num_sampled,
            status="ok" if result.weights is not None else "failed",
            reason=result.reason if result.weights is None else "")

    def evaluate(self, metrics: Metrics) -> None:
        self._pending["evaluate"] = dict(metrics)

    def finish(self, server_round: int, central: Metrics | None) -> RoundRecord:
        now = time.perf_counter()
        record = RoundRecord(server_round, server=dict(central or {}),
                             duration_s=now - self._started, **self._pending)
        self._started = now
        self.records.append(record)
        self._pending = {}
        if self.on_round is not None:
            self.on_round(record)
        return record
