"""Every stream has a server-side time limit, and the keepalive policies of the two
sides agree, so idle long-polls are never punished."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from fuzz_wire import RawClient, chunked
from helpers import ScriptedClient, run_clients

from fedloom import ServerConfig, Weights
from fedloom.client_sdk.connection import Connection
from fedloom.config import ClientConfig, TransferConfig
from fedloom.messages import ResultHeader, TaskHeader
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.server import Server
from fedloom.server import servicer as servicer_module
from fedloom.server.app import ServerHandle, grpc_server_options
from fedloom.server.transfer_slots import TransferSlots

ServerConfigFactory = Callable[..., ServerConfig]


def _weights(n: int = 12) -> Weights:
    return Weights({"w": np.zeros(n, np.float32), "b": np.zeros(3, np.float32)})


def _zero_update(raw: RawClient, task: TaskHeader, n: int = 12) -> tuple[ResultHeader, bytes]:
    """A fit result for ``task``: a zero delta of `_weights` (n) and its header."""
    return raw.fit_result(task, Weights({k: np.zeros_like(a) for k, a in _weights(n).items()}))


def _round_completes_with(handle: ServerHandle, threads: list[Any], updates: int) -> None:
    history = handle.wait(60)
    for t in threads:
        t.join(10)
    assert history[-1].status == "ok" and history[-1].num_updates == updates


def _stop_reading_download(
    server_config: ServerConfigFactory, **limits: float
) -> tuple[ServerHandle, RawClient, Weights, pytest.ExceptionInfo[grpc.RpcError], float]:
    """A 32 MB model whose download is read up to its header, then not at all: the
    server's writes block on flow control until a limit cuts the stream."""
    transfer = TransferConfig(chunk_size=64 * 1024, max_message_bytes=160 * 1024)
    big = _weights(8 << 20)  # 32 MB: far beyond what HTTP/2 flow control buffers
    config = server_config(
        num_rounds=1, min_clients=1, min_fit_clients=1, transfer=transfer,
        round_timeout_s=20.0, **limits,
    )  # fmt: skip
    handle = Server(config, initial_weights=big).start()
    raw = RawClient(handle.address)
    started = time.monotonic()
    stream = raw.stub.Pull(pb.PullRequest(session=raw.session_proto), timeout=30)
    assert next(stream).WhichOneof("part") == "task"
    time.sleep(3.0)  # read nothing more
    with pytest.raises(grpc.RpcError) as info:
        for _ in stream:
            pass
    return handle, raw, big, info, time.monotonic() - started


def test_a_trickling_upload_is_cut_at_the_stream_limit_and_the_round_goes_on(
    server_config: ServerConfigFactory,
) -> None:
    config = server_config(num_rounds=1, min_clients=3, min_fit_clients=2, stream_timeout_s=1.0)
    handle = Server(config, initial_weights=_weights()).start()
    raw = RawClient(handle.address)
    threads = run_clients(
        handle.address, [ScriptedClient(seed=i, num_examples=2) for i in range(2)]
    )
    header, payload = _zero_update(raw, raw.pull_task())

    def trickle():  # type: ignore[no-untyped-def]
        yield codec.result_to_proto(header)
        for offset, data in chunked(payload, 4):  # 4 bytes every 0.3 s: 4.5 s in all
            time.sleep(0.3)
            yield pb.PushRequest(chunk=pb.Chunk(offset=offset, data=data))

    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        raw.stub.Push(trickle(), timeout=20)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "stream limit" in (info.value.details() or "")
    assert time.monotonic() - started < 3.0

    # A silent stream (header never sent) is cut the same way.
    def silent():  # type: ignore[no-untyped-def]
        time.sleep(3.0)
        yield codec.result_to_proto(header)

    with pytest.raises(grpc.RpcError) as info:
        raw.stub.Push(silent(), timeout=20)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _round_completes_with(handle, threads, 2)


