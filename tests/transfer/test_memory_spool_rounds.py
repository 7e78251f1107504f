"""Small uploads held in memory, through a real server over loopback gRPC.

The server's upload memory (`fedloom.server.upload_memory.UPLOAD_MEMORY`) is replaced
by a test's own, which records each upload it was asked to hold. Raw sessions then end
held uploads every way the servicer knows, and the budget must come back each time;
and a round whose small updates outrun the budget sends the rest to files and still
computes FedAvg.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from helpers import ScriptedClient, committed_models, pull_task, run_clients, small_weights

from fedloom import Weights
from fedloom.compression import CodecSpec, encode
from fedloom.config import CompressionConfig
from fedloom.messages import PROTOCOL_VERSION, Capability, JoinRequest, ResultHeader, TaskHeader
from fedloom.payload import PayloadInfo, serialize
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc
from fedloom.server import Server, upload_memory
from fedloom.server.upload_memory import HeldPayload, UploadMemory
from fedloom.types import TaskKind

Q8 = CodecSpec("q8", block=4)


class RecordingMemory(UploadMemory):
    """An `UploadMemory` that records whether each upload it was asked for was held,
    and the most it had reserved."""

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self.outcomes: list[bool] = []
        self.peak = 0

    def hold(self, info: PayloadInfo, max_chunk_bytes: int) -> HeldPayload | None:
        held = super().hold(info, max_chunk_bytes)
        self.outcomes.append(held is not None)
        self.peak = max(self.peak, self.in_use)
        return held


@pytest.fixture
def memory(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], RecordingMemory]:
    def install(budget_bytes: int) -> RecordingMemory:
        recording = RecordingMemory(budget_bytes)
        monkeypatch.setattr(upload_memory, "UPLOAD_MEMORY", recording)
        return recording

    return install


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


class Session:
    """A session joined by hand, to push what the SDK never would."""

    def __init__(self, address: str, name: str, upload_codecs: tuple[str, ...] = ()) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.FleetStub(self.channel)
        request = JoinRequest(PROTOCOL_VERSION, frozenset(Capability), name,
                              upload_codecs=upload_codecs)
        reply = self.stub.Join(codec.join_request_to_proto(request), timeout=10)
        self.session = codec.join_reply_from_proto(reply).session

    def fit_task(self) -> TaskHeader:
        return pull_task(self.stub, self.session)

    def header(self, task: TaskHeader, info: PayloadInfo,
               codec_spec: CodecSpec | None = None) -> ResultHeader:
        return ResultHeader(self.session, task.task_id, task.round, TaskKind.FIT,
                            num_examples=3, base_round=task.round - 1, update=info,
                            codec=codec_spec)

    def push(self, header: ResultHeader, data: bytes,
             hold: threading.Event | None = None) -> grpc.Future:
        """Push ``header`` and ``data`` in one chunk; with ``hold``, keep the stream open
        (sending nothing more) until it is set."""

        def messages() -> Iterator[pb.PushRequest]:
            yield codec.result_to_proto(header)
            yield pb.PushRequest(chunk=pb.Chunk(offset=0, data=data))
            if hold is not None:
                hold.wait(30)

        return self.stub.Push.future(messages(), timeout=30)

    def close(self) -> None:
        self.channel.close()


def status(future: grpc.Future) -> tuple[Any, str]:
    try:
        future.result()
    except grpc.FutureCancelledError:
        return grpc.StatusCode.CANCELLED, "cancelled by the client"
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def delta(seed: int) -> Weights:
    rng = np.random.default_rng(seed)
    return Weights({n: rng.normal(size=a.shape).astype(a.dtype)
                    for n, a in small_weights().items()})


def test_the_budget_comes_back_on_every_exit_path(
        server_config, memory: Callable[[int], RecordingMemory]) -> None:  # type: ignore[no-untyped-def]
    held = memory(1 << 20)
    config = server_config(num_rounds=1, min_clients=4, min_fit_clients=1,
                           fraction_evaluate=0.0, chunk_timeout_s=1.0, client_timeout_s=60.0,
                           compression=CompressionConfig(upload=("q8", "zstd"), quantize_block=4))
    handle = Server(config, initial_weights=small_weights()).start()
    plain, quantized, compressed, quitter = (Session(handle.address, "plain"),
                                             Session(handle.address, "q8", ("q8",)),
                                             Session(handle.address, "zstd", ("zstd",)),
                                             Session(handle.address, "quitter"))
    release = threading.Event()
    seen: dict[str, tuple[Any, str]] = {}

    def ends(name: str, future: grpc.Future) -> None:
        seen[name] = status(future)
        wait_until(lambda: held.in_use == 0, f"the budget back after {name}")
        assert held.outcomes == [True] * len(seen), (name, held.outcomes)  # it was held

    try:
        tasks = {s: s.fit_task() for s in (plain, quantized, compressed, quitter)}
        good = delta(1)
        payload = bytes(serialize(good))
        info = PayloadInfo.describe(good.specs(), payload)
        task = tasks[plain]

        wrong = PayloadInfo(info.specs, info.total_bytes, b"\x01" * 32)
        ends("digest", plain.push(plain.header(task, wrong), payload))

        ends("stalled", plain.push(plain.header(task, info), payload, hold=release))

        bad = {n: np.array(a) for n, a in encode(Q8.build(), good, np.random.default_rng(0)
                                                 ).items()}
        bad["w|q8"][0] = -128  # q8 codes lie in [-127, 127]: refused at the decode check
        encoded = bytes(serialize(Weights(bad)))
        ends("refused codec", quantized.push(
            quantized.header(tasks[quantized], PayloadInfo.describe(Weights(bad).specs(),
                                                                    encoded), Q8), encoded))

        garbage = b"\x28\xb5\x2f\xfd" + b"\xff" * 36  # zstd's magic number, then no frame
        stream = PayloadInfo(info.specs, info.total_bytes, info.sha256, wire_bytes=len(garbage))
        ends("refused stream", compressed.push(compressed.header(tasks[compressed], stream),
                                               garbage))

        # Cancelled once its one chunk is in: the server ends the upload (whole, it may
        # even fold it) and the retry is taken, or answered "duplicate".
        header = quitter.header(tasks[quitter], info)
        cancelled = quitter.push(header, payload, hold=release)
        wait_until(lambda: len(held.outcomes) == len(seen) + 1, "the chunk to arrive")
        cancelled.cancel()
        seen["cancelled"] = status(cancelled)
        seen["retried"] = status(quitter.push(header, payload))

        seen["folded"] = status(plain.push(plain.header(task, info), payload))
        history = handle.wait(30)
        wait_until(lambda: held.in_use == 0, "the budget back after the round")
    finally:
        release.set()
        for session in (plain, quantized, compressed, quitter):
            session.close()
    assert all(held.outcomes) and held.in_use == 0
    assert seen["digest"][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "digest mismatch" in seen["digest"][1]
    assert seen["stalled"][0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "moved no chunk" in seen["stalled"][1]
    assert seen["refused codec"][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not decode with q8" in seen["refused codec"][1]
    assert seen["refused stream"][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "zstd stream" in seen["refused stream"][1]
    assert seen["cancelled"][0] == grpc.StatusCode.CANCELLED
    assert seen["retried"][0] == seen["folded"][0] == grpc.StatusCode.OK
    assert [(r.status, r.num_updates, r.num_failures) for r in history] == [("ok", 2, 2)]
    # The round's model is the mean of the two updates folded (the same delta).
    model = committed_models(config.state_dir)[1]
    for name, arr in good.items():
        np.testing.assert_array_equal(model[name], arr)


def test_a_held_upload_open_when_the_server_stops_returns_its_reservation(
        server_config, memory: Callable[[int], RecordingMemory]) -> None:  # type: ignore[no-untyped-def]
    held = memory(1 << 20)
    config = server_config(num_rounds=1, min_clients=1, min_fit_clients=1,
                           fraction_evaluate=0.0, client_timeout_s=60.0)
    handle = Server(config, initial_weights=small_weights()).start()
    session = Session(handle.address, "late")
    release = threading.Event()
    try:
        task = session.fit_task()
        good = delta(2)
        payload = bytes(serialize(good))
        future = session.push(session.header(task, PayloadInfo.describe(good.specs(), payload)),
                              payload, hold=release)
        wait_until(lambda: held.in_use > 0, "the chunk to arrive")
        handle.stop()  # the round is abandoned with the upload in flight
        handle.wait(15)
        code, _ = status(future)
        wait_until(lambda: held.in_use == 0, "the budget back after the stop")
    finally:
        release.set()
        session.close()
    assert held.outcomes == [True] and code != grpc.StatusCode.OK


def test_a_round_past_the_budget_spools_the_rest_and_computes_fedavg(
        server_config, memory: Callable[[int], RecordingMemory]) -> None:  # type: ignore[no-untyped-def]
    one = small_weights().nbytes
    held = memory(2 * one)  # two updates at a time; the round's five stay until its fold
    config = server_config(num_rounds=2, min_clients=5, min_fit_clients=5,
                           fraction_evaluate=0.0, keep_checkpoints=10)
    handle = Server(config, initial_weights=small_weights()).start()
    clients = [ScriptedClient(seed=i, num_examples=10 * (i + 1)) for i in range(5)]
    threads = run_clients(handle.address, clients)
    history = handle.wait(60)
    for thread in threads:
        thread.join(10)
    assert [(r.status, r.num_updates) for r in history] == [("ok", 5), ("ok", 5)]
    assert len(held.outcomes) == 10 and held.peak <= 2 * one
    assert sorted(held.outcomes[:5]) == [False, False, False, True, True]  # round 1
    assert held.outcomes.count(True) >= 3  # round 1's came back before round 2's arrived
    wait_until(lambda: held.in_use == 0, "the budget back after the run")
    models = committed_models(config.state_dir)
    for server_round in (1, 2):
        previous = models[server_round - 1]
        sent = [(c.num_examples, g, new) for c in clients for r, g, new in c.sent
                if r == server_round]
        total = sum(n for n, _, _ in sent)
        for name, arr in previous.items():
            mean = sum(n * (new[name].astype(np.float64) - g[name]) for n, g, new in sent)
            want = (arr + mean / total).astype(np.float32)
            np.testing.assert_allclose(models[server_round][name], want, rtol=1e-5, atol=1e-5)

