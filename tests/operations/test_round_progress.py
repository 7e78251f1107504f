"""What an operator sees while a round runs: the live status line counts the answers of
each phase, and a client's reported failure is logged with the client and its reason."""

from __future__ import annotations

import logging

import pytest
from helpers import ScriptedClient, run_to_end, scripted, small_weights

from fedloom import Weights
from fedloom.client_sdk import FitOutput
from fedloom.server import Server
from fedloom.server import progress as server_progress
from fedloom.types import Config


class _Failing(ScriptedClient):
    def fit(self, weights: Weights, config: Config) -> FitOutput:
        raise RuntimeError("out of disk space on the device")


def test_the_status_line_counts_each_phases_answers(
        server_config, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    shown: list[str] = []
    monkeypatch.setattr(server_progress.RoundReporter, "_set_status",
                        lambda self, text: shown.append(text))
    config = server_config(num_rounds=1, min_clients=2, min_fit_clients=2, progress=True)
    handle = Server(config, initial_weights=small_weights()).start()
    history = run_to_end(handle, scripted(2))
    assert history[-1].status == "ok"
    assert "round 1/1: 0/2 clients answered" in shown  # the round, of how many, tasks
    for verb in ("trained", "evaluated"):
        counts = [line for line in shown if line.startswith("round 1: ") and verb in line]
        assert counts[-1] == f"round 1: 2/2 clients {verb}"
        assert "round 1: 1/2 clients " + verb in counts


def test_a_reported_failure_is_logged_with_the_client_and_its_reason(
        server_config, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    config = server_config(num_rounds=1, min_clients=3, min_fit_clients=3,
                           fraction_evaluate=0.0)
    handle = Server(config, initial_weights=small_weights()).start()
    with caplog.at_level(logging.INFO, logger="fedloom.server"):
        history = run_to_end(handle, [*scripted(2), _Failing(seed=2, num_examples=5)])
    assert (history[-1].num_updates, history[-1].num_failures) == (2, 1)
    lines = [r.getMessage() for r in caplog.records]
    failed = [line for line in lines if " reported a failure: " in line]
    assert len(failed) == 1
    assert failed[0].startswith("client ") and "out of disk space on the device" in failed[0]
    # The id it names is the failing client's session (run_clients names it "c2").
    client_id = failed[0].removeprefix("client ").split(" ", 1)[0]
    assert any(line.startswith(f"client {client_id} (c2) joined") for line in lines)
