"""Getting the model out: the final model file at the end of a run, ``fedloom export``
for any kept round, `load_weights` on anything a user may hand it, `Server.weights`."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ScriptedClient, run_clients, small_weights

from fedloom.cli import main
from fedloom.errors import CheckpointError, ConfigError
from fedloom.server import Server, load_weights
from fedloom.server.checkpoint import load_checkpoint
from fedloom.server.export import export_model
from fedloom.server.store import RunStore


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Server, str]:
    from fedloom.config import ServerConfig

    state = tmp_path_factory.mktemp("run") / "state"
    config = ServerConfig(address="127.0.0.1:0", num_rounds=4, min_clients=2,
                          min_fit_clients=2, state_dir=str(state), progress=False,
                          long_poll_s=2.0, heartbeat_interval_s=0.5, client_timeout_s=5.0,
                          keep_checkpoints=2, insecure=True)
    server = Server(config, initial_weights=small_weights())
    handle = server.start()
    threads = run_clients(handle.address, [ScriptedClient(seed=i, num_examples=5)
                                           for i in range(2)])
    handle.wait(60)
    for t in threads:
        t.join(10)
    store = RunStore(state / "fedloom.db")
    run_id = store.runs()[-1].run_id
    store.close()
    return state, server, run_id


def _round(state: Path, run_id: str, server_round: int) -> dict[str, np.ndarray]:
    store = RunStore(state / "fedloom.db")
    try:
        row = {r.round: r for r in store.rounds(run_id)}[server_round]
    finally:
        store.close()
    return dict(load_checkpoint(state / row.checkpoint, row.sha256).weights.items())


def test_the_run_writes_its_final_model_as_plain_safetensors(finished_run) -> None:  # type: ignore[no-untyped-def]
    state, server, run_id = finished_run
    final = load_weights(state / "models" / f"{run_id}.safetensors")
    assert list(final) == list(small_weights())  # the model's names and order, nothing else
    want = _round(state, run_id, 4)
    for name in want:
        np.testing.assert_array_equal(final[name], want[name])
    assert server.weights is not None
    for name in want:
        np.testing.assert_array_equal(server.weights[name], want[name])


def test_export_writes_any_kept_round(finished_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    state, _, run_id = finished_run
    out = tmp_path / "r3.safetensors"
    assert main(["export", "--state-dir", str(state), "--round", "3", "--out", str(out)]) == 0
    exported = load_weights(out)
    for name, value in _round(state, run_id, 3).items():
        np.testing.assert_array_equal(exported[name], value)
    assert export_model(state, tmp_path / "last.safetensors", run_id[:8]) == (run_id, 4)


def test_export_says_which_rounds_are_kept(finished_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    state, _, _ = finished_run
    with pytest.raises(ConfigError, match=r"round 1 is no longer kept .* rounds kept: \[3, 4\]"):
        export_model(state, tmp_path / "x.safetensors", server_round=1)
    with pytest.raises(ConfigError, match="no committed round 9"):
        export_model(state, tmp_path / "x.safetensors", server_round=9)
    with pytest.raises(ConfigError, match="holds no fedloom run database"):
        export_model(tmp_path, tmp_path / "x.safetensors")
    assert main(["export", "--state-dir", str(tmp_path), "--out", str(tmp_path / "y")]) == 2


def test_load_weights_of_a_checkpoint_is_the_model_alone(finished_run) -> None:  # type: ignore[no-untyped-def]
    state, _, run_id = finished_run
    store = RunStore(state / "fedloom.db")
    row = store.rounds(run_id)[-1]
    store.close()
    weights = load_weights(state / row.checkpoint)
    assert list(weights) == list(small_weights())  # no "weights/..." or "state/..." names


def test_a_pytorch_file_is_refused_with_how_to_write_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(3, 2).state_dict(), path)
    assert zipfile.is_zipfile(path)
    with pytest.raises(CheckpointError, match=r"is not a safetensors file .*save_weights"):
        load_weights(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_weights(tmp_path / "missing.safetensors")
