"""`fedloom demo`: a real federated run on loopback gRPC, with nothing to install by hand.

It runs over mutual TLS with throwaway certificates it makes in a temporary folder
(`fedloom.simulations.demo_tls`): each client proves its name with its certificate.

A server and N spawned client processes; each client holds a private non-IID share
(Dirichlet alpha = 0.5 over labels) of scikit-learn's bundled handwritten digits and
trains a small PyTorch MLP; the server evaluates the global model on a held-out test
split after every round. Writes ``history.json``, ``metrics.png`` and the final
checkpoint (``model.safetensors``) into the output folder.

``--secure-aggregation`` runs every fit round under SecAgg+ (the server learns only the
sum of the updates), and ``--drop-clients N`` kills N client processes mid-round to
show dropout recovery (`fedloom.simulations.demo_secure`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedloom.config import ServerConfig, StrategyConfig
from fedloom.records import RoundRecord
from fedloom.simulations.demo_secure import ClientKiller, describe, secure_settings
from fedloom.simulations.demo_tls import ThrowawayPKI, client_tls_config
from fedloom.weights import Weights

log = logging.getLogger("fedloom.demo")


def load_digits_split(seed: int, test_fraction: float = 0.2) -> tuple[np.ndarray, ...]:
    """Digits scaled to [0, 1], split (stratified) into train and test."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    return tuple(train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y))


def dirichlet_shares(
    labels: np.ndarray, num_clients: int, alpha: float, seed: int, min_size: int = 10
) -> list[np.ndarray]:
    """Split indices so each label's examples go to clients in Dirichlet(alpha) shares."""
    rng = np.random.default_rng(seed)
    for _ in range(100):
        shares: list[list[int]] = [[] for _ in range(num_clients)]
        for label in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == label))
            cuts = np.cumsum(rng.dirichlet(np.full(num_clients, alpha)))[:-1] * len(idx)
            for client, part in enumerate(np.split(idx, cuts.astype(int))):
                shares[client].extend(part.tolist())
        if min(len(s) for s in shares) >= min_size:
            return [np.sort(np.array(s, dtype=np.int64)) for s in shares]
    raise ValueError(f"could not give every client {min_size} examples; lower --clients")


def make_model() -> Any:
    import torch

    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _client_process(address: str, index: int, num_clients: int, seed: int, certs: str) -> None:
    """Entry point of one spawned client process."""
    import torch

    from fedloom.client_sdk import TorchClient, start_client

    torch.set_num_threads(1)
    torch.manual_seed(seed + index)
    x_train, _x_test, y_train, _y_test = load_digits_split(seed)
    share = dirichlet_shares(y_train, num_clients, 0.5, seed)[index]
    dataset = torch.utils.data.TensorDataset(
        torch.from_numpy(x_train[share]), torch.from_numpy(y_train[share])
    )
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(seed + index)
    )
    client = TorchClient(
        make_model(),
        loader,
        local_epochs=2,
        device="auto",
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    )
    logging.basicConfig(level=logging.WARNING)
    name = f"demo-client-{index}"
    start_client(address, client, name=name, config=client_tls_config(address, certs, name))


def _server_evaluator(seed: int) -> Any:
    import torch

    from fedloom.client_sdk.torch_trainer import evaluate_module, load_weights

    torch.set_num_threads(1)
    _x_train, x_test, _y_train, y_test = load_digits_split(seed)
    loader = [(torch.from_numpy(x_test), torch.from_numpy(y_test))]
    model = make_model()
    loss_fn = torch.nn.CrossEntropyLoss()

    def evaluate(server_round: int, weights: Weights) -> tuple[float, dict[str, float]]:
        load_weights(model, weights)
        loss, accuracy, _ = evaluate_module(model, loader, loss_fn, torch.device("cpu"))
        return loss, {} if accuracy is None else {"accuracy": accuracy}

    return evaluate


def plot_history(history: list[RoundRecord], path: Path) -> None:
    history_figure(history).savefig(path, dpi=120)


