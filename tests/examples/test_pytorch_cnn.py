"""examples/pytorch_cnn: a server process and two client processes on loopback."""

from __future__ import annotations

import json
import socket
from pathlib import Path

ROUNDS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_clients_train_the_cnn_through_the_server(apps, tmp_path: Path) -> None:
    address = f"127.0.0.1:{_free_port()}"
    history_file = tmp_path / "history.json"
    server = apps.start("pytorch_cnn/app.py", "server", "--address", address,
                        "--clients", "2", "--rounds", str(ROUNDS), "--history", str(history_file))
    # Started right away: the SDK retries until the server listens.
    clients = [apps.start("pytorch_cnn/app.py", "client", "--server", address,
                          "--index", str(i), "--clients", "2", "--threads", "1") for i in range(2)]
    apps.finish(server, timeout_s=90)
    for client in clients:
        assert "3 fits, 3 evaluations, run finished: True" in apps.finish(client, timeout_s=30)

    history = json.loads(history_file.read_text())
    assert [r["round"] for r in history] == list(range(1, ROUNDS + 1))
    assert all(r["status"] == "ok" and r["fit"]["num_updates"] == 2 for r in history)
    # Federated evaluation: both clients scored each new model on their validation split.
    first, last = history[0]["evaluate"], history[-1]["evaluate"]
    assert last["loss"] < first["loss"]
    assert last["accuracy"] > max(first["accuracy"], 0.8)  # 10 classes: chance is 0.1
