"""Top-k with error feedback over real gRPC: the residual is carried into the next update,
survives a restart of the client through its ``state_dir`` (and only through it), and
never leaves the device.

The reference top-k here is numpy's ``argsort`` of the magnitudes (not the codec's
``argpartition``); the residual follows the published rule ``e' = u + e - topk(u + e)``.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from compression_support import client_threads, rounds_committed
from helpers import ScriptedClient, small_weights

from fedloom import Weights
from fedloom.client_sdk._compression import FEEDBACK_FOLDER, UpdateEncoder
from fedloom.client_sdk.connection import Connection
from fedloom.compression import CodecSpec, encoded_bytes, encoded_layout
from fedloom.config import CompressionConfig
from fedloom.payload import deserialize
from fedloom.protos import codec
from fedloom.server import Server

FRACTION = 0.25
TOPK = CodecSpec("topk", fraction=FRACTION)


def _topk(values: np.ndarray) -> np.ndarray:
    """The largest ``ceil(FRACTION * n)`` magnitudes of ``values`` kept, the rest zero."""
    flat = values.reshape(-1)
    k = max(1, math.ceil(FRACTION * flat.size))
    out = np.zeros_like(flat)
    keep = np.argsort(-np.abs(flat), kind="stable")[:k]
    out[keep] = flat[keep]
    return out.reshape(values.shape)


class StopsAfterOneFit(ScriptedClient):
    """Trains once, then asks its loop to stop (the process "restarts" as a new one)."""

    def __init__(self, seed: int, num_examples: int) -> None:
        super().__init__(seed, num_examples)
        self.stop = threading.Event()

    def fit(self, weights, config):  # type: ignore[no-untyped-def]
        self.stop.set()  # checked after this task's result is pushed
        return super().fit(weights, config)


class _Pushes:
    """Every result header and payload the SDK pushed, by client thread."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[tuple[str, bytes, bytes]] = []
        real = Connection.push

        def recording(conn: Connection, result: Any, payload: Any) -> bool:
            self.sent.append((threading.current_thread().name,
                              codec.result_to_proto(result).SerializeToString(),
                              bytes(payload) if payload is not None else b""))
            return real(conn, result, payload)

        monkeypatch.setattr(Connection, "push", recording)

    def of(self, client: str) -> list[tuple[bytes, bytes]]:
        return [(h, p) for name, h, p in self.sent if name == client]


