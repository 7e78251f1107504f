"""Update and broadcast compression: bytes, codec speed, accuracy, and round time.

For each codec setting — plain float32; fp16, bf16, q8, q4 updates; top-k 1% updates
with error feedback; q8 updates with an fp16 broadcast (and top-k 5%, for scale):

1. **Bytes and accuracy** (`_compression_accuracy`): the simulation (`run_scenario`,
   local engine) of two digits tasks, with the scenario's ``[compression]`` table and
   the same seeds for every setting: the 64-64-10 MLP (4,810 parameters) and a
   64-13500-10 MLP (1,012,510 parameters); 50 clients with Dirichlet(0.5) label skew,
   10 a round, 30 rounds, 2 local epochs of SGD. Bytes per client and round each way
   come from the round records (the payloads' sizes); accuracy is the central test
   accuracy after the last round, mean over the seeds, and its difference from float32
   in points. When top-k 1% misses its accuracy target it runs again for 4x the rounds,
   to show when it gets there.
2. **Codec throughput**: encode and decode of a 10M-value float32 update on one thread,
   MB/s of float32 input, median of 5; Gaussian values of standard deviation 1e-3, and
   of 1e-5 (below float16's normal range, where numpy's float16 cast is slow).
3. **Round time over a limited link** (`_compression_link`): a real server (FedAvg,
   plaintext on loopback) and 2 SDK clients in their own processes, each behind its own
   token-bucket proxy (20 Mbit/s client to server, 100 Mbit/s back); a 10M-parameter
   float32 model, clients that add small noise to it, 5 fit-only rounds; float32 against
   q8 updates with an fp16 broadcast (server ``[compression] upload = ["q8"],
   download = ["fp16"]``, the clients asking for them), and the same with the zstd
   stage added both ways (``q8+zstd``, ``fp16+zstd``). Seconds per round: the median of
   the rounds after the first, split by the proxies' byte timings into download,
   client gap, upload and server gap.
4. **The zstd stage** (`_compression_zstd`): each codec's payload with and without
   zstd, on real trained updates of both digits models (and the broadcast), the round
   trip asserted bit-identical; compress / decompress MB/s.
5. **The event loop at a version change** (`_compression_stall`): a real server and 2
   SDK clients (processes) granted ``fp16+zstd`` downloads, a 10M-parameter model, 4
   fit-only rounds; the loop's lag, sampled every 5 ms, while each new version is
   published (its broadcast built in the worker thread), and the build's own time.

Targets (printed PASS / FAIL): q8 >= 3.5x fewer uplink bytes within 1 accuracy point
of float32; top-k 1% with error feedback >= 20x fewer within 2 points; the limited-link
round >= 3x faster with q8 up + fp16 down.

    python benchmarks/compression.py            # ~11.5 min on 2 cores: compression.json, .png
    python benchmarks/compression.py --quick    # ~45 s smoke run: compression-quick.json
    python benchmarks/compression.py --parts link --link-rounds 8
    python benchmarks/compression.py --parts stall --out benchmarks/results/compression-stall.json

``--quick`` runs 10 and 5 rounds on one seed, a 64-2000-10 MLP, a 1M-value throughput
tensor, a 2.5M-parameter link (and stall) model and 2 updates per model for zstd: its
figures check that everything runs, not the targets. Run one benchmark at a time
(benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS = Path(__file__).resolve().parent / "results"
TOLERANCE = {"q8": 0.01, "topk": 0.02}  # accuracy below float32's, as a fraction
PARTS = ("accuracy", "throughput", "link", "zstd", "stall")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (~1 min)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=30, help="rounds of every run")
    parser.add_argument("--large-hidden", type=int, default=13_500,
                        help="hidden width of the large task's MLP (13500: 1.01M params)")
    parser.add_argument("--extend", type=int, default=4,
                        help="top-k 1%% reruns for this many times the rounds if it misses")
    parser.add_argument("--throughput-params", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--link-params", type=int, default=10_000_000)
    parser.add_argument("--link-rounds", type=int, default=5)
    parser.add_argument("--link-clients", type=int, default=2)
    parser.add_argument("--up-mbit", type=float, default=20.0)
    parser.add_argument("--down-mbit", type=float, default=100.0)
    parser.add_argument("--zstd-clients", type=int, default=5,
                        help="trained updates per model for the zstd ratios")
    parser.add_argument("--stall-params", type=int, default=10_000_000)
    parser.add_argument("--stall-rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS / "compression.json")
    return parser


def _apply_quick(args: argparse.Namespace) -> None:
    args.seeds, args.rounds, args.large_hidden, args.extend = [0], 10, 2_000, 1
    args.throughput_params, args.repeats = 1_000_000, 3
    args.link_params, args.link_rounds = 2_500_000, 3
    args.zstd_clients = 2
    args.stall_params, args.stall_rounds = 2_500_000, 3
    if args.out == RESULTS / "compression.json":
        args.out = RESULTS / "compression-quick.json"


def _name(hidden: int) -> str:
    """``digits-4.81k``, ``digits-1.01M``: the task by its model's parameter count."""
    params = 75 * hidden + 10  # 64-hidden-10 MLP: 64h + h + 10h + 10
    size = f"{params / 1e6:.3g}M" if params >= 1e6 else f"{params / 1e3:.3g}k"
    return f"digits-{size}"


