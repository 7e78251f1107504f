"""What SecAgg+ costs: fedloom's plain and secure rounds, over gRPC and in the local
engine, beside Flower 1.42's plain and SecAgg+ rounds in its simulation.

One run, the same settings for everyone: 10, 20 and 50 clients; 100k and 1M float32
parameters; 0% and 20% dropout. Every client "trains" by adding a fixed random step to
the weights (the point is the protocol's cost, not learning) and reports 100 examples.
SecAgg+ parameters alike on both sides: every client has 10 neighbours and a secret
needs 6 shares (fedloom ``neighbours = 10, threshold = 6``, its own share not counted;
Flower ``num_shares = 11, reconstruction_threshold = 6``, counting the client itself:
the same graph degree and the same t), clip range 8, 2**22 quantization levels, weights
``num_examples / 100``. With 10 clients the graph is complete on both sides.

Systems (each setting runs its plain round, then its secure round, back to back):

- **fedloom gRPC**: `fedloom.server.Server` in this process on loopback, over mutual TLS
  with a throwaway PKI for both modes (secure rounds are then authenticated: signed keys,
  certificates checked, the consistency stage); clients in spawned processes
  (`_secagg_grpc.ClientPool`: 20 workers, so 10 and 20 clients run one per process and
  50 clients run 2 or 3 per process, as threads);
- **fedloom local**: `run_local` in this process, plain or with `LocalSecureAggregation`;
- **Flower sim**: `flwr.simulation.run_simulation`, legacy ``DefaultWorkflow`` with the
  default fit workflow or ``SecAggPlusWorkflow`` + ``secaggplus_mod`` (`_secagg_flower`),
  one Ray CPU per client (as many actors at once as the machine has CPUs), 50
  SuperNodes sampled down.

Dropout (20%): a fifth of each round's clients drop after sharing their keys: they answer
advertise/setup and share keys, then fail their masked-input task (fedloom over gRPC:
they report a failure; locally: `SecureDropout(after="share_keys")`; Flower: an error
reply to collect-masked-vectors), so the server must reconstruct their mask keys and
remove their pairwise masks. They are spread over the neighbour graph so the round can
finish (`spread_dropouts`; Flower's ring kept in its random sampled order with every
fifth marked). In plain rounds the same fifth fails instead of uploading (fedloom: they
train, then report a failure; Flower: an error reply to the fit message).

Distributed DP (``--ddp``): a third mode, "secure-ddp", runs the secure round with
``[privacy] mode = "distributed"`` (z = 1, ``expected_dropout`` = the setting's dropout):
each client clips, rotates, rounds and adds Skellam noise before masking a vector of
``d' + 1`` values (d' the next power of two). Reported beside the secure round without it.

Reported per system and mode: seconds per steady round (median of rounds 2..R; round 1
is warm-up), client CPU seconds per stage per client per round, and bytes sent per
client per round (fedloom over gRPC: protobuf bytes of every request; fedloom local:
the payload of the SecAgg+ messages; Flower: the payload of every reply its ClientApp
returns: arrays, bytes, 8 per number).

    .venv/bin/python benchmarks/secagg.py
    .venv/bin/python benchmarks/secagg.py --quick        # 10 and 20 clients, 100k, 3 rounds
    .venv/bin/python benchmarks/secagg.py --clients 20 --params 1000000 --skip flower --ddp

Writes ``benchmarks/results/secagg.json`` (or ``--out``) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _secagg_grpc import fixed_step

from fedloom.certs import write_certificates
from fedloom.client_sdk import Client, EvaluateOutput, FitOutput
from fedloom.config import ServerConfig, TLSConfig
from fedloom.privacy import PrivacyConfig
from fedloom.secagg import SecAggConfig
from fedloom.server import Server
from fedloom.simulations.local_engine import run_local
from fedloom.simulations.local_secure import LocalSecureAggregation, SecureDropout
from fedloom.strategies import FedAvg, SelectionConfig, apply_privacy
from fedloom.weights import Weights

RESULTS = Path(__file__).resolve().parent / "results"
NEIGHBOURS, THRESHOLD = 10, 6
FLOWER_SECAGG = {"num_shares": NEIGHBOURS + 1, "reconstruction_threshold": THRESHOLD,
                 "max_weight": 100.0, "clipping_range": 8.0, "quantization_range": 2**22}
STAGES = ("train", "advertise_keys", "share_keys", "masked_input", "consistency", "unmask",
          "update", "push")
FLOWER_STAGES = ("fit", "setup", "share_keys", "collect_masked_vectors", "unmask")


def secagg_config() -> SecAggConfig:
    return SecAggConfig(enabled=True, neighbours=NEIGHBOURS, threshold=THRESHOLD,
                        clip_range=8.0, bits=22, max_weight=100.0, max_participants=64,
                        stage_timeout_s=120.0)


def ddp_config(dropout: float) -> PrivacyConfig:
    """Distributed DP at z = 1; the clip bound does not bind the benchmark's step."""
    return PrivacyConfig(mode="distributed", noise_multiplier=1.0, clip_norm=1e4,
                         sampling="none", expected_dropout=dropout)