def test_a_client_that_stops_reading_its_download_cannot_hold_the_stream(
    server_config: ServerConfigFactory,
) -> None:
    handle, raw, big, info, _ = _stop_reading_download(server_config, stream_timeout_s=1.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "stream limit" in (info.value.details() or "")
    # The task is delivered again to a client that reads; the server is fine.
    again = raw.stub.Pull(pb.PullRequest(session=raw.session_proto), timeout=30)
    parts = list(again)
    assert parts[0].WhichOneof("part") == "task"
    assert sum(len(p.chunk.data) for p in parts[1:]) == big.nbytes
    handle.stop()
    handle.wait(10)


def _client_channel_options(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def spy(target: str, *args: Any, options: Any = None, **kwargs: Any) -> Any:
        seen.update(dict(options or []))
        return real(target, *args, options=options, **kwargs)

    real = grpc.insecure_channel
    monkeypatch.setattr(grpc, "insecure_channel", spy)
    Connection(ClientConfig(server_address="127.0.0.1:9", insecure=True)).close()
    return seen


def test_keepalive_policies_let_idle_long_polls_live(
    server_config: ServerConfigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = dict(grpc_server_options(server_config()))
    client = _client_channel_options(monkeypatch)
    # A client pinging more often than the server accepts earns strikes, then a GOAWAY
    # that drops every call on the connection; the SDK stays well inside the policy.
    min_interval = server["grpc.http2.min_recv_ping_interval_without_data_ms"]
    assert client["grpc.keepalive_time_ms"] >= 2 * min_interval
    assert server["grpc.keepalive_permit_without_calls"] == 1  # idle clients may ping
    assert server["grpc.http2.max_ping_strikes"] >= 1
    # Dead peers are still found: both sides ping, and give up after a timeout.
    assert client["grpc.keepalive_timeout_ms"] <= 20_000
    assert server["grpc.keepalive_time_ms"] <= 60_000
    # Messages: the client accepts what the server may send, and vice versa.
    assert client["grpc.max_receive_message_length"] >= server["grpc.max_send_message_length"]


# ---- streams that hold a transfer turn must keep moving (chunk_timeout_s) ------------


class _SlowClient(ScriptedClient):
    def fit(self, weights, config):  # type: ignore[no-untyped-def]
        time.sleep(1.5)
        return super().fit(weights, config)


def test_an_upload_that_stalls_while_holding_the_only_turn_is_cut_and_others_go_on(
    server_config: ServerConfigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(servicer_module, "TransferSlots", functools.partial(TransferSlots, 1))
    transfer = TransferConfig(chunk_size=1024, max_message_bytes=20 * 1024)
    config = server_config(
        num_rounds=1, min_clients=3, min_fit_clients=2, stream_timeout_s=60.0,
        chunk_timeout_s=1.0, transfer=transfer,
    )  # fmt: skip
    handle = Server(config, initial_weights=_weights(2048)).start()
    raw = RawClient(handle.address)
    # Honest clients that train for a while: they upload after the stall took the turn.
    threads = run_clients(handle.address, [_SlowClient(seed=i, num_examples=2) for i in range(2)])
    header, payload = _zero_update(raw, raw.pull_task(), 2048)  # 8 chunks: it needs a turn

    def stall():  # type: ignore[no-untyped-def]
        yield codec.result_to_proto(header)
        offset, data = chunked(payload, 1024)[0]
        yield pb.PushRequest(chunk=pb.Chunk(offset=offset, data=data))
        time.sleep(5.0)  # holds the only upload turn, sends nothing more

    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        raw.stub.Push(stall(), timeout=20)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "chunk_timeout_s" in (info.value.details() or "")
    assert time.monotonic() - started < 4.0  # the idle limit, not the 60 s stream limit
    # The two honest clients then upload through the freed turn.
    _round_completes_with(handle, threads, 2)


def test_a_download_that_stops_reading_is_cut_by_the_idle_limit(
    server_config: ServerConfigFactory,
) -> None:
    handle, _, _, info, elapsed = _stop_reading_download(
        server_config, stream_timeout_s=60.0, chunk_timeout_s=1.0
    )
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "chunk_timeout_s" in (info.value.details() or "")
    assert elapsed < 10.0
    handle.stop()
    handle.wait(10)


class _NoTurns(TransferSlots):
    """Slots whose turns never come: only transfers that need no turn can happen."""

    def __init__(self, *, free_bytes: int) -> None:
        super().__init__(free_bytes=free_bytes)
        self._downloads = asyncio.Semaphore(0)
        self._uploads = asyncio.Semaphore(0)


def test_models_of_one_chunk_need_no_transfer_turn(
    server_config: ServerConfigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tasks and results that fit in one chunk (secure-aggregation stages, tiny models)
    never queue behind model transfers: with no turn ever free, a round of them runs."""
    monkeypatch.setattr(servicer_module, "TransferSlots", _NoTurns)
    config = server_config(num_rounds=2, min_clients=2, min_fit_clients=2, round_timeout_s=20.0)
    handle = Server(config, initial_weights=_weights()).start()  # 60 bytes: one chunk
    threads = run_clients(
        handle.address, [ScriptedClient(seed=i, num_examples=2) for i in range(2)]
    )
    history = handle.wait(60)
    for t in threads:
        t.join(10)
    assert [r.status for r in history] == ["ok", "ok"]
    assert [r.num_updates for r in history] == [2, 2]
