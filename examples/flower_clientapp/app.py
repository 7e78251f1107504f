"""A plain Flower ClientApp, driven by a fedloom strategy on Flower's simulation engine.

The ClientApp below is written the way Flower 1.42's quickstarts write one (message
API: ``@app.train()`` and ``@app.evaluate()``) and knows nothing of fedloom. fedloom's
FedAvg samples, configures and aggregates through `run_flower`, which wraps it in the
`FlowerStrategy` bridge and runs it under ``flwr.simulation.run_simulation`` (Ray).
From the repository root::

    python examples/flower_clientapp/app.py --clients 4 --rounds 5
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
from client_app import Net, app
from sklearn.datasets import load_digits

from fedloom import Metrics, Weights
from fedloom.simulations import History, run_flower
from fedloom.strategies import FedAvg


def evaluate_on_all_digits(server_round: int, weights: Weights) -> Metrics:
    """Central evaluation after every round (and of the initial model, round 0)."""
    digits = load_digits()
    x = torch.from_numpy((digits.data / 16.0).astype(np.float32))
    y = torch.from_numpy(digits.target.astype(np.int64))
    model = Net()
    model.load_state_dict({name: torch.from_numpy(a.copy()) for name, a in weights.items()})
    with torch.no_grad():
        outputs = model(x)
    return {"test_loss": torch.nn.functional.cross_entropy(outputs, y).item(),
            "test_accuracy": (outputs.argmax(dim=1) == y).float().mean().item()}


def run(clients: int, rounds: int, seed: int) -> History:
    torch.manual_seed(seed)
    # The global model starts as the state dict of a fresh Net: the same names the
    # ClientApp's replies carry, which is how the bridge matches them up.
    initial = Weights((name, t.detach().numpy()) for name, t in Net().state_dict().items())
    return run_flower(
        FedAvg(),  # every connected node trains and evaluates each round
        app,
        initial,
        num_clients=clients,
        num_rounds=rounds,
        base_seed=seed,  # each node gets its own "seed" per round in the train config
        fit_defaults={"lr": 0.05, "local_epochs": 1},
        evaluate_fn=evaluate_on_all_digits,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="write history.json/.csv/.png here")
    args = parser.parse_args(argv)
    history = run(args.clients, args.rounds, args.seed)
    for record in history.rounds:
        print(f"round {record.round}: test accuracy {record.get('test_accuracy'):.3f}, "
              f"federated accuracy {record.get('federated_eval_acc', float('nan')):.3f}")
    if args.out:
        history.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
