"""Checkpoints: state round trips exactly, and a torn or altered file is never loaded."""

from __future__ import annotations

import numpy as np
import pytest

from fedloom import CheckpointError, Weights
from fedloom.server.checkpoint import load_checkpoint, write_checkpoint


def test_round_trip_keeps_shapes_and_nested_state(tmp_path) -> None:
    weights = Weights(
        {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "steps": np.array(4, np.int64)}
    )
    state = {
        "sampler": {"seed": 3, "big": 2**100},
        "optimizer": {"m": {"steps": np.array(1.5)}, "history": [np.zeros((0, 2)), 1.0]},
    }
    path = tmp_path / "round-000001.safetensors"
    digest = write_checkpoint(
        path, run_id="r", server_round=1, weights=weights, strategy_state=state
    )
    loaded = load_checkpoint(path, digest)
    assert loaded.round == 1 and loaded.run_id == "r"
    assert list(loaded.weights) == ["w", "steps"]
    assert loaded.weights["steps"].shape == ()
    assert loaded.strategy_state["optimizer"]["m"]["steps"].shape == ()
    assert loaded.strategy_state["optimizer"]["history"][0].shape == (0, 2)
    assert loaded.strategy_state["sampler"] == {"seed": 3, "big": 2**100}


def test_altered_or_truncated_file_is_refused(tmp_path) -> None:
    path = tmp_path / "c.safetensors"
    digest = write_checkpoint(
        path,
        run_id="r",
        server_round=2,
        weights=Weights({"w": np.ones(100, np.float32)}),
        strategy_state={},
    )
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CheckpointError, match="torn or altered"):
        load_checkpoint(path, digest)
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="torn or altered"):
        load_checkpoint(path, digest)
    assert not list(tmp_path.glob(".*.tmp"))  # no temp file left behind
