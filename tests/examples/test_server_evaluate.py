"""examples/server_evaluate: the server scores every round's model on held-out data."""

from __future__ import annotations

import json
from pathlib import Path

ROUNDS = 3


def test_server_side_accuracy_rises_over_the_rounds(apps, tmp_path: Path) -> None:
    history_file = tmp_path / "history.json"
    output = apps.run("server_evaluate/app.py", "--clients", "2", "--rounds", str(ROUNDS),
                      "--history", str(history_file), timeout_s=60)

    history = json.loads(history_file.read_text())
    # Round 0 is the initial model, evaluated before any training.
    assert [r["round"] for r in history] == list(range(ROUNDS + 1))
    assert all(r["status"] == "ok" for r in history)
    accuracy = [r["server"]["accuracy"] for r in history]
    loss = [r["server"]["loss"] for r in history]
    assert accuracy[0] < 0.25  # an untrained model: near chance (0.1) on 10 classes
    assert accuracy[-1] > 0.7 and loss[-1] < loss[0]
    # The printed table is the history's.
    assert f"{ROUNDS:5d}  {loss[-1]:9.3f}  {accuracy[-1]:13.3f}" in output