def steady(seconds: list[float]) -> float:
    """Median seconds per round after the first (warm-up) round."""
    return statistics.median(seconds[1:] if len(seconds) > 1 else seconds)


def initial(params: int) -> Weights:
    return Weights({"w": np.zeros(params, np.float32)})


# -- fedloom over gRPC ----------------------------------------------------------------
def make_pki(folder: Path, clients: int) -> Path:
    """A throwaway CA, the server's certificate and ``bench-<i>`` client certificates."""
    write_certificates(folder, clients=[f"bench-{i}" for i in range(clients)])
    return folder


def run_grpc(pool: Any, mode: str, n: int, params: int, dropout: float, rounds: int,
             state_root: Path, pki: Path, task_stream: bool = True) -> dict[str, Any]:
    plain_min = n - round(dropout * n)
    tls = TLSConfig(cert=str(pki / "server.pem"), key=str(pki / "server.key"),
                    client_ca=str(pki / "ca.pem"))
    config = ServerConfig(
        address="127.0.0.1:0", num_rounds=rounds, min_clients=n,
        min_fit_clients=n if mode != "plain" else plain_min, fraction_fit=1.0,
        fraction_evaluate=0.0, state_dir=str(state_root / f"{mode}-{n}-{params}-{dropout}"),
        progress=False, keep_checkpoints=1, round_timeout_s=600.0, tls=tls,
        secure_aggregation=secagg_config() if mode != "plain" else SecAggConfig(),
        privacy=ddp_config(dropout) if mode == "secure-ddp" else PrivacyConfig())
    server = Server(config, initial_weights=initial(params))
    handle = server.start()
    started_cpu, started = time.process_time(), time.perf_counter()
    pending = pool.run(handle.address, n, dropout, timeout_s=1800.0, pki=str(pki),
                       task_stream=task_stream)
    history = handle.wait(1800.0)
    wall, server_cpu = time.perf_counter() - started, time.process_time() - started_cpu
    clients = pool.collect(pending, 120.0)
    rows = [r for r in history if r.get("round", 0) >= 1]
    if len(rows) != rounds or any(r["status"] != "ok" for r in rows):
        raise RuntimeError(f"gRPC {mode} n={n} P={params}: rounds {rows}")
    seconds = [r["duration_s"] for r in rows]
    per = n * rounds
    cpu = {s: sum(c["cpu_s"].get(s, 0.0) for c in clients) / per for s in STAGES}
    out: dict[str, Any] = {
        "round_s": steady(seconds), "rounds_s": seconds, "wall_s": wall,
        "updates": [r["num_updates"] for r in rows],
        "client_cpu_s": {k: v for k, v in cpu.items() if v > 0},
        "client_process_cpu_s": sum(c["process_cpu_s"] for c in clients) / per,
        "server_cpu_s": server_cpu / rounds,
        "sent_bytes": sum(c["sent"] for c in clients) / per,
        "received_bytes": sum(c["received"] for c in clients) / per,
        "dropped": sum(c["dropped"] for c in clients) / rounds,
        "stage_sent_bytes": {s: sum(c["stage_sent"].get(s, 0) for c in clients) / per
                             for s in STAGES if any(s in c["stage_sent"] for c in clients)},
    }
    if mode != "plain":
        stage_rows = [r["secure_aggregation"]["stage_s"] for r in rows[1:] or rows]
        out["stage_s"] = {s: statistics.median(x[s] for x in stage_rows) for s in stage_rows[0]}
        out["survivors"] = [r["secure_aggregation"]["survivors"] for r in rows]
    return out


