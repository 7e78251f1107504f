"""FedAvg aggregation from what each server holds after the wire: fedloom beside Flower.

N client updates of a float32 model (default 10M parameters: a flat weight and a
10-value bias), the same values on both sides, each side starting from the form its
server holds once the messages are in:

- **fedloom**: verified spool files, written through the server's own receive path
  (`fedloom.server.uploads.Spool`: chunks, digest, finite check), aggregated by
  ``FedAvg().aggregate_fit`` over `SpooledWeights` (the code path of a server round:
  streaming weighted mean, then the server optimizer step);
- **Flower**: ``RecordDict`` messages (an ``ArrayRecord`` under ``"arrays"`` and a
  ``MetricRecord`` with ``"num-examples"``), deflated to Flower 1.42's wire objects and
  inflated back as its ServerApp receives them, then
  ``flwr.serverapp.strategy.strategy_utils.aggregate_arrayrecords``.

Each case runs in its own spawned process. Figures: the median time over repeats,
GB/s of input (N x model bytes / time), and peak memory: the process's ``VmHWM`` above
its RSS just before aggregating (inputs already held: Flower's in memory, fedloom's
on disk) — the aggregation's own working memory — and the process's absolute peak.
The two results are compared element-wise (they must agree to float32 rounding).

    python benchmarks/aggregate.py                 # N = 10 and 50, 10M parameters
    python benchmarks/aggregate.py --quick         # N = 10, 1M parameters
    python benchmarks/aggregate.py --updates 10,50 --params 10M --repeats 5

Run one benchmark at a time (two at once measure each other). Writes
``benchmarks/results/aggregate.json`` (``aggregate-quick.json``; or ``--out``) and prints
the table; the current figures are in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
from _procmem import peak_rss_bytes, reset_peak, rss_bytes
from _report import print_targets, write_report
from transfer import parse_size, size_label

RESULTS = Path(__file__).resolve().parent / "results"
MB = 1e6
BIAS = 10


def update_arrays(num_params: int, index: int) -> list[np.ndarray]:
    """Update ``index``: seeded normal values, the same on both sides."""
    rng = np.random.default_rng(1000 + index)
    return [
        rng.standard_normal(num_params - BIAS, dtype=np.float32),
        rng.standard_normal(BIAS, dtype=np.float32),
    ]


def num_examples(index: int) -> int:
    return 10 + 7 * index


def _measure(run_once: Any, repeats: int) -> dict[str, Any]:
    """Time ``run_once()`` ``repeats`` times after one untimed warm-up run (both sides:
    first-call costs such as allocator growth and thread start-up are not the steady
    cost of a server's round); peak RSS above the RSS before each call."""
    times, above = [], []
    start = time.perf_counter()
    result = run_once()
    warmup_s = time.perf_counter() - start
    for _ in range(repeats):
        result = None
        gc.collect()
        before = rss_bytes()
        reset_peak()
        start = time.perf_counter()
        result = run_once()
        times.append(time.perf_counter() - start)
        above.append(peak_rss_bytes() - before)
    return {
        "warmup_s": warmup_s,
        "times_s": times,
        "median_s": statistics.median(times),
        "peak_above_inputs_bytes": max(above),
        "process_peak_bytes": peak_rss_bytes(),
        "result": result,
    }


def _fingerprint(arrays: list[np.ndarray]) -> list[float]:
    """A few values of the result, to compare the sides without shipping the arrays."""
    flat = arrays[0].ravel()
    picks = np.linspace(0, flat.size - 1, 64).astype(np.int64)
    return [float(v) for v in flat[picks]] + [float(v) for v in arrays[1]]


def fedloom_case(folder: str, num_params: int, n: int, repeats: int, report: Connection) -> None:
    """Spawned: FedAvg over ``n`` spooled updates in ``folder``."""
    from fedloom import ClientUpdate, Weights
    from fedloom.server.uploads import SpooledWeights
    from fedloom.strategies import FedAvg

    specs = Weights(
        [("w", np.zeros(num_params - BIAS, np.float32)), ("b", np.zeros(BIAS, np.float32))]
    ).specs()
    current = Weights(
        [("w", np.zeros(num_params - BIAS, np.float32)), ("b", np.zeros(BIAS, np.float32))]
    )
    paths = sorted(Path(folder).glob("update-*.bin"))[:n]

    def once() -> list[np.ndarray]:
        updates = (
            ClientUpdate(f"c{i}", SpooledWeights(p, specs), num_examples(i), 0)
            for i, p in enumerate(paths)
        )
        result = FedAvg().aggregate_fit(1, current, updates)
        assert result.weights is not None
        return [result.weights["w"], result.weights["b"]]

    out = _measure(once, repeats)
    out["fingerprint"] = _fingerprint(out.pop("result"))
    report.send(out)


def flower_case(num_params: int, n: int, repeats: int, report: Connection) -> None:
    """Spawned: ``aggregate_arrayrecords`` over ``n`` messages as Flower receives them."""
    from flwr.app import ArrayRecord, MetricRecord, RecordDict
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

    records = []
    for i in range(n):
        sent = RecordDict(
            {
                "arrays": ArrayRecord(update_arrays(num_params, i)),
                "metrics": MetricRecord({"num-examples": num_examples(i)}),
            }
        )
        contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(sent).items()}
        root = sent.object_id
        del sent
        received = inflate_object_from_contents(root, contents)
        assert isinstance(received, RecordDict)
        records.append(received)
        del contents

    def once() -> list[np.ndarray]:
        record = aggregate_arrayrecords(records, "num-examples")
        return [a.numpy() for a in record.values()]

    out = _measure(once, repeats)
    out["fingerprint"] = _fingerprint(out.pop("result"))
    out["inputs_rss_bytes"] = rss_bytes()
    report.send(out)


