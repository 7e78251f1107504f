"""Server-side evaluation: the server scores every global model on a held-out set.

One process runs the server in a background thread and the clients in threads (each
would be its own device in a deployment); from the repository root::

    python examples/server_evaluate/app.py --clients 3 --rounds 5

``evaluate_fn(server_round, weights) -> (loss, metrics)`` runs on the server after each
round, and once before round 1 on the initial model (round 0). Its results land in the
history that `Server` returns: each round's `RoundRecord` has them as ``record.server``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from typing import Any

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

from fedloom import ClientConfig, Metrics, ServerConfig, Weights
from fedloom.client_sdk import TorchClient, start_client
from fedloom.server import EvaluateFn, Server


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def make_evaluate_fn(x_test: np.ndarray, y_test: np.ndarray) -> EvaluateFn:
    """An ``evaluate_fn`` that scores weights on the held-out set with a model of its own."""
    model = make_model().eval()
    inputs, targets = torch.from_numpy(x_test), torch.from_numpy(y_test)

    def evaluate(server_round: int, weights: Weights) -> tuple[float, Metrics]:
        # The arrays are read-only views of the global model: copy before torch owns them.
        model.load_state_dict({name: torch.from_numpy(a.copy()) for name, a in weights.items()})
        with torch.no_grad():
            outputs = model(inputs)
        loss = torch.nn.functional.cross_entropy(outputs, targets).item()
        accuracy = (outputs.argmax(dim=1) == targets).float().mean().item()
        return loss, {"accuracy": accuracy}

    return evaluate


def run(clients: int, rounds: int, seed: int) -> list[dict[str, Any]]:
    """Run the federation; returns the server's per-round history."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    # The server's held-out set never reaches a client.
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=seed, stratify=y)

    torch.manual_seed(seed)
    model = make_model()
    initial = Weights((name, t.detach().numpy()) for name, t in model.state_dict().items())
    with tempfile.TemporaryDirectory() as state_dir:
        config = ServerConfig(
            address="127.0.0.1:0",  # any free port; the handle says which
            num_rounds=rounds,
            min_clients=clients,
            min_fit_clients=clients,
            fraction_evaluate=0.0,  # no federated evaluation: the server's own is enough
            state_dir=state_dir,
            insecure=True,  # plaintext on loopback only
            progress=False,  # the table below shows the rounds
        )
        server = Server(config, initial_weights=initial,
                        evaluate_fn=make_evaluate_fn(x_test, y_test))
        handle = server.start()  # returns once the port is bound
        threads = []
        for index, rows in enumerate(np.array_split(np.arange(len(y_train)), clients)):
            data = TensorDataset(torch.from_numpy(x_train[rows]), torch.from_numpy(y_train[rows]))
            client = TorchClient(
                make_model(), DataLoader(data, batch_size=32, shuffle=True), device="auto",
                optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
            thread = threading.Thread(
                target=start_client, args=(handle.address, client), daemon=True,
                kwargs={"name": f"client-{index}", "handle_signals": False,  # not main thread
                        "config": ClientConfig(handle.address, insecure=True)})
            thread.start()
            threads.append(thread)
        history = handle.wait()
        for thread in threads:
            thread.join(timeout=10)
    return history


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--history", default="", help="also write the history here (JSON)")
    args = parser.parse_args(argv)
    history = run(args.clients, args.rounds, args.seed)
    print("round  test loss  test accuracy")
    for record in history:
        scores = record.server  # empty when a round failed
        print(f"{record.round:5d}  {scores.get('loss', float('nan')):9.3f}  "
              f"{scores.get('accuracy', float('nan')):13.3f}")
    if args.history:
        with open(args.history, "w") as out:
            json.dump([r.to_dict() for r in history], out, indent=2)
    return 0 if [r.round for r in history] == list(range(args.rounds + 1)) else 1


if __name__ == "__main__":
    sys.exit(main())
