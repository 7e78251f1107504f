"""What an operator can do to a state folder, and what the server then does.

- Two servers on one ``state_dir`` (a rolling update that starts the new server before
  the old one stops): the second refuses to start, naming the first; before, both
  committed rounds and the second overwrote a committed checkpoint.
- A resumed run keeps its strategy, privacy, round mode and secure aggregation: a
  server started with others refuses, naming the setting; ``num_rounds`` and the other
  settings may change, and the run's record says what they are now.
- A restart on a finished run writes nothing, even when its newest checkpoint is torn
  (it used to drop that round's record).
- A server that cannot listen opens no run.
- A state folder, run store or output path that cannot be used is refused with one
  line and exit status 2 by ``fedloom server``, ``runs`` and ``export``.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from lifecycle_support import ClientThreads, GatedClient, free_port, tiny_weights, wait_until

from fedloom import cli
from fedloom.config import PrivacyConfig, RoundsConfig, StrategyConfig
from fedloom.errors import ConfigError
from fedloom.server import Server, load_weights
from fedloom.server.store import RunStore


def _finish(config, rounds: int = 1) -> list[str]:  # type: ignore[no-untyped-def]
    handle = Server(config, initial_weights=tiny_weights()).start()
    pool = ClientThreads(handle.address, [GatedClient()])  # type: ignore[arg-type]
    try:
        return [r.status for r in handle.wait(30)]
    finally:
        pool.close()


class _SecondFitWaits(GatedClient):
    """Trains its first round at once, then waits (for a gate nobody opens)."""

    def fit(self, weights, config):  # type: ignore[no-untyped-def]
        if self.fits >= 1:
            threading.Event().wait(30.0)
        return super().fit(weights, config)


def _store(config) -> RunStore:  # type: ignore[no-untyped-def]
    return RunStore(Path(config.state_dir) / "fedloom.db", readonly=True)


def _one_client(server_config, **overrides):  # type: ignore[no-untyped-def]
    return server_config(min_clients=1, min_fit_clients=1, fraction_evaluate=0.0,
                         finished_grace_s=0.0, **overrides)


def test_a_second_server_on_the_same_state_dir_refuses_to_start(server_config) -> None:  # type: ignore[no-untyped-def]
    config = _one_client(server_config, num_rounds=1)
    first = Server(config, initial_weights=tiny_weights()).start()
    try:
        with pytest.raises(ConfigError, match=r"state_dir: .* is in use by another server "
                                              r"\(pid \d+ on .*\): one server per state_dir"):
            Server(config, initial_weights=tiny_weights()).start(10)
    finally:
        pool = ClientThreads(first.address, [GatedClient()])  # type: ignore[arg-type]
        try:
            assert [r.status for r in first.wait(30)] == ["ok"]
        finally:
            pool.close()
    # The first one has stopped: the folder is free again (a finished run, told so).
    again = Server(config, initial_weights=tiny_weights())
    again.start(10).wait(20)
    assert again.run_finished


def test_a_resume_with_another_strategy_is_refused_and_num_rounds_may_change(
        server_config, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    config = _one_client(server_config, num_rounds=3)
    handle = Server(config, initial_weights=tiny_weights()).start()
    pool = ClientThreads(handle.address, [_SecondFitWaits()])  # type: ignore[arg-type]
    try:
        wait_until(lambda: bool(handle.server.coordinator
                                and handle.server.coordinator.history), 30)
        handle.stop()  # round 2 is still training
        handle.wait(30)
    finally:
        pool.close()
    store = _store(config)
    committed = [r.round for r in store.rounds(store.runs()[0].run_id)]
    first_record = store.runs()[0].config
    store.close()
    assert committed == [0, 1]
    other = dataclasses.replace(config, strategy=StrategyConfig("fedadam", {"eta": 0.1}))
    with pytest.raises(ConfigError, match=r"strategy_class: run \S+ was started with other "
                                          r"settings \(strategy_class: 'FedAvg' then, "
                                          r"'FedAdam' now\)"):
        Server(other, initial_weights=tiny_weights()).start(10)
    # Privacy that was off stays off, whatever its unused fields say; a round mode and
    # a switch to a private run are refused; the run's record is left as it was.
    unused = dataclasses.replace(config, privacy=PrivacyConfig(noise_multiplier=3.0),
                                 rounds=RoundsConfig(mode="async"))
    with pytest.raises(ConfigError, match=r"rounds.mode: .*\(rounds.mode: 'sync' then, "
                                          r"'async' now\)"):
        Server(unused, initial_weights=tiny_weights()).start(10)
    store = _store(config)
    assert store.runs()[0].config == first_record
    store.close()
    # Fewer rounds and another fraction: resumed, logged, and recorded as they now are.
    shorter = dataclasses.replace(config, num_rounds=committed[-1] + 1, round_timeout_s=29.0)
    with caplog.at_level(logging.WARNING, logger="fedloom.server"):
        assert _finish(shorter) == ["ok"] * (committed[-1] + 1)
    assert any("num_rounds 3 -> " in r.getMessage() and "round_timeout_s 30.0 -> 29.0"
               in r.getMessage() for r in caplog.records)
    store = _store(config)
    try:
        (run,) = store.runs()
        assert (run.status, run.num_rounds) == ("finished", committed[-1] + 1)
        assert run.config["round_timeout_s"] == 29.0
    finally:
        store.close()


def test_a_restart_on_a_finished_run_keeps_a_torn_last_round_on_record(
        server_config, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    config = _one_client(server_config, num_rounds=2)
    assert _finish(config) == ["ok", "ok"]
    store = _store(config)
    run_id = store.runs()[0].run_id
    last = store.rounds(run_id)[-1]
    store.close()
    with open(Path(config.state_dir) / last.checkpoint, "ab") as fh:
        fh.write(b"torn")
    with caplog.at_level(logging.WARNING, logger="fedloom.server"):
        server = Server(config, initial_weights=tiny_weights())
        server.start(10).wait(20)
    assert server.run_finished
    assert any("its last round is 2" in r.getMessage() for r in caplog.records)
    # It serves the model the run ended with (its final model file), as round 2.
    final = load_weights(Path(config.state_dir) / "models" / f"{run_id}.safetensors")
    assert server.weights is not None and server.coordinator is not None
    assert all(np.array_equal(server.weights[k], final[k]) for k in final)
    assert server.coordinator.model.version == 2
    store = _store(config)
    try:
        assert [r.round for r in store.rounds(run_id)] == [0, 1, 2]
        assert store.runs()[0].status == "finished"
    finally:
        store.close()


def test_a_server_that_cannot_listen_opens_no_run(server_config) -> None:  # type: ignore[no-untyped-def]
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        config = server_config(address=f"127.0.0.1:{taken.getsockname()[1]}")
        with pytest.raises(ConfigError, match="address: cannot listen"):
            Server(config, initial_weights=tiny_weights()).start(10)
    finally:
        taken.close()
    assert not (Path(config.state_dir) / "fedloom.db").exists()


def test_unusable_state_and_paths_are_refused_with_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "fedloom.db").write_bytes(b"this is not a database" * 100)
    weights = tmp_path / "w.safetensors"
    from fedloom.server import save_weights

    save_weights(weights, tiny_weights())
    server = ["server", "--insecure", "--address", "127.0.0.1:0", "--state-dir", str(state),
              "--initial-weights", str(weights), "--progress", "false"]
    for argv, says in [
        (server, "is not a fedloom run store (file is not a database)"),
        (["runs", "--state-dir", str(state)], "is not a fedloom run store"),
        (["export", "--state-dir", str(state), "--out", str(tmp_path / "m.safetensors")],
         "is not a fedloom run store"),
        (["server", "--config", str(tmp_path)], "cannot read"),
    ]:
        assert cli.main(argv) == cli.EXIT_REFUSED, argv
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, (argv, err)


def test_export_to_a_folder_is_refused_and_leaves_no_temp_file(
        server_config, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    config = _one_client(server_config, num_rounds=1)
    assert _finish(config) == ["ok"]
    out = tmp_path / "outdir"
    out.mkdir()
    assert cli.main(["export", "--state-dir", config.state_dir, "--out", str(out)]) == 2
    assert "it is a folder" in capsys.readouterr().err
    assert list(tmp_path.glob(".outdir*")) == []


def test_a_server_that_fails_before_serving_releases_its_folder_and_port(
        server_config, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from fedloom.server import app

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the coordinator could not be built")

    port = free_port()
    config = _one_client(server_config, num_rounds=1, address=f"127.0.0.1:{port}")
    with monkeypatch.context() as patched:
        patched.setattr(app, "Coordinator", broken)
        with pytest.raises(RuntimeError, match="could not be built"):
            Server(config, initial_weights=tiny_weights()).start(10)
    probe = socket.socket()
    try:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # the port was released
    finally:
        probe.close()
    again = Server(config, initial_weights=tiny_weights()).start(10)  # and the folder
    again.stop()
    again.wait(10)


def test_a_second_stop_during_shutdown_still_releases_the_folder(server_config) -> None:  # type: ignore[no-untyped-def]
    config = _one_client(server_config, num_rounds=3)
    gate = threading.Event()  # never set: round 1 stays open
    handle = Server(config, initial_weights=tiny_weights()).start(10)
    pool = ClientThreads(handle.address, [GatedClient(gate)])  # type: ignore[arg-type]
    try:
        wait_until(lambda: bool(handle.server.coordinator
                                and handle.server.coordinator.registry), 20)
        time.sleep(0.5)  # the client is long-polling
        handle.stop()
        time.sleep(0)
        handle.stop()  # a second Ctrl-C, during the first one's shutdown
        handle.wait(20)
    finally:
        gate.set()
        pool.close()
    again = Server(config, initial_weights=tiny_weights()).start(10)
    again.stop()
    again.wait(10)


def _reopen(config, strategy=None) -> None:  # type: ignore[no-untyped-def]
    """Open the folder's run as a (re)start does (round 0 committed the first time)."""
    from fedloom.server.persistence import RunPersistence
    from fedloom.strategies import build_strategy

    strategy = strategy or build_strategy(config.strategy, config.selection)
    RunPersistence.open(config, tiny_weights(), strategy).close()


