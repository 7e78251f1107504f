"""Part 1 of benchmarks/compression.py: what each codec does to a run, and how fast it is.

- **Accuracy and bytes**: `run_scenario` on the local engine (one process, one torch
  thread) with the scenario's ``[compression]`` table, the same seeds for every codec.
  Each run's round records give the bytes a client sent and received in a round
  (``upload_bytes_per_client``, ``download_bytes_per_client``: the payloads' sizes,
  encoded or float32) and the central test accuracy after every round.
- **Throughput**: each codec's `encode` and `decode` of one flat float32 tensor of
  ``params`` Gaussian values, on one thread (BLAS and OpenMP pools held to one); MB/s
  of float32 input (4 bytes per value), median of ``repeats`` timings. Two scales:
  standard deviation 1e-3, and 1e-5, where almost every value lies below float16's
  normal range (6.1e-5), as many of a small update's do: numpy's float16 cast is much
  slower on those. Top-k is also timed inside `ErrorFeedback` (residual added,
  encoded, decoded again, new residual kept: what the client runs).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import numpy as np

#: Every digits run: 50 clients with Dirichlet(0.5) label skew, 10 a round, 2 local
#: epochs of SGD (lr 0.05, momentum 0.9, batch 8), FedAvg.
NUM_CLIENTS, PER_ROUND, LOCAL_EPOCHS = 50, 10, 2


@dataclasses.dataclass(frozen=True)
class CodecSetting:
    """One row: the codec each direction uses (empty: plain float32)."""

    label: str
    upload: str = ""
    download: str = ""
    topk_fraction: float = 0.01


SETTINGS = (
    CodecSetting("float32"),
    CodecSetting("fp16 up", "fp16"),
    CodecSetting("bf16 up", "bf16"),
    CodecSetting("q8 up", "q8"),
    CodecSetting("q4 up", "q4"),
    CodecSetting("topk 1% + EF up", "topk"),
    CodecSetting("q8 up + fp16 down", "q8", "fp16"),
    CodecSetting("topk 5% + EF up", "topk", topk_fraction=0.05),
)
PLAIN, Q8, TOPK = SETTINGS[0], SETTINGS[3], SETTINGS[5]


@dataclasses.dataclass(frozen=True)
class Task:
    """A digits task: the MLP's hidden width, rounds, seeds."""

    name: str
    hidden: int
    rounds: int
    seeds: tuple[int, ...]

    @property
    def params(self) -> int:
        return 64 * self.hidden + self.hidden + 10 * self.hidden + 10

    def describe(self) -> str:
        return (f"digits, MLP 64-{self.hidden}-10 ({self.params:,} parameters), "
                f"{NUM_CLIENTS} clients with Dirichlet(0.5) label skew, {PER_ROUND} a "
                f"round, {self.rounds} rounds, {LOCAL_EPOCHS} local epochs, seeds "
                f"{', '.join(map(str, self.seeds))}")


def scenario(task: Task, setting: CodecSetting, seed: int, rounds: int) -> Any:
    from fedloom.simulations.compression import CompressionSpec
    from fedloom.simulations.scenario import (
        ClientSpec,
        ModelSpec,
        PartitionSpec,
        Scenario,
    )

    return Scenario(
        name=f"compression-{task.name}", seed=seed, engine="local",
        num_clients=NUM_CLIENTS, clients_per_round=PER_ROUND, rounds=rounds,
        local_epochs=LOCAL_EPOCHS, progress=False,
        partition=PartitionSpec("dirichlet", alpha=0.5, min_size=5),
        model=ModelSpec(hidden=task.hidden),
        client=ClientSpec(batch_size=8, lr=0.05, momentum=0.9),
        compression=CompressionSpec(setting.upload, setting.download,
                                    topk_fraction=setting.topk_fraction),
    )  # fmt: skip


def run_setting(task: Task, setting: CodecSetting, rounds: int | None = None
                ) -> dict[str, Any]:
    """``setting`` on ``task`` for each seed: accuracy per round, bytes, wall time."""
    from fedloom.simulations.runner import run_scenario

    rounds = rounds or task.rounds
    curves, started = [], time.perf_counter()
    upload = download = 0.0
    for seed in task.seeds:
        history = run_scenario(scenario(task, setting, seed, rounds), None)
        curves.append([acc for _, acc in history.series("test_accuracy")])
        first = history.rounds[1].metrics  # the same every round
        upload, download = first["upload_bytes_per_client"], first["download_bytes_per_client"]
    mean_curve = [statistics.mean(c[r] for c in curves) for r in range(rounds + 1)]
    return {
        "setting": dataclasses.asdict(setting), "rounds": rounds,
        "upload_bytes": upload, "download_bytes": download,
        "final_accuracy": mean_curve[task.rounds],
        "final_by_seed": [c[task.rounds] for c in curves],
        "mean_curve": mean_curve, "wall_s": time.perf_counter() - started,
    }  # fmt: skip


