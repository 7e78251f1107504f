"""Small uploads held in memory (`fedloom.server.upload_memory`) against the spool file.

Each upload goes through the server's own receive path (`Spool`: chunks, digest,
finite check); a test's own `UploadMemory` decides which path it takes: a budget of 0
bytes sends every upload to a file. The two paths must be indistinguishable to their
consumers: the same tensors, the same block reads, the same aggregate bit for bit, the
same refusals; and the budget must come back whichever way an upload ends.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import random_weights

from fedloom import ClientUpdate, Weights
from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.payload import DEFAULT_CHUNK_SIZE, PayloadInfo, iter_chunks, serialize
from fedloom.server.upload_memory import MAX_HELD_BYTES, UploadMemory
from fedloom.server.uploads import HeldWeights, Spool, SpooledWeights
from fedloom.strategies import FedAvg

CHUNK = 4096
SHAPES = {
    "conv": ((3, 4, 5), np.float32),
    "half": ((9,), np.float16),
    "wide": ((6,), np.float64),
    "steps": ((), np.int64),
    "count": ((4,), np.int32),
    "empty": ((0, 3), np.float32),
}


def make_weights(rng: np.random.Generator) -> Weights:
    return random_weights(SHAPES, rng)


def start(folder: Path, weights: Weights, memory: UploadMemory, *, sha256: bytes | None = None,
          chunk: int = CHUNK) -> tuple[Spool, bytes]:
    payload = bytes(serialize(weights))
    info = PayloadInfo.describe(weights.specs(), payload)
    if sha256 is not None:
        info = PayloadInfo(info.specs, info.total_bytes, sha256)
    return Spool(folder, info, chunk, memory=memory), payload


def receive(folder: Path, weights: Weights, memory: UploadMemory, *,
            piece: int = CHUNK, chunk: int = CHUNK) -> SpooledWeights:
    """``weights`` uploaded in pieces of ``piece`` bytes (``chunk`` at most), verified."""
    spool, payload = start(folder, weights, memory, chunk=chunk)
    for offset, data in iter_chunks(payload, piece):
        spool.feed(offset, data)
    return spool.finish()


def files(folder: Path) -> list[Path]:
    return sorted(folder.glob("upload-*.bin")) if folder.exists() else []


def test_a_small_upload_is_held_and_reads_as_its_file_would(tmp_path: Path) -> None:
    weights = make_weights(np.random.default_rng(1))
    memory = UploadMemory()
    held = receive(tmp_path / "held", weights, memory)
    spooled = receive(tmp_path / "file", weights, UploadMemory(budget_bytes=0))
    assert isinstance(held, HeldWeights) and not files(tmp_path / "held")
    assert not isinstance(spooled, HeldWeights) and len(files(tmp_path / "file")) == 1
    assert memory.in_use == weights.nbytes
    assert held.specs() == spooled.specs() == weights.specs()
    for name, want in weights.items():
        for got in (held[name], spooled[name]):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.tobytes() == want.tobytes() and not got.flags.writeable
    for source in (held, spooled):  # a block read from the middle of a tensor
        out = np.empty(7, np.float32)
        with source.open_blocks() as reader:
            reader.read_into("conv", 50, out)
        assert out.tobytes() == weights["conv"].reshape(-1)[50:57].tobytes()
    del held
    assert memory.in_use == 0  # the last reference to its bytes went


def test_an_upload_just_above_the_threshold_uses_a_file(tmp_path: Path) -> None:
    memory = UploadMemory()
    at = Weights({"w": np.ones(MAX_HELD_BYTES // 4, np.float32)})
    above = Weights({"w": np.ones(MAX_HELD_BYTES // 4 + 1, np.float32)})
    assert (at.nbytes, above.nbytes) == (MAX_HELD_BYTES, MAX_HELD_BYTES + 4)
    kept = receive(tmp_path / "at", at, memory, piece=DEFAULT_CHUNK_SIZE,
                   chunk=DEFAULT_CHUNK_SIZE)
    assert isinstance(kept, HeldWeights) and memory.in_use == MAX_HELD_BYTES
    spool, payload = start(tmp_path / "above", above, memory, chunk=DEFAULT_CHUNK_SIZE)
    assert len(files(tmp_path / "above")) == 1  # its file comes with its header
    spool.feed(0, payload)
    assert not spool.held and memory.in_use == MAX_HELD_BYTES
    assert spool.finish()["w"].tobytes() == above["w"].tobytes()


def test_a_small_payload_sent_in_several_chunks_uses_a_file(tmp_path: Path) -> None:
    weights = make_weights(np.random.default_rng(2))
    memory = UploadMemory()
    spooled = receive(tmp_path, weights, memory, piece=64)
    assert not isinstance(spooled, HeldWeights) and len(files(tmp_path)) == 1
    assert memory.in_use == 0


def test_uploads_past_the_budget_go_to_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    one = make_weights(rng).nbytes
    memory = UploadMemory(budget_bytes=2 * one + one // 2)
    kept = [receive(tmp_path, make_weights(rng), memory) for _ in range(4)]
    assert [isinstance(w, HeldWeights) for w in kept] == [True, True, False, False]
    assert memory.in_use == 2 * one and len(files(tmp_path)) == 2
    del kept[0]
    assert isinstance(receive(tmp_path, make_weights(rng), memory), HeldWeights)


def test_a_header_without_chunks_reserves_nothing(tmp_path: Path) -> None:
    memory = UploadMemory()
    spool, _ = start(tmp_path, make_weights(np.random.default_rng(4)), memory)
    assert memory.in_use == 0 and not files(tmp_path)
    with pytest.raises(MessageRejectedError, match="stream ended after 0 of"):
        spool.finish()
    spool.discard()
    assert memory.in_use == 0 and not files(tmp_path)


@pytest.mark.parametrize("ending", ["digest", "non-finite", "discarded", "finished-then-dropped"])
def test_the_reservation_comes_back_however_the_upload_ends(tmp_path: Path, ending: str) -> None:
    weights = make_weights(np.random.default_rng(5))
    memory = UploadMemory()
    spool, payload = start(tmp_path, weights, memory,
                           sha256=b"\0" * 32 if ending == "digest" else None)
    if ending == "non-finite":
        bad = bytearray(payload)
        bad[0:4] = np.float32(np.inf).tobytes()  # the first value of "conv"
        with pytest.raises(MessageRejectedError) as refused:
            spool.feed(0, bytes(bad))
        assert refused.value.reason is RejectReason.INVALID
    else:
        spool.feed(0, payload)
    assert spool.held and memory.in_use == weights.nbytes
    if ending == "digest":
        with pytest.raises(MessageRejectedError, match="digest mismatch"):
            spool.finish()
    if ending == "finished-then-dropped":
        payload_weights = spool.finish()
        del payload_weights, spool  # the owner has folded it and let it go
    else:
        spool.discard()  # what `Upload.abandon` and the owners do
    assert memory.in_use == 0 and not files(tmp_path)


def _refusal(folder: Path, memory: UploadMemory, case: str) -> tuple[RejectReason, str, bool]:
    weights = make_weights(np.random.default_rng(8))
    spool, payload = start(folder, weights, memory,
                           sha256=b"\0" * 32 if case == "digest" else None)
    data = bytearray(payload)
    if case == "non-finite":
        data[0:4] = np.float32(np.nan).tobytes()
    sent = bytes(data) + (b"\0" if case == "too long" else b"")
    sent = sent[:-1] if case == "short" else sent
    try:
        spool.feed(0, sent)
        spool.finish()
    except MessageRejectedError as exc:
        return exc.reason, str(exc), spool.held
    finally:
        spool.discard()
    raise AssertionError(f"{case}: not refused")


@pytest.mark.parametrize("case", ["digest", "non-finite", "too long", "short"])
def test_both_paths_refuse_alike(tmp_path: Path, case: str) -> None:
    memory = UploadMemory()
    reason, message, held = _refusal(tmp_path / "held", memory, case)
    assert (reason, message) == _refusal(tmp_path / "file", UploadMemory(budget_bytes=0),
                                         case)[:2]
    assert reason is RejectReason.INVALID and memory.in_use == 0
    assert held is (case in ("digest", "non-finite"))  # whole in one chunk: held


def test_a_held_upload_asked_for_its_file_gets_one(tmp_path: Path) -> None:
    weights = make_weights(np.random.default_rng(6))
    memory = UploadMemory()
    spool, payload = start(tmp_path, weights, memory)
    spool.feed(0, payload)
    assert isinstance(spool.finish(), HeldWeights)
    path = spool.path  # what a masked input's memory map, or the async buffer, reads
    assert path.read_bytes() == payload and files(tmp_path) == [path]
    spool.discard()
    assert not path.exists() and memory.in_use == 0


def _aggregate(current: Weights, updates: list[tuple[SpooledWeights, int]]) -> Weights:
    stream = (ClientUpdate(f"c{i}", delta, n, 0) for i, (delta, n) in enumerate(updates))
    result = FedAvg().aggregate_fit(1, current, stream)
    assert result.weights is not None
    return result.weights


@pytest.mark.parametrize("held_share", [0.0, 0.5, 1.0])
def test_the_memory_path_aggregates_bit_for_bit_as_the_file_path(
        tmp_path: Path, held_share: float) -> None:
    rng = np.random.default_rng(7)
    current = make_weights(rng)
    ups = [(make_weights(rng), int(rng.integers(1, 1000))) for _ in range(20)]
    one = current.nbytes
    memory = UploadMemory(budget_bytes=int(held_share * len(ups)) * one)
    mixed = [(receive(tmp_path / "mixed", d, memory), n) for d, n in ups]
    assert sum(isinstance(w, HeldWeights) for w, _ in mixed) == int(held_share * len(ups))
    files_only = [(receive(tmp_path / "files", d, UploadMemory(budget_bytes=0)), n)
                  for d, n in ups]
    got, want = _aggregate(current, mixed), _aggregate(current, files_only)
    for name in current:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
        assert got[name].tobytes() == want[name].tobytes(), name
    # ... and both are FedAvg: the float64 weighted mean of the deltas, cast back.
    total = sum(n for _, n in ups)
    mean = np.sum([n * d["wide"] for d, n in ups], axis=0) / total
    np.testing.assert_allclose(got["wide"], current["wide"] + mean, rtol=1e-12)
    del mixed, got
    assert memory.in_use == 0
