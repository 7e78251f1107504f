"""What benchmarks/privacy.py reports: upload bytes per mode, the table, the plot of accuracy
against ε, and the target."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fedloom.privacy._hadamard import padded_length

TARGET_EPSILON, TARGET_POINTS = 8.0, 0.02


def wire_bytes(dimension: int) -> dict[str, int]:
    """Upload bytes per client per round of each mode, from the model size."""
    return {"plain": 4 * dimension, "central-fixed": 4 * dimension,
            "central-adaptive": 4 * dimension, "secagg": 4 * (dimension + 1),
            "distributed-same-z": 4 * (padded_length(dimension) + 1),
            "distributed-own-eps": 4 * (padded_length(dimension) + 1)}


def table(rows: list[dict[str, Any]], dimension: int) -> str:
    sizes = wire_bytes(dimension)
    lines = ["| mode | target ε | z | spent ε (max over seeds) | accuracy (mean) | per seed | "
             "upload B/client/round |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        spent = "-" if r["spent_epsilon"] is None else f"{r['spent_epsilon']:.2f}"
        seeds = " ".join(f"{s['accuracy']:.3f}" for s in r["seeds"].values())
        lines.append(f"| {r['mode']} | {r['target_epsilon']:g} | {r['z']:.3f} | {spent} | "
                     f"{r['accuracy']:.3f} | {seeds} | {sizes[r['mode']]:,} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    plain = next(r for r in rows if r["mode"] == "plain")
    ax.axhline(plain["accuracy"], color="black", linestyle="--",
               label=f"no DP (ε = ∞): {plain['accuracy']:.3f}")
    styles = {"central-fixed": "o-", "central-adaptive": "s-", "distributed-own-eps": "^-",
              "distributed-same-z": "v:"}
    for mode, style in styles.items():
        points = sorted((r["target_epsilon"] if mode != "distributed-same-z"
                         else r["spent_epsilon"], r["accuracy"]) for r in rows
                        if r["mode"] == mode)
        label = mode if mode != "distributed-same-z" else (
            "distributed, central's z (at the ε its ledger spent)")
        ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
    ax.set_xscale("log")
    ticks = sorted({r["target_epsilon"] for r in rows if math.isfinite(r["target_epsilon"])}
                   | {round(r["spent_epsilon"]) for r in rows
                      if r["mode"] == "distributed-same-z" and r["spent_epsilon"]})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("ε (δ = 1e-5)")
    ax.set_ylabel("test accuracy after the last round")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"wrote {out}")


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(r["mode"], r["target_epsilon"]): r for r in rows}
    central = by.get(("central-fixed", TARGET_EPSILON))
    distributed = by.get(("distributed-same-z", TARGET_EPSILON))
    if central is None or distributed is None:
        return []
    gap = central["accuracy"] - distributed["accuracy"]
    return [{"target": "distributed DP within 2 accuracy points of central DP (fixed clipping) "
             f"at the noise of central ε = {TARGET_EPSILON:g}",
             "value": f"distributed {distributed['accuracy']:.3f}, central "
                      f"{central['accuracy']:.3f} (difference {-100 * gap:+.1f} points)",
             "met": gap <= TARGET_POINTS}]
