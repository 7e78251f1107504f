"""The simulation side of `benchmarks/async.py`: synchronous FedAvg (with and without
over-selection) and FedBuff on the local engine's virtual clock.

Every run is a `fedloom.simulations.Scenario` run by `run_scenario` (a pure function of
its seed: partition, initial model, client speeds, sampling), so a side that runs the
same methods elsewhere (the gRPC server with sleeping clients) can build the same
scenarios from `scenario` and compare like with like.

Tuning: each method's settings are picked on the tuning seeds by the mean virtual time
to the target (a setting that misses it on a seed within the step budget is out);
tuning runs stop at the target. The chosen settings then run on the report seeds for
the whole step budget. The same server learning rates are offered to every method, so
the synchronous baselines are tuned alike (see `run_sim` for FedBuff's two settings).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import statistics
import time
from typing import Any

from fedloom.config import RoundsConfig, StrategyConfig
from fedloom.simulations.history import RoundRecord
from fedloom.simulations.runner import run_scenario
from fedloom.simulations.scenario import ClientSpec, PartitionSpec, Scenario
from fedloom.simulations.speed import SpeedSpec


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every run shares (the benchmark's command-line settings)."""

    clients: int = 100
    per_step: int = 10  # clients per synchronous round = FedBuff's buffer size K
    target: float = 0.90
    window: int = 5  # evaluations (steps) averaged when checking the target
    steps: int = 300  # rounds / versions of a report run: steps * per_step updates
    mean_s: float = 1.0
    sigma: float = 0.5
    jitter: float = 0.2
    straggler_fraction: float = 0.2
    straggler_factor: float = 10.0


@dataclasses.dataclass(frozen=True)
class Settings:
    """One point of a method's grid."""

    eta: float = 1.0  # server learning rate (1: FedAvg)
    over_selection: float = 1.0
    concurrency: int = 0  # > 0: FedBuff
    weighting: str = "polynomial"
    exponent: float = 0.5
    max_staleness: int = 10

    @property
    def asynchronous(self) -> bool:
        return self.concurrency > 0

    def describe(self) -> str:
        parts = [f"eta {self.eta:g}"]
        if self.asynchronous:
            weighting = (f"polynomial a={self.exponent:g}" if self.weighting == "polynomial"
                         else self.weighting)
            parts[:0] = [f"concurrency {self.concurrency}", weighting,
                         f"max_staleness {self.max_staleness}"]
        elif self.over_selection != 1.0:
            parts.insert(0, f"over_selection {self.over_selection:g}")
        return ", ".join(parts)


def grids(full: bool) -> dict[str, list[Settings]]:
    """Each method's grid; ``full`` adds FedBuff's max_staleness 50 and a = 1."""
    etas = (1.0, 1.5, 2.0, 3.0, 4.0)
    staleness = (10, 50) if full else (10,)
    weightings = [("constant", 0.5), ("polynomial", 0.5)] + ([("polynomial", 1.0)] if full
                                                              else [])
    fedbuff = [Settings(eta=eta, concurrency=c, weighting=w, exponent=a, max_staleness=s)
               for c in (10, 20, 30) for w, a in weightings for eta in etas
               for s in staleness]
    return {
        "sync": [Settings(eta=eta) for eta in etas],
        "sync-overselect": [Settings(eta=eta, over_selection=1.3) for eta in etas],
        "fedbuff": fedbuff,
    }


LABELS = {"sync": "synchronous FedAvg", "sync-overselect": "synchronous FedAvg, over-selection",
          "fedbuff": "FedBuff, fastest",
          "fedbuff-budget": "FedBuff, fastest within 1.5x the updates"}
SWEEP_LABELS = {**LABELS, "fedbuff": "FedBuff"}
#: FedBuff's second setting may use this many times the best synchronous method's updates.
UPDATES_BUDGET = 1.5


