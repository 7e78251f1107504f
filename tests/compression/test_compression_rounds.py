"""Compressed rounds over real gRPC on loopback: real server, real client loops.

The reference for each round is computed here, independently of the server's decode
path: the kernel's `decode` applied to exactly the payloads the clients encoded (the SDK's
encoder is recorded), weighted as FedAvg weights them, added to the server's own previous
float32 model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from compression_support import EncodeLog, client_threads, rounds_committed
from helpers import ScriptedClient, small_weights

from fedloom import Weights
from fedloom.compression import CodecSpec, decode, encoded_bytes
from fedloom.config import CompressionConfig, RoundsConfig, StrategyConfig, TransferConfig
from fedloom.server import Server

Q8 = CodecSpec("q8", block=4)  # several blocks per tensor of the small model


def _fp16(weights: Weights) -> Weights:
    return Weights({n: np.asarray(a).astype(np.float16).astype(a.dtype)
                    for n, a in weights.items()})


def _decoded(entry: Any, specs: Any) -> Weights:
    return decode(entry.codec, specs, entry.encoded)


def test_q8_updates_and_an_fp16_broadcast_aggregate_to_the_mean_of_what_was_sent(
        server_config, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    config = server_config(num_rounds=2, keep_checkpoints=10, fraction_evaluate=0.0,
                           compression=CompressionConfig(upload=("q8",), download=("fp16",),
                                                         quantize_block=4))
    log = EncodeLog(monkeypatch)
    initial = Weights({"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3),
                       "b": np.array([0.1, 0.2, 0.3], np.float32)})
    handle = Server(config, initial_weights=initial).start()
    clients = {f"c{i}": ScriptedClient(seed=i, num_examples=10 * (i + 1)) for i in range(3)}
    asks = {"c0": {"upload_codecs": ("q8",), "download_codecs": ("fp16",)},
            "c1": {"upload_codecs": ("topk", "q8"), "download_codecs": ("fp16",)},
            "c2": {}}  # an old-style client: plain both ways
    with client_threads(handle.address, {n: (c, asks[n]) for n, c in clients.items()}):
        history = handle.wait(60)
    assert [r.status for r in history] == ["ok", "ok"]
    models = rounds_committed(config.state_dir)
    for server_round in (1, 2):
        previous = models[server_round - 1]
        total, acc = 0, {n: np.zeros(a.shape) for n, a in previous.items()}
        for name, client in clients.items():
            (received, new), = [(g, w) for r, g, w in client.sent if r == server_round]
            if name == "c2":
                assert received.allclose(previous, rtol=0, atol=0)  # plain float32
                delta = {n: new[n].astype(np.float64) - received[n] for n in new}
            else:
                # Trained from the fp16 broadcast of the server's own model.
                assert received.allclose(_fp16(previous), rtol=0, atol=0)
                assert not received.allclose(previous, rtol=0, atol=0)
                entry = log.of(name)[server_round - 1]
                assert isinstance(entry.codec, type(Q8.build()))
                # The delta was taken against the weights it trained from (decoded).
                assert entry.delta.allclose(new.subtract(received), rtol=0, atol=0)
                delta = {n: a.astype(np.float64) for n, a in
                         _decoded(entry, previous.specs()).items()}
            acc = {n: acc[n] + client.num_examples * delta[n] for n in acc}
            total += client.num_examples
        expected = {n: (previous[n] + acc[n] / total).astype(np.float32) for n in previous}
        got = models[server_round]
        for n in expected:
            np.testing.assert_allclose(got[n], expected[n], rtol=1e-6, atol=1e-6, err_msg=n)
    assert len(log.of("c0")) == len(log.of("c1")) == 2 and not log.of("c2")


def test_the_size_limits_count_encoded_bytes(server_config) -> None:  # type: ignore[no-untyped-def]
    # A float32 model of 16 KiB; limits of 10 KiB on both sides: only fp16 down (8 KiB)
    # and q8 up (about 4 KiB) fit. The plain client cannot even take its task.
    model = Weights({"w": np.zeros(4096, np.float32)})
    transfer = TransferConfig(chunk_size=1024, max_message_bytes=64 * 1024,
                              max_model_bytes=10 * 1024)
    config = server_config(num_rounds=1, min_clients=3, min_fit_clients=2, over_selection=1.0,
                           round_timeout_s=15.0, fraction_evaluate=0.0, transfer=transfer,
                           compression=CompressionConfig(upload=("q8",), download=("fp16",)))
    assert encoded_bytes(CodecSpec("q8", block=256).build(), model.specs()) < 10 * 1024
    handle = Server(config, initial_weights=model).start()
    squeezed = {"upload_codecs": ("q8",), "download_codecs": ("fp16",), "transfer": transfer}
    clients = {"c0": (ScriptedClient(0, 5), squeezed), "c1": (ScriptedClient(1, 5), squeezed),
               "plain": (ScriptedClient(2, 5), {"transfer": transfer})}
    with client_threads(handle.address, clients):
        history = handle.wait(60)
    assert history[-1].status == "ok" and history[-1].num_updates == 2
    assert not clients["plain"][0].sent  # its client refused the 16 KiB model


@pytest.mark.parametrize("strategy", [
    StrategyConfig("fedmedian"), StrategyConfig("fedavg", {"max_update_norm": 0.5})])
def test_robust_rules_and_the_norm_bound_see_decoded_updates(
        server_config, monkeypatch: pytest.MonkeyPatch, strategy: StrategyConfig) -> None:  # type: ignore[no-untyped-def]
    config = server_config(num_rounds=1, fraction_evaluate=0.0, strategy=strategy,
                           compression=CompressionConfig(upload=("q4",), quantize_block=8))
    log = EncodeLog(monkeypatch)
    handle = Server(config, initial_weights=small_weights()).start()
    clients = {f"c{i}": ScriptedClient(seed=i, num_examples=7) for i in range(3)}
    with client_threads(handle.address,
                        {n: (c, {"upload_codecs": ("q4",)}) for n, c in clients.items()}):
        assert handle.wait(60)[-1].status == "ok"
    specs = small_weights().specs()
    deltas = [_decoded(log.of(name)[0], specs) for name in clients]
    if strategy.name == "fedmedian":
        expected = {n: np.median([d[n] for d in deltas], axis=0) for n in deltas[0]}
    else:  # each decoded update clipped to the bound on the server, then averaged
        clipped = []
        for d in deltas:
            norm = np.sqrt(sum(float(np.sum(np.asarray(a, np.float64) ** 2)) for a in d.values()))
            clipped.append({n: np.asarray(a, np.float64) * min(1.0, 0.5 / norm)
                            for n, a in d.items()})
        expected = {n: np.mean([c[n] for c in clipped], axis=0) for n in clipped[0]}
    got = rounds_committed(config.state_dir)[1]
    for n in expected:
        np.testing.assert_allclose(got[n], expected[n], rtol=1e-5, atol=1e-6, err_msg=n)


def test_asynchronous_rounds_take_encoded_updates(server_config,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    # One client, buffer of one: every version is the last one plus its decoded update.
    config = server_config(num_rounds=3, min_clients=1, min_fit_clients=1, keep_checkpoints=10,
                           fraction_evaluate=0.0,
                           rounds=RoundsConfig(mode="async", concurrency=1, buffer_size=1),
                           compression=CompressionConfig(upload=("q8",), download=("bf16",),
                                                         quantize_block=4))
    log = EncodeLog(monkeypatch)
    handle = Server(config, initial_weights=small_weights()).start()
    client = ScriptedClient(seed=4, num_examples=3)
    with client_threads(handle.address, {"c0": (client, {"upload_codecs": ("q8",),
                                                          "download_codecs": ("bf16",)})}):
        assert [r.num_updates for r in handle.wait(60)] == [1, 1, 1]
    models = rounds_committed(config.state_dir)
    for version in (1, 2, 3):
        entry = log.of("c0")[version - 1]
        delta = _decoded(entry, small_weights().specs())
        for n in delta:
            np.testing.assert_allclose(models[version][n], models[version - 1][n] + delta[n],
                                       rtol=1e-6, atol=1e-6)


class _NoNoise:
    """Stands in for the DP strategy's generator: the noise is zero, so the clipping of
    what the server aggregates is all that moves the model."""

    def normal(self, loc: float, scale: float, size: Any = None) -> Any:
        return np.zeros(size) if size is not None else 0.0


def test_central_privacy_clips_the_decoded_update_on_the_server(
        server_config, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from fedloom.privacy import PrivacyConfig

    clip = 0.5
    config = server_config(num_rounds=1, fraction_evaluate=0.0,
                           privacy=PrivacyConfig(mode="central", noise_multiplier=1.0,
                                                 clip_norm=clip, sampling="fixed"),
                           compression=CompressionConfig(upload=("q8",), quantize_block=4))
    log = EncodeLog(monkeypatch)
    server = Server(config, initial_weights=small_weights())
    server.strategy._rng = _NoNoise()  # type: ignore[attr-defined]
    handle = server.start()
    clients = {f"c{i}": ScriptedClient(seed=i, num_examples=9) for i in range(3)}
    with client_threads(handle.address,
                        {n: (c, {"upload_codecs": ("q8",)}) for n, c in clients.items()}):
        assert handle.wait(60)[-1].status == "ok"
    specs = small_weights().specs()
    total: dict[str, np.ndarray] = {}
    for name in clients:  # ScriptedClient does not clip: only the server's clip bounds it
        delta = _decoded(log.of(name)[0], specs)
        norm = np.sqrt(sum(float(np.sum(np.asarray(a, np.float64) ** 2)) for a in delta.values()))
        assert norm > clip
        for n, a in delta.items():
            total[n] = total.get(n, 0) + np.asarray(a, np.float64) * (clip / norm)
    got = rounds_committed(config.state_dir)[1]
    for n in total:  # the sum over the expected number of clients (3), added to zeros
        np.testing.assert_allclose(got[n], total[n] / 3, rtol=1e-5, atol=1e-6)
