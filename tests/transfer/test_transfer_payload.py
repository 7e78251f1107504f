"""Payload helpers of the transfer path: the one-pass delta serializer."""

from __future__ import annotations

import numpy as np
import pytest

from fedloom import Weights
from fedloom.payload import deserialize, serialize, serialize_difference


def _weights(rng: np.random.Generator) -> Weights:
    tensors: dict[str, np.ndarray] = {
        "w": rng.normal(size=(3, 4)).astype(np.float32),
        "h": rng.normal(size=5).astype(np.float16),
        "d": rng.normal(size=2),
        "steps": np.array(int(rng.integers(0, 100)), np.int64),
        "u": rng.integers(0, 200, size=3).astype(np.uint8),
        "empty": np.zeros((0, 2), np.float32),
    }
    return Weights(tensors)


def test_serialize_difference_is_serialize_of_subtract() -> None:
    rng = np.random.default_rng(0)
    old, new = _weights(rng), _weights(rng)
    want = serialize(new.subtract(old))
    got = serialize_difference(new, old)
    assert bytes(got) == bytes(want)  # same bytes, integer wrap-around included
    assert got.readonly
    back = deserialize(new.specs(), got)
    assert back.allclose(new.subtract(old), rtol=0, atol=0)


def test_serialize_difference_refuses_another_layout() -> None:
    rng = np.random.default_rng(1)
    new = _weights(rng)
    other = Weights({"w": np.zeros((3, 4), np.float32)})
    with pytest.raises(ValueError, match="missing"):
        serialize_difference(new, other)
