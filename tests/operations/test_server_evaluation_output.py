"""What the server does with its ``evaluate_fn``'s output, and how a round's headline
figures are shown.

An evaluation function is the application's code: numpy scalars (what `np.mean` and
most metrics return) become Python numbers; anything a round record cannot hold (a
tensor, a non-finite loss) is logged as an error naming ``evaluate_fn`` and that round's
server metrics are left out. It used to reach the run store's JSON encoder after the
round's commit and end the server, and again at every restart. ``fedloom runs``
shows a round's loss and accuracy from one evaluation (never a server loss beside a
federated accuracy), and ``--json`` is strict JSON even when a metric is NaN.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import run_to_end, scripted, small_weights

from fedloom.records import RoundRecord, headline_evaluation
from fedloom.server import Server
from fedloom.server.evaluation import checked_evaluation
from fedloom.server.run_report import print_runs, rounds_table
from fedloom.server.store import RoundRow, RunStore
from fedloom.strategies import HookOutputError


class _Scalar:
    """Stands in for a torch tensor: a number-like object that is not a number."""

    def __float__(self) -> float:
        return 0.9


def test_numpy_scalars_become_python_numbers() -> None:
    out = checked_evaluation((np.float32(0.25), {"accuracy": np.float64(0.75),
                                                 "n": np.int64(3), "ok": np.bool_(True)}))
    assert out == {"loss": 0.25, "accuracy": 0.75, "n": 3, "ok": True}
    assert [type(v) for v in out.values()] == [float, float, int, bool]
    json.dumps(out, allow_nan=False)  # what the run store does with it


@pytest.mark.parametrize(("outcome", "message"), [
    (0.5, r"evaluate_fn must return \(loss, metrics\) or None, got float"),
    ((0.5, {"accuracy": _Scalar()}), r"evaluate_fn returned 'accuracy' = .* \(_Scalar\); a "
                                     "metric must be a bool, int, float or str"),
    ((_Scalar(), {}), r"a loss of type _Scalar; return a Python float \(e.g. float\(loss\)"),
    ((float("nan"), {}), "the loss nan .*; a loss must be finite"),
    ((np.float32("inf"), {}), "the loss inf .*; a loss must be finite"),
    ((0.5, {"accuracy": float("nan")}), "evaluate_fn returned 'accuracy': nan is not finite"),
    ((0.5, ["accuracy"]), "evaluate_fn must return a dict of metrics, got list"),
])
def test_what_a_round_record_cannot_hold_is_refused_by_name(outcome: Any, message: str) -> None:
    with pytest.raises(HookOutputError, match=message):
        checked_evaluation(outcome)


def test_a_bad_evaluation_costs_its_metrics_not_the_run(
        server_config: Any, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    config = server_config(num_rounds=2, min_clients=1, min_fit_clients=1,
                           fraction_evaluate=0.0, finished_grace_s=0.0,
                           state_dir=str(tmp_path / "state"))

    def evaluate(server_round: int, weights: Any) -> tuple[Any, dict[str, Any]]:
        if server_round == 1:
            return 0.5, {"accuracy": _Scalar()}  # e.g. a torch tensor left unconverted
        return np.float32(0.5), {"accuracy": np.float32(0.8)}

    with caplog.at_level(logging.ERROR, logger="fedloom.server"):
        handle = Server(config, initial_weights=small_weights(), evaluate_fn=evaluate).start()
        history = run_to_end(handle, scripted(1))
    assert [r.status for r in history if r.round > 0] == ["ok", "ok"]
    by_round = {r.round: r.server for r in history}
    assert by_round[1] == {}
    assert by_round[2] == {"loss": 0.5, "accuracy": pytest.approx(0.8)}
    assert any("round 1: evaluate_fn returned 'accuracy'" in r.getMessage()
               and "server-side metrics are not recorded" in r.getMessage()
               for r in caplog.records)
    # ... and a restart on the finished run has nothing to trip over either
    again = Server(config, initial_weights=small_weights(), evaluate_fn=evaluate).start()
    assert [r.round for r in again.wait(30)][-1] == 2


def test_the_headline_comes_from_one_evaluation() -> None:
    server, federated = {"loss": 0.5}, {"loss": 0.7, "accuracy": 0.66}
    assert headline_evaluation(server, federated) == server  # no federated accuracy beside
    assert headline_evaluation({}, federated) == federated
    assert headline_evaluation(None, None) == {}
    record = RoundRecord(1, evaluate=federated, server=server)
    assert record.headline.get("accuracy") is None


def _store_with(tmp_path: Path, server: dict[str, Any], evaluate: dict[str, Any]) -> Path:
    state = tmp_path / "state"
    state.mkdir()
    store = RunStore(state / "fedloom.db")
    try:
        store.create_run("run-1", 1, {"strategy_class": "FedAvg"})
        record = RoundRecord(1, evaluate=evaluate, server=server)
        store.commit_round(RoundRow("run-1", 1, "ok", "round-1.safetensors", "0" * 64,
                                    record.to_dict(), 0.0, 0.0))
    finally:
        store.close()
    return state


def test_fedloom_runs_shows_loss_and_accuracy_from_the_same_evaluation(tmp_path: Path) -> None:
    state = _store_with(tmp_path, {"loss": 0.5}, {"loss": 0.7, "accuracy": 0.6583})
    store = RunStore(state / "fedloom.db", readonly=True)
    try:
        table = rounds_table(store, store.runs()[0])
    finally:
        store.close()
    row = table.splitlines()[-1].split()
    assert row[-2:] == ["0.5000", "-"]  # the server's loss, and no accuracy of its own


def test_fedloom_runs_json_is_strict_json_with_non_finite_metrics(tmp_path: Path) -> None:
    state = _store_with(tmp_path, {"loss": float("nan")}, {"accuracy": float("inf")})
    out = tmp_path / "out.json"
    with out.open("w") as fh:
        print_runs(state, json_output=True, out=fh)
    text = out.read_text()
    assert "NaN" not in text and "Infinity" not in text

    def refuse(constant: str) -> None:
        raise AssertionError(f"non-strict JSON constant {constant}")

    document = json.loads(text, parse_constant=refuse)
    metrics = document["runs"][0]["rounds"][0]["metrics"]
    assert metrics["server"]["loss"] is None and metrics["evaluate"]["accuracy"] is None
