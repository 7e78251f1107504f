"""What client-level differential privacy costs in accuracy: central DP (fixed and
adaptive clipping) and distributed DP under SecAgg+, at ε ∈ {1, 3, 8} and without DP.

**Task.** scikit-learn's digits (1,437 training / 360 test images, `fedloom.simulations`),
split IID over 500 virtual clients (2-3 images each: the cross-device regime DP is for,
many users with little data each), 50 clients per round, 100 rounds on the local engine
(`run_local`), the 64-64-10 MLP (4,810 parameters), client SGD lr 0.1, momentum 0.9,
batch 8, 5 local epochs, FedAvg on the server. Digits rather than the synthetic data
set: a fit takes milliseconds, so 500 clients and a dozen runs per seed stay affordable,
and the plain run converges within 100 rounds. Accuracy is the
central test accuracy after the last round, the mean over ``--seeds`` (each seed its
own split, initial model, sampling and noise); 360 test images make one image 0.28
points, hence more than one seed.

**Clip norm.** C is the median L2 norm of the round-1 updates of the first round's
50 clients (seed 0), measured by the script before the runs: clipping
then binds about half of the early updates, as adaptive clipping's ``target_quantile =
0.5`` would choose. Adaptive runs start from the same C.

**Noise.** ``fedloom.privacy.calibrate_noise_multiplier`` for each target ε at
δ = 1e-5 over the run's rounds. Central DP uses **Poisson sampling** (rate 50/500) with
the **RDP** accountant. Fixed-size sampling (m of n, what plain FedAvg does) is
accounted under replace-one, where one client moves the sum by 2C, and needs several
times the noise for the same ε (its z is printed, not run). The PLD accountant would
need slightly less noise, but dp-accounting's PLD composition costs several times RDP's
per recorded round, too much over 100 rounds and six central runs per seed (both
trade-offs are quantified in benchmarks/README.md). So the central runs sample a
varying cohort (mean 50) where the plain and distributed runs take exactly 50; the
noised sum is divided by 50 in all of them.

Distributed DP (Skellam, Agarwal, Kairouz & Liu 2021) runs under SecAgg+ (the local
engine's `LocalSecureAggregation`, authenticated, k = 10, t = 6) with ``sampling =
"none"`` (no amplification by sampling: dp-accounting has no subsampled-Skellam bound)
and ``expected_dropout = 0``; its ε comes from the run's `SkellamLedger`, which counts the
noise of ``survivors - 1 - colluding`` clients (48 of 50). Two sets of runs:

- **distributed (same z)**: the z of central DP at each target ε; the ledger then
  reports a much larger ε (no amplification). At ε = 8 this is the comparison the
  script's target is judged on: *distributed DP within 2 accuracy points of central DP
  (fixed clipping) at the same noise level*;
- **distributed (own ε)**: z found by bisection so that the ledger's ε after all rounds
  is the target (predicted with `fedloom.privacy._skellam.calibrate` and the ledger's
  RDP, no training), so the three modes can be compared at equal ε.

Bytes per client per round are computed from the model: a plain float32 update (4 d),
a SecAgg+ masked vector (uint32 of d + 1) and a distributed-DP masked vector (uint32 of
d' + 1, d' the next power of two: 8,192 for 4,810). The distributed mode's extra client
CPU is the Skellam encoding (clip, rotate, round, noise), timed alone.

Reproducibility: every run is an exact rerun. The benchmark seeds what the library
draws from the operating system's CSPRNG by default: the central noise
(`CentralDPStrategy`'s ``rng``) and the distributed rounds' rotation seeds
(`DistributedDPStrategy`'s ``rng``). The clients' rounding and noise in the local
engine, the sampling, the data and the fits are seeded too.

    .venv/bin/python benchmarks/privacy.py            # the full run (--seeds 0: half)
    .venv/bin/python benchmarks/privacy.py --quick    # a smoke run

Writes ``benchmarks/results/privacy.json`` and ``privacy.png`` (``privacy-quick.*`` with
``--quick``; or ``--out``) and prints the table; the current figures and run times are
in benchmarks/README.md. Run one benchmark at a time (two at once measure each other).
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _privacy_noise import DELTA, SECAGG, central_z, distributed_z, encode_seconds
from _privacy_report import plot, table, targets, wire_bytes
from _privacy_setup import Federation
from _report import print_targets, write_report

from fedloom.privacy import PrivacyConfig
from fedloom.privacy._hadamard import padded_length
from fedloom.simulations.local_secure import LocalSecureAggregation
from fedloom.strategies import CentralDPStrategy, Strategy
from fedloom.strategies._ddp import DistributedDPStrategy

RESULTS = Path(__file__).resolve().parent / "results"
EPSILONS = (1.0, 3.0, 8.0)
MODES = ("central-fixed", "central-adaptive", "distributed-same-z", "distributed-own-eps")


def strategy_for(fed: Federation, mode: str, z: float, clip: float
                 ) -> tuple[Strategy, LocalSecureAggregation | None]:
    inner = fed.fedavg()
    if mode == "plain":
        return inner, None
    if mode.startswith("central"):
        privacy = PrivacyConfig(
            mode="central", noise_multiplier=z, clip_norm=clip, delta=DELTA,
            clipping="adaptive" if mode == "central-adaptive" else "fixed",
            target_quantile=0.5, sampling="poisson", accountant="rdp")
        # A seeded generator so that reruns agree (the library's default is a CSPRNG).
        return CentralDPStrategy(inner, privacy, rng=np.random.default_rng([fed.seed, 1])), None
    privacy = PrivacyConfig(mode="distributed", noise_multiplier=z, clip_norm=clip,
                            delta=DELTA, sampling="none", expected_dropout=0.0)
    strategy = DistributedDPStrategy(inner, privacy, colluding_clients=SECAGG.colluding_clients,
                                     rng=np.random.default_rng([fed.seed, 2]))
    return strategy, LocalSecureAggregation(SECAGG, run_id=f"privacy-{fed.seed}", seed=fed.seed)


def plan_runs(z_central: dict[float, float], z_own: dict[float, float]
              ) -> list[tuple[str, float, float]]:
    """(mode, target ε, z) of every run; ε = inf is plain FedAvg."""
    runs: list[tuple[str, float, float]] = [("plain", math.inf, 0.0)]
    for eps in sorted(z_central):
        runs += [("central-fixed", eps, z_central[eps]), ("central-adaptive", eps, z_central[eps]),
                 ("distributed-same-z", eps, z_central[eps]),
                 ("distributed-own-eps", eps, z_own[eps])]
    return runs


def execute(args: argparse.Namespace, runs: list[tuple[str, float, float]], clip: float,
            log: Callable[[str], None]) -> list[dict[str, Any]]:
    rows: dict[tuple[str, float], dict[str, Any]] = {
        (m, e): {"mode": m, "target_epsilon": e, "z": z, "seeds": {}} for m, e, z in runs}
    for seed in args.seeds:
        fed = Federation(args, seed)
        for mode, eps, z in runs:
            strategy, secure = strategy_for(fed, mode, z, clip)
            result = fed.run(strategy, secure)
            if secure is not None:
                sent = [sum(r.bytes_sent.values()) / max(len(r.bytes_sent), 1)
                        for r in secure.reports]
                result["secure_bytes_sent_per_client"] = float(np.mean(sent))
                result["failed_rounds"] = sum(bool(r.failure) for r in secure.reports)
            rows[(mode, eps)]["seeds"][seed] = result
            spent = result["spent_epsilon"]
            log(f"seed {seed} {mode:20s} eps {eps:>4g} z {z:8.3f}: acc {result['accuracy']:.3f}"
                f" spent eps {'-' if spent is None else f'{spent:.2f}'}"
                f" ({result['seconds']:.0f} s)")
    for row in rows.values():
        per_seed = list(row["seeds"].values())
        row["accuracy"] = statistics.fmean(r["accuracy"] for r in per_seed)
        row["accuracy_last5"] = statistics.fmean(r["accuracy_last5"] for r in per_seed)
        spent = [r["spent_epsilon"] for r in per_seed if r["spent_epsilon"] is not None]
        row["spent_epsilon"] = max(spent) if spent else None
        row["seeds"] = {str(k): v for k, v in row["seeds"].items()}
    return list(rows.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--clients", type=int, default=500)
    parser.add_argument("--per-round", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--epsilons", type=float, nargs="+", default=list(EPSILONS))
    parser.add_argument("--local-epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--clip-norm", type=float, default=0.0,
                        help="C (0: the median round-1 update norm, measured)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 200 clients, 20 per round, 15 rounds, ε = 8, one seed")
    parser.add_argument("--out", type=Path, default=RESULTS / "privacy.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.per_round, args.rounds = 200, 20, 15
        args.seeds, args.epsilons = [0], [8.0]
        if args.out == RESULTS / "privacy.json":
            args.out = RESULTS / "privacy-quick.json"
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's RDP order warnings
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {message}", flush=True)

    first = Federation(args, args.seeds[0])
    dimension = first.dimension
    norms = first.first_round_norms()
    clip = args.clip_norm or round(statistics.median(norms), 2)
    log(f"d = {dimension} (d' = {padded_length(dimension)}); round-1 update norms: median "
        f"{statistics.median(norms):.3f}, 10-90% {np.percentile(norms, 10):.3f}-"
        f"{np.percentile(norms, 90):.3f}; C = {clip}")
    z_central = {e: central_z(e, args, "poisson") for e in args.epsilons}
    z_fixed = {e: central_z(e, args, "fixed") for e in args.epsilons}
    z_own = {e: distributed_z(e, clip, dimension, args) for e in args.epsilons}
    for e in args.epsilons:
        log(f"eps {e:g}: z central (poisson, rdp) {z_central[e]:.3f}; fixed-size sampling "
            f"(rdp) would need {z_fixed[e]:.3f}; distributed (own ledger) {z_own[e]:.3f}")
    encode_s = encode_seconds(clip, dimension, max(z_central.values()), args.per_round)
    log(f"Skellam encoding, one client: {1e3 * encode_s:.2f} ms CPU")

    rows = execute(args, plan_runs(z_central, z_own), clip, log)
    for row in rows:
        row["upload_bytes_per_client_round"] = wire_bytes(dimension)[row["mode"]]
    text = table(rows, dimension)
    checks = targets(rows)
    sizes = wire_bytes(dimension)
    print("\n" + text + "\n")
    print(f"upload per client per round: float32 {sizes['plain']:,} B; SecAgg+ masked "
          f"uint32[d+1] {sizes['secagg']:,} B; distributed DP uint32[d'+1] "
          f"{sizes['distributed-same-z']:,} B ({sizes['distributed-same-z'] / sizes['plain']:.2f}x"
          f" float32); Skellam encoding {1e3 * encode_s:.2f} ms of client CPU")
    print_targets(checks)
    wall = time.perf_counter() - started
    print(f"wall time {wall:.0f} s")
    settings = {"dataset": "digits", "partition": "iid", "dimension": dimension,
                "padded_dimension": padded_length(dimension), "clip_norm": clip,
                "round1_update_norms": norms, "delta": DELTA,
                "z_central_poisson_rdp": z_central, "z_central_fixed_rdp": z_fixed,
                "z_distributed_own_epsilon": z_own, "upload_bytes": sizes,
                "skellam_encode_cpu_s": encode_s, "wall_s": wall,
                "secagg": {"neighbours": SECAGG.neighbours, "threshold": SECAGG.threshold,
                           "colluding_clients": SECAGG.colluding_clients},
                "table": text.splitlines()}
    write_report("privacy: accuracy against epsilon, central and distributed DP", args,
                 [{"settings": settings}, *rows], checks, args.out)
    plot(rows, args.out.with_suffix(".png"), f"digits, {args.clients} clients, "
         f"{args.per_round} per round, {args.rounds} rounds (mean of seeds {args.seeds})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