def scenario(setup: Setup, settings: Settings, seed: int, steps: int) -> Scenario:
    """The run of ``settings`` on ``seed``: digits, Dirichlet(0.5) label skew, the MLP."""
    strategy = (StrategyConfig("fedavg") if settings.eta == 1.0 else
                StrategyConfig("fedavgm", {"server_learning_rate": settings.eta,
                                           "server_momentum": 0.0}))
    rounds = RoundsConfig()
    if settings.asynchronous:
        rounds = RoundsConfig(mode="async", concurrency=settings.concurrency,
                              buffer_size=setup.per_step, max_staleness=settings.max_staleness,
                              staleness_weighting=settings.weighting,
                              staleness_exponent=settings.exponent)
    return Scenario(
        name="async-benchmark", seed=seed, num_clients=setup.clients,
        clients_per_round=setup.per_step, rounds=steps, local_epochs=1, progress=False,
        partition=PartitionSpec(name="dirichlet", alpha=0.5, min_size=5),
        client=ClientSpec(batch_size=8, lr=0.05, momentum=0.9),
        strategy=strategy, over_selection=settings.over_selection, rounds_config=rounds,
        speed=SpeedSpec(distribution="lognormal", mean_s=setup.mean_s, sigma=setup.sigma,
                        jitter=setup.jitter, straggler_fraction=setup.straggler_fraction,
                        straggler_factor=setup.straggler_factor),
    )


class _Reached(Exception):
    """Raised from a tuning run's round callback once the target is reached: the rest of
    the run cannot change its time to the target."""


def run(setup: Setup, settings: Settings, seed: int, *, stop_at_target: bool) -> dict[str, Any]:
    """One run's measures (see `measure`); its curve is kept for report runs only."""
    records: list[RoundRecord] = []
    recent: collections.deque[float] = collections.deque(maxlen=setup.window)

    def on_round(record: RoundRecord) -> None:
        records.append(record)
        accuracy = record.get("test_accuracy")
        if isinstance(accuracy, float) and record.round > 0:
            recent.append(accuracy)
            if (stop_at_target and len(recent) == setup.window
                    and statistics.fmean(recent) >= setup.target):
                raise _Reached

    started = time.perf_counter()
    with contextlib.suppress(_Reached):
        run_scenario(scenario(setup, settings, seed, setup.steps), None, on_round=on_round)
    out = measure(records, setup.target, setup.window)
    out.update(seed=seed, wall_s=round(time.perf_counter() - started, 2))
    if stop_at_target:
        out.pop("curve")
    return out


def measure(records: list[RoundRecord], target: float, window: int) -> dict[str, Any]:
    """Time, updates and client fits to ``target``; the final accuracy; the curve.

    The target is reached at the first evaluation where the mean accuracy of the last
    ``window`` evaluations (that one included) is at least ``target``: a single lucky
    evaluation of a noisy run does not count (``first_time_to_target_s`` is that first
    single one, for reference). *Updates* are the updates aggregated; *fits* are the fit
    tasks clients ran, those thrown away included (over-selection's cancelled tasks,
    FedBuff's stale ones).
    """
    updates = fits = 0
    reached: dict[str, Any] = {"time_to_target_s": None, "updates_to_target": None,
                               "fits_to_target": None, "steps_to_target": None}
    first = None
    curve, staleness = [], []
    recent: collections.deque[float] = collections.deque(maxlen=window)
    for record in records:
        updates += record.num_updates
        fits += record.num_sampled
        if record.round > 0 and isinstance(record.fit.get("staleness"), int | float):
            staleness.append(float(record.fit["staleness"]))
        accuracy = record.get("test_accuracy")
        if not isinstance(accuracy, float):
            continue
        now = float(record.get("virtual_time_s"))
        curve.append([round(now, 3), round(accuracy, 4), updates])
        if record.round == 0:
            continue
        recent.append(accuracy)
        if first is None and accuracy >= target:
            first = round(now, 2)
        if (reached["time_to_target_s"] is None and len(recent) == window
                and statistics.fmean(recent) >= target):
            reached = {"time_to_target_s": round(now, 2), "updates_to_target": updates,
                       "fits_to_target": fits, "steps_to_target": record.round}
    last = records[-1]
    return {**reached, "first_time_to_target_s": first,
            "final_accuracy": last.get("test_accuracy"),
            "final_time_s": round(float(last.get("virtual_time_s")), 2), "updates": updates,
            "fits": fits, "mean_staleness": statistics.fmean(staleness) if staleness else None,
            "curve": curve}


