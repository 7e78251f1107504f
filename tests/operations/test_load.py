"""The load generator's small version: 50 lean clients, 2 rounds, in-process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load_module() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("fedloom_load_benchmark", BENCHMARKS / "load.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fifty_clients_complete_two_rounds_without_an_error(tmp_path) -> None:
    load = _load_module()
    result = load.run_inprocess(50, 2, str(tmp_path / "state"), heartbeat_interval_s=0.3)
    assert result["client_errors"] == 0, result["error_samples"]
    assert result["rounds_ok"] == 2
    assert [r["updates"] for r in result["per_round"]] == [50, 50]
    assert all(r["federated_evaluation"] for r in result["per_round"])
    assert (result["fits"], result["evaluations"], result["refused"]) == (100, 100, 0)
    assert result["clients_finished"] == 50
    latency = result["latency_s"]
    assert latency["pull_delivery"]["n"] == 100  # every fit task, timed from its round's start
    assert latency["push_fit"]["n"] == 100 and latency["push_evaluate"]["n"] == 100
    assert latency["heartbeat"]["n"] > 0 and latency["join"]["n"] == 50
    for name, figures in latency.items():
        assert 0 <= figures["p50"] <= figures["p95"] <= figures["p99"] <= figures["max"], name
        assert figures["max"] < 30, name


def test_percentiles_match_numpy_on_a_known_sample() -> None:
    load = _load_module()
    figures = load.percentiles([float(i) for i in range(1, 101)])
    # numpy's linear interpolation: p50 of 1..100 is 50.5, p95 is 95.05, p99 is 99.01
    assert (figures["p50"], figures["p95"], figures["p99"]) == (50.5, 95.05, 99.01)
    assert load.percentiles([]) == {"n": 0}
