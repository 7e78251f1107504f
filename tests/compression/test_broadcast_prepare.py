"""Where the encoded and compressed broadcast of a model version is built: in a worker
thread, before the version reaches task delivery, never on the server's event loop; and
the bytes sent are what the codec and zstd make of the model (independent references:
numpy's casts and zstandard itself), for the sessions that held their grant when the
version was published and for one that joined afterwards.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

import numpy as np
import pytest
import zstandard
from compression_support import client_threads, rounds_committed

from fedloom import Weights
from fedloom.client_sdk import Client, EvaluateOutput, FitOutput
from fedloom.compression import CodecSpec
from fedloom.config import CompressionConfig, RoundsConfig
from fedloom.messages import TaskHeader
from fedloom.server import Server, ServerHandle
from fedloom.server import model as server_model
from fedloom.server import servicer as server_servicer
from fedloom.server.model import Broadcast
from fedloom.types import TaskKind


def _model() -> Weights:
    return Weights({"w": np.zeros((48, 40), np.float32), "b": np.zeros(40, np.float32)})


class _RowStep(Client):
    """Moves only the first row of ``w``: every version stays mostly zeros, so each
    payload's zstd frame is smaller than it (and is what goes out). Records the
    weights it trained from."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.sent: list[tuple[int, Weights]] = []  # (round, weights received)

    def fit(self, weights: Weights, config: Any) -> FitOutput:
        self.sent.append((int(config["server_round"]), weights.copy()))
        w = np.array(weights["w"])
        w[0] += self.rng.normal(size=w.shape[1]).astype(np.float32)
        return FitOutput(Weights({"w": w, "b": np.asarray(weights["b"])}), 10, {})

    def evaluate(self, weights: Weights, config: Any) -> EvaluateOutput:
        return EvaluateOutput(0.0, 10, {})


def _fp16_bytes(weights: Weights) -> bytes:
    return b"".join(np.asarray(a, np.float32).astype(np.float16).tobytes()
                    for a in weights.values())


def _plain_bytes(weights: Weights) -> bytes:
    return b"".join(np.asarray(a).tobytes() for a in weights.values())


def _bf16_bytes(weights: Weights) -> bytes:
    """bfloat16 by hand: float32's top 16 bits, rounded to nearest even (finite values)."""
    out = []
    for array in weights.values():
        bits = np.asarray(array, np.float32).view(np.uint32).astype(np.uint64)
        out.append(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes())
    return b"".join(out)


def _frame(payload: bytes) -> bytes | None:
    """What zstd level 1 makes of ``payload``; None where it would not be smaller."""
    frame = zstandard.ZstdCompressor(level=1).compress(payload)
    return frame if len(frame) < len(payload) else None


