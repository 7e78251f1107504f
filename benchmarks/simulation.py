"""Client-fits per second: plain Flower, fedloom's Flower bridge, and fedloom's engines.

The same job for every row: 100 clients holding IID shares of scikit-learn's digits
(about 14 examples each), a 64-64-10 MLP, one local epoch of SGD (batch 32), one torch
thread per client (per worker process); rounds with 10 and with 100 clients each, and
a row of 1,000 clients per round (the digits over 1,000 clients: 1 or 2 examples each;
in-process rows only, ``--large-rounds 0`` skips it).

- **plain Flower**: a ``ClientApp`` written the Flower way (``to_torch_state_dict``,
  train, ``ArrayRecord(model.state_dict())``) under Flower's message-API ``FedAvg``;
- **fedloom bridge**: `FlowerStrategy(FedAvg)` over `to_client_app(TorchClient)`;
- **bare PyTorch loop (N processes)**: the bare loop in ``--workers`` processes, each
  on its share of every round's clients, with nothing between them: what the cores
  give the parallel engine at best;
- **vectorized engine (N threads)**: the vectorized engine on ``--workers`` torch
  threads (``[engine] threads``), where every other in-process row runs on one;
- **bare PyTorch loop**, **local**, **parallel** and **vectorized engine**: in this
  process (`_sim_engines`), no Ray.

Both Flower engines run in one ``run_simulation`` (one Ray start), phase after phase,
alternating ``--repeats`` times, so a shared machine's changing load hits both alike;
each ClientApp gets exactly the messages written for it. The data pipeline (tensors,
batch loader, model) is the same code everywhere, so the figures compare the engines.
Throughput counts fits from round 2 of each phase on (round 1 holds Ray's start, actor
creation and the bridge's identity query); the table shows the median over repeats.

    python benchmarks/simulation.py                  # full run, JSON in benchmarks/results/
    python benchmarks/simulation.py --quick          # fewer rounds
    python benchmarks/simulation.py --engines local vectorized --large-rounds 0
                                                     # some rows only, no Ray
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _sim_engines import IN_PROCESS, Phase, in_process_phases
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.simulation import run_simulation

from fedloom.client_sdk.torch_trainer import TorchClient
from fedloom.simulations._records import weights_to_arrays
from fedloom.simulations.flower_strategy import FlowerStrategy
from fedloom.simulations.job import Job
from fedloom.simulations.runner import job_client_app
from fedloom.simulations.scenario import ClientSpec, ModelSpec, Scenario
from fedloom.strategies import FedAvg, SelectionConfig

RESULTS = Path(__file__).resolve().parent / "results"
BACKEND: dict[str, Any] = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}}


def make_job(num_clients: int) -> Job:
    scenario = Scenario(
        name="bench", num_clients=num_clients, clients_per_round=num_clients, rounds=1,
        model=ModelSpec(hidden=64), client=ClientSpec(batch_size=32), progress=False,
    )
    return Job.from_scenario(scenario)


def plain_flower_app(job: Job) -> ClientApp:
    """Flower's quickstart pattern, on the same model and batch loader objects."""
    app = ClientApp()
    cache: dict[int, TorchClient] = {}

    @app.train()
    def train(message: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        index = int(context.node_config["partition-id"])
        if index not in cache:
            cache[index] = job.make_client(index)
        model, loader = cache[index].model, cache[index].train_loader
        arrays = message.content["arrays"]
        assert isinstance(arrays, ArrayRecord)
        model.load_state_dict(arrays.to_torch_state_dict())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loss_fn = torch.nn.CrossEntropyLoss()
        model.train()
        total, seen = 0.0, 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            total += float(loss) * len(y)
            seen += len(y)
        content = RecordDict({
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"train_loss": total / seen, "num-examples": seen}),
        })
        return Message(content, reply_to=message)

    return app


def combined_app(job: Job) -> ClientApp:
    """Both ClientApps behind one dispatch, so both engines share one Ray session.

    A bridge instruction carries a ``seed`` in its config (plain Flower's FedAvg sends
    none); each message goes, untouched, to the app written for it.
    """
    plain, ours = plain_flower_app(job), job_client_app(job)
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        target = ours if "seed" in message.content["config"] else plain
        return target(message, context)

    @app.query("fedloom_identity")
    def identity(message: Message, context: Context) -> Message:
        return ours(message, context)

    return app


def plain_strategy(n: int) -> Callable[[int], Any]:
    return lambda k: FlowerFedAvg(fraction_train=k / n, fraction_evaluate=0.0,
                                  min_train_nodes=k, min_available_nodes=n)


def bridge_strategy(job: Job, n: int) -> Callable[[int], Any]:
    return lambda k: FlowerStrategy(
        FedAvg(selection=SelectionConfig(fraction_fit=k / n, min_fit_clients=k,
                                         fraction_evaluate=0.0, seed=0)),
        base_seed=0, fit_defaults=job.fit_defaults(), min_available_nodes=n,
    )


