"""Strategy experiments: convergence under label skew, and robustness to poisoning.

Both run fedloom strategies on the simulation package's local engine over scikit-learn's
digits (1,437 training / 360 test images), 20 clients, each training the 64-64-10 MLP
with SGD (lr 0.05, momentum 0.9, batch 16, one local epoch), every client in every round.

**Convergence** (Dirichlet alpha = 0.1 label skew): rounds until the central test
accuracy first reaches 0.90, for FedAvg, FedProx, FedAvgM, FedAdam, FedYogi and
FedAdagrad. Each strategy's server hyperparameters are swept on the sweep seeds; the
best setting (fewest mean rounds, a run that never gets there counting as
``max_rounds + 1``) and Flower's defaults are then measured on held-out report seeds
(other partitions and initial models). FedOpt's client learning rate ``eta_l`` is held
at the clients' 0.05 so that only the server side differs.

**Poisoning** (IID partition, fixed per seed): the last 4 of the 20 clients attack —
``sign_flip`` (their delta times -10), ``noise`` (Gaussian noise with that update's
norm, 10x the honest delta's), ``noise1000`` (1000x), ``inflate`` (label-shifted
training claiming 100x its examples). Accuracy is the mean central test accuracy of the
last 3 of ``--rounds`` rounds, as a share of FedAvg's clean run on the same seed. A
last table shows how much noise FedAvg absorbs (its accuracy per noise factor).

    python benchmarks/strategies.py                    # both; JSON, PNG in benchmarks/results/
    python benchmarks/strategies.py --part poisoning --seeds 0 1
    python benchmarks/strategies.py --quick            # a smoke run (minutes)

Run one benchmark at a time (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from strategies_experiments import (
    Attack,
    Federation,
    Setup,
    final_accuracy,
    rounds_to_reach,
    run_experiment,
)

from fedloom import StrategyConfig
from fedloom.strategies import NormBoundedStrategy, SelectionConfig, Strategy, build_strategy

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 0.90
CLIENT_LR = 0.05

# -- convergence ------------------------------------------------------------------------

#: Flower 1.42's defaults (eta_l pinned to the clients' lr), then the sweep grid.
DEFAULTS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "fedprox": {"proximal_mu": 0.0},
    "fedavgm": {"server_learning_rate": 1.0, "server_momentum": 0.0},
    "fedadam": {"eta": 0.1, "tau": 1e-3, "eta_l": CLIENT_LR},
    "fedyogi": {"eta": 0.01, "tau": 1e-3, "eta_l": CLIENT_LR},
    "fedadagrad": {"eta": 0.1, "tau": 1e-3, "eta_l": CLIENT_LR},
}


def _grid(**axes: Sequence[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{}]
    for key, values in axes.items():
        out = [{**point, key: v} for point in out for v in values]
    return out


SWEEPS: dict[str, list[dict[str, Any]]] = {
    "fedavg": [{}],
    # Li et al. (2020) tune mu in {0.001, 0.01, 0.1, 0.5, 1}.
    "fedprox": _grid(proximal_mu=[0.001, 0.01, 0.1, 1.0]),
    # Hsu et al. (2019): what matters is the effective rate lr / (1 - momentum).
    "fedavgm": _grid(server_momentum=[0.5, 0.9], server_learning_rate=[0.1, 0.3, 1.0]),
    # Reddi et al. (2021) sweep eta and tau on log grids (with eta_l, held here).
    "fedadam": _grid(eta=[0.01, 0.03, 0.1, 0.3], tau=[1e-3, 1e-2], eta_l=[CLIENT_LR]),
    "fedyogi": _grid(eta=[0.01, 0.03, 0.1, 0.3], tau=[1e-3, 1e-2], eta_l=[CLIENT_LR]),
    "fedadagrad": _grid(eta=[0.03, 0.1, 0.3, 1.0], tau=[1e-3, 1e-2], eta_l=[CLIENT_LR]),
}


def _strategy(name: str, params: dict[str, Any]) -> Strategy:
    return build_strategy(StrategyConfig(name, params),
                          SelectionConfig(min_fit_clients=2, fraction_evaluate=0.0))


def _convergence_setup(seed: int) -> Setup:
    return Setup(partition="dirichlet", alpha=0.1, min_size=5, seed=seed, lr=CLIENT_LR)


def _rounds(name: str, params: dict[str, Any], seed: int, max_rounds: int) -> int | None:
    history = run_experiment(_strategy(name, params), Federation(_convergence_setup(seed)),
                             "none", max_rounds, stop_at=TARGET)
    return rounds_to_reach(history, TARGET)


def _cost(rounds: Sequence[int | None], max_rounds: int) -> float:
    return statistics.fmean(max_rounds + 1 if r is None else r for r in rounds)


def convergence(sweep_seeds: Sequence[int], report_seeds: Sequence[int], max_rounds: int,
                curve_rounds: int, names: Sequence[str]) -> dict[str, Any]:
    sweep: dict[str, list[dict[str, Any]]] = {}
    report: dict[str, dict[str, Any]] = {}
    for name in names:
        trials: list[dict[str, Any]] = []
        for params in SWEEPS[name]:
            rounds: list[int | None] = []
            for seed in sweep_seeds:
                rounds.append(_rounds(name, params, seed, max_rounds))
                if rounds[-1] is None:  # out of the running: spare the other seeds
                    break
            trials.append({"params": params, "rounds": rounds,
                           "cost": _cost(rounds, max_rounds) if None not in rounds
                           else float(max_rounds + 1)})
            print(f"  sweep {name} {params}: {rounds}", flush=True)
        sweep[name] = trials
        best: dict[str, Any] = min(trials, key=lambda t: float(t["cost"]))["params"]
        report[name] = {}
        for label, params in (("default", DEFAULTS[name]), ("tuned", best)):
            rounds = [_rounds(name, params, s, max_rounds) for s in report_seeds]
            report[name][label] = {"params": params, "rounds": rounds}
            print(f"  report {name} {label} {params}: {rounds}", flush=True)
    curves = {}
    for name in names:
        history = run_experiment(_strategy(name, report[name]["tuned"]["params"]),
                                 Federation(_convergence_setup(report_seeds[0])), "none",
                                 curve_rounds)
        curves[name] = history.series("test_accuracy")
    return {"target": TARGET, "max_rounds": max_rounds, "sweep_seeds": list(sweep_seeds),
            "report_seeds": list(report_seeds), "sweep": sweep, "report": report,
            "curves": curves}


def _median_rounds(rounds: Sequence[int | None], max_rounds: int) -> str:
    value = statistics.median(max_rounds + 1 if r is None else r for r in rounds)
    return f">{max_rounds}" if value > max_rounds else f"{value:g}"


def _format_params(params: dict[str, Any]) -> str:
    shown = {k: v for k, v in params.items() if k != "eta_l"}
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in shown.items()) or "—"


def convergence_table(result: dict[str, Any]) -> str:
    cap = result["max_rounds"]
    lines = [f"rounds to {result['target']:.2f} test accuracy (median over seeds "
             f"{result['report_seeds']}; each seed's rounds in brackets, '-' = not within {cap})",
             "",
             "| strategy | tuned setting | rounds (tuned) | Flower defaults | rounds (defaults) |",
             "|---|---|---|---|---|"]
    for name, rows in result["report"].items():
        tuned, default = rows["tuned"], rows["default"]

        def each(rounds: list[int | None]) -> str:
            return " [" + " ".join("-" if r is None else str(r) for r in rounds) + "]"

        lines.append(
            f"| {name} | {_format_params(tuned['params'])} | "
            f"{_median_rounds(tuned['rounds'], cap)}{each(tuned['rounds'])} | "
            f"{_format_params(default['params'])} | "
            f"{_median_rounds(default['rounds'], cap)}{each(default['rounds'])} |")
    return "\n".join(lines)


# -- poisoning --------------------------------------------------------------------------

F = 4  # attackers among the 20 clients

ROBUST: dict[str, Callable[[float], Strategy]] = {
    "fedavg": lambda bound: _strategy("fedavg", {}),
    "fedavg+normbound": lambda bound: NormBoundedStrategy(_strategy("fedavg", {}), bound, "clip"),
    "fedmedian": lambda bound: _strategy("fedmedian", {}),
    "fedtrimmedavg": lambda bound: _strategy("fedtrimmedavg", {"beta": 0.2}),
    "krum": lambda bound: _strategy("krum", {"num_malicious_nodes": F}),
    "multikrum": lambda bound: _strategy("multikrum", {"num_malicious_nodes": F,
                                                       "num_nodes_to_select": 20 - F}),
    "bulyan": lambda bound: _strategy("bulyan", {"num_malicious_nodes": F}),
}
#: Column -> (attack, setup changes).
ATTACK_COLUMNS: dict[str, tuple[Attack, dict[str, Any]]] = {
    "clean": ("none", {}),
    "sign_flip": ("sign_flip", {}),
    "noise": ("noise", {}),
    "noise1000": ("noise", {"attack_scale": -1000.0}),
    "inflate": ("inflate", {}),
}


#: Noise factors (times the honest delta's norm) for the FedAvg noise table.
NOISE_FACTORS = (10.0, 30.0, 100.0, 300.0, 1000.0)


def honest_norm(federation: Federation) -> float:
    """Median L2 norm of the honest clients' round-1 deltas (to set the norm bound)."""
    import numpy as np

    initial = federation.initial_weights()
    make = federation.client_factory("none")
    norms = []
    for i in range(federation.setup.num_clients):
        out = make(i).fit(initial, {"seed": i, "local_epochs": federation.setup.local_epochs})
        delta = out.weights.subtract(initial)
        norms.append(float(np.sqrt(sum(float(np.sum(d.astype(np.float64) ** 2))
                                       for d in delta.values()))))
    return float(np.median(norms))