# -- fedloom's local engine -----------------------------------------------------------
class LocalClient(Client):
    """The gRPC benchmark's client, in-process: a fixed step; a plain dropout raises."""

    def __init__(self, index: int, dropout: float, cpu: dict[str, float]) -> None:
        self.index, self.dropout, self.cpu = index, dropout, cpu
        self.steps: dict[int, np.ndarray] = {}

    def fit(self, weights: Weights, config: Any) -> FitOutput:
        arr = weights["w"]
        step = self.steps.get(arr.size)
        if step is None:  # made once per size, not counted as training
            step = self.steps[arr.size] = fixed_step(self.index, arr.size)
        started = time.thread_time()
        out = FitOutput(Weights({"w": arr + step}), 100)
        self.cpu["train"] = self.cpu.get("train", 0.0) + time.thread_time() - started
        if self.dropout and (self.index + int(config["server_round"])) % 5 == 0:
            raise RuntimeError("benchmark dropout")  # trained, then vanished
        return out

    def evaluate(self, weights: Weights, config: Any) -> EvaluateOutput:
        return EvaluateOutput(0.0, 100)


def run_local_mode(mode: str, n: int, params: int, dropout: float,
                   rounds: int) -> dict[str, Any]:
    cpu: dict[str, float] = {}
    secure = (LocalSecureAggregation(secagg_config(), SecureDropout(dropout, "share_keys"))
              if mode != "plain" else None)
    clients = [LocalClient(i, dropout if secure is None else 0.0, cpu) for i in range(n)]
    logging.getLogger("fedloom.simulations").setLevel(logging.ERROR)
    strategy = FedAvg(selection=SelectionConfig(min_fit_clients=n, fraction_evaluate=0.0))
    if mode == "secure-ddp":
        strategy = apply_privacy(strategy, ddp_config(dropout))
    history = run_local(strategy, clients.__getitem__, initial(params), num_clients=n,
                        num_rounds=rounds, secure_aggregation=secure)
    seconds = [float(r.get("seconds")) for r in history.rounds[1:]]
    per = n * rounds
    out: dict[str, Any] = {"round_s": steady(seconds), "rounds_s": seconds,
                           "updates": [r.get("num_updates") for r in history.rounds[1:]]}
    if secure is None:
        out["client_cpu_s"] = {"train": cpu.get("train", 0.0) / per}
        out["sent_bytes"] = 4.0 * params * (n - round(dropout * n)) / n  # float32 delta
        return out
    totals: dict[str, float] = {}
    for report in secure.reports:
        for stage, value in report.client_cpu_s.items():
            totals[stage] = totals.get(stage, 0.0) + value
        if report.failure:
            raise RuntimeError(f"local secure round failed: {report.failure}")
    out["client_cpu_s"] = {k: v / per for k, v in totals.items()}
    out["sent_bytes"] = sum(sum(r.bytes_sent.values()) for r in secure.reports) / per
    reports = secure.reports[1:] or secure.reports
    out["stage_s"] = {s: statistics.median(r.stage_s[s] for r in reports)
                      for s in reports[0].stage_s}
    return out


# -- Flower ------------------------------------------------------------------------------
def run_flower(settings: list[tuple[int, int, float]], rounds: int) -> dict[tuple, dict]:
    import _secagg_flower

    logging.getLogger("flwr").setLevel(logging.WARNING)
    phases = [{"mode": mode, "clients": n, "params": p, "dropout": d}
              for n, p, d in settings for mode in ("plain", "secure")]
    supernodes = max(n for n, _, _ in settings)
    with tempfile.TemporaryDirectory(prefix="secagg-flower-") as tmp:
        done = _secagg_flower.run_phases(phases, supernodes, rounds, FLOWER_SECAGG, Path(tmp))
    out: dict[tuple, dict] = {}
    for phase in done:
        n, per = phase["clients"], phase["clients"] * rounds
        seconds = [end - start for start, end in phase["round_times"]]
        cpu: dict[str, float] = {}
        for m in phase["messages"]:
            cpu[m["stage"]] = cpu.get(m["stage"], 0.0) + m["cpu_s"] / per
        out[(phase["mode"], n, phase["params"], phase["dropout"])] = {
            "round_s": steady(seconds), "rounds_s": seconds, "client_cpu_s": cpu,
            "sent_bytes": sum(m["sent"] for m in phase["messages"]) / per,
            "received_bytes": sum(m["received"] for m in phase["messages"]) / per,
            "errors": sum(m["error"] for m in phase["messages"]),
        }
    return out


