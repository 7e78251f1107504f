"""GPU check for the client SDK's PyTorch trainer: correctness and speed, CUDA vs CPU.

Run it on a machine with a CUDA GPU::

    python benchmarks/gpu_check.py                  # prints a table, writes JSON
    python -m pytest -q tests/client_sdk/test_torch_client.py   # the CUDA test runs there

What it does, for an MLP of ``--hidden`` units on synthetic data of ``--examples`` rows:

1. ``device="auto"`` resolves to CUDA (fails loudly if it does not);
2. one seeded fit on CPU and one on CUDA from the same weights: the results must agree
   to 1e-3 (different kernels, same math) and the CUDA weights come back as host numpy;
3. seconds per local epoch on each device (median of ``--repeats`` fits after a warm-up),
   and the speed-up;
4. a 3-round federated run on the local engine with every client on CUDA, whose test
   accuracy must rise: once plain and once under SecAgg+ (authenticated, label v4),
   where the masked sum must give the same accuracy as the plain run to 0.02.

Nothing here needs a GPU to import; without one it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedloom.client_sdk.torch_trainer import TorchClient, resolve_device

RESULTS = Path(__file__).resolve().parent / "results"


def _data(n: int, features: int, classes: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, features, generator=g) * 2
    y = torch.randint(0, classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, features, generator=g)
    return [(x[i : i + 256], y[i : i + 256]) for i in range(0, n, 256)]


def _model(features: int, hidden: int, classes: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, classes),
    )


def _epoch_seconds(client: TorchClient, weights: Any, repeats: int) -> float:
    client.fit(weights, {"seed": 0})  # warm-up (CUDA context, kernels, allocator)
    samples = []
    for _ in range(repeats):
        if client.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        client.fit(weights, {"seed": 0})  # .fit copies weights back to host: synchronises
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _federated_run(secure: bool) -> dict[str, float]:
    from fedloom.secagg import SecAggConfig
    from fedloom.simulations.runner import run_scenario
    from fedloom.simulations.scenario import ClientSpec, Scenario

    secagg = SecAggConfig(enabled=secure, neighbours=6, threshold=4)
    scenario = Scenario(name="gpu-check", num_clients=8, clients_per_round=8, rounds=3,
                        progress=False, client=ClientSpec(device="cuda"),
                        secure_aggregation=secagg)
    start = time.perf_counter()
    history = run_scenario(scenario, out_dir=None)
    seconds = time.perf_counter() - start
    first = history.rounds[0].metrics["test_accuracy"]
    last = history.rounds[-1].metrics["test_accuracy"]
    return {"accuracy_round_0": float(first), "accuracy_final": float(last),
            "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--examples", type=int, default=20_000)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_check.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU visible to torch: nothing to check here", file=sys.stderr)
        return 2
    assert resolve_device("auto").type == "cuda"
    classes = 10
    data = _data(args.examples, args.features, classes, seed=0)
    cpu = TorchClient(_model(args.features, args.hidden, classes), data, device="cpu")
    gpu = TorchClient(_model(args.features, args.hidden, classes), data, device="auto")
    start = cpu.get_weights()
    on_cpu = cpu.fit(start, {"seed": 0}).weights
    on_gpu = gpu.fit(start, {"seed": 0}).weights
    worst = max(float(np.abs(on_cpu[k] - on_gpu[k]).max()) for k in on_cpu)
    agree = on_gpu.allclose(on_cpu, rtol=1e-3, atol=1e-3)
    cpu_s = _epoch_seconds(cpu, start, args.repeats)
    gpu_s = _epoch_seconds(gpu, start, args.repeats)
    federated = _federated_run(secure=False)
    secure = _federated_run(secure=True)
    result = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "parameters": sum(int(np.prod(a.shape)) for a in start.values()),
        "examples": args.examples,
        "cpu_vs_cuda_max_abs_diff": worst,
        "cpu_and_cuda_agree": agree,
        "cpu_epoch_s": cpu_s,
        "cuda_epoch_s": gpu_s,
        "speedup": cpu_s / gpu_s,
        **federated,
        "secure": secure,
    }
    print(f"{'device':<8} {'s/epoch':>9}")
    print(f"{'cpu':<8} {cpu_s:>9.3f}\n{'cuda':<8} {gpu_s:>9.3f}   ({cpu_s / gpu_s:.1f}x)")
    print(f"CPU vs CUDA weights after one fit: max |diff| {worst:.2e} (agree: {agree})")
    print(f"federated run on CUDA clients: accuracy {federated['accuracy_round_0']:.3f} -> "
          f"{federated['accuracy_final']:.3f} ({federated['seconds']:.1f} s)")
    print(f"same under SecAgg+ (v4, authenticated): accuracy {secure['accuracy_round_0']:.3f} -> "
          f"{secure['accuracy_final']:.3f} ({secure['seconds']:.1f} s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    ok = (agree and federated["accuracy_final"] > federated["accuracy_round_0"]
          and abs(secure["accuracy_final"] - federated["accuracy_final"]) <= 0.02)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