def run_accuracy(args: argparse.Namespace) -> list[dict[str, Any]]:
    from _compression_accuracy import Task, run_task

    seeds = tuple(args.seeds)
    large_rounds = args.rounds if not args.quick else max(2, args.rounds // 2)
    tasks = [Task(_name(64), 64, args.rounds, seeds),
             Task(_name(args.large_hidden), args.large_hidden, large_rounds, seeds)]
    out = []
    for task in tasks:
        print(f"{task.name}: {task.describe()}", flush=True)
        out.append(run_task(task, args.extend, TOLERANCE))
    return out


def run_link(args: argparse.Namespace) -> list[dict[str, Any]]:
    from _compression_link import run_link_case

    cases = [("float32", (), ()), ("q8 up + fp16 down", ("q8",), ("fp16",)),
             ("q8+zstd up + fp16+zstd down", ("q8+zstd",), ("fp16+zstd",))]
    out = []
    for label, upload, download in cases:
        case = run_link_case(args.link_params, args.link_rounds, args.link_clients,
                             args.up_mbit, args.down_mbit, upload, download)
        case["label"] = label
        out.append(case)
        print(f"  link: {label:<27} {case['round_s']:.2f} s per round "
              f"({case['wall_s']:.0f} s)", flush=True)
    return out


def run_zstd_part(args: argparse.Namespace) -> dict[str, Any]:
    from _compression_zstd import run_zstd

    return run_zstd((64, args.large_hidden), args.zstd_clients, args.repeats)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        _apply_quick(args)
    logging.getLogger("fedloom").setLevel(logging.ERROR)
    from _compression_accuracy import throughput
    from _compression_report import (
        codec_table,
        link_table,
        plot,
        print_checks,
        targets,
        throughput_table,
    )
    from _compression_stall import run_stall, stall_line

    started = time.perf_counter()
    tasks = run_accuracy(args) if "accuracy" in args.parts else []
    codecs = (throughput(args.throughput_params, args.repeats)
              if "throughput" in args.parts else [])
    link = run_link(args) if "link" in args.parts else []
    zstd = run_zstd_part(args) if "zstd" in args.parts else None
    stall = run_stall(args.stall_params, args.stall_rounds) if "stall" in args.parts else None
    checks = targets(tasks, link, TOLERANCE)
    wall = time.perf_counter() - started
    report = {
        "benchmark": "compression",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "cpus": os.cpu_count()},
        "args": {k: str(v) for k, v in vars(args).items()},
        "tasks": tasks, "throughput": codecs, "link": link, "zstd": zstd, "stall": stall,
        "targets": checks,
        "wall_s": round(wall, 1),
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    png = args.out.with_suffix(".png")
    if tasks or link:  # the figure's only panels
        plot(tasks, link, png)
    print()
    if tasks:
        for task in tasks:
            print(f"{task['task']['name']}: {task['describe']}")
        print()
        print(codec_table(tasks, codecs))
        for task in tasks:
            topk = next(r for r in task["rows"] if r["setting"]["label"].startswith("topk 1%"))
            reached = topk.get("rounds_to_plain_minus_tolerance")
            print(f"{task['task']['name']}: top-k 1% + EF first within "
                  f"{TOLERANCE['topk'] * 100:g} points of float32's round-"
                  f"{task['task']['rounds']} accuracy at round "
                  f"{reached if reached is not None else 'never (in the rounds run)'}")
        print()
    if codecs:
        print(throughput_table(codecs))
        print()
    if link:
        print(link_table(link))
        print()
    if zstd:
        from _compression_zstd import zstd_table

        print(zstd_table(zstd))
        print()
    if stall:
        print(stall_line(stall))
        print()
    print_checks(checks)
    print(f"\nwrote {args.out}{f' and {png}' if tasks or link else ''} ({wall:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