def _poisoning_setup(seed: int, model: str) -> Setup:
    """IID shares, fixed by the seed; the numpy model (for smoke runs) takes a larger lr."""
    return Setup(partition="iid", seed=seed, lr=CLIENT_LR if model == "mlp" else 0.5,
                 model="softmax" if model == "softmax" else "mlp")


def poisoning(seeds: Sequence[int], rounds: int, model: str = "mlp") -> dict[str, Any]:
    runs: dict[str, dict[str, list[float]]] = {n: {c: [] for c in ATTACK_COLUMNS} for n in ROBUST}
    bounds = []
    for seed in seeds:
        base = _poisoning_setup(seed, model)
        bound = honest_norm(Federation(base))
        bounds.append(bound)
        for column, (attack, changes) in ATTACK_COLUMNS.items():
            federation = Federation(dataclasses.replace(base, **changes))
            for name, make in ROBUST.items():
                started = time.perf_counter()
                accuracy = final_accuracy(run_experiment(make(bound), federation, attack, rounds))
                runs[name][column].append(accuracy)
                print(f"  seed {seed} {column:9s} {name:16s} {accuracy:.3f} "
                      f"({time.perf_counter() - started:.1f} s)", flush=True)
    noise: dict[str, list[float]] = {str(f): [] for f in NOISE_FACTORS}
    for seed in seeds:
        for factor in NOISE_FACTORS:
            federation = Federation(dataclasses.replace(_poisoning_setup(seed, model),
                                                        attack_scale=-factor))
            accuracy = final_accuracy(run_experiment(_strategy("fedavg", {}), federation,
                                                     "noise", rounds))
            noise[str(factor)].append(accuracy)
            print(f"  seed {seed} fedavg noise x{factor:g}: {accuracy:.3f}", flush=True)
    return {"seeds": list(seeds), "rounds": rounds, "model": model, "num_attackers": F,
            "norm_bounds": bounds, "accuracy": runs, "fedavg_noise": noise}