def first_round_reaching(curve: list[float], target: float) -> int | None:
    """The first round whose (seed-mean) accuracy reaches ``target``."""
    return next((r for r, acc in enumerate(curve) if r > 0 and acc >= target), None)


def run_task(task: Task, extend: int, tolerance: dict[str, float]) -> dict[str, Any]:
    """Every setting on ``task``; a top-k 1% that misses its accuracy target at
    ``task.rounds`` runs again for ``extend`` x the rounds (the first rounds are the same
    run), to find when it gets within ``tolerance`` of plain's accuracy."""
    rows = []
    for setting in SETTINGS:
        row = run_setting(task, setting)
        rows.append(row)
        print(f"  {task.name}: {setting.label:<18} accuracy {row['final_accuracy']:.4f} "
              f"({row['wall_s']:.0f} s)", flush=True)
    plain = rows[0]["final_accuracy"]
    for row in rows:
        row["delta_points"] = 100 * (row["final_accuracy"] - plain)
    topk = rows[SETTINGS.index(TOPK)]
    target = plain - tolerance["topk"]
    topk["rounds_to_plain_minus_tolerance"] = first_round_reaching(topk["mean_curve"], target)
    if topk["rounds_to_plain_minus_tolerance"] is None and extend > 1:
        longer = run_setting(task, TOPK, rounds=extend * task.rounds)
        topk["extended_curve"] = longer["mean_curve"]
        topk["rounds_to_plain_minus_tolerance"] = first_round_reaching(
            longer["mean_curve"], target)
        print(f"  {task.name}: topk 1% over {extend * task.rounds} rounds reaches "
              f"{target:.4f} at round {topk['rounds_to_plain_minus_tolerance']} "
              f"({longer['wall_s']:.0f} s)", flush=True)
    return {"task": dataclasses.asdict(task), "describe": task.describe(),
            "params": task.params, "rows": rows}


def _median_seconds(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def codec_label(name: str, fraction: float) -> str:
    """``q8``, ``topk 1%``: a codec as the throughput table names it."""
    return f"topk {fraction:.0%}" if name == "topk" else name


def _codecs() -> list[tuple[str, Any]]:
    """Every codec the settings use, once (top-k once per fraction)."""
    from fedloom.compression import make_codec

    found: dict[str, Any] = {}
    for setting in SETTINGS:
        for name in (setting.upload, setting.download):
            if name:
                settings = {"fraction": setting.topk_fraction} if name == "topk" else {}
                found.setdefault(codec_label(name, setting.topk_fraction),
                                 make_codec(name, **settings))
    return list(found.items())


def _time_codec(codec: Any, update: Any, repeats: int) -> dict[str, float]:
    """Median seconds of ``codec``'s encode, its decode, and (top-k) error feedback's."""
    from fedloom.compression import ErrorFeedback, decode, encode

    rng, specs = np.random.default_rng(1), update.specs()
    encoded = encode(codec, update, rng)
    times = {"encode": _median_seconds(lambda: encode(codec, update, rng), repeats),
             "decode": _median_seconds(lambda: decode(codec, specs, encoded), repeats),
             "bytes": encoded.nbytes}
    if codec.name == "topk":
        feedback = ErrorFeedback(codec)
        times["feedback"] = _median_seconds(lambda: feedback.encode(update, rng), repeats)
    return times


def throughput(params: int, repeats: int, scales: tuple[float, ...] = (1e-3, 1e-5)
               ) -> list[dict[str, Any]]:
    """Encode and decode MB/s per codec and value scale (see the module docstring)."""
    from threadpoolctl import threadpool_limits

    from fedloom.weights import Weights

    megabytes, out = 4 * params / 1e6, []
    with threadpool_limits(1):
        for scale in scales:
            update = Weights({"update": (np.random.default_rng(0).standard_normal(params)
                                         * scale).astype(np.float32)})
            for label, codec in _codecs():
                times = _time_codec(codec, update, repeats)
                row = {"codec": label, "scale": scale, "params": params,
                       "encode_mb_s": megabytes / times["encode"],
                       "decode_mb_s": megabytes / times["decode"],
                       "encoded_bytes": times["bytes"]}
                out.append(row)
                if "feedback" in times:  # what the client runs
                    out.append({**row, "codec": f"{label} + EF",
                                "encode_mb_s": megabytes / times["feedback"]})
    return out