def test_what_a_resume_may_and_may_not_change(tmp_path: Path) -> None:
    from fedloom.config import ServerConfig
    from fedloom.strategies import build_strategy

    base = ServerConfig(insecure=True, state_dir=tmp_path / "s", progress=False,  # a Path
                        strategy=StrategyConfig("fedadam", {}))
    _reopen(base)
    # The same aggregating class, however named or built: resumed.
    _reopen(dataclasses.replace(base, strategy=StrategyConfig("FedAdam", {"eta": 0.1})))
    _reopen(dataclasses.replace(base, strategy=StrategyConfig("fedavg", {})),
            strategy=build_strategy(base.strategy, base.selection))  # a Python object
    # An unused [privacy] table's fields: resumed.
    _reopen(dataclasses.replace(base, privacy=PrivacyConfig(noise_multiplier=2.0)))
    # Weaker secure-aggregation checks: refused.
    weaker = dataclasses.replace(base, secure_aggregation=dataclasses.replace(
        base.secure_aggregation, allow_unauthenticated=True))
    with pytest.raises(ConfigError, match=r"secure_aggregation\.allow_unauthenticated"):
        _reopen(weaker)
    # A resume refused for another reason (another model) leaves the record as it was.
    from fedloom.server.persistence import RunPersistence

    other_model = tiny_weights()
    other_model = type(other_model)({"w": np.zeros((5, 5), np.float32)})
    longer = dataclasses.replace(base, num_rounds=50)
    with pytest.raises(ConfigError, match="different model"):
        RunPersistence.open(longer, other_model, build_strategy(base.strategy, base.selection))
    store = RunStore(tmp_path / "s" / "fedloom.db", readonly=True)
    try:
        assert store.runs()[0].num_rounds == base.num_rounds
    finally:
        store.close()


def test_a_full_disk_at_a_commit_stops_the_server_with_a_clear_error(
        server_config, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    import sqlite3

    from fedloom.errors import CheckpointError, FedloomError

    real = RunStore.commit_round

    def full(self, record, clients=()):  # type: ignore[no-untyped-def]
        if record.round >= 1:
            raise sqlite3.OperationalError("database or disk is full")
        return real(self, record, clients)

    monkeypatch.setattr(RunStore, "commit_round", full)
    config = _one_client(server_config, num_rounds=2)
    handle = Server(config, initial_weights=tiny_weights()).start()
    pool = ClientThreads(handle.address, [GatedClient()])  # type: ignore[arg-type]
    try:
        with pytest.raises(CheckpointError, match=r"could not record round 1 in .*database "
                                                  r"or disk is full.*last committed round "
                                                  r"is 0.*it resumes from there"):
            handle.wait(30)
    finally:
        pool.close()
    assert issubclass(CheckpointError, FedloomError)  # `fedloom server`: one line, exit 2