def run_flower_phases(
    job: Job, plan: list[tuple[int, int]], repeats: int
) -> tuple[list[dict[str, Any]], float]:
    """One run_simulation running each engine's phases in turn, ``repeats`` times
    (the order of the engines alternates). Returns the phases and the seconds until
    the first round ended (Ray's start and the actors' creation)."""
    n = job.scenario.num_clients
    engines: list[tuple[str, Callable[[int], Any]]] = [
        ("plain Flower", plain_strategy(n)),
        ("fedloom bridge", bridge_strategy(job, n)),
    ]
    results: list[dict[str, Any]] = []
    initial = weights_to_arrays(job.initial_weights())
    server_app = ServerApp()
    started = time.perf_counter()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        for rep in range(repeats):
            for name, make_strategy in engines if rep % 2 == 0 else engines[::-1]:
                for per_round, rounds in plan:
                    phase = Phase(name, per_round)
                    make_strategy(per_round).start(
                        grid, initial, num_rounds=rounds,
                        train_config=ConfigRecord({"lr": 0.05}),
                        evaluate_fn=lambda r, _a, p=phase: p.round_done() if r > 0 else None,
                    )
                    results.append(phase.result())

    run_simulation(server_app, combined_app(job), num_supernodes=n, backend_config=BACKEND)
    if len(results) != 2 * repeats * len(plan):
        raise RuntimeError("the Flower simulation stopped early; see its log")
    return results, min(r["first_round_end"] for r in results) - started


ORDER = ("plain Flower", "fedloom bridge", "bare PyTorch loop", "local engine",
         "parallel engine", "vectorized engine")


def summarise(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median (and range) of steady fits/s per (engine, clients per round), with ratios
    to plain Flower, the bare loop and the local engine at the same clients per round."""
    groups: dict[tuple[str, int], list[float]] = {}
    for r in results:
        key = (r["engine"], r["clients_per_round"])
        groups.setdefault(key, []).append(r["steady_fits_per_s"])

    def rank(engine: str) -> int:
        return next(i for i, name in enumerate(ORDER) if engine.startswith(name))

    rows: list[dict[str, Any]] = []
    for (engine, k), samples in sorted(groups.items(), key=lambda g: (g[0][1], rank(g[0][0]))):
        rows.append({"engine": engine, "clients_per_round": k, "samples": sorted(samples),
                     "median_fits_per_s": statistics.median(samples)})
    for column, reference in (("vs_plain_flower", "plain Flower"),
                              ("vs_bare_loop", "bare PyTorch loop"),
                              ("vs_local_engine", "local engine")):
        base = {r["clients_per_round"]: r["median_fits_per_s"] for r in rows
                if r["engine"] == reference}
        for row in rows:
            k = row["clients_per_round"]
            row[column] = row["median_fits_per_s"] / base[k] if k in base else None
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def ratio(value: float | None) -> str:
        return f"{value:.2f}x" if value is not None else "-"

    lines = [f"{'engine':<30} {'per round':>9} {'median fits/s':>14} {'range':>15} "
             f"{'vs plain':>9} {'vs bare':>8} {'vs local':>9}"]
    for r in rows:
        span = f"{r['samples'][0]:.0f}-{r['samples'][-1]:.0f}"
        lines.append(f"{r['engine']:<30} {r['clients_per_round']:>9} "
                     f"{r['median_fits_per_s']:>14.1f} {span:>15} "
                     f"{ratio(r['vs_plain_flower']):>9} {ratio(r['vs_bare_loop']):>8} "
                     f"{ratio(r['vs_local_engine']):>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--rounds-small", type=int, default=15, help="rounds at 10 per round")
    parser.add_argument("--rounds-full", type=int, default=4, help="rounds at 100 per round")
    parser.add_argument("--repeats", type=int, default=3, help="alternations per engine")
    parser.add_argument("--large-rounds", type=int, default=3,
                        help="rounds at 1,000 clients per round (0: no such row)")
    parser.add_argument("--workers", type=int, default=2, help="parallel engine's processes")
    parser.add_argument("--chunk-size", type=int, default=100,
                        help="vectorized engine's clients per batched computation")
    parser.add_argument("--engines", nargs="+", choices=(*IN_PROCESS, "flower"),
                        default=[*IN_PROCESS, "flower"],
                        help="rows to run (flower: plain Flower and the bridge, in Ray)")
    parser.add_argument("--quick", action="store_true", help="3 and 2 rounds, 1 repeat")
    parser.add_argument("--out", type=Path, default=RESULTS / "simulation.json")
    args = parser.parse_args(argv)
    if "parallel" in args.engines and args.workers < 2:
        parser.error("--workers: the parallel engine needs at least 2 processes")
    if args.quick:
        args.rounds_small, args.rounds_full, args.repeats = 3, 2, 1
        args.large_rounds = min(args.large_rounds, 2)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    n = args.clients
    plan = [(max(1, n // 10), args.rounds_small), (n, args.rounds_full)]
    job = make_job(n)
    engines = [name for name in IN_PROCESS if name in args.engines]
    results = in_process_phases(job, plan, args.repeats, args.workers, args.chunk_size,
                                engines)
    if args.large_rounds > 0 and engines:
        large = make_job(1000)
        results += in_process_phases(large, [(1000, args.large_rounds)], args.repeats,
                                     args.workers, args.chunk_size, engines)
    first_round_s = None
    if "flower" in args.engines:
        flower_results, first_round_s = run_flower_phases(job, plan, args.repeats)
        results += flower_results
    rows = summarise(results)
    text = table(rows)
    print(text)
    if first_round_s is not None:
        print(f"(Ray start and actor creation: first Flower round ended after "
              f"{first_round_s:.1f} s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "simulation client-fits per second",
        "clients": n,
        "model_parameters": job.initial_weights().num_parameters,
        "plan": {"clients_per_round_and_rounds": plan, "repeats": args.repeats,
                 "large_rounds": args.large_rounds, "workers": args.workers,
                 "chunk_size": args.chunk_size, "engines": args.engines},
        "seconds_to_first_flower_round": first_round_s,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": sys.version.split()[0], "load_avg": os.getloadavg()},
        "summary": rows,
        "phases": results,
        "table": text.splitlines(),
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
