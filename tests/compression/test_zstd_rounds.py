"""The zstd stage over real gRPC on loopback: a lossless stage changes nothing the server
aggregates.

The same two rounds run twice with the same seeds (the SDK's stochastic rounding is
seeded per client thread here): once with q8 / fp16 and plain clients, once with the
zstd stage added to each (q8+zstd up, fp16+zstd down; zstd alone for the plain float32
client), beside a client that asks for nothing in both; in synchronous rounds, in
asynchronous ones, and under central DP (whose clip applies to the decoded update, the
same with or without the stage). The committed models must be equal bit for bit, the
compressed run must really have compressed (recorded on both sides), and chunks of
1 KiB make every payload span several chunks.
"""

from __future__ import annotations

import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from compression_support import client_threads, rounds_committed

from fedloom import Weights
from fedloom.client_sdk import Client, EvaluateOutput, FitOutput
from fedloom.client_sdk import _compression as client_compression
from fedloom.config import CompressionConfig, RoundsConfig, TransferConfig
from fedloom.privacy import PrivacyConfig
from fedloom.server import Server
from fedloom.server import model as server_model

TRANSFER = TransferConfig(chunk_size=1024, max_message_bytes=64 * 1024)


class SparseStep(Client):
    """Moves a seeded tenth of each tensor's values (a trained update's zeros are what
    zstd finds to squeeze); records the weights it received."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.received: list[Weights] = []

    def fit(self, weights: Weights, config: Any) -> FitOutput:
        self.received.append(weights.copy())
        new = {}
        for name, array in weights.items():
            step = self.rng.normal(size=array.shape).astype(array.dtype)
            step[self.rng.random(array.shape) > 0.1] = 0
            new[name] = array + step
        return FitOutput(Weights(new), 5, {})

    def evaluate(self, weights: Weights, config: Any) -> EvaluateOutput:
        return EvaluateOutput(0.0, 5, {})


def _model() -> Weights:
    return Weights({"w": np.zeros((48, 40), np.float32), "b": np.zeros(40, np.float32)})


class _Recorder:
    """Records, per client thread, every zstd frame the SDK made; seeds each client's
    stochastic rounding by its thread's name, so two runs draw the same codes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.frames: dict[str, list[int]] = {}
        self.broadcasts: list[int] = []
        real_init = client_compression.UpdateEncoder.__init__
        real = client_compression.compress

        def seeded(encoder: Any, state_dir: str = "") -> None:
            real_init(encoder, state_dir)
            name = threading.current_thread().name.encode()
            encoder._rng = np.random.default_rng(zlib.crc32(name))

        def recording(payload: Any) -> bytes | None:
            frame = real(payload)
            if frame is not None:
                self.frames.setdefault(threading.current_thread().name, []).append(len(frame))
            return frame

        def recording_broadcast(payload: Any) -> bytes | None:
            frame = real(payload)
            self.broadcasts.append(len(frame) if frame is not None else -1)
            return frame

        monkeypatch.setattr(client_compression.UpdateEncoder, "__init__", seeded)
        monkeypatch.setattr(client_compression, "compress", recording)
        monkeypatch.setattr(server_model, "compress", recording_broadcast)


def _run(server_config: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zstd: bool,
         names: tuple[str, ...], **settings: Any
         ) -> tuple[dict[int, Weights], dict[str, SparseStep], _Recorder]:
    stage = "+zstd" if zstd else ""
    config = server_config(
        num_rounds=2, keep_checkpoints=10, fraction_evaluate=0.0, transfer=TRANSFER,
        state_dir=str(tmp_path / ("zstd" if zstd else "plain")),
        compression=CompressionConfig(upload=("q8" + stage, "zstd") if zstd else ("q8",),
                                      download=("fp16" + stage, "zstd") if zstd else ("fp16",),
                                      quantize_block=32), **settings)
    recorder = _Recorder(monkeypatch)
    server = Server(config, initial_weights=_model())
    if config.privacy.mode == "central":
        server.strategy._rng = _NoNoise()  # type: ignore[attr-defined]
    handle = server.start()
    clients = {name: SparseStep(seed) for seed, name in enumerate(names)}
    asks: dict[str, dict[str, Any]] = {
        "q8": {"upload_codecs": ("q8" + stage,), "download_codecs": ("fp16" + stage,)},
        "plain": {"upload_codecs": ("zstd",), "download_codecs": ("zstd",)} if zstd else {},
        "old": {}}
    with client_threads(handle.address, {n: (c, {**asks[n], "transfer": TRANSFER})
                                         for n, c in clients.items()}):
        history = handle.wait(60)
    assert [r.num_updates for r in history if r.round > 0] == [len(names)] * 2
    return rounds_committed(config.state_dir), clients, recorder


