"""The end of a run, across restarts (issue 20, items 3 and 4).

- A server killed just after committing the last round and started again has nothing
  left to train; it used to exit at once, leaving every client retrying it for ever.
  It now stays answerable ("run finished") until the clients have heard it, and the
  ``fedloom client`` commands exit.
- A server started again on a finished run used to begin a new run from the initial
  weights; now that takes ``new_run`` (``--new-run``), and without it the server tells
  the run's clients it is over and exits.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest
from lifecycle_support import (
    ClientThreads,
    GatedClient,
    ServerCommand,
    client_command,
    tiny_weights,
)

from fedloom.cli import build_parser, server_config_from_args
from fedloom.server import Server
from fedloom.server.store import RunStore

#: round_committed is reached once per round from round 0: the third is round 2's.
LAST_COMMIT_OF_TWO_ROUNDS = "round_committed:3"
CRASH_EXIT = 86


def test_clients_stranded_by_a_crash_after_the_last_commit_hear_that_the_run_is_over(
        tmp_path: Path) -> None:
    server = ServerCommand(tmp_path, finished_grace_s=30.0)
    first = server.start(crash_at=LAST_COMMIT_OF_TWO_ROUNDS)
    server.wait_serving(first)
    clients = [client_command(server.address, f"site-{i}", tmp_path / f"client-{i}.log")
               for i in range(2)]
    try:
        assert server.wait(first, 60) == CRASH_EXIT, server.output()
        second = server.start()
        # The clients join the restarted server, hear "run finished" and exit...
        for i, client in enumerate(clients):
            try:
                code = client.wait(30)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"fedloom client {i} is still retrying:\n{server.output()}\n"
                    + (tmp_path / f"client-{i}.log").read_text()) from None
            assert code == 0
            assert "run_finished=True" in (tmp_path / f"client-{i}.log").read_text()
        # ... and the server, having told as many clients as the last round had, too.
        assert server.wait(second, 20) == 0, server.output()
        assert "telling its clients" in server.output()
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
                client.wait(10)
    store = RunStore(server.state_dir / "fedloom.db", readonly=True)
    try:
        (run,) = store.runs()
        assert run.status == "finished"
        assert [r.round for r in store.rounds(run.run_id)] == [0, 1, 2]
    finally:
        store.close()


def _finish_a_run(config) -> None:  # type: ignore[no-untyped-def]
    handle = Server(config, initial_weights=tiny_weights()).start()
    pool = ClientThreads(handle.address, [GatedClient()])  # type: ignore[arg-type]
    try:
        assert [r.status for r in handle.wait(30)] == ["ok"]
    finally:
        pool.close()


def _runs(config) -> list[str]:  # type: ignore[no-untyped-def]
    store = RunStore(Path(config.state_dir) / "fedloom.db", readonly=True)
    try:
        return [run.status for run in store.runs()]
    finally:
        store.close()


def _settings(config) -> dict:  # type: ignore[no-untyped-def]
    keys = ("num_rounds", "min_clients", "min_fit_clients", "fraction_evaluate",
            "finished_grace_s")
    return {k: getattr(config, k) for k in keys}


def test_a_restart_on_a_finished_run_trains_nothing_and_says_how_to_start_anew(
        server_config, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    config = server_config(num_rounds=1, min_clients=1, min_fit_clients=1,
                           fraction_evaluate=0.0, finished_grace_s=20.0)
    _finish_a_run(config)
    # Started again (a supervisor's restart): no new run, and a late client is told.
    latecomer = GatedClient()
    with caplog.at_level(logging.WARNING, logger="fedloom.server"):
        handle = Server(config, initial_weights=tiny_weights()).start()
        pool = ClientThreads(handle.address, [latecomer])  # type: ignore[arg-type]
        try:
            history = handle.wait(20)  # it leaves once the run's one client has heard
        finally:
            pool.close()
    assert [r.round for r in history] == [1]
    assert pool.stats[0].run_finished and latecomer.fits == 0
    assert handle.server.run_finished
    assert _runs(config) == ["finished"]
    assert any("--new-run" in r.getMessage() for r in caplog.records)
    # An explicit new run is one.
    _finish_a_run(server_config(**{**_settings(config), "new_run": True}))
    assert _runs(config) == ["finished", "finished"]



def test_new_run_is_a_plain_flag() -> None:
    def parsed(*flags: str) -> bool:
        args = build_parser().parse_args(["server", "--insecure", *flags])
        return server_config_from_args(args).new_run

    assert parsed("--new-run") is True
    assert parsed("--new-run", "false") is False
    assert parsed() is False