# -- report ---------------------------------------------------------------------------
def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def tables(rows: list[dict[str, Any]]) -> str:
    head = ("| clients | params | dropout | gRPC plain s | gRPC secure s | ratio | local "
            "plain s | local secure s | ratio | Flower plain s | Flower SecAgg+ s | ratio | "
            "Flower SecAgg+ / local secure | secure bytes sent / float32 (fedloom, Flower) |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        g, lo, f = r.get("grpc", {}), r.get("local", {}), r.get("flower", {})
        gp, gs = g.get("plain", {}).get("round_s"), g.get("secure", {}).get("round_s")
        lp, ls = lo.get("plain", {}).get("round_s"), lo.get("secure", {}).get("round_s")
        fp, fs = f.get("plain", {}).get("round_s"), f.get("secure", {}).get("round_s")
        float32 = 4 * r["params"]
        ours = g.get("secure", {}).get("sent_bytes") or lo.get("secure", {}).get("sent_bytes")
        theirs = f.get("secure", {}).get("sent_bytes")
        lines.append(
            f"| {r['clients']} | {r['params'] // 1000}k | {r['dropout']:.0%} | {fmt(gp)} | "
            f"{fmt(gs)} | {fmt(ratio(gs, gp), '.2f')}x | {fmt(lp)} | {fmt(ls)} | "
            f"{fmt(ratio(ls, lp), '.2f')}x | {fmt(fp)} | {fmt(fs)} | "
            f"{fmt(ratio(fs, fp), '.2f')}x | {fmt(ratio(fs, ls), '.1f')}x | "
            f"{fmt(ratio(ours, float32), '.4f')}, {fmt(ratio(theirs, float32), '.3f')} |")
    lines += ["", "fedloom over gRPC: fastest steady round (s), server CPU s per round, "
              "client process CPU s per client per round, MB sent / received per client "
              "per round (plain | secure):", "",
              "| clients | params | dropout | fastest round | server CPU | client CPU | "
              "MB sent | MB received |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r.get("grpc", {})
        if "plain" not in g or "secure" not in g:
            continue
        p, q = g["plain"], g["secure"]
        lines.append(
            f"| {r['clients']} | {r['params'] // 1000}k | {r['dropout']:.0%} | "
            f"{p['min_round_s']:.3f} / {q['min_round_s']:.3f} | "
            f"{p['server_cpu_s']:.3f} / {q['server_cpu_s']:.3f} | "
            f"{p['client_process_cpu_s']:.4f} / {q['client_process_cpu_s']:.4f} | "
            f"{p['sent_bytes'] / 1e6:.3f} / {q['sent_bytes'] / 1e6:.3f} | "
            f"{p['received_bytes'] / 1e6:.3f} / {q['received_bytes'] / 1e6:.3f} |")
    lines += ["", "Client CPU seconds per client per round, by stage (0% dropout rows; "
              "fedloom gRPC | fedloom local | Flower):", ""]
    lines.append("| clients | params | mode | fedloom gRPC | fedloom local | Flower |")
    lines.append("|---|---|---|---|---|---|")
    for r in rows:
        if r["dropout"]:
            continue
        for mode in ("plain", "secure"):
            cells = []
            for system in ("grpc", "local", "flower"):
                cpu = r.get(system, {}).get(mode, {}).get("client_cpu_s", {})
                order = FLOWER_STAGES if system == "flower" else STAGES
                cells.append(", ".join(f"{s} {cpu[s]:.4f}" for s in order if s in cpu) or "-")
            lines.append(f"| {r['clients']} | {r['params'] // 1000}k | {mode} | "
                         + " | ".join(cells) + " |")
    lines += ["", "fedloom over gRPC, each SecAgg+ stage of a steady secure round: wall s "
              "(median), client CPU s and bytes sent per client:", "",
              "| clients | params | dropout | " + " | ".join(STAGES[1:6]) + " |",
              "|---|---|---|" + "---|" * 5]
    for r in rows:
        q = r.get("grpc", {}).get("secure")
        if q is None:
            continue
        cells = [f"{q.get('stage_s', {}).get(s, 0):.4f} s, "
                 f"{q.get('client_cpu_s', {}).get(s, 0) * 1e3:.2f} ms, "
                 f"{q.get('stage_sent_bytes', {}).get(s, 0):,.0f} B" for s in STAGES[1:6]]
        lines.append(f"| {r['clients']} | {r['params'] // 1000}k | {r['dropout']:.0%} | "
                     + " | ".join(cells) + " |")
    ddp = [r for r in rows if "secure-ddp" in r.get("grpc", {}) or "secure-ddp" in r.get(
        "local", {})]
    if ddp:
        lines += ["", "Distributed DP under SecAgg+ (Skellam, z = 1) beside the secure round "
                  "without it: steady round s, and bytes sent per client / float32:", "",
                  "| clients | params | dropout | gRPC secure s | gRPC secure + DDP s | ratio "
                  "| local secure s | local secure + DDP s | ratio | DDP bytes / float32 |",
                  "|" + "---|" * 10]
    for r in ddp:
        g, lo = r.get("grpc", {}), r.get("local", {})
        gs, gd = g.get("secure", {}).get("round_s"), g.get("secure-ddp", {}).get("round_s")
        ls, ld = lo.get("secure", {}).get("round_s"), lo.get("secure-ddp", {}).get("round_s")
        sent = (g.get("secure-ddp", {}).get("sent_bytes")
                or lo.get("secure-ddp", {}).get("sent_bytes"))
        lines.append(f"| {r['clients']} | {r['params'] // 1000}k | {r['dropout']:.0%} | "
                     f"{fmt(gs)} | {fmt(gd)} | {fmt(ratio(gd, gs), '.2f')}x | {fmt(ls)} | "
                     f"{fmt(ld)} | {fmt(ratio(ld, ls), '.2f')}x | "
                     f"{fmt(ratio(sent, 4 * r['params']), '.3f')} |")
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        if r["params"] != 1_000_000:
            continue
        g, lo, f = r.get("grpc", {}), r.get("local", {}), r.get("flower", {})
        tag = f"{r['clients']} clients, 1M, {r['dropout']:.0%} dropout"
        if r["clients"] == 20 and "secure" in g and "plain" in g:
            x = ratio(g["secure"]["round_s"], g["plain"]["round_s"])
            # The fastest steady rounds beside the medians: one slow plain run on a
            # shared machine moves a median of two runs a long way.
            fast = ratio(g["secure"].get("min_round_s"), g["plain"].get("min_round_s"))
            out.append(f"gRPC secure / plain ({tag}): {fmt(x, '.2f')}x median, "
                       f"{fmt(fast, '.2f')}x fastest rounds (target <= 1.5x)")
        if "secure" in f and "secure" in lo and "plain" in lo:
            x = ratio(f["secure"]["round_s"], lo["secure"]["round_s"])
            out.append(f"Flower SecAgg+ / fedloom local secure ({tag}): {fmt(x, '.1f')}x "
                       "(target >= 5x)")
        if r["clients"] == 20 and "secure" in g and "secure-ddp" in g:
            x = ratio(g["secure-ddp"]["round_s"], g["secure"]["round_s"])
            fast = ratio(g["secure-ddp"].get("min_round_s"), g["secure"].get("min_round_s"))
            out.append(f"gRPC secure with distributed DP / secure ({tag}): {fmt(x, '.2f')}x "
                       f"median, {fmt(fast, '.2f')}x fastest rounds (target <= 1.2x)")
        if not r["dropout"] and "secure" in g:
            x = ratio(g["secure"]["sent_bytes"], 4e6)
            out.append(f"upload expansion, gRPC bytes sent / float32 ({tag}): "
                       f"{fmt(x, '.4f')}x (target <= 1.1x)")
    return out


def alternate(modes: list[str], repeats: int, run: Any) -> dict[str, dict[str, Any]]:
    """Run each mode ``repeats`` times, alternating (plain, secure, secure, plain, ...)
    so a shared machine's changing load hits both alike; merge each mode's runs: the
    median of their steady round times, the mean of their CPU and bytes."""
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for rep in range(repeats):
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            runs[mode].append(run(mode))
    return {mode: merge(results) for mode, results in runs.items()}


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"round_s": statistics.median(r["round_s"] for r in results),
                           "runs_round_s": [r["round_s"] for r in results],
                           "rounds_s": [x for r in results for x in r["rounds_s"]],
                           "min_round_s": min(min(r["rounds_s"][1:] or r["rounds_s"])
                                              for r in results)}
    for key, value in results[0].items():
        if key in out:
            continue
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = statistics.fmean(r[key] for r in results)
        elif isinstance(value, dict) and key == "stage_s":
            out[key] = {k: statistics.median(r[key][k] for r in results) for k in value}
        elif isinstance(value, dict):
            out[key] = {k: statistics.fmean(r[key].get(k, 0.0) for r in results) for k in value}
        else:
            out[key] = [r[key] for r in results]
    return out


def progress(system: str, row: dict[str, Any]) -> None:
    times = " / ".join(f"{mode} {r['round_s']:.3f} s" for mode, r in row[system].items())
    print(f"{system} {row['clients']} clients x {row['params']} {row['dropout']:.0%}: {times}",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 20, 50])
    parser.add_argument("--params", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--dropouts", type=float, nargs="+", default=[0.0, 0.2])
    parser.add_argument("--rounds", type=int, default=4, help="rounds per phase (1 warm-up)")
    parser.add_argument("--workers", type=int, default=20, help="client processes (gRPC)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each mode per setting, alternating (gRPC, local)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["grpc", "local", "flower"])
    parser.add_argument("--modes", nargs="+", default=["plain", "secure"],
                        choices=["plain", "secure", "secure-ddp"],
                        help="(profiling) run only these")
    parser.add_argument("--ddp", action="store_true",
                        help="add the secure round with distributed DP (mode secure-ddp)")
    parser.add_argument("--pull", action="store_true",
                        help="(A/B) clients Pull each task instead of reading a Tasks stream")
    parser.add_argument("--quick", action="store_true",
                        help="10 and 20 clients, 100k parameters, 3 rounds, 1 repeat")
    parser.add_argument("--out", type=Path, default=RESULTS / "secagg.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.params, args.rounds, args.repeats = [10, 20], [100_000], 3, 1
    if args.ddp and "secure-ddp" not in args.modes:
        args.modes.append("secure-ddp")
    logging.basicConfig(level=logging.WARNING)
    settings = [(n, p, d) for p in args.params for n in args.clients for d in args.dropouts]
    rows = [{"clients": n, "params": p, "dropout": d} for n, p, d in settings]
    started = time.perf_counter()
    if "local" not in args.skip:
        for row in rows:
            row["local"] = alternate(args.modes, args.repeats, lambda m, r=row: run_local_mode(
                m, r["clients"], r["params"], r["dropout"], args.rounds))
            progress("local", row)
    if "grpc" not in args.skip:
        from _secagg_grpc import ClientPool

        pool = ClientPool(min(args.workers, max(args.clients)))
        try:
            with tempfile.TemporaryDirectory(prefix="secagg-bench-") as tmp:
                pki = make_pki(Path(tmp) / "pki", max(args.clients))
                for row in rows:
                    row["grpc"] = alternate(args.modes, args.repeats, lambda m, r=row: run_grpc(
                        pool, m, r["clients"], r["params"], r["dropout"], args.rounds, Path(tmp),
                        pki, task_stream=not args.pull))
                    progress("grpc", row)
        finally:
            pool.close()
    if "flower" not in args.skip:
        flower = run_flower(settings, args.rounds)
        for row in rows:
            key = (row["clients"], row["params"], row["dropout"])
            row["flower"] = {m: flower[(m, *key)] for m in ("plain", "secure")}
    text = tables(rows)
    goals = targets(rows)
    print(text)
    print("\n".join(goals))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "secagg: plain vs SecAgg+ rounds, fedloom (gRPC, local) and Flower",
        "settings": {"clients": args.clients, "params": args.params,
                     "dropouts": args.dropouts, "rounds": args.rounds,
                     "secagg": {"neighbours": NEIGHBOURS, "threshold": THRESHOLD,
                                "clip_range": 8.0, "bits": 22, "max_weight": 100.0},
                     "flower_secagg": FLOWER_SECAGG, "grpc_workers": args.workers,
                     "task_stream": not args.pull,
                     "repeats": args.repeats},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": sys.version.split()[0], "load_avg": os.getloadavg()},
        "wall_s": time.perf_counter() - started,
        "rows": rows, "table": text.splitlines(), "targets": goals,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