def _equal(ours: Weights, theirs: Weights) -> None:
    assert list(ours) == list(theirs)
    for name in ours:
        assert np.asarray(ours[name]).tobytes() == np.asarray(theirs[name]).tobytes(), name


class _NoNoise:
    """The DP strategy's generator, without noise: its clipping is all that shows."""

    def normal(self, loc: float, scale: float, size: Any = None) -> Any:
        return np.zeros(size) if size is not None else 0.0


# How each run is set up: which clients, and the server's settings. Asynchronous rounds
# take one client (concurrency and buffer of one), so that every version is one update
# and both runs fold the same updates in the same order.
MODES: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "sync": (("q8", "plain", "old"), {}),
    "async": (("q8",), {"rounds": RoundsConfig(mode="async", concurrency=1, buffer_size=1),
                        "min_clients": 1, "min_fit_clients": 1}),
    "central-dp": (("q8", "plain", "old"), {"privacy": PrivacyConfig(
        mode="central", noise_multiplier=1.0, clip_norm=0.5, sampling="fixed")}),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_the_zstd_stage_leaves_every_aggregate_bit_identical(
        server_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:  # type: ignore[no-untyped-def]
    names, settings = MODES[mode]
    plain_models, plain_clients, plain_log = _run(server_config, tmp_path, monkeypatch, False,
                                                  names, **settings)
    monkeypatch.undo()
    models, clients, log = _run(server_config, tmp_path, monkeypatch, True, names, **settings)
    assert sorted(models) == sorted(plain_models) == [0, 1, 2]
    for version in models:
        _equal(models[version], plain_models[version])
    for name in clients:  # every client trained from the same broadcast in both runs
        # (the first two: an asynchronous client may start a third fit as the run ends)
        for ours, theirs in zip(clients[name].received[:2], plain_clients[name].received[:2],
                                strict=True):
            _equal(ours, theirs)
    # The stage was used where granted, and only there: q8 and plain float32 updates,
    # and both broadcasts (fp16 and plain), went as zstd frames.
    assert not plain_log.frames and not plain_log.broadcasts
    assert sorted(log.frames) == sorted({"q8", "plain"} & set(names))
    assert all(len(f) >= 2 for f in log.frames.values())
    # Each broadcast compressed once per model version and codec, not per client.
    downloads = 2 if "plain" in names else 1  # fp16, and plain float32
    assert len(log.broadcasts) in (2 * downloads, 3 * downloads)  # (+ an async 3rd version)
    assert min(log.broadcasts) > 0
    if mode != "async":
        assert len(log.broadcasts) == 2 * downloads


@pytest.mark.parametrize("inline", [True, False], ids=["report", "push"])
def test_a_compressed_update_is_decompressed_off_the_event_loop(
        server_config: Any, monkeypatch: pytest.MonkeyPatch, inline: bool) -> None:
    # A few compressed bytes may expand to the whole payload (an all-zero update of
    # tens of MiB in one chunk): on the event loop that would hold every other client's
    # calls; it is taken in by a worker thread.
    from fedloom.compression import ZstdReceiver

    threads: list[int] = []
    real = ZstdReceiver.feed

    def recording(receiver: ZstdReceiver, offset: int, data: bytes) -> None:
        threads.append(threading.get_ident())
        real(receiver, offset, data)

    monkeypatch.setattr(ZstdReceiver, "feed", recording)
    transfer = TransferConfig(chunk_size=1024, max_message_bytes=64 * 1024,
                              inline_payloads=inline)
    config = server_config(num_rounds=1, min_clients=2, min_fit_clients=2,
                           fraction_evaluate=0.0, transfer=transfer,
                           compression=CompressionConfig(upload=("zstd",)))
    handle = Server(config, initial_weights=_model()).start()
    clients = {f"c{i}": (SparseStep(i), {"upload_codecs": ("zstd",), "transfer": transfer})
               for i in range(2)}
    with client_threads(handle.address, clients):
        assert handle.wait(60)[-1].num_updates == 2
    loop_thread = handle.thread.ident
    assert threads and loop_thread is not None
    server_side = [t for t in threads if t != loop_thread]
    assert len(server_side) == len(threads)  # none on the server's event loop