def test_the_residual_is_carried_across_a_client_restart_and_never_sent(
        server_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    pushes = _Pushes(monkeypatch)
    config = server_config(num_rounds=2, min_clients=4, min_fit_clients=3, keep_checkpoints=10,
                           fraction_evaluate=0.0,
                           compression=CompressionConfig(upload=("topk",),
                                                         topk_fraction=FRACTION))
    handle = Server(config, initial_weights=small_weights()).start()
    state = {"upload_codecs": ("topk",), "state_dir": str(tmp_path / "client")}
    first = StopsAfterOneFit(seed=7, num_examples=4)
    plain = {f"p{i}": (ScriptedClient(seed=i, num_examples=2 + i), {}) for i in range(3)}
    restarted = ScriptedClient(seed=8, num_examples=5)
    with client_threads(handle.address, plain), \
            client_threads(handle.address, {"A": (first, state)}, {"A": first.stop}):
        assert first.stop.wait(30)  # A trains round 1, then its process ends
        # The same device starts again with the same state_dir: a new runner and encoder,
        # joining while round 1 runs, so that round 2 samples it (it reads the residual
        # file at its first update, which A wrote before its round-1 push).
        with client_threads(handle.address, {"B": (restarted, state)}):
            history = handle.wait(60)
    assert [r.status for r in history] == ["ok", "ok"]
    assert history[1].num_updates == 4  # p0, p1, p2 and the restarted client
    assert len(list((tmp_path / "client" / FEEDBACK_FOLDER).glob("*.npz"))) == 1
    run_id = handle.server.coordinator.run_id

    specs = small_weights().specs()
    models = rounds_committed(config.state_dir)
    (_, received1, new1), = first.sent
    (_, received2, new2), = restarted.sent
    delta1 = {n: new1[n].astype(np.float64) - received1[n] for n in new1}
    sent1 = {n: _topk(delta1[n].astype(np.float32)).astype(np.float64) for n in delta1}
    residual1 = {n: (delta1[n] - sent1[n]).astype(np.float32) for n in delta1}
    corrected2 = {n: (new2[n].astype(np.float64) - received2[n] + residual1[n]).astype(np.float32)
                  for n in new2}
    sent2 = {n: _topk(corrected2[n]).astype(np.float64) for n in corrected2}
    residual2 = {n: (corrected2[n] - sent2[n]).astype(np.float32) for n in corrected2}
    for server_round, compressed, count in ((1, (first, sent1), 4), (2, (restarted, sent2), 4)):
        previous = models[server_round - 1]
        updates = [(c.num_examples, {n: w[n].astype(np.float64) - g[n] for n in w})
                   for c, _ in plain.values() for r, g, w in c.sent if r == server_round]
        updates.append((compressed[0].num_examples, compressed[1]))
        assert len(updates) == count
        total = sum(n for n, _ in updates)
        for name in previous:
            want = previous[name] + sum(n * d[name] for n, d in updates) / total
            np.testing.assert_allclose(models[server_round][name], want, rtol=1e-6, atol=1e-6)

    # What left the device: exactly k indices and values per tensor, none of them residual.
    layout = encoded_layout(TOPK.build(), specs)
    for client, residual in (("A", residual1), ("B", residual2)):
        (header, payload), = pushes.of(client)
        assert len(payload) == encoded_bytes(TOPK.build(), specs)
        parts = deserialize(layout, payload)
        for name, values in residual.items():
            hidden = values[values != 0]
            assert hidden.size  # top-k did leave something behind
            assert not np.isin(hidden, parts[f"{name}|val"]).any()
            assert hidden.tobytes() not in header + payload
    # The second process kept carrying it: its file now holds the round-2 residual.
    reloaded = UpdateEncoder(str(tmp_path / "client")).feedback(run_id, TOPK)
    for name in residual2:
        np.testing.assert_allclose(reloaded.residual[name], residual2[name], atol=1e-7)


def test_without_a_state_dir_a_restart_starts_from_zero() -> None:
    base = small_weights()
    new = Weights({n: a + np.arange(a.size, dtype=a.dtype).reshape(a.shape) + 1
                   for n, a in base.items()})
    encoder = UpdateEncoder()
    encoder.update("run-1", TOPK, new, base)
    assert np.abs(encoder.feedback("run-1", TOPK).residual["w"]).sum() > 0
    assert UpdateEncoder().feedback("run-1", TOPK).residual == {}  # in memory only


def test_a_new_run_starts_from_zero_and_drops_the_old_residual(tmp_path: Path) -> None:
    base = small_weights()
    new = Weights({n: a + 1 + np.arange(a.size, dtype=a.dtype).reshape(a.shape)
                   for n, a in base.items()})
    UpdateEncoder(str(tmp_path)).update("../../run-1", TOPK, new, base)
    files = list((tmp_path / FEEDBACK_FOLDER).iterdir())
    assert len(files) == 1 and files[0].parent == tmp_path / FEEDBACK_FOLDER  # a safe name
    restarted = UpdateEncoder(str(tmp_path))
    assert restarted.feedback("../../run-1", TOPK).residual  # carried over
    assert UpdateEncoder(str(tmp_path)).feedback("run-2", TOPK).residual == {}
    assert [p.name for p in (tmp_path / FEEDBACK_FOLDER).iterdir()] == []


def test_an_update_a_codec_cannot_carry_goes_plain() -> None:
    base = small_weights()
    huge = Weights({n: a + 1e6 for n, a in base.items()})  # beyond float16's range
    payload, info, used = UpdateEncoder().update("run-1", CodecSpec("fp16"), huge, base)
    assert used is None and info.specs == base.specs()
    np.testing.assert_array_equal(deserialize(info.specs, payload)["w"], huge["w"] - base["w"])


def test_a_residual_that_spoils_an_update_is_dropped_with_it() -> None:
    """A top-k update that cannot be encoded goes plain, and what error feedback carried
    into it is forgotten: the next update is encoded again (a residual that could never
    encode kept every later update plain)."""
    base = small_weights()
    new = Weights({n: a + 1 + np.arange(a.size, dtype=a.dtype).reshape(a.shape)
                   for n, a in base.items()})
    encoder = UpdateEncoder()
    encoder.update("run-1", TOPK, new, base)
    feedback = encoder.feedback("run-1", TOPK)
    feedback.residual["w"][0] = np.inf  # whatever made it so
    assert encoder.update("run-1", TOPK, new, base)[2] is None  # plain, this once
    assert feedback.residual == {}
    assert encoder.update("run-1", TOPK, new, base)[2] == TOPK  # top-k again