def history_figure(history: list[RoundRecord]) -> Any:
    """Test accuracy and loss per round of a server's history (a matplotlib Figure)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    evaluated = [r for r in history if r.server]
    rounds = [r.round for r in evaluated]
    acc = [r.server["accuracy"] for r in evaluated]
    loss = [r.server["loss"] for r in evaluated]
    fig = Figure(figsize=(7, 4))
    ax1 = fig.subplots()
    ax1.plot(rounds, acc, "o-", color="tab:blue", label="test accuracy")
    ax1.set_xlabel("round")
    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))  # no round 2.5
    ax1.set_ylabel("accuracy", color="tab:blue")
    ax1.set_ylim(0, 1)
    ax2 = ax1.twinx()
    ax2.plot(rounds, loss, "s--", color="tab:red", label="test loss")
    ax2.set_ylabel("loss", color="tab:red")
    ax1.set_title("fedloom demo: FedAvg on digits (Dirichlet 0.5)")
    fig.tight_layout()
    return fig


def run_demo(
    clients: int = 8,
    rounds: int = 20,
    seed: int = 0,
    out_dir: str | Path = "fedloom-out",
    progress: bool = True,
    secure_aggregation: bool = False,
    drop_clients: int = 0,
    drop_round: int = 2,
) -> list[RoundRecord]:
    """Run the demo and return its history (also written to ``out_dir``).

    With ``secure_aggregation`` the fit rounds run under SecAgg+; ``drop_clients``
    client processes are then killed in round ``drop_round`` after sharing keys.
    """
    import torch

    from fedloom.client_sdk.torch_trainer import state_dict_to_weights
    from fedloom.server import Server, save_weights

    out = Path(out_dir)
    state_dir = out / "state"
    shutil.rmtree(state_dir, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    initial = state_dict_to_weights(make_model().state_dict())
    pki = ThrowawayPKI([f"demo-client-{i}" for i in range(clients)])  # mutual TLS
    config = ServerConfig(
        address="127.0.0.1:0",
        num_rounds=rounds,
        min_clients=clients,
        min_fit_clients=clients,
        fraction_evaluate=0.0,
        seed=seed,
        state_dir=str(state_dir),
        progress=progress,
        round_timeout_s=120.0,
        strategy=StrategyConfig("fedavg"),
        tls=pki.server_tls(),
        auth=pki.server_auth(),
    )
    if secure_aggregation:  # SecAgg+ settings for this demo (demo_secure.py)
        _x, _xt, y_train, _yt = load_digits_split(seed)
        largest = max(len(s) for s in dirichlet_shares(y_train, clients, 0.5, seed))
        config = dataclasses.replace(config, **secure_settings(clients, drop_clients, largest))
    server = Server(config, initial_weights=initial, evaluate_fn=_server_evaluator(seed))
    started = time.time()
    handle = server.start()
    context = mp.get_context("spawn")
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    processes = [
        context.Process(
            target=_client_process,
            args=(handle.address, i, clients, seed, str(pki.folder)),
            daemon=True,
        )
        for i in range(clients)
    ]
    for p in processes:
        p.start()
    if env_threads is None:
        os.environ.pop("OMP_NUM_THREADS", None)

    def respawn(index: int) -> Any:  # a killed client coming back (--drop-clients)
        process = context.Process(
            target=_client_process,
            args=(handle.address, index, clients, seed, str(pki.folder)),
            daemon=True,
        )
        process.start()
        return process

    killer = (ClientKiller(server, processes, drop_clients, drop_round, respawn)
              if secure_aggregation else None)
    try:
        history = handle.wait(timeout_s=600)
    finally:
        if killer is not None:
            killer.close()
        for p in processes:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        pki.cleanup()
    elapsed = time.time() - started
    final = server.coordinator.global_weights if server.coordinator else initial
    save_weights(out / "model.safetensors", final)
    (out / "history.json").write_text(
        json.dumps(
            {
                "clients": clients,
                "rounds": rounds,
                "seed": seed,
                "seconds": elapsed,
                "history": [r.to_dict() for r in history],
            },
            indent=2,
        )
    )
    plot_history(history, out / "metrics.png")
    best = max((float(r.server["accuracy"]) for r in history if r.server), default=0.0)
    last = float(history[-1].server.get("accuracy", 0.0)) if history else 0.0
    print(
        f"\nfinished {rounds} rounds with {clients} clients in {elapsed:.1f} s; "
        f"final test accuracy {last:.3f} (best {best:.3f})"
    )
    if secure_aggregation:
        print("secure aggregation (SecAgg+): the server saw only sums of masked updates")
        summary = describe(history, killer)
        if summary:
            print(summary)
    print(f"wrote {out / 'history.json'}, {out / 'metrics.png'}, {out / 'model.safetensors'}")
    return history


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=8, help="client processes (default 8)")
    parser.add_argument("--rounds", type=int, default=20, help="training rounds (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed for data, model and sampling")
    parser.add_argument("--out", default="fedloom-out", help="output folder (default fedloom-out)")
    parser.add_argument("--secure-aggregation", action="store_true",
                        help="run the fit rounds under SecAgg+: the server learns only sums")
    parser.add_argument("--drop-clients", type=int, default=0, metavar="N",
                        help="with --secure-aggregation: kill N client processes mid-round "
                        "(after they shared keys) to show dropout recovery")
    parser.add_argument("--drop-round", type=int, default=2, metavar="R",
                        help="the round in which --drop-clients kills them (default 2)")


def main(args: argparse.Namespace) -> int:
    if args.clients < 1 or args.rounds < 1:
        raise SystemExit("--clients and --rounds must be at least 1")
    if args.drop_clients and not args.secure_aggregation:
        raise SystemExit("--drop-clients shows SecAgg+ dropout recovery: add --secure-aggregation")
    run_demo(args.clients, args.rounds, args.seed, args.out,
             secure_aggregation=args.secure_aggregation, drop_clients=args.drop_clients,
             drop_round=args.drop_round)
    return 0
