"""Atomic, verified checkpoints: global weights + strategy state in one safetensors file.

Write: temp file in the same folder, fsync, rename over the final name, fsync the
folder; the caller then records the file's SHA-256 in the run store. Load: the digest
is checked before anything is parsed, so a torn or tampered file is never loaded.

Layout of a checkpoint file:

- tensors ``weights/<name>`` — the global model, in order (order kept in metadata);
- tensors ``state/<i>`` — numpy arrays found in the strategy state;
- metadata ``fedloom`` — JSON: format version, run id, round, tensor order, and the
  strategy state with each array replaced by ``{"__array__": "state/<i>"}``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

from fedloom.errors import CheckpointError
from fedloom.server.crashpoints import crashpoint
from fedloom.weights import Weights

FORMAT_VERSION = 1
_ARRAY_KEY = "__array__"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _encode_state(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(value, np.ndarray):
        key = f"state/{len(arrays)}"
        arrays[key] = np.require(value, requirements="C")  # keeps 0-d arrays 0-d
        return {_ARRAY_KEY: key}
    if isinstance(value, Mapping):
        return {str(k): _encode_state(v, arrays) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encode_state(v, arrays) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise CheckpointError(f"strategy state holds a {type(value).__name__}, which cannot be saved")


def _decode_state(value: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    if isinstance(value, dict):
        if set(value) == {_ARRAY_KEY}:
            return arrays[value[_ARRAY_KEY]]
        return {k: _decode_state(v, arrays) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_state(v, arrays) for v in value]
    return value


def write_checkpoint(
    path: Path, *, run_id: str, server_round: int, weights: Weights, strategy_state: Any
) -> str:
    """Write atomically and return the file's SHA-256 (hex)."""
    arrays: dict[str, np.ndarray] = {}
    state_json = _encode_state(strategy_state, arrays)
    tensors = {f"weights/{name}": arr for name, arr in weights.items()}
    tensors.update(arrays)
    meta = {
        "format": FORMAT_VERSION,
        "run_id": run_id,
        "round": server_round,
        "weights": list(weights),
        "state": state_json,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"fedloom": json.dumps(meta)})
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        digest = file_sha256(tmp)
        crashpoint("checkpoint_temp_written")
        os.replace(tmp, path)
        fsync_dir(path.parent)
        crashpoint("checkpoint_renamed")
    except (OSError, SafetensorError) as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"could not write checkpoint {path}: {exc}") from exc
    return digest


class Checkpoint:
    """A loaded, verified checkpoint: ``run_id``, ``round`` (the round that committed
    it; 0 is the initial model), ``weights`` (the global model) and ``strategy_state``
    (the strategy's `state_dict`, arrays included)."""

    def __init__(self, run_id: str, server_round: int, weights: Weights, state: Any) -> None:
        self.run_id = run_id
        self.round = server_round
        self.weights = weights
        self.strategy_state = state


def load_checkpoint(path: Path, expected_sha256: str | None) -> Checkpoint:
    """Load and verify; raise `CheckpointError` for a missing, torn or altered file."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if expected_sha256 is not None:
        actual = file_sha256(path)
        if actual != expected_sha256:
            raise CheckpointError(
                f"checkpoint {path} fails its digest (file {actual[:12]}…, "
                f"recorded {expected_sha256[:12]}…): torn or altered; not loading it"
            )
    try:
        with safe_open(str(path), framework="numpy") as fh:
            meta_raw = (fh.metadata() or {}).get("fedloom")
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"checkpoint {path} is unreadable: {exc}") from exc
    if meta_raw is None:
        raise CheckpointError(f"{path} is not a fedloom checkpoint (no 'fedloom' metadata)")
    meta = json.loads(meta_raw)
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')} is not supported")
    try:
        weights = Weights((name, tensors[f"weights/{name}"]) for name in meta["weights"])
    except KeyError as exc:
        raise CheckpointError(f"{path}: tensor {exc} listed in metadata is missing") from exc
    state = _decode_state(meta["state"], tensors)
    return Checkpoint(meta["run_id"], int(meta["round"]), weights, state)


def save_weights(path: str | Path, weights: Weights) -> None:
    """Write bare weights (e.g. a server's initial model) atomically as safetensors.

    Raises:
        CheckpointError: the file cannot be written there (a folder of that name, a
            read-only or full filesystem); no temp file is left behind.
    """
    target = Path(path)
    if target.is_dir():
        raise CheckpointError(f"cannot write {target}: it is a folder; name a file")
    tmp = target.with_name(f".{target.name}.tmp")
    order = json.dumps(list(weights))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file(dict(weights.items()), str(tmp), metadata={"fedloom_order": order})
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)
    except (OSError, SafetensorError) as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        reason = getattr(exc, "strerror", None) or str(exc)
        raise CheckpointError(f"cannot write {target}: {reason}") from exc


def load_weights(path: str | Path) -> Weights:
    """The model in a safetensors file: one written by `save_weights` (a run's final
    model, an export) or by any tool, in saved order, or a round checkpoint's weights
    (without the strategy state it also holds).

    Raises:
        CheckpointError: no such file, or not a safetensors file (a PyTorch ``.pt``, say:
            the message says how to write one).
    """
    if not Path(path).is_file():
        raise CheckpointError(f"{path} does not exist")
    try:
        with safe_open(str(path), framework="numpy") as fh:
            metadata = fh.metadata() or {}
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(
            f"{path} is not a safetensors file ({exc}); write the model with "
            "fedloom.server.save_weights(path, weights) — from PyTorch, weights = "
            "fedloom.client_sdk.torch_trainer.state_dict_to_weights(model.state_dict()) — "
            "or safetensors.torch.save_file(model.state_dict(), path)") from exc
    if "fedloom" in metadata:  # a round checkpoint: its weights, not its strategy state
        return load_checkpoint(Path(path), None).weights
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"cannot read weights from {path}: {exc}") from exc
    order_raw = metadata.get("fedloom_order")
    order = json.loads(order_raw) if order_raw else sorted(tensors)
    return Weights((name, tensors[name]) for name in order)
