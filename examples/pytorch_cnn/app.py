"""A federated CNN on digits: one fedloom server, clients that embed the SDK.

Run each part in its own terminal (or process), from the repository root::

    python examples/pytorch_cnn/app.py server --clients 2 --rounds 5
    python examples/pytorch_cnn/app.py client --index 0 --clients 2
    python examples/pytorch_cnn/app.py client --index 1 --clients 2

Clients may start before the server: `start_client` retries with backoff until the
server answers, and returns once the server says the run is over.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile

import torch
from cnn import DigitsCNN, client_loaders

from fedloom import ClientConfig, ServerConfig, Weights
from fedloom.client_sdk import TorchClient, start_client
from fedloom.server import Server


def initial_weights(seed: int) -> Weights:
    """The global model of round 0: the state dict of a freshly initialised CNN."""
    torch.manual_seed(seed)
    state = DigitsCNN().state_dict()
    # Every tensor of the state dict (parameters and buffers), by name and in order:
    # `TorchClient` loads and returns exactly these, so the server checks each update
    # against this layout.
    return Weights((name, tensor.detach().cpu().numpy()) for name, tensor in state.items())


def serve(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as scratch:
        config = ServerConfig(
            address=args.address,
            num_rounds=args.rounds,
            min_clients=args.clients,  # a round starts once every client is connected
            min_fit_clients=args.clients,
            min_evaluate_clients=args.clients,  # clients score each new model on their own
            state_dir=args.state_dir or scratch,  # checkpoints and the run database
            insecure=True,  # plaintext: loopback only; see docs/security.md for TLS
        )
        history = Server(config, initial_weights=initial_weights(args.seed)).run()
    if args.history:
        with open(args.history, "w") as out:
            json.dump([r.to_dict() for r in history], out, indent=2)
    finished = len(history) == args.rounds and all(r.status == "ok" for r in history)
    return 0 if finished else 1


def train(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed + args.index)
    train_loader, val_loader = client_loaders(args.index, args.clients, args.seed)
    client = TorchClient(
        DigitsCNN(),
        train_loader,
        val_loader,
        local_epochs=1,
        device="auto",  # CUDA when torch sees a GPU, else the CPU
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    )
    name = f"cnn-client-{args.index}"
    print(f"{name}: training on {client.device}")
    config = ClientConfig(args.server, insecure=True)  # plaintext, as the server above
    stats = start_client(args.server, client, name=name, config=config)
    print(f"{name}: {stats.fits} fits, {stats.evaluations} evaluations, "
          f"run finished: {stats.run_finished}")
    return 0 if stats.run_finished else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="same on the server and clients")
    commands = parser.add_subparsers(dest="command", required=True)
    server = commands.add_parser("server", help="run the aggregation server")
    server.add_argument("--address", default="127.0.0.1:8080", help="HOST:PORT to listen on")
    server.add_argument("--clients", type=int, default=2, help="clients every round waits for")
    server.add_argument("--rounds", type=int, default=5)
    server.add_argument("--state-dir", default="", help="keep checkpoints here (default: "
                        "a temporary folder, removed at the end)")
    server.add_argument("--history", default="", help="write the per-round history (JSON)")
    client = commands.add_parser("client", help="run one client")
    client.add_argument("--server", default="127.0.0.1:8080", help="the server's HOST:PORT")
    client.add_argument("--index", type=int, required=True, help="which share of the data")
    client.add_argument("--clients", type=int, default=2, help="how many shares there are")
    client.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default: "
                        "torch's choice, all cores; 1 when several clients share a machine)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.command == "server" else logging.WARNING)
    return serve(args) if args.command == "server" else train(args)


if __name__ == "__main__":
    sys.exit(main())