def _sha(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


class _Spy:
    """Records the thread of every encode and compress of the server's broadcast, and
    the header and digest of every task payload the servicer writes to a stream."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.builds: list[tuple[str, int]] = []
        self.sent: list[tuple[TaskHeader, bytes]] = []
        self._lock = threading.Lock()
        encode, compress = server_model.encode, server_model.compress
        send_task = server_servicer.send_task

        def recording_encode(*args: Any) -> Any:
            self._record("encode")
            return encode(*args)

        def recording_compress(payload: Any) -> Any:
            self._record("compress")
            return compress(payload)

        async def recording_send(context: Any, task: Any, *args: Any) -> bool:
            header, payload = task
            with self._lock:
                self.sent.append((header, _sha(payload)))
            return await send_task(context, task, *args)

        monkeypatch.setattr(server_model, "encode", recording_encode)
        monkeypatch.setattr(server_model, "compress", recording_compress)
        monkeypatch.setattr(server_servicer, "send_task", recording_send)

    def _record(self, what: str) -> None:
        with self._lock:
            self.builds.append((what, threading.get_ident()))

    def threads(self, what: str) -> list[int]:
        with self._lock:
            return [ident for name, ident in self.builds if name == what]


def _version(header: TaskHeader) -> int:
    """The model version a task carries: a fit trains the previous round's model."""
    return header.round - 1 if header.kind is TaskKind.FIT else header.round


def _check_sent(spy: _Spy, models: dict[int, Weights], codec: str | None, zstd: bool,
                reference: Any) -> set[tuple[str, int]]:
    """Every payload sent with ``codec`` (and the stage) is the reference's bytes of its
    version, as a zstd frame for the stage; the tasks checked, as (kind, round)."""
    checked = set()
    for header, sent_digest in spy.sent:
        used = header.codec.name if header.codec is not None else None
        if used != codec or bool(header.weights.wire_bytes) != zstd:
            continue
        payload = reference(models[_version(header)])
        frame = _frame(payload) if zstd else None
        assert (frame is not None) == zstd  # (_RowStep keeps every version compressible)
        assert header.weights.sha256 == _sha(payload)
        assert header.weights.total_bytes == len(payload)
        assert sent_digest == _sha(frame if frame is not None else payload)
        assert header.weights.wire_bytes == (len(frame) if frame is not None else 0)
        checked.add((str(header.kind), header.round))
    return checked


ASYNC = {"rounds": RoundsConfig(mode="async", concurrency=1, buffer_size=1),
         "min_clients": 1, "min_fit_clients": 1}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_broadcast_of_each_version_is_built_off_the_event_loop(
        server_config, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:  # type: ignore[no-untyped-def]
    settings: dict[str, Any] = ASYNC if mode == "async" else {"min_clients": 2,
                                                             "min_fit_clients": 2}
    config = server_config(num_rounds=2, keep_checkpoints=10,
                           compression=CompressionConfig(download=("fp16+zstd", "zstd")),
                           **settings)
    spy = _Spy(monkeypatch)
    handle = Server(config, initial_weights=_model()).start()
    asks = {"fp16": {"download_codecs": ("fp16+zstd",)}, "zstd": {"download_codecs": ("zstd",)}}
    names = ["fp16"] if mode == "async" else ["fp16", "zstd"]
    with client_threads(handle.address, {n: (_RowStep(i), asks[n])
                                         for i, n in enumerate(names)}):
        history = handle.wait(60)
    assert [r.status for r in history if r.round > 0] == ["ok", "ok"]
    encodes, compresses = spy.threads("encode"), spy.threads("compress")
    # Versions 0, 1 and 2 (2 for the last round's evaluation): the fp16 encode once
    # each, zstd once per version and grant.
    assert len(encodes) == 3
    assert len(compresses) == 3 * len(names)
    loop_thread = handle.thread.ident
    assert loop_thread is not None and loop_thread not in encodes + compresses


def test_the_bytes_sent_are_the_codec_and_zstd_of_the_model(
        server_config, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    config = server_config(num_rounds=2, keep_checkpoints=10,
                           compression=CompressionConfig(download=("fp16+zstd", "fp16",
                                                                   "zstd")))
    spy = _Spy(monkeypatch)
    handle = Server(config, initial_weights=_model()).start()
    asks = {"fp16+zstd": ("fp16+zstd",), "fp16": ("fp16",), "zstd": ("zstd",)}
    clients = {name: _RowStep(i) for i, name in enumerate(asks)}
    with client_threads(handle.address, {n: (c, {"download_codecs": asks[n]})
                                         for n, c in clients.items()}):
        history = handle.wait(60)
    assert [r.status for r in history if r.round > 0] == ["ok", "ok"]
    models = rounds_committed(config.state_dir)
    # 2 fit and 2 evaluate tasks per client: versions 0, 1 (fit), 1, 2 (evaluate).
    every = {(kind, r) for kind in ("fit", "evaluate") for r in (1, 2)}
    assert _check_sent(spy, models, "fp16", True, _fp16_bytes) == every
    assert _check_sent(spy, models, "fp16", False, _fp16_bytes) == every
    assert _check_sent(spy, models, None, True, _plain_bytes) == every
    # And the clients trained from those bytes, decoded.
    for name, client in clients.items():
        assert [r for r, _ in client.sent] == [1, 2]
        for server_round, received in client.sent:
            model = models[server_round - 1]
            want = (model if name == "zstd" else
                    Weights({n: np.asarray(a).astype(np.float16).astype(np.float32)
                             for n, a in model.items()}))
            assert received.allclose(want, rtol=0, atol=0)


class _Holding(_RowStep):
    """Holds its ``kind`` task of round ``held`` until ``release`` is set (after
    ``holding``)."""

    def __init__(self, seed: int, kind: str, held: int) -> None:
        super().__init__(seed)
        self.kind, self.held = kind, held
        self.holding, self.release = threading.Event(), threading.Event()

    def _hold(self, kind: str, config: Any) -> None:
        if kind == self.kind and int(config["server_round"]) == self.held:
            self.holding.set()
            assert self.release.wait(30)

    def fit(self, weights: Weights, config: Any) -> FitOutput:
        self._hold("fit", config)
        return super().fit(weights, config)

    def evaluate(self, weights: Weights, config: Any) -> EvaluateOutput:
        self._hold("evaluate", config)
        return super().evaluate(weights, config)


def _connected(handle: ServerHandle) -> int:
    coordinator = handle.server.coordinator
    return len(coordinator.registry) if coordinator is not None else 0


def test_a_session_that_joins_after_a_version_is_published_gets_its_broadcast(
        server_config, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    # Version 1 is published while only "first" (fp16+zstd) is connected; "late" joins
    # during round 1's evaluation, granted bf16+zstd, which no session held then, and
    # trains version 1 in round 2.
    config = server_config(num_rounds=2, keep_checkpoints=10, min_clients=1,
                           min_fit_clients=1,
                           compression=CompressionConfig(download=("fp16+zstd", "bf16+zstd")))
    spy = _Spy(monkeypatch)
    handle = Server(config, initial_weights=_model()).start()
    first, late = _Holding(0, "evaluate", 1), _RowStep(1)
    with client_threads(handle.address,
                        {"first": (first, {"download_codecs": ("fp16+zstd",)})}):
        assert first.holding.wait(30)
        with client_threads(handle.address,
                            {"late": (late, {"download_codecs": ("bf16+zstd",)})}):
            deadline = time.monotonic() + 30
            while _connected(handle) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _connected(handle) == 2
            first.release.set()
            history = handle.wait(60)
    assert [r.status for r in history if r.round > 0] == ["ok", "ok"]
    models = rounds_committed(config.state_dir)
    # Round 2's fit (version 1) and evaluation (version 2) to the late session.
    assert _check_sent(spy, models, "bf16", True, _bf16_bytes) == {("fit", 2),
                                                                    ("evaluate", 2)}
    (server_round, received), = late.sent
    assert server_round == 2
    want = np.frombuffer(_bf16_bytes(models[1]), np.uint16).astype(np.uint32) << 16
    assert np.concatenate([np.ravel(a) for a in received.values()]).view(np.uint32) \
        .tolist() == want.tolist()
    # Its encoding was built when round 2 began, in the worker thread like the others.
    loop_thread = handle.thread.ident
    assert loop_thread not in spy.threads("encode") + spy.threads("compress")


def test_concurrent_first_uses_build_each_piece_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    encode, compress = server_model.encode, server_model.compress

    def slow_encode(*args: Any) -> Any:
        calls.append("encode")
        time.sleep(0.05)  # long enough for every thread to arrive while it runs
        return encode(*args)

    def counted_compress(payload: Any) -> Any:
        calls.append("compress")
        return compress(payload)

    monkeypatch.setattr(server_model, "encode", slow_encode)
    monkeypatch.setattr(server_model, "compress", counted_compress)
    broadcast = Broadcast(_model(), 0)
    fp16 = CodecSpec("fp16")
    results: list[Any] = []
    start = threading.Barrier(8)

    def first_use() -> None:
        start.wait()
        results.append(broadcast.select(fp16, True))

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(calls) == ["compress", "encode"]
    assert len(results) == 8 and all(r[1] is results[0][1] for r in results)
    assert broadcast.ready((fp16, True)) and not broadcast.ready((CodecSpec("bf16"), False))
    info, payload, used = results[0]
    assert used == fp16 and bytes(payload) == _frame(_fp16_bytes(_model()))
    assert info.sha256 == _sha(_fp16_bytes(_model()))


def test_an_async_session_that_joins_mid_version_gets_a_broadcast_built_off_the_loop(
        server_config, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    # Version 1 is current and "first" (fp16+zstd) is training it; "late" joins granted
    # bf16+zstd, which no session held when version 1 was published. It is given a task
    # on version 1 once its broadcast is built, in the worker thread.
    config = server_config(num_rounds=3, keep_checkpoints=10, min_clients=1,
                           min_fit_clients=1,
                           rounds=RoundsConfig(mode="async", concurrency=2, buffer_size=1),
                           compression=CompressionConfig(download=("fp16+zstd", "bf16+zstd")))
    spy = _Spy(monkeypatch)
    handle = Server(config, initial_weights=_model()).start()
    first, late = _Holding(0, "fit", 2), _RowStep(1)  # first holds version 1
    with client_threads(handle.address,
                        {"first": (first, {"download_codecs": ("fp16+zstd",)})}):
        assert first.holding.wait(30)
        with client_threads(handle.address,
                            {"late": (late, {"download_codecs": ("bf16+zstd",)})}):
            deadline = time.monotonic() + 20
            while not late.sent and time.monotonic() < deadline:
                time.sleep(0.02)
            trained = bool(late.sent)
            first.release.set()
            history = handle.wait(60)
    assert trained, "the late session got no task while version 1 was current"
    assert [r.status for r in history if r.round > 0] == ["ok", "ok", "ok"]
    models = rounds_committed(config.state_dir)
    server_round, received = late.sent[0]
    assert server_round == 2  # trained version 1, the version current when it joined
    assert ("fit", 2) in _check_sent(spy, models, "bf16", True, _bf16_bytes)
    want = np.frombuffer(_bf16_bytes(models[1]), np.uint16).astype(np.uint32) << 16
    assert np.concatenate([np.ravel(a) for a in received.values()]).view(np.uint32) \
        .tolist() == want.tolist()
    loop_thread = handle.thread.ident
    assert loop_thread is not None
    assert loop_thread not in spy.threads("encode") + spy.threads("compress")