def write_spools(folder: Path, num_params: int, n: int) -> None:
    """Each update through the server's receive path into a verified spool file."""
    from fedloom import Weights
    from fedloom.payload import PayloadInfo, iter_chunks, serialize
    from fedloom.server.uploads import Spool

    for i in range(n):
        weights = Weights(zip(("w", "b"), update_arrays(num_params, i), strict=True))
        payload = serialize(weights)
        spool = Spool(folder, PayloadInfo.describe(weights.specs(), payload), 1 << 20)
        for offset, data in iter_chunks(payload, 1 << 20):
            spool.feed(offset, data)
        spool.finish()
        spool.path.rename(folder / f"update-{i:04d}.bin")


def _spawned(target: Any, *args: Any) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, send))
    proc.start()
    while not receive.poll(0.5):
        if not proc.is_alive():
            raise RuntimeError(f"{target.__name__} died; see its output above")
    result: dict[str, Any] = receive.recv()
    proc.join(60)
    return result


def summarize(side: str, n: int, num_params: int, raw: dict[str, Any]) -> dict[str, Any]:
    model = 4 * num_params
    return {
        "side": side,
        "updates": n,
        "params": num_params,
        "input_mb": n * model / MB,
        "median_s": raw["median_s"],
        "times_s": raw["times_s"],
        "warmup_s": raw["warmup_s"],
        "input_gb_per_s": n * model / raw["median_s"] / 1e9,
        "peak_above_inputs_mb": raw["peak_above_inputs_bytes"] / MB,
        "peak_above_inputs_x_model": raw["peak_above_inputs_bytes"] / model,
        "process_peak_mb": raw["process_peak_bytes"] / MB,
        "fingerprint": raw["fingerprint"],
    }


def table(results: list[dict[str, Any]]) -> str:
    head = (f"{'N':>3} {'params':>6} {'side':8} {'time ms':>8} {'GB/s in':>8} "
            f"{'work MB':>8} {'x model':>7} {'proc MB':>8} {'vs Flower':>9}")
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = f"{r['x_flower']:.2f}x" if "x_flower" in r else ""
        lines.append(
            f"{r['updates']:>3} {size_label(r['params']):>6} {r['side']:8} "
            f"{1000 * r['median_s']:>8.1f} {r['input_gb_per_s']:>8.2f} "
            f"{r['peak_above_inputs_mb']:>8.1f} {r['peak_above_inputs_x_model']:>7.2f} "
            f"{r['process_peak_mb']:>8.0f} {ratio:>9}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--updates", default="10,50", help="numbers of updates (N)")
    parser.add_argument("--params", default="10M", help="float32 parameters per update")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case")
    parser.add_argument("--sides", default="fedloom,flower")
    parser.add_argument("--quick", action="store_true", help="N = 10 at 1M parameters")
    parser.add_argument("--out", type=Path, default=None, help="JSON report path")
    args = parser.parse_args(argv)
    if args.quick:
        args.updates, args.params, args.repeats = "10", "1M", 2
    counts = [int(x) for x in args.updates.split(",") if x]
    num_params = parse_size(args.params)
    sides = {s.strip() for s in args.sides.split(",")}
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fedloom-agg-", dir="/tmp") as tmp:
        if "fedloom" in sides:
            print(f"writing {max(counts)} spool files of {size_label(num_params)} ...", flush=True)
            write_spools(Path(tmp), num_params, max(counts))
        for n in counts:
            pair: dict[str, dict[str, Any]] = {}
            if "fedloom" in sides:
                print(f"fedloom N={n} ...", flush=True)
                raw = _spawned(fedloom_case, tmp, num_params, n, args.repeats)
                pair["fedloom"] = summarize("fedloom", n, num_params, raw)
            if "flower" in sides:
                print(f"Flower N={n} ...", flush=True)
                raw = _spawned(flower_case, num_params, n, args.repeats)
                pair["flower"] = summarize("flower", n, num_params, raw)
            if len(pair) == 2:
                ours, theirs = pair["fedloom"], pair["flower"]
                ours["x_flower"] = ours["input_gb_per_s"] / theirs["input_gb_per_s"]
                diff = np.abs(np.subtract(ours["fingerprint"], theirs["fingerprint"]))
                scale = np.abs(theirs["fingerprint"]).max()
                ours["max_abs_diff_vs_flower"] = float(diff.max())
                if diff.max() > 1e-5 * max(1.0, float(scale)):
                    raise AssertionError(f"the sides disagree: max |diff| {diff.max()}")
            results += pair.values()
    checks = []
    for r in results:
        if r["side"] != "fedloom":
            continue
        checks.append({"target": f"N={r['updates']}: >= 5 GB/s of input",
                       "value": round(r["input_gb_per_s"], 2), "met": r["input_gb_per_s"] >= 5})
        if "x_flower" in r:
            checks.append({"target": f"N={r['updates']}: >= 2x Flower's GB/s",
                           "value": round(r["x_flower"], 2), "met": r["x_flower"] >= 2})
    print()
    print(table(results))
    print()
    print_targets(checks)
    for r in results:
        r.pop("fingerprint", None)
    out = args.out or RESULTS / ("aggregate-quick.json" if args.quick else "aggregate.json")
    write_report("aggregate", args, results, checks, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
