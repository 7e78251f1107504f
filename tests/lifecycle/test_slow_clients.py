"""Slow clients cannot starve a round of its transfer turns (issue 20, item 1).

Only a few uploads (and downloads) stream at once. An upload used to hold its turn from
its result header on, and a chunk of any size reset its idle limit, so a client sending
one byte every 29 s held a turn for the whole stream limit (600 s); two such clients
stopped every honest update of every round. Now a turn is taken at the first chunk,
chunks of a payload that needs one are full-size, a turn is held only while the stream
keeps up ``min_transfer_rate`` (with ``transfer_window_s`` of slack, hence for at most
``window + size / rate``), and a stream cut for slowness is a strike.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from helpers import pull_task
from lifecycle_support import ClientThreads, GatedClient, RawSession, wait_until

from fedloom import Weights
from fedloom.config import TransferConfig
from fedloom.messages import ResultHeader, TaskHeader
from fedloom.payload import PayloadInfo, iter_chunks, serialize
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.server import Server
from fedloom.server import servicer as servicer_module
from fedloom.server.transfer_slots import TransferPace, TransferSlots
from fedloom.types import TaskKind

CHUNK = 4096
TRANSFER = TransferConfig(chunk_size=CHUNK, max_message_bytes=CHUNK + 32 * 1024)
#: 16 full chunks and a short one: every upload and download of it needs a turn.
MODEL = Weights({"w": np.zeros(16 * CHUNK // 4, np.float32), "b": np.zeros(3, np.float32)})


class _Slots(TransferSlots):
    """Two turns each way whatever the machine, and a handle on them for the test."""

    made: list[TransferSlots] = []

    def __init__(self, *, free_bytes: int) -> None:
        super().__init__(2, free_bytes=free_bytes)
        self.made.append(self)

    def uploads_taken(self) -> bool:
        return self._uploads.locked()


def _pull_task(raw: RawSession) -> TaskHeader:
    return pull_task(raw.stub, raw.session)


def _fit_result(raw: RawSession, task: TaskHeader) -> tuple[ResultHeader, bytes]:
    delta = Weights({n: np.zeros_like(a) for n, a in MODEL.items()})
    payload = bytes(serialize(delta))
    header = ResultHeader(raw.session, task.task_id, task.round, TaskKind.FIT, num_examples=1,
                          base_round=task.round - 1,
                          update=PayloadInfo.describe(delta.specs(), payload))
    return header, payload


def _trickle(header: ResultHeader, payload: bytes, pause_s: float,
             sizes: list[int] | None = None) -> Iterator[pb.PushRequest]:
    """Full chunks (or ``sizes``), ``pause_s`` apart: a client slower than the minimum."""
    yield codec.result_to_proto(header)
    pieces = list(iter_chunks(payload, CHUNK)) if sizes is None else _pieces(payload, sizes)
    for i, (offset, data) in enumerate(pieces):
        if i:
            time.sleep(pause_s)
        yield pb.PushRequest(chunk=pb.Chunk(offset=offset, data=data))


def _pieces(payload: bytes, sizes: list[int]) -> list[tuple[int, bytes]]:
    out, offset = [], 0
    for size in sizes:
        out.append((offset, payload[offset:offset + size]))
        offset += size
    return out


def _push_status(raw: RawSession, requests: Iterator[pb.PushRequest]) -> tuple[Any, str]:
    try:
        raw.stub.Push(requests, timeout=30)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def test_two_trickling_clients_do_not_starve_the_honest_ones(
        server_config, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    _Slots.made = []
    monkeypatch.setattr(servicer_module, "TransferSlots", _Slots)
    config = server_config(
        num_rounds=1, min_clients=5, min_fit_clients=3, fraction_fit=0.6, over_selection=1.7,
        fraction_evaluate=0.0, round_timeout_s=10.0, transfer=TRANSFER,
        min_transfer_rate=16 * 1024, transfer_window_s=0.5, quarantine_after=2)
    handle = Server(config, initial_weights=MODEL).start()
    gate = threading.Event()
    honest = ClientThreads(handle.address, [GatedClient(gate) for _ in range(3)])  # type: ignore[arg-type]
    slow = [RawSession(handle.address, f"slow-{i}") for i in range(2)]
    outcomes: list[tuple[Any, str]] = []
    try:
        tasks = [_pull_task(raw) for raw in slow]  # every client is in the round

        def attack(raw: RawSession, task: TaskHeader) -> None:
            header, payload = _fit_result(raw, task)
            outcomes.append(_push_status(raw, _trickle(header, payload, pause_s=1.0)))

        attackers = [threading.Thread(target=attack, args=(raw, task), daemon=True)
                     for raw, task in zip(slow, tasks, strict=True)]
        for thread in attackers:
            thread.start()
        # Both upload turns are the trickling clients' before anyone honest uploads.
        wait_until(lambda: bool(_Slots.made) and _Slots.made[0].uploads_taken(), 10.0,
                   "the slow clients to hold both upload turns")
        gate.set()
        history = handle.wait(30)
        for thread in attackers:
            thread.join(10)
    finally:
        gate.set()
        honest.close()
        for raw in slow:
            raw.close()
    assert [(r.status, r.num_updates) for r in history] == [("ok", 3)]
    # Each slow stream was cut for its pace, long before the stream limit...
    assert [code for code, _ in outcomes] == [grpc.StatusCode.DEADLINE_EXCEEDED] * 2
    assert all("too slow" in details for _, details in outcomes), outcomes
    # ... and each cut was a strike: two of them quarantine the address they came from.
    coordinator = handle.server.coordinator
    assert coordinator is not None
    assert coordinator.fleet.address_quarantine.remaining_s("127.0.0.1") > 0


def test_a_header_without_chunks_holds_no_turn(
        server_config, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(servicer_module, "TransferSlots",
                        functools.partial(TransferSlots, 1))  # one upload at a time
    config = server_config(num_rounds=1, min_clients=2, min_fit_clients=1, fraction_fit=0.5,
                           over_selection=2.0, fraction_evaluate=0.0, round_timeout_s=10.0,
                           transfer=TRANSFER, chunk_timeout_s=30.0)
    handle = Server(config, initial_weights=MODEL).start()
    coordinator = handle.server.coordinator
    assert coordinator is not None
    spool = Path(config.state_dir) / "spool" / coordinator.run_id
    gate, release = threading.Event(), threading.Event()
    honest = ClientThreads(handle.address, [GatedClient(gate)])  # type: ignore[arg-type]
    silent = RawSession(handle.address, "silent")
    try:
        header, _ = _fit_result(silent, _pull_task(silent))

        def header_only() -> Iterator[pb.PushRequest]:
            yield codec.result_to_proto(header)
            release.wait(30)

        future = silent.stub.Push.future(header_only(), timeout=30)
        # The server has taken the header (its upload is spooling) before anyone uploads.
        wait_until(lambda: any(spool.glob("upload-*.bin")), 10.0, "the header to be taken")
        gate.set()
        history = handle.wait(20)  # the honest upload took the only turn at once
        assert [(r.status, r.num_updates) for r in history] == [("ok", 1)]
        future.cancel()
    finally:
        gate.set()
        release.set()
        honest.close()
        silent.close()


def test_chunks_of_a_payload_that_needs_a_turn_are_full_size(server_config) -> None:  # type: ignore[no-untyped-def]
    config = server_config(num_rounds=1, min_clients=1, min_fit_clients=1, transfer=TRANSFER,
                           fraction_evaluate=0.0)
    handle = Server(config, initial_weights=MODEL).start()
    raw = RawSession(handle.address, "nibbler")
    try:
        header, payload = _fit_result(raw, _pull_task(raw))
        sizes = [CHUNK, 1, len(payload) - CHUNK - 1]  # a 1-byte chunk in the middle
        code, details = _push_status(raw, _trickle(header, payload, 0.0, sizes))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "chunk_size" in details
        # Full chunks and a shorter last one (12 bytes) are taken.
        assert len(payload) % CHUNK == 12
        code, details = _push_status(raw, _trickle(header, payload, 0.0))
        assert code == grpc.StatusCode.OK, details
        assert handle.wait(20)[-1].num_updates == 1
    finally:
        raw.close()


def test_the_pace_cuts_a_stream_that_lags_the_minimum_rate() -> None:
    async def lagging() -> tuple[str, float]:
        pace = TransferPace(10.0, min_rate=1000.0, window_s=0.1, size=1000, chunk=100)
        started = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutError):
            async with pace:
                for _ in range(10):
                    await asyncio.sleep(0.15)  # 100 bytes per 0.15 s: 667 bytes/s
                    pace.moved(100)
        return pace.limit, asyncio.get_running_loop().time() - started

    limit, elapsed = asyncio.run(lagging())
    assert limit == "rate" and elapsed < 0.9  # not the 10 s idle limit

    async def keeping_up() -> int:
        pace = TransferPace(10.0, min_rate=1000.0, window_s=0.1, size=1000, chunk=100)
        async with pace:
            for _ in range(10):
                await asyncio.sleep(0.05)  # 2000 bytes/s
                pace.moved(100)
        return pace.moved_bytes

    assert asyncio.run(keeping_up()) == 1000


def test_a_download_read_slower_than_the_minimum_rate_is_cut(server_config) -> None:  # type: ignore[no-untyped-def]
    transfer = TransferConfig(chunk_size=64 * 1024, max_message_bytes=160 * 1024)
    big = Weights({"w": np.zeros(2 << 20, np.float32)})  # 8 MB: far past HTTP/2's buffers
    config = server_config(num_rounds=1, min_clients=1, min_fit_clients=1, transfer=transfer,
                           min_transfer_rate=1 << 20, transfer_window_s=0.5,
                           chunk_timeout_s=30.0)
    handle = Server(config, initial_weights=big).start()
    # Fixed HTTP/2 windows: the client's gRPC does not buffer the model ahead of its reads.
    raw = RawSession(handle.address, "slow-reader", options=(("grpc.http2.bdp_probe", 0),))
    try:
        stream = raw.stub.Pull(pb.PullRequest(session=codec.session_to_proto(raw.session)),
                               timeout=30)
        assert next(stream).WhichOneof("part") == "task"
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:  # 64 KiB a second: a sixteenth of the minimum
                time.sleep(1.0)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "download is too slow" in (info.value.details() or "")
        assert time.monotonic() - started < 10.0  # not chunk_timeout_s, not the stream limit
    finally:
        raw.close()
        handle.stop()
        handle.wait(10)