def _mean(runs: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.fmean(values) if values else math.inf


def sweep(setup: Setup, grid: list[Settings], seeds: list[int], log: Any) -> list[dict]:
    """Every grid point's tuning runs (stopped at the target) and their means."""
    points = []
    for settings in grid:
        runs = [run(setup, settings, seed, stop_at_target=True) for seed in seeds]
        point = {"settings": dataclasses.asdict(settings), "describe": settings.describe(),
                 "missed": sum(r["time_to_target_s"] is None for r in runs),
                 "mean_time_to_target_s": _mean(runs, "time_to_target_s"),
                 "mean_updates_to_target": _mean(runs, "updates_to_target"), "runs": runs}
        points.append(point)
        log(f"  {settings.describe():62s} {point['mean_time_to_target_s']:7.1f} s, "
            f"{point['mean_updates_to_target']:5.0f} updates"
            + (f" ({point['missed']} missed)" if point["missed"] else ""))
    return points


def fastest(points: list[dict], max_updates: float = math.inf) -> dict | None:
    """The point with the smallest mean time to the target among those that always
    reach it within ``max_updates`` mean updates (None: no such point)."""
    allowed = [p for p in points if not p["missed"] and p["mean_updates_to_target"] <= max_updates]
    return min(allowed, key=lambda p: p["mean_time_to_target_s"]) if allowed else None


def run_sim(setup: Setup, tuning_seeds: list[int], report_seeds: list[int], full: bool,
            log: Any = print) -> dict[str, Any]:
    """The whole simulation side: tune each method on the tuning seeds, then run the
    chosen settings on the report seeds.

    FedBuff is reported twice: its fastest setting, and its fastest setting whose mean
    updates to the target stay within `UPDATES_BUDGET` times those of the best
    synchronous method (the issue's target is on both time and updates; an operator
    with an update budget would choose so). Both are chosen on the tuning seeds only.
    """
    sweeps, chosen = {}, {}
    for name, grid in grids(full).items():
        log(f"{SWEEP_LABELS[name]}: {len(grid)} settings on seeds {tuning_seeds} "
            f"(mean time and updates to {setup.target})")
        sweeps[name] = sweep(setup, grid, tuning_seeds, log)
    for name in ("sync", "sync-overselect", "fedbuff"):
        chosen[name] = fastest(sweeps[name])
    synced = [p for p in (chosen["sync"], chosen["sync-overselect"]) if p is not None]
    if synced:
        best = min(synced, key=lambda p: p["mean_time_to_target_s"])
        chosen["fedbuff-budget"] = fastest(
            sweeps["fedbuff"], UPDATES_BUDGET * best["mean_updates_to_target"])
    methods, reported = [], {}
    for name, point in chosen.items():
        if point is None:
            log(f"{LABELS[name]}: no setting of the grid qualifies")
            continue
        point.setdefault("chosen_as", []).append(name)
        settings = Settings(**point["settings"])
        if settings not in reported:  # both FedBuff choices may be one setting
            log(f"{LABELS[name]}: {settings.describe()} on seeds {report_seeds}")
            reported[settings] = [run(setup, settings, seed, stop_at_target=False)
                                  for seed in report_seeds]
        runs = reported[settings]
        methods.append({"name": name, "label": LABELS[name], "settings": point["settings"],
                        "describe": settings.describe(), "runs": runs})
    return {"methods": methods, "grid": sweeps}
