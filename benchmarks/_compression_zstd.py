"""Part 4 of benchmarks/compression.py: what the lossless zstd stage adds after each codec.

On real trained updates — one client's first fit on the accuracy part's digits task
(its Dirichlet(0.5) share of 50, 2 local epochs of SGD, lr 0.05, momentum 0.9, batch 8,
from the seeded initial model), for the 64-64-10 and the 64-13500-10 MLP, and for
``clients`` clients — each codec's encoded payload is compressed as the SDK does it
(`fedloom.compression.compress`, zstd level 1) and decompressed as the server does it,
chunk by chunk (`fedloom.compression.ZstdReceiver`). The decoded update is asserted
bit-identical to the codec's own decode (the stage is lossless: the accuracy part's
figures hold unchanged). Reported: bytes before and after, the ratio (min-max over the
clients), and compress / decompress MB/s of the encoded payload on one thread (on the
larger model). The broadcast is measured the same way: the initial model, plain and
fp16 / bf16.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
from _compression_accuracy import LOCAL_EPOCHS, NUM_CLIENTS

#: The codecs of the upload table: (label, codec name, its settings).
UPLOADS = (("float32", "", {}), ("fp16", "fp16", {}), ("bf16", "bf16", {}),
           ("q8", "q8", {}), ("q4", "q4", {}), ("topk 1%", "topk", {"fraction": 0.01}))
DOWNLOADS = (("float32", "", {}), ("fp16", "fp16", {}), ("bf16", "bf16", {}))
CHUNK = 1 << 20  # the SDK's default chunk size


def trained_updates(hidden: int, clients: int, seed: int = 0) -> tuple[Any, list[Any]]:
    """The initial model and ``clients`` clients' first deltas on the digits task."""
    import torch

    from fedloom.simulations.datasets import load_digits
    from fedloom.simulations.models import initial_weights, make_mlp, make_torch_client
    from fedloom.simulations.partition import dirichlet_partition

    torch.set_num_threads(1)
    data = load_digits(seed=seed)
    parts = dirichlet_partition(data.y_train, NUM_CLIENTS, 0.5, seed, min_size=5)
    model = initial_weights(make_mlp(64, hidden, 10), seed)
    deltas = []
    for index in range(clients):
        rows = parts[index]
        client = make_torch_client(data.x_train[rows], data.y_train[rows], batch_size=8,
                                   local_epochs=LOCAL_EPOCHS, lr=0.05, momentum=0.9,
                                   seed=seed, hidden=hidden)
        fit = client.fit(model, {"seed": seed * 1000 + index})
        deltas.append(fit.weights.subtract(model))
    return model, deltas


def _timed(fn: Any, repeats: int) -> tuple[Any, float]:
    times, out = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - started)
    return out, statistics.median(times)


def _received(info: Any, frame: bytes) -> bytes:
    """``frame`` decompressed chunk by chunk through the receivers the server uses."""
    from fedloom.compression import ZstdReceiver
    from fedloom.compression._zstd import PIECE_BYTES
    from fedloom.payload import PayloadReceiver

    out = bytearray()

    class Sink:
        def write(self, data: bytes) -> None:
            out.extend(data)

    payload = PayloadReceiver(info.specs, info.total_bytes, info.sha256, Sink(),
                              max_chunk_bytes=PIECE_BYTES)
    receiver = ZstdReceiver(payload, len(frame), max_chunk_bytes=CHUNK)
    for offset in range(0, len(frame), CHUNK):
        receiver.feed(offset, frame[offset:offset + CHUNK])
    receiver.finish()
    return bytes(out)


