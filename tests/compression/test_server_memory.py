"""The server never holds a whole decoded update: encoded uploads stay encoded on disk
(the spool, the asynchronous buffer), and every decode is of one tensor, dropped before
the next one is decoded."""

from __future__ import annotations

import sqlite3
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from compression_support import client_threads
from helpers import ScriptedClient

from fedloom import Weights
from fedloom.compression import CodecSpec, QuantizeCodec, decode, encode
from fedloom.config import CompressionConfig
from fedloom.payload import PayloadInfo, serialize
from fedloom.server import Server
from fedloom.server.async_buffer import DurableBuffer
from fedloom.server.store import RunStore

TENSORS = 8


class _LiveDecodes:
    """Counts decoded tensors still alive each time the server decodes another one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.most_alive = 0
        self._alive: list[weakref.ref[np.ndarray]] = []
        self._lock = threading.Lock()
        real = QuantizeCodec.decode_tensor

        def counting(codec: QuantizeCodec, parts: Any, spec: Any) -> np.ndarray:
            with self._lock:
                self._alive = [ref for ref in self._alive if ref() is not None]
                self.most_alive = max(self.most_alive, len(self._alive))
                self.calls += 1
            out = real(codec, parts, spec)
            with self._lock:
                self._alive.append(weakref.ref(out))
            return out

        monkeypatch.setattr(QuantizeCodec, "decode_tensor", counting)


def test_the_server_decodes_one_tensor_at_a_time(server_config,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    model = Weights({f"t{i}": np.zeros(5000, np.float32) for i in range(TENSORS)})
    config = server_config(num_rounds=1, min_clients=2, min_fit_clients=2, fraction_evaluate=0.0,
                           compression=CompressionConfig(upload=("q8",)))
    live = _LiveDecodes(monkeypatch)
    handle = Server(config, initial_weights=model).start()
    # One encoded client (the other sends plain), so that every decode is its update's.
    clients = {"q": (ScriptedClient(0, 3), {"upload_codecs": ("q8",)}),
               "plain": (ScriptedClient(1, 3), {})}
    with client_threads(handle.address, clients):
        assert handle.wait(60)[-1].status == "ok"
    # Each tensor decoded once, by the fold (the check before acceptance reads only the
    # parts: scales and codes), and when each decode began at most one earlier decoded
    # tensor was still referenced.
    assert live.calls == TENSORS
    assert live.most_alive <= 1


def _specs() -> Any:
    return Weights({"w": np.zeros((6, 5), np.float32), "n": np.zeros((), np.int64)}).specs()


def _encoded_update(spec: CodecSpec) -> tuple[Weights, Weights]:
    rng = np.random.default_rng(3)
    delta = Weights({"w": rng.normal(size=(6, 5)).astype(np.float32),
                     "n": np.array(4, np.int64)})
    return delta, encode(spec.build(), delta, rng)


def test_an_encoded_asynchronous_update_is_recovered_decoded_with_its_own_settings(
        tmp_path: Path) -> None:
    spec = CodecSpec("q4", block=7)
    _, encoded = _encoded_update(spec)
    payload = serialize(encoded)
    spool = tmp_path / "spool" / "upload-1.bin"
    spool.parent.mkdir()
    spool.write_bytes(payload)
    store = RunStore(tmp_path / "fedloom.db")
    store.create_run("run", 3, {})
    buffer = DurableBuffer(store, tmp_path, "run", _specs())
    kept = buffer.keep(1, "c1", 0, 5, {}, spool, PayloadInfo.describe(encoded.specs(), payload),
                       spec)
    # On disk: the encoded bytes, not a decoded update.
    assert (tmp_path / kept.row.path).stat().st_size == len(payload)
    store.close()
    store = RunStore(tmp_path / "fedloom.db")  # a restarted server
    (entry,) = DurableBuffer(store, tmp_path, "run", _specs()).recover(0)
    want = decode(spec.build(), _specs(), encoded)
    for name in want:
        np.testing.assert_array_equal(entry.update().delta[name], want[name])
        np.testing.assert_array_equal(kept.update().delta[name], want[name])
    store.close()


def test_a_store_written_before_compression_gains_the_codec_column(tmp_path: Path) -> None:
    path = tmp_path / "fedloom.db"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE buffered_updates (
            seq INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL,
            version INTEGER NOT NULL, client_id TEXT NOT NULL, base_round INTEGER NOT NULL,
            num_examples INTEGER NOT NULL, metrics TEXT NOT NULL, path TEXT NOT NULL,
            sha256 TEXT NOT NULL);
        INSERT INTO buffered_updates (run_id, version, client_id, base_round, num_examples,
            metrics, path, sha256) VALUES ('run', 1, 'c1', 0, 5, '{}', 'b/x.bin', 'ab');
    """)
    db.commit()
    db.close()
    store = RunStore(path)
    (row,) = store.buffered_updates("run")
    assert row.codec == ""  # an update of before: plain
    store.close()