def poisoning_table(result: dict[str, Any]) -> str:
    acc = result["accuracy"]
    clean = acc["fedavg"]["clean"]
    lines = [f"mean test accuracy of the last 3 of {result['rounds']} rounds (mean over seeds "
             f"{result['seeds']}) and its share of FedAvg's clean accuracy",
             "", "| strategy | " + " | ".join(ATTACK_COLUMNS) + " |",
             "|---|" + "---|" * len(ATTACK_COLUMNS)]
    for name, columns in acc.items():
        cells = []
        for column in ATTACK_COLUMNS:
            values = columns[column]
            ratio = statistics.fmean(v / c for v, c in zip(values, clean, strict=True))
            cells.append(f"{statistics.fmean(values):.3f} ({ratio:.0%})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    noise = result.get("fedavg_noise")
    if noise:

        def share(values: list[float]) -> str:
            ratio = statistics.fmean(a / c for a, c in zip(values, clean, strict=True))
            return f"{statistics.fmean(values):.3f} ({ratio:.0%})"

        lines += ["", "FedAvg under noise attacks of growing norm (times the honest delta's norm)",
                  "", "| noise factor | " + " | ".join(f"x{float(f):g}" for f in noise) + " |",
                  "|---|" + "---|" * len(noise),
                  "| FedAvg accuracy (share of clean) | "
                  + " | ".join(share(v) for v in noise.values()) + " |"]
    return "\n".join(lines)


# -- output -----------------------------------------------------------------------------

def plot(convergence_result: dict[str, Any] | None, poisoning_result: dict[str, Any] | None,
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [p for p in (convergence_result, poisoning_result) if p is not None]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    column = 0
    if convergence_result is not None:
        ax = axes[0][column]
        styles = ["-", "--", ":", "-.", (0, (5, 1)), (0, (1, 3))]  # overlapping curves show
        for i, (name, points) in enumerate(convergence_result["curves"].items()):
            ax.plot([r for r, _ in points], [a for _, a in points], label=name,
                    linestyle=styles[i % len(styles)])
        ax.axhline(convergence_result["target"], color="grey", linestyle=":")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
        ax.set(xlabel="round", ylabel="test accuracy", ylim=(0, 1),
               title=f"digits, 20 clients, Dirichlet 0.1 (seed "
                     f"{convergence_result['report_seeds'][0]}, tuned)")
        ax.legend(fontsize=8)
        column += 1
    if poisoning_result is not None:
        ax = axes[0][column]
        acc = poisoning_result["accuracy"]
        clean = acc["fedavg"]["clean"]
        names = list(acc)
        width = 0.8 / len(ATTACK_COLUMNS)
        for j, col in enumerate(ATTACK_COLUMNS):
            ratios = [statistics.fmean(v / c for v, c in zip(acc[n][col], clean, strict=True))
                      for n in names]
            ax.bar([i + j * width for i in range(len(names))], ratios, width, label=col)
        ax.axhline(0.9, color="grey", linestyle=":")
        ax.axhline(0.5, color="grey", linestyle="--")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=30,
                      ha="right", fontsize=8)
        ax.set(ylabel="accuracy / FedAvg clean", title="poisoning: 4 of 20 clients attack")
        ax.legend(fontsize=8, ncol=len(ATTACK_COLUMNS), loc="upper center",
                  bbox_to_anchor=(0.5, -0.28))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def replot(out: Path) -> int:
    """Print the tables and draw both panels from the JSON files a run left in ``out``."""
    results = []
    for part in ("convergence", "poisoning"):
        path = out / f"strategies_{part}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    conv, pois = results
    if conv is None and pois is None:
        print(f"no strategies_*.json in {out}", file=sys.stderr)
        return 1
    plot(conv, pois, out / "strategies_all.png")
    for result, table in ((conv, convergence_table), (pois, poisoning_table)):
        if result is not None:
            print(table(result), end="\n\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("convergence", "poisoning", "all"), default="all")
    parser.add_argument("--quick", action="store_true", help="fewer seeds, rounds and settings")
    parser.add_argument("--sweep-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--report-seeds", type=int, nargs="+", default=[3, 4, 5, 6, 7])
    parser.add_argument("--max-rounds", type=int, default=150)
    parser.add_argument("--curve-rounds", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1],
                        help="poisoning seeds")
    parser.add_argument("--rounds", type=int, default=40, help="poisoning rounds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--replot", action="store_true",
                        help="no runs: tables and strategies_all.png from the JSON in --out")
    args = parser.parse_args(argv)
    if args.replot:
        return replot(args.out)
    logging.getLogger("fedloom").setLevel(logging.ERROR)  # diverging runs: failed fits
    if args.quick:
        args.sweep_seeds, args.report_seeds, args.seeds = [0], [3], [0]
        args.max_rounds, args.curve_rounds, args.rounds = 60, 30, 20
        for name in SWEEPS:
            SWEEPS[name] = SWEEPS[name][:2]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    started = time.perf_counter()
    conv = pois = None
    if args.part in ("convergence", "all"):
        conv = convergence(args.sweep_seeds, args.report_seeds, args.max_rounds,
                           args.curve_rounds, list(SWEEPS))
        (args.out / "strategies_convergence.json").write_text(
            json.dumps({**meta, **conv}, indent=2) + "\n")
    if args.part in ("poisoning", "all"):
        pois = poisoning(args.seeds, args.rounds)
        (args.out / "strategies_poisoning.json").write_text(
            json.dumps({**meta, **pois}, indent=2) + "\n")
    plot(conv, pois, args.out / f"strategies_{args.part}.png")
    print()
    if conv is not None:
        print(convergence_table(conv), end="\n\n")
    if pois is not None:
        print(poisoning_table(pois), end="\n\n")
    print(f"wrote {args.out} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