def measure(weights: Any, name: str, settings: dict[str, Any], repeats: int = 1
            ) -> dict[str, Any]:
    """One payload (``weights`` encoded with codec ``name``, or plain) with and without
    zstd; asserts the round trip is bit-identical after the codec's decode."""
    from fedloom.compression import compress, decode, encode, make_codec
    from fedloom.payload import PayloadInfo, deserialize, serialize

    codec = make_codec(name, **settings) if name else None
    encoded = encode(codec, weights, np.random.default_rng(0)) if codec else weights
    payload = serialize(encoded)
    frame, compress_s = _timed(lambda: compress(payload), repeats)
    row = {"bytes": len(payload), "zstd_bytes": len(frame) if frame else len(payload),
           "compress_mb_s": len(payload) / 1e6 / compress_s}
    if frame is None:  # not smaller: the SDK sends it plain
        return {**row, "ratio": 1.0, "decompress_mb_s": None}
    info = PayloadInfo.describe(encoded.specs(), payload)
    back, decompress_s = _timed(lambda: _received(info, frame), repeats)
    assert back == bytes(payload), "zstd round trip changed the payload"
    if codec is not None:
        ours = decode(codec, weights.specs(), deserialize(encoded.specs(), back))
        theirs = decode(codec, weights.specs(), encoded)
        for tensor in ours:
            assert ours[tensor].tobytes() == theirs[tensor].tobytes(), tensor
    return {**row, "ratio": len(payload) / len(frame),
            "decompress_mb_s": len(payload) / 1e6 / decompress_s}


def run_zstd(hiddens: tuple[int, ...], clients: int, repeats: int) -> dict[str, Any]:
    """Both tables (see the module docstring), per model."""
    from threadpoolctl import threadpool_limits

    out: dict[str, Any] = {"clients": clients, "models": []}
    with threadpool_limits(1):
        for hidden in hiddens:
            model, deltas = trained_updates(hidden, clients)
            timing = repeats if hidden == max(hiddens) else 1
            rows = []
            for label, name, settings in UPLOADS:
                each = [measure(d, name, settings, timing if i == 0 else 1)
                        for i, d in enumerate(deltas)]
                rows.append({"label": label, "direction": "upload",
                             "bytes": each[0]["bytes"],
                             "zstd_bytes": statistics.mean(r["zstd_bytes"] for r in each),
                             "ratios": [r["ratio"] for r in each],
                             "compress_mb_s": each[0]["compress_mb_s"],
                             "decompress_mb_s": each[0]["decompress_mb_s"]})
            for label, name, settings in DOWNLOADS:
                row = measure(model, name, settings, timing)
                rows.append({**row, "label": label, "direction": "download",
                             "ratios": [row["ratio"]]})
            out["models"].append({"hidden": hidden, "params": model.nbytes // 4,
                                  "rows": rows, "timed": timing > 1})
            print(f"  zstd: 64-{hidden}-10 measured ({len(deltas)} updates)", flush=True)
    return out


def zstd_table(result: dict[str, Any]) -> str:
    """One row per direction and codec: bytes without / with zstd, ratio, speed."""
    models = result["models"]
    names = " / ".join(f"{m['params']:,}" for m in models)
    head = ["direction", "codec", f"bytes ({names} params)", "with zstd", "zstd x fewer",
            "compress / decompress MB/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    timed = next((m for m in models if m["timed"]), models[-1])
    for i, row in enumerate(models[0]["rows"]):
        cells = [row["direction"], row["label"],
                 " / ".join(f"{m['rows'][i]['bytes']:,}" for m in models),
                 " / ".join(f"{m['rows'][i]['zstd_bytes']:,.0f}" for m in models),
                 " / ".join(_ratios(m["rows"][i]["ratios"]) for m in models)]
        speed = timed["rows"][i]
        cells.append(f"{speed['compress_mb_s']:.0f} / {speed['decompress_mb_s']:.0f}"
                     if speed["decompress_mb_s"] else "- (not smaller: sent plain)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratios(ratios: list[float]) -> str:
    low, high = min(ratios), max(ratios)
    return f"{low:.2f}x" if high - low < 0.005 else f"{low:.2f}-{high:.2f}x"
