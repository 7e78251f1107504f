"""examples/flower_clientapp: fedloom's FedAvg drives a plain Flower ClientApp on
Flower's simulation engine. Ray's start dominates (~10 s), so one small run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.flower

ROUNDS = 2


def test_fedloom_strategy_trains_a_plain_flower_client_app(apps, tmp_path: Path) -> None:
    apps.run("flower_clientapp/app.py", "--clients", "2", "--rounds", str(ROUNDS),
             "--out", str(tmp_path), timeout_s=150)

    rounds = json.loads((tmp_path / "history.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == list(range(ROUNDS + 1))
    # Every round both nodes' replies were used (a failed reply is counted, not raised).
    assert all(r["num_updates"] == 2 and r["num_failures"] == 0 for r in rounds[1:])
    # The ClientApp's own evaluate replies were aggregated by the fedloom strategy.
    assert all(0.0 <= r["federated_eval_acc"] <= 1.0 for r in rounds[1:])
    assert rounds[0]["test_accuracy"] < 0.25  # the initial model: near chance
    assert rounds[-1]["test_accuracy"] > 0.6 and rounds[-1]["test_loss"] < rounds[0]["test_loss"]
