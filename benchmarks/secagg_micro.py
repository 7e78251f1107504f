"""Micro-benchmark of the SecAgg+ state machines, in-process (no transport).

Measures, for one round of n clients with k neighbours over a vector of P parameters:
the CPU seconds each client spends per stage, the server's time to take the masked
inputs and to unmask, the bytes of every message, and the upload expansion over a
float32 update. Rounds are authenticated (certificates of a throwaway client CA: keys
and survivor sets are signed and checked, the consistency stage runs). Scenarios: no
dropout, 20% of the clients gone after sharing keys (their masks are removed through
their reconstructed keys), and 20% gone after confirming the survivor set (their inputs
stay in the sum).

    python benchmarks/secagg_micro.py                      # 1M params, k=10, 20 clients
    python benchmarks/secagg_micro.py --params 100000 --clients 50

Prints a table and writes ``benchmarks/results/secagg_micro.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from fedloom import certs
from fedloom.secagg import (
    PeerVerifier,
    RoundId,
    RoundSetup,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    SecAggStatus,
    SigningIdentity,
    Stage,
)
from fedloom.simulations.secure_report import payload_bytes

RESULTS = Path(__file__).resolve().parent / "results"


def run_round(config: SecAggConfig, params: int, n: int, drop_stage: Stage | None,
              drop_fraction: float, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    ids = [f"client-{i:03d}" for i in range(n)]
    inputs = {c: (rng.normal(0, 0.01, params).astype(np.float32), int(rng.integers(50, 500)))
              for c in ids}
    gone = set(ids[: round(drop_fraction * n)]) if drop_stage else set()
    setup = RoundSetup.create(config, RoundId("bench", 1, seed), ids, params,
                              model_digest=bytes(32), config_digest=bytes(32),
                              authenticated=True)
    ca = certs.make_ca("benchmark client CA")
    peers = PeerVerifier([ca.cert])
    server = SecAggServer(setup, verifier=peers)
    clients = {}
    for i, c in enumerate(ids):
        issued = certs.make_client_cert(ca, c)
        clients[c] = SecAggClient(c, identity=SigningIdentity(issued.cert, issued.key),
                                  peers=peers, rng=np.random.default_rng(i))
    cpu: dict[str, list[float]] = defaultdict(list)
    size: dict[str, list[int]] = defaultdict(list)
    server_s: dict[str, float] = defaultdict(float)
    wall0 = time.perf_counter()
    while server.status is SecAggStatus.RUNNING:
        stage = server.stage
        for cid in sorted(server.pending()):
            if cid in gone and stage is drop_stage:
                server.drop(cid)
                continue
            request = server.request_for(cid)
            vector, num_examples = inputs[cid]
            t0 = time.process_time()
            reply = clients[cid].handle(request, vector=vector, num_examples=num_examples)
            cpu[stage].append(time.process_time() - t0)
            size[f"{stage} request"].append(payload_bytes(request))
            size[f"{stage} reply"].append(payload_bytes(reply))
            t0 = time.perf_counter()
            server.receive(cid, reply)
            server_s[f"receive {stage}"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        server.advance()
        server_s[f"close {stage}"] += time.perf_counter() - t0
    wall = time.perf_counter() - wall0
    result = server.result
    survivors = result.survivors
    weights = np.array([inputs[c][1] / config.max_weight for c in survivors])
    stack = np.stack([np.clip(inputs[c][0].astype(np.float64), -config.clip_range,
                              config.clip_range) for c in survivors])
    plain = (weights @ stack) / weights.sum()
    t0 = time.perf_counter()
    acc = np.zeros(params, np.float64)
    for c in survivors:  # the plain streaming weighted sum, for scale
        acc += np.multiply(inputs[c][0], inputs[c][1], dtype=np.float64)
    plain_sum_s = time.perf_counter() - t0
    return {
        "drop_stage": str(drop_stage) if drop_stage else None,
        "dropped_clients": len(gone),
        "survivors": len(survivors),
        "masks_removed_for": len(result.dropped),
        "max_abs_error_vs_plaintext": float(np.abs(result.mean - plain).max()),
        "client_cpu_s": {str(s): {"mean": statistics.fmean(v), "max": max(v)}
                         for s, v in cpu.items()},
        "server_s": dict(server_s),
        "server_unmask_s": server_s[f"receive {Stage.UNMASK}"] + server_s[f"close {Stage.UNMASK}"],
        "plain_weighted_sum_s": plain_sum_s,
        "bytes": {k: max(v) for k, v in size.items()},
        "round_wall_s_serial": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--neighbours", type=int, default=10)
    parser.add_argument("--threshold", type=int, default=6)
    parser.add_argument("--out", type=Path, default=RESULTS / "secagg_micro.json")
    args = parser.parse_args()
    config = SecAggConfig(enabled=True, neighbours=args.neighbours, threshold=args.threshold,
                          clip_range=8.0, bits=22, max_weight=1000.0, max_participants=1024)
    scenarios = [(None, 0.0), (Stage.MASKED_INPUT, 0.2), (Stage.UNMASK, 0.2)]
    runs = [run_round(config, args.params, args.clients, stage, frac, seed)
            for seed, (stage, frac) in enumerate(scenarios)]
    float32_bytes = 4 * args.params
    report = {
        "params": args.params, "clients": args.clients, "neighbours": args.neighbours,
        "threshold": args.threshold, "bits": config.bits, "clip_range": config.clip_range,
        "upload_expansion_vs_float32": (4 * (args.params + 1)) / float32_bytes,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(), "numpy": np.__version__,
        "runs": runs,
    }
    print(f"SecAgg+ micro-benchmark: {args.params:,} params, {args.clients} clients, "
          f"k={args.neighbours}, t={args.threshold}, bits={config.bits}")
    print(f"upload expansion over float32: {report['upload_expansion_vs_float32']:.6f}x")
    header = f"{'scenario':<28}" + "".join(f"{s!s:>16}" for s in Stage)
    print("\nclient CPU s per stage (mean / max)")
    print(header)
    for r in runs:
        name = f"{r['drop_stage'] or 'no dropout'} ({r['dropped_clients']} gone)"
        cells = "".join(
            f"{r['client_cpu_s'][str(s)]['mean']:>8.4f}/{r['client_cpu_s'][str(s)]['max']:<7.4f}"
            for s in Stage)
        print(f"{name:<28}{cells}")
    print("\nserver s: take masked inputs | unmask (replies + reconstruct + remove masks)"
          " | plain f64 weighted sum")
    for r in runs:
        name = f"{r['drop_stage'] or 'no dropout'} ({r['dropped_clients']} gone)"
        print(f"{name:<28}{r['server_s'][f'receive {Stage.MASKED_INPUT}']:>10.4f}"
              f"{r['server_unmask_s']:>12.4f}{r['plain_weighted_sum_s']:>12.4f}"
              f"   max err {r['max_abs_error_vs_plaintext']:.2e}")
    print("\nbytes per message (largest)")
    for key, value in runs[0]["bytes"].items():
        print(f"  {key:<28}{value:>12,}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
