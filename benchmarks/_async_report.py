"""What `benchmarks/async.py` reports for each side: medians over the report seeds, the
table, the targets and the plot of accuracy against (virtual) wall-clock time.

A side's result is ``{"methods": [{"name", "label", "describe", "runs": [...]}, ...]}``
with the methods named ``sync``, ``sync-overselect``, ``fedbuff`` and (optionally)
``fedbuff-budget``, and each run
holding ``time_to_target_s``, ``updates_to_target``, ``fits_to_target``,
``final_accuracy``, ``updates`` and ``curve`` (``[time_s, accuracy, updates]`` points),
as `_async_sim.measure` writes them; every side is reported alike.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

SPEEDUP_TARGET, UPDATES_TARGET = 2.0, 1.5


def median(runs: list[dict[str, Any]], key: str) -> float | None:
    """The median of ``key`` over the runs; None when a run has none (missed target)."""
    values = [r[key] for r in runs]
    if not values or any(v is None for v in values):
        return None
    return float(statistics.median(values))


FEDBUFFS = ("fedbuff", "fedbuff-budget")


def summarize(side: dict[str, Any]) -> dict[str, Any]:
    """Each method's medians, and each FedBuff setting against the best synchronous
    method (the one with the smaller median time to the target): how many times sooner
    it gets there, with how many times the updates and the client fits."""
    rows = {}
    for method in side["methods"]:
        runs = method["runs"]
        rows[method["name"]] = {key: median(runs, key) for key in (
            "time_to_target_s", "updates_to_target", "fits_to_target", "final_accuracy",
            "final_time_s", "updates")}
    synced = [n for n in ("sync", "sync-overselect") if rows.get(n, {}).get("time_to_target_s")]
    best = min(synced, key=lambda n: rows[n]["time_to_target_s"]) if synced else None
    comparisons = {}
    for name in FEDBUFFS:
        fedbuff = rows.get(name)
        if best is None or fedbuff is None or not fedbuff["time_to_target_s"]:
            continue
        base = rows[best]
        comparisons[name] = {
            "best_sync": best,
            "speedup": base["time_to_target_s"] / fedbuff["time_to_target_s"],
            "updates_ratio": fedbuff["updates_to_target"] / base["updates_to_target"],
            "fits_ratio": fedbuff["fits_to_target"] / base["fits_to_target"]}
    return {"medians": rows, "comparisons": comparisons}


def _cell(value: float | None, fmt: str) -> str:
    return "missed" if value is None else format(value, fmt)


def table(side: dict[str, Any], summary: dict[str, Any], target: float, clock: str) -> str:
    lines = [f"| method | settings (tuned) | {clock} s to {target:.2f}: median [per seed] | "
             f"updates to {target:.2f} | client fits to {target:.2f} (incl. discarded) | "
             f"final accuracy [after updates, at {clock} s] |", "|---|---|---|---|---|---|"]
    for method in side["methods"]:
        runs, med = method["runs"], summary["medians"][method["name"]]
        seeds = " ".join(_cell(r["time_to_target_s"], ".0f") for r in runs)
        lines.append(
            f"| {method['label']} | {method['describe']} | "
            f"{_cell(med['time_to_target_s'], '.0f')} [{seeds}] | "
            f"{_cell(med['updates_to_target'], '.0f')} | {_cell(med['fits_to_target'], '.0f')} | "
            f"{_cell(med['final_accuracy'], '.3f')} [{_cell(med['updates'], '.0f')}, "
            f"{_cell(med['final_time_s'], '.0f')}] |")
    return "\n".join(lines)


def targets(side_name: str, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's two targets for each FedBuff setting, against the best synchronous
    method (the client fits, discarded ones included, are reported beside them)."""
    checks = []
    for name, c in summary["comparisons"].items():
        checks += [
            {"target": f"{side_name}, {name}: reaches the target at least "
                       f"{SPEEDUP_TARGET:g}x sooner than the best synchronous setting "
                       f"({c['best_sync']})",
             "value": round(c["speedup"], 2), "unit": "x sooner",
             "met": c["speedup"] >= SPEEDUP_TARGET},
            {"target": f"{side_name}, {name}: ... with at most {UPDATES_TARGET:g}x its "
                       f"aggregated updates (client fits: {c['fits_ratio']:.2f}x)",
             "value": round(c["updates_ratio"], 2), "unit": "x the updates",
             "met": c["updates_ratio"] <= UPDATES_TARGET},
        ]
    return checks


def plot(sides: dict[str, dict[str, Any]], target: float, out: Path, title: str) -> None:
    """Accuracy against time (log scale: the methods differ by orders of magnitude) and
    against updates, one panel pair per side; every report seed drawn, thin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(sides), 2, figsize=(12, 4.2 * len(sides)), squeeze=False)
    colours = {"sync": "tab:red", "sync-overselect": "tab:orange", "fedbuff": "tab:blue",
               "fedbuff-budget": "tab:green"}
    for row, (side_name, side) in zip(axes, sides.items(), strict=True):
        for method in side["methods"]:
            for i, r in enumerate(method["runs"]):
                points = [p for p in r["curve"] if p[0] > 0]
                label = method["label"] if i == 0 else None
                style = {"color": colours.get(method["name"]), "lw": 1.0, "alpha": 0.8}
                row[0].plot([p[0] for p in points], [p[1] for p in points], label=label,
                            **style)
                row[1].plot([p[2] for p in r["curve"]], [p[1] for p in r["curve"]], **style)
        for axis, xlabel in zip(row, (f"{side_name}: time (s, log scale)",
                                      f"{side_name}: client updates aggregated"), strict=True):
            axis.axhline(target, color="grey", ls="--", lw=0.8)
            axis.set_xlabel(xlabel)
            axis.set_ylabel("test accuracy")
            axis.set_ylim(0.5, 1.0)
            axis.grid(alpha=0.3)
        row[0].set_xscale("log")
        row[1].legend(*row[0].get_legend_handles_labels(), loc="lower right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
