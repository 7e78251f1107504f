"""Tables, targets and the figure of benchmarks/compression.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _compression_accuracy import PLAIN, Q8, SETTINGS, TOPK, codec_label


def _speed(codecs: dict[str, dict[str, Any]], setting: dict[str, Any], key: str) -> str:
    """The setting's codecs' figure (up / down); top-k's encode inside error feedback."""
    cells = []
    for direction in ("upload", "download"):
        name = setting[direction]
        if name and codecs:
            label = codec_label(name, setting["topk_fraction"])
            row = codecs.get(f"{label} + EF" if name == "topk" else label)
            cells.append(f"{row[key]:.0f}" if row else "?")
    return " / ".join(cells) or "-"


def _ratio(plain: float, value: float) -> str:
    return f"{plain / value:.2f}x"


def codec_table(tasks: list[dict[str, Any]], codecs: list[dict[str, Any]]) -> str:
    """One row per codec setting: bytes, throughput, accuracy (and delta) per task."""
    scale = min((c["scale"] for c in codecs), key=lambda v: abs(v - 1e-3), default=0)
    by_codec = {c["codec"]: c for c in codecs if c["scale"] == scale}
    names = " / ".join(t["task"]["name"] for t in tasks)
    head = ["setting", f"up B/client/round ({names})", "up x fewer",
            f"down B/client/round ({names})", "down x fewer",
            "encode MB/s (up / down)", "decode MB/s (up / down)"]
    head += [f"{t['task']['name']} accuracy (Δ pts)" for t in tasks]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, setting in enumerate(SETTINGS):
        rows = [t["rows"][i] for t in tasks]
        plains = [t["rows"][0] for t in tasks]
        cells = [setting.label,
                 " / ".join(f"{r['upload_bytes']:,.0f}" for r in rows),
                 " / ".join(_ratio(p["upload_bytes"], r["upload_bytes"])
                            for p, r in zip(plains, rows, strict=True)),
                 " / ".join(f"{r['download_bytes']:,.0f}" for r in rows),
                 " / ".join(_ratio(p["download_bytes"], r["download_bytes"])
                            for p, r in zip(plains, rows, strict=True)),
                 _speed(by_codec, rows[0]["setting"], "encode_mb_s"),
                 _speed(by_codec, rows[0]["setting"], "decode_mb_s")]
        cells += [f"{r['final_accuracy']:.4f} ({r['delta_points']:+.2f})" for r in rows]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def throughput_table(codecs: list[dict[str, Any]]) -> str:
    scales = sorted({c["scale"] for c in codecs}, reverse=True)
    names = list(dict.fromkeys(c["codec"] for c in codecs))
    by = {(c["codec"], c["scale"]): c for c in codecs}
    per = " / ".join(f"sd {s:g}" for s in scales)
    lines = [f"| codec ({codecs[0]['params']:,} float32 values, one thread) | encode MB/s "
             f"({per}) | decode MB/s ({per}) |", "|---|---|---|"]
    for name in names:
        cells = [" / ".join(f"{by[name, s][key]:.0f}" for s in scales)
                 for key in ("encode_mb_s", "decode_mb_s")]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def link_table(cases: list[dict[str, Any]]) -> str:
    plain = cases[0]["round_s"]
    lines = ["| case | s per round, median (min-max) | download s | client gap s | upload s "
             "| server gap s | wire MB up / down per client per round | link time of "
             "those bytes, s | speed-up |", "|" + "---|" * 9]
    for c in cases:
        floor = c["wire_up_bytes"] * 8 / (c["up_mbit"] * 1e6) \
            + c["wire_down_bytes"] * 8 / (c["down_mbit"] * 1e6)
        phases = c.get("phases") or {}
        split = [f"{phases[k]:.2f}" if k in phases else "?" for k in
                 ("download_s", "client_gap_s", "upload_s", "server_gap_s")]
        lines.append(
            f"| {c['label']} | {c['round_s']:.2f} ({c['min_round_s']:.2f}-"
            f"{c['max_round_s']:.2f}) | {' | '.join(split)} | "
            f"{c['wire_up_bytes'] / 1e6:.2f} / {c['wire_down_bytes'] / 1e6:.2f} | "
            f"{floor:.2f} | {plain / c['round_s']:.2f}x |")
    return "\n".join(lines)


def targets(tasks: list[dict[str, Any]], link: list[dict[str, Any]],
            tolerance: dict[str, float]) -> list[dict[str, Any]]:
    """The issue's targets: q8 >= 3.5x fewer uplink bytes within 1 point, top-k 1% with
    error feedback >= 20x fewer within 2 points (each task), and the link >= 3x."""
    checks = []
    for task in tasks:
        plain = task["rows"][SETTINGS.index(PLAIN)]
        for setting, ratio, key in ((Q8, 3.5, "q8"), (TOPK, 20.0, "topk")):
            row = task["rows"][SETTINGS.index(setting)]
            fewer = plain["upload_bytes"] / row["upload_bytes"]
            points = tolerance[key] * 100
            checks.append({
                "target": f"{task['task']['name']}: {setting.label}: >= {ratio:g}x fewer "
                          f"uplink bytes, accuracy within {points:g} point(s) of float32",
                "value": f"{fewer:.2f}x, {row['delta_points']:+.2f} points",
                "met": fewer >= ratio and row["delta_points"] >= -points,
            })
    for case in link[1:]:
        speedup = link[0]["round_s"] / case["round_s"]
        checks.append({"target": f"{case['label']}: round >= 3x faster than float32 "
                                 "over the limited link",
                       "value": f"{speedup:.2f}x", "met": speedup >= 3.0})
    return checks


def print_checks(checks: list[dict[str, Any]]) -> None:
    for c in checks:
        print(f"{'PASS' if c['met'] else 'FAIL'}  {c['target']}: {c['value']}")


def plot(tasks: list[dict[str, Any]], link: list[dict[str, Any]], out: Path) -> None:
    """Seed-mean test accuracy per round for each task, and the link's round times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(tasks) + (1 if link else 0)
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(5.5 * max(panels, 1), 4.3),
                             squeeze=False)
    for axis, task in zip(axes[0], tasks, strict=False):
        for row in task["rows"]:
            curve = row.get("extended_curve", row["mean_curve"])
            axis.plot(range(len(curve)), curve, lw=1.2, label=row["setting"]["label"])
        axis.axvline(task["task"]["rounds"], color="grey", ls="--", lw=0.8)
        axis.set_title(f"{task['task']['name']}: {task['params']:,} parameters", fontsize=10)
        axis.set_xlabel("round")
        axis.set_ylabel("test accuracy (mean of seeds)")
        axis.set_ylim(0.5, 1.0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="lower right")
    if link:
        axis = axes[0][-1]
        labels = [c["label"] for c in link]
        axis.bar(labels, [c["round_s"] for c in link],
                 color=["tab:grey", "tab:blue", "tab:green"][:len(link)])
        axis.tick_params(axis="x", labelsize=7)
        for i, c in enumerate(link):
            axis.text(i, c["round_s"], f"{c['round_s']:.1f} s", ha="center", va="bottom")
        first = link[0]
        axis.set_title(f"{first['params'] / 1e6:g}M parameters, {first['clients']} clients, "
                       f"{first['up_mbit']:g} / {first['down_mbit']:g} Mbit/s", fontsize=10)
        axis.set_ylabel("seconds per round (median after round 1)")
        axis.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
