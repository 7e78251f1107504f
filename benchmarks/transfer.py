"""Broadcast + upload cost per round: fedloom beside Flower 1.42's deployment engine.

The job on both sides: fit-only FedAvg rounds over loopback, clients whose 'training'
adds a constant to every weight (no evaluation), a float32 model of a flat weight and
a 10-value bias. For each model size:

- **fedloom**: the server in its own spawned process, 5 clients in 5 spawned
  processes (plus, at one size, 50 clients, 10 per process);
- **Flower**: a SuperLink and 5 SuperNodes started fresh for the size, every process
  under an address-space cap (``prlimit --as``), and ``flwr run`` of the hand-written
  app in ``flower_transfer_app/`` (its ServerApp runs Flower's message-API FedAvg).

Figures: seconds per steady round (the median round period after round 1), effective
throughput (2 x model bytes x clients / round time) and the server's peak memory above
its idle footprint: for fedloom the server process's ``VmHWM`` above its RSS once its
imports were done and before the model existed; for Flower the SuperLink's ``VmHWM``
above its RSS with the SuperNodes connected (its ServerApp process's absolute peak is
reported beside it). Ratios are against Flower in the same invocation.

    python benchmarks/transfer.py                       # 1k, 1M, 10M, 100M; Flower to 10M
    python benchmarks/transfer.py --quick               # 1k and 10M, few rounds
    python benchmarks/transfer.py --sizes 10M --sides fedloom --many-clients 0
    python benchmarks/transfer.py --sides fedloom --shared-upload-connection  # A/B

Run one benchmark at a time (two at once measure each other). Writes
``benchmarks/results/transfer.json`` (``transfer-quick.json``; or ``--out``) and prints
the table; the current figures are in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path
from typing import Any

import _transfer_fedloom
import _transfer_flower
from _report import print_targets, write_report

RESULTS = Path(__file__).resolve().parent / "results"
MB = 1e6
SUFFIXES = {"k": 1_000, "M": 1_000_000, "G": 1_000_000_000}
#: Rounds per size (full run, quick run); round 1 is warm-up and not counted.
ROUNDS = {1_000: (30, 6), 1_000_000: (12, 4), 10_000_000: (8, 4), 100_000_000: (4, 3)}
FLOWER_ROUNDS = {1_000: (5, 3), 1_000_000: (5, 3), 10_000_000: (5, 3)}


def parse_size(text: str) -> int:
    """``1k`` -> 1000, ``10M`` -> 10_000_000, ``123`` -> 123."""
    text = text.strip()
    if text and text[-1] in SUFFIXES:
        return int(float(text[:-1]) * SUFFIXES[text[-1]])
    return int(text)


def size_label(n: int) -> str:
    for suffix, factor in sorted(SUFFIXES.items(), key=lambda kv: -kv[1]):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{suffix}"
    return str(n)


def steady(round_ends: list[float]) -> dict[str, Any]:
    """Round periods after round 1: median (the figure), min and max."""
    periods = [b - a for a, b in itertools.pairwise(round_ends)]
    if not periods:
        raise ValueError("need at least 2 rounds (round 1 is warm-up)")
    return {
        "steady_round_s": statistics.median(periods),
        "min_round_s": min(periods),
        "max_round_s": max(periods),
        "periods_s": periods,
    }


def fedloom_case(
    num_params: int, rounds: int, clients: int, processes: int, separate_uploads: bool = True
) -> dict[str, Any]:
    raw = _transfer_fedloom.run(num_params, rounds, clients, processes, separate_uploads)
    model = 4 * num_params
    result: dict[str, Any] = {
        "side": "fedloom",
        "params": num_params,
        "model_mb": model / MB,
        "clients": clients,
        "client_processes": processes,
        "separate_upload_connection": separate_uploads,
        "rounds": rounds,
        "ok_rounds": sum(s == "ok" for s in raw["statuses"]),
        **steady(raw["round_ends"]),
        "server_idle_mb": raw["idle_rss"] / MB,
        "server_peak_mb": raw["peak_rss"] / MB,
        "server_peak_above_idle_mb": (raw["peak_rss"] - raw["idle_rss"]) / MB,
        "client_process_peak_mb": raw["client_peak_rss"] / MB,
        "server_cpu_s": raw["cpu_s"],
        "clients_cpu_s": raw["clients_cpu_s"],
        "wall_s": raw["wall_s"],
    }
    return _derive(result)


def flower_case(num_params: int, rounds: int, nodes: int, cap: int) -> dict[str, Any]:
    raw = _transfer_flower.run(num_params, rounds, nodes, cap)
    result: dict[str, Any] = {
        "side": "flower",
        "params": num_params,
        "model_mb": 4 * num_params / MB,
        "clients": nodes,
        "rounds": rounds,
        "memory_cap_gb": cap / 2**30,
    }
    if "error" in raw:
        return {**result, **raw}
    peaks = raw["peak_rss"]
    result.update(steady(raw["round_ends"]))
    result.update(
        {
            "server_idle_mb": raw["superlink_idle_rss"] / MB,
            "server_peak_mb": peaks.get("superlink", 0) / MB,
            "server_peak_above_idle_mb": (peaks.get("superlink", 0) - raw["superlink_idle_rss"])
            / MB,
            "serverapp_peak_mb": peaks.get("serverapp", 0) / MB,
            "supernode_peak_mb": peaks.get("supernode", 0) / MB,
            "clientapp_peak_mb": peaks.get("clientapp", 0) / MB,
            "processes": raw["processes"],
            "wall_s": raw["wall_s"],
        }
    )
    return _derive(result)


def _derive(result: dict[str, Any]) -> dict[str, Any]:
    moved = 2 * result["model_mb"] * result["clients"]
    result["effective_mb_per_s"] = moved / result["steady_round_s"]
    result["server_peak_x_model"] = result["server_peak_above_idle_mb"] / result["model_mb"]
    return result


def compare(results: list[dict[str, Any]]) -> None:
    """Add Flower ratios to fedloom's rows of the same size and client count."""
    flower = {(r["params"], r["clients"]): r for r in results if r["side"] == "flower"}
    for r in results:
        other = flower.get((r["params"], r["clients"]))
        if r["side"] != "fedloom" or other is None or "error" in other:
            continue
        r["speedup_vs_flower"] = other["steady_round_s"] / r["steady_round_s"]
        r["throughput_x_flower"] = r["effective_mb_per_s"] / other["effective_mb_per_s"]


def targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets, each with the figure it is judged on."""
    def find(side: str, params: int, clients: int = 5) -> dict[str, Any] | None:
        for r in results:
            key = (r["side"], r["params"], r["clients"])
            if key == (side, params, clients) and "error" not in r:
                return r
        return None

    out: list[dict[str, Any]] = []
    small = find("fedloom", 1_000)
    if small:
        out.append(_target("steady round at 1k params <= 0.3 s",
                           small["steady_round_s"], small["steady_round_s"] <= 0.3, "s"))
    ten = find("fedloom", 10_000_000)
    if ten and "throughput_x_flower" in ten:
        out.append(_target("10M: effective throughput >= 10x Flower's",
                           ten["throughput_x_flower"], ten["throughput_x_flower"] >= 10, "x"))
    if ten:
        out.append(_target("10M, 5 clients: server peak <= 4x model above idle",
                           ten["server_peak_x_model"], ten["server_peak_x_model"] <= 4, "x model"))
    many = next((r for r in results if r["side"] == "fedloom" and r["clients"] > 5), None)
    if ten and many and many["params"] == ten["params"]:
        ratio = many["server_peak_above_idle_mb"] / ten["server_peak_above_idle_mb"]
        out.append(_target(f"{many['clients']} clients: server peak no higher than 5 clients'"
                           " (10% measurement slack)", ratio, ratio <= 1.10, "x the 5-client peak"))
    huge = find("fedloom", 100_000_000)
    if huge:
        out.append(_target("100M moves without memory blow-up (server peak <= 4x model)",
                           huge["server_peak_x_model"], huge["server_peak_x_model"] <= 4,
                           "x model"))
    return out


def _target(name: str, value: float, met: bool, unit: str) -> dict[str, Any]:
    return {"target": name, "value": round(value, 3), "unit": unit, "met": met}


def table(results: list[dict[str, Any]]) -> str:
    head = (f"{'params':>6} {'side':8} {'clients':>7} {'round s':>8} {'MB/s':>8} "
            f"{'srv peak MB':>11} {'x model':>7} {'vs Flower':>9}")
    lines = [head, "-" * len(head)]
    for r in results:
        label = size_label(r["params"])
        if "error" in r:
            lines.append(f"{label:>6} {r['side']:8} {r['clients']:>7}  {r['error']}")
            continue
        ratio = f"{r['speedup_vs_flower']:.1f}x" if "speedup_vs_flower" in r else ""
        lines.append(
            f"{label:>6} {r['side']:8} {r['clients']:>7} {r['steady_round_s']:>8.3f} "
            f"{r['effective_mb_per_s']:>8.1f} {r['server_peak_above_idle_mb']:>11.1f} "
            f"{r['server_peak_x_model']:>7.2f} {ratio:>9}"
        )
    for r in results:
        if r["side"] == "flower" and "error" not in r:
            lines.append(
                f"Flower {size_label(r['params'])}: ServerApp peak {r['serverapp_peak_mb']:.0f} MB,"
                f" SuperNode {r['supernode_peak_mb']:.0f} MB, ClientApp"
                f" {r['clientapp_peak_mb']:.0f} MB (absolute)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--sizes", default="1k,1M,10M,100M", help="model sizes (float32s)")
    parser.add_argument("--sides", default="fedloom,flower", help="fedloom, flower or both")
    parser.add_argument("--clients", type=int, default=5, help="clients (processes) per run")
    parser.add_argument("--many-clients", type=int, default=50,
                        help="also run fedloom with this many clients (0: skip)")
    parser.add_argument("--many-size", default="10M", help="model size of the many-client run")
    parser.add_argument("--clients-per-process", type=int, default=10,
                        help="clients per process in the many-client run")
    parser.add_argument("--rounds", type=int, default=0, help="rounds per run (0: per size)")
    parser.add_argument("--flower-max", default="10M", help="largest size Flower runs")
    parser.add_argument("--flower-mem-cap-gb", type=float, default=8.0,
                        help="address-space cap of each Flower process (prlimit --as)")
    parser.add_argument("--quick", action="store_true",
                        help="sizes 1k and 10M, fewer rounds, 20 clients for the many run")
    parser.add_argument("--shared-upload-connection", action="store_true",
                        help="clients push on their long-lived channel (separate_upload_"
                             "connection off), for comparison with the default")
    parser.add_argument("--out", type=Path, default=None, help="JSON report path")
    args = parser.parse_args(argv)
    if args.quick and args.sizes == parser.get_default("sizes"):
        args.sizes = "1k,10M"
    if args.quick and args.many_clients == parser.get_default("many_clients"):
        args.many_clients = 20
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    sides = {s.strip() for s in args.sides.split(",")}
    flower_max = parse_size(args.flower_max)
    cap = int(args.flower_mem_cap_gb * 2**30)
    pick = 1 if args.quick else 0
    separate = not args.shared_upload_connection

    def rounds_for(table_: dict[int, tuple[int, int]], n: int) -> int:
        if args.rounds:
            return max(2, args.rounds)
        return table_.get(n, (6, 3))[pick]

    results: list[dict[str, Any]] = []
    for n in sizes:
        if "fedloom" in sides:
            print(f"fedloom {size_label(n)} x {args.clients} clients ...", flush=True)
            results.append(fedloom_case(n, rounds_for(ROUNDS, n), args.clients, args.clients,
                                        separate))
        if "flower" in sides and n <= flower_max:
            print(f"Flower {size_label(n)} x {args.clients} SuperNodes ...", flush=True)
            results.append(flower_case(n, rounds_for(FLOWER_ROUNDS, n), args.clients, cap))
    many_size = parse_size(args.many_size)
    if "fedloom" in sides and args.many_clients > 0:
        procs = max(1, -(-args.many_clients // args.clients_per_process))
        print(f"fedloom {size_label(many_size)} x {args.many_clients} clients ...", flush=True)
        results.append(
            fedloom_case(many_size, rounds_for(ROUNDS, many_size), args.many_clients, procs,
                         separate)
        )
    compare(results)
    checks = targets(results)
    print()
    print(table(results))
    print()
    print_targets(checks)
    out = args.out or RESULTS / ("transfer-quick.json" if args.quick else "transfer.json")
    write_report("transfer", args, results, checks, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
