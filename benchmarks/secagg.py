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
  50 clients run 2 or 3 per process, as threads; one BLAS thread per process, as on a
  one-core device);
- **fedloom local**: `run_local` in this process, plain or with `LocalSecureAggregation`
  (`_secagg_local`);
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

from _secagg_local import run_local_mode
from _secagg_report import tables, targets
from _secagg_setup import (
    FLOWER_SECAGG,
    NEIGHBOURS,
    STAGES,
    THRESHOLD,
    ddp_config,
    initial,
    secagg_config,
    steady,
)

from fedloom.certs import write_certificates
from fedloom.config import ServerConfig, TLSConfig
from fedloom.privacy import PrivacyConfig
from fedloom.secagg import SecAggConfig
from fedloom.server import Server

RESULTS = Path(__file__).resolve().parent / "results"


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
        fraction_evaluate=0.0,
        # A folder per run: a folder whose run finished would only replay its history.
        state_dir=tempfile.mkdtemp(prefix=f"{mode}-{n}-{params}-{dropout}-", dir=state_root),
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
    if not all(c["sent"] for c in clients):
        raise RuntimeError(f"gRPC {mode} n={n} P={params}: a client sent nothing")
    rows = [r for r in history if r.round >= 1]
    if len(rows) != rounds or any(r.status != "ok" for r in rows):
        raise RuntimeError(f"gRPC {mode} n={n} P={params}: rounds {rows}")
    seconds = [r.duration_s for r in rows]
    per = n * rounds
    cpu = {s: sum(c["cpu_s"].get(s, 0.0) for c in clients) / per for s in STAGES}
    out: dict[str, Any] = {
        "round_s": steady(seconds), "rounds_s": seconds, "wall_s": wall,
        "updates": [r.num_updates for r in rows],
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
        stage_rows = [r.secure_aggregation["stage_s"] for r in rows[1:] or rows]
        out["stage_s"] = {s: statistics.median(x[s] for x in stage_rows) for s in stage_rows[0]}
        out["survivors"] = [r.secure_aggregation["survivors"] for r in rows]
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
