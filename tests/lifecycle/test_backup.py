"""``fedloom backup``: a state folder copied whole, beside a running server or not, and a
server restored from the copy resumes where the copy ends."""

from __future__ import annotations

import dataclasses
import io
import threading
from pathlib import Path

import numpy as np
import pytest
from lifecycle_support import ClientThreads, GatedClient, tiny_weights, wait_until

from fedloom import cli
from fedloom.errors import ConfigError
from fedloom.server import Server, load_weights
from fedloom.server.backup import backup_state
from fedloom.server.run_report import print_runs
from fedloom.server.store import RunStore


class _SecondFitWaits(GatedClient):
    """Trains round 1 at once, then waits for ``release``."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.release = release

    def fit(self, weights, config):  # type: ignore[no-untyped-def]
        if self.fits >= 1:
            self.release.wait(30.0)
        return super().fit(weights, config)


def _finished_run(server_config, **settings):  # type: ignore[no-untyped-def]
    """The config of a run with one client, run to its end."""
    config = server_config(min_clients=1, min_fit_clients=1, fraction_evaluate=0.0,
                           finished_grace_s=0.0, **settings)
    handle = Server(config, initial_weights=tiny_weights()).start()
    pool = ClientThreads(handle.address, [GatedClient()])  # type: ignore[arg-type]
    try:
        handle.wait(30)
    finally:
        pool.close()
    return config


def _runs_text(state_dir: Path) -> str:
    out = io.StringIO()
    print_runs(state_dir, out=out)
    return out.getvalue()


def test_a_backup_beside_a_running_server_restores_to_a_resumable_run(
        server_config, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = server_config(num_rounds=3, min_clients=1, min_fit_clients=1,
                           fraction_evaluate=0.0, finished_grace_s=0.0)
    release = threading.Event()
    handle = Server(config, initial_weights=tiny_weights()).start()
    pool = ClientThreads(handle.address, [_SecondFitWaits(release)])  # type: ignore[arg-type]
    copy = tmp_path / "backup"
    try:
        wait_until(lambda: bool(handle.server.coordinator
                                and handle.server.coordinator.history), 30)
        # Round 1 is committed, round 2 is training: the server holds the folder, and
        # its rounds may be only in the write-ahead log.
        report = backup_state(config.state_dir, copy)
        release.set()
        assert [r.status for r in handle.wait(30)] == ["ok"] * 3
    finally:
        release.set()
        pool.close()
    assert report.runs == 1 and report.checkpoints == 2  # rounds 0 and 1
    assert not list(tmp_path.glob(".backup*"))  # no staging folder left
    store = RunStore(copy / "fedloom.db", readonly=True)
    try:
        (run,) = store.runs()
        assert [r.round for r in store.rounds(run.run_id)] == [0, 1]
    finally:
        store.close()
    # Restored: a server on the copy resumes after round 1 and finishes the run.
    restored = dataclasses.replace(config, state_dir=str(copy))
    handle = Server(restored, initial_weights=tiny_weights()).start()
    pool = ClientThreads(handle.address, [GatedClient()])  # type: ignore[arg-type]
    try:
        assert [r.round for r in handle.wait(30)] == [1, 2, 3]
    finally:
        pool.close()


def test_a_finished_run_backs_up_with_its_model_and_reads_the_same(
        server_config, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    config = _finished_run(server_config, num_rounds=2)
    copy = tmp_path / "copy"
    assert cli.main(["backup", str(copy), "--state-dir", config.state_dir]) == 0
    assert "backed up 1 run(s), 3 checkpoint(s)" in capsys.readouterr().out
    assert _runs_text(copy) == _runs_text(Path(config.state_dir))
    (model,) = (copy / "models").glob("*.safetensors")
    original = load_weights(Path(config.state_dir) / "models" / model.name)
    assert all(np.array_equal(load_weights(model)[k], original[k]) for k in original)
    # A second backup to the same folder is refused; the first is untouched.
    assert cli.main(["backup", str(copy), "--state-dir", config.state_dir]) == 2
    assert "exists: name a new folder" in capsys.readouterr().err


def test_a_torn_newest_checkpoint_fails_the_backup_and_leaves_nothing(
        server_config, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = _finished_run(server_config, num_rounds=1)
    (newest,) = Path(config.state_dir).glob("checkpoints/*/round-000001.safetensors")
    with open(newest, "ab") as fh:
        fh.write(b"torn")
    with pytest.raises(ConfigError, match=r"round 1, .*\) fails its digest"):
        backup_state(config.state_dir, tmp_path / "copy")
    assert not (tmp_path / "copy").exists() and not list(tmp_path.glob(".copy*"))


def test_pruned_rounds_are_not_news_but_a_torn_older_one_is_reported(
        server_config, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = _finished_run(server_config, num_rounds=3, keep_checkpoints=2)
    kept = sorted(Path(config.state_dir).glob("checkpoints/*/round-*.safetensors"))
    assert [p.name for p in kept] == ["round-000002.safetensors", "round-000003.safetensors"]
    report = backup_state(config.state_dir, tmp_path / "first")
    assert (report.checkpoints, report.left_out) == (2, [])  # rounds 0 and 1 were pruned
    with open(kept[0], "ab") as fh:
        fh.write(b"torn")
    report = backup_state(config.state_dir, tmp_path / "second")
    assert report.checkpoints == 1
    assert len(report.left_out) == 1 and "round 2: fails its digest" in report.left_out[0]
