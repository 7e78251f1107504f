"""Fuzz targets against a live server over loopback gRPC (shared by the CI tests and
``benchmarks/fuzz.py``).

Three kinds of input, each of which must earn a clear status (never UNKNOWN, the
status of an unhandled exception; INTERNAL only for bytes that do not parse as the
request type), never hang (every call has a client deadline; a call that hits it is a
hang), and never stop the server from running its rounds:

- raw bytes (random, or a valid request mutated) as the request of any method;
- sessions of random actions: pulls, pushes for a real task with their chunks
  shuffled, dropped, repeated, truncated, altered or re-offset, random result headers
  (pushed, or reported in one Report call),
  a second header mid-stream, an oversize message, heartbeats and leaves with good and
  bad sessions;
- streams cut short by the client (cancelled mid-upload).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from fuzz_codec_targets import messages, mutate
from fuzz_wire import CLEAR_STATUSES, UNPARSEABLE, RawClient, chunked, status_of
from hypothesis import strategies as st

from fedloom import TaskKind, Weights
from fedloom.messages import PROTOCOL_VERSION, JoinRequest, ResultHeader, TaskHeader
from fedloom.payload import PayloadInfo, serialize
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.server import ServerHandle

CALL_TIMEOUT_S = 8.0
MAX_MESSAGE_BYTES = 1024 + 16 * 1024

_names = itertools.count()


class HangError(AssertionError):
    """A call ran into the client's own deadline: the server did not answer."""


class UnclearStatusError(AssertionError):
    """A call ended with a status that does not say what was wrong."""


def fuzz_weights() -> Weights:
    return Weights({"w": np.zeros((8, 4), np.float32), "b": np.zeros(4, np.float32)})


def check_status(code: grpc.StatusCode, details: str, what: str, parseable: bool = True) -> None:
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and "stream limit" not in details:
        raise HangError(f"{what}: no answer before the client's deadline ({details})")
    allowed = CLEAR_STATUSES if parseable else CLEAR_STATUSES | {UNPARSEABLE}
    if code not in allowed:
        raise UnclearStatusError(f"{what}: {code.name} {details!r}")
    if code != grpc.StatusCode.OK and not details:
        raise UnclearStatusError(f"{what}: {code.name} without a message")


# ---- raw bytes ---------------------------------------------------------------------
METHODS: dict[str, tuple[str, Any]] = {
    "Join": ("unary", pb.JoinRequest),
    "Heartbeat": ("unary", pb.HeartbeatRequest),
    "Leave": ("unary", pb.LeaveRequest),
    "Pull": ("stream_out", pb.PullRequest),
    "Tasks": ("stream_out", pb.PullRequest),
    "Push": ("stream_in", pb.PushRequest),
    "Report": ("unary", pb.PushRequest),
}


@st.composite
def raw_calls(draw: st.DrawFn) -> tuple[str, list[bytes]]:
    """(method, request bytes): random bytes, or a valid-ish request mutated."""
    method = draw(st.sampled_from(sorted(METHODS)))
    cls = METHODS[method][1]
    count = draw(st.integers(1, 4)) if method == "Push" else 1
    parts = []
    for _ in range(count):
        if draw(st.booleans()):
            parts.append(draw(st.binary(max_size=200)))
        else:
            base = draw(messages(cls.DESCRIPTOR, depth=3)).SerializeToString()
            ops = draw(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 12),
                                          st.integers(0, 255)), max_size=4))  # fmt: skip
            parts.append(mutate(base, ops))
    return method, parts


def run_raw_call(client: RawClient, method: str, parts: list[bytes]) -> grpc.StatusCode:
    kind, cls = METHODS[method]
    parseable = all(_parses(cls, p) for p in parts)
    if kind == "unary":
        code, details = status_of(client.raw_unary, method, parts[0], CALL_TIMEOUT_S)
    elif kind == "stream_out":
        code, details = status_of(client.raw_stream_out, method, parts[0], CALL_TIMEOUT_S)
    else:
        code, details = status_of(client.raw_stream_in, method, parts, CALL_TIMEOUT_S)
    check_status(code, details, f"raw {method}", parseable)
    return code


def _parses(cls: Any, data: bytes) -> bool:
    try:
        cls.FromString(data)
    except Exception:
        return False
    return True


# ---- sessions of actions -------------------------------------------------------------
CHUNK_EDITS = ["none", "shuffle", "drop", "repeat", "truncate", "flip", "offset", "empty",
               "header_again", "header_only", "nan"]  # fmt: skip
#: What a session granted "inline" does to a small update it reports inside its header.
INLINE_EDITS = ["none", "truncate", "extend", "flip", "nan", "empty"]
ACTIONS = ["pull", "push", "report_inline", "push_random_header", "report_random_header",
           "push_chunks_first", "oversize", "heartbeat", "heartbeat_bad_session",
           "leave_bad_session", "join_random"]  # fmt: skip


@st.composite
def sessions(draw: st.DrawFn) -> list[tuple[str, Any]]:
    actions = []
    for _ in range(draw(st.integers(1, 6))):
        action = draw(st.sampled_from(ACTIONS))
        if action == "push":
            arg: Any = (draw(st.sampled_from(CHUNK_EDITS)), draw(st.integers(0, 1 << 30)))
        elif action == "report_inline":
            arg = (draw(st.sampled_from(INLINE_EDITS)), draw(st.integers(0, 1 << 30)))
        elif action in ("push_random_header", "report_random_header"):
            arg = draw(messages(pb.ResultHeader.DESCRIPTOR, depth=3))
        elif action == "join_random":
            arg = draw(messages(pb.JoinRequest.DESCRIPTOR, depth=2))
        else:
            arg = None
        actions.append((action, arg))
    return actions


class SessionRunner:
    """Plays a list of actions as one joined client; checks every status."""

    def __init__(self, address: str, short_pull: bool = True) -> None:
        self.client = RawClient(address, name=f"fuzz-{next(_names)}",
                                capabilities=("fit", "inline"))
        self.task: TaskHeader | None = None
        self.statuses: dict[str, int] = {}

    def close(self) -> None:
        """Leave (so that no round waits for this client), then close the channel."""
        with contextlib.suppress(grpc.RpcError):  # the fuzzing may have ended the session
            self.client.stub.Leave(pb.LeaveRequest(session=self.client.session_proto),
                                   timeout=CALL_TIMEOUT_S)
        self.client.close()

    def _note(self, code: grpc.StatusCode) -> None:
        self.statuses[code.name] = self.statuses.get(code.name, 0) + 1

    def play(self, actions: list[tuple[str, Any]]) -> None:
        for action, arg in actions:
            code, details = getattr(self, f"_{action}")(arg)
            check_status(code, details, action)
            self._note(code)

    def _pull(self, _: Any) -> tuple[grpc.StatusCode, str]:
        session = self.client.session_proto
        try:
            parts = list(self.client.stub.Pull(pb.PullRequest(session=session),
                                               timeout=CALL_TIMEOUT_S))  # fmt: skip
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
        if parts and parts[0].WhichOneof("part") == "task":
            self.task = codec.task_from_proto(parts[0].task)
        return grpc.StatusCode.OK, ""

    def _fit_header(self, delta: Weights) -> tuple[ResultHeader, bytes]:
        assert self.task is not None
        payload = bytes(serialize(delta))
        header = ResultHeader(
            self.client.session, self.task.task_id, self.task.round, TaskKind.FIT,
            num_examples=1, base_round=self.task.round - 1,
            update=PayloadInfo.describe(delta.specs(), payload),
        )  # fmt: skip
        return header, payload

    def _delta(self, edit: str, rng: np.random.Generator) -> Weights:
        delta = Weights({n: rng.normal(size=a.shape).astype(a.dtype)
                         for n, a in fuzz_weights().items()})  # fmt: skip
        if edit == "nan":
            delta = Weights({"w": np.full((8, 4), np.nan, np.float32), "b": delta["b"]})
        return delta

    def _update(self, arg: tuple[str, int]
                ) -> tuple[ResultHeader, bytes, np.random.Generator] | tuple[grpc.StatusCode, str]:
        """A fit result for the held task (pulled first when none is held), its delta
        shaped by the edit, and the generator the edit draws from; or the pull's status
        when no task came."""
        edit, seed = arg
        if self.task is None:
            code, details = self._pull(None)
            if self.task is None:
                return code, details
        rng = np.random.default_rng(seed)
        return (*self._fit_header(self._delta(edit, rng)), rng)

    def _push(self, arg: tuple[str, int]) -> tuple[grpc.StatusCode, str]:
        made = self._update(arg)
        if len(made) == 2:
            return made
        header, payload, rng = made
        edit = arg[0]
        pieces = chunked(payload, int(rng.integers(1, 200)))
        requests = _edit_stream(codec.result_to_proto(header), pieces, edit, rng)
        return status_of(self.client.stub.Push, iter(requests), timeout=CALL_TIMEOUT_S)

    def _report_inline(self, arg: tuple[str, int]) -> tuple[grpc.StatusCode, str]:
        """A small update inside its result header, whole or damaged (`INLINE_EDITS`)."""
        made = self._update(arg)
        if len(made) == 2:
            return made
        header, payload, rng = made
        edit = arg[0]
        at = int(rng.integers(len(payload)))
        if edit == "truncate":
            payload = payload[:at]
        elif edit == "extend":
            payload += bytes(int(rng.integers(1, 64)))
        elif edit == "flip":
            payload = payload[:at] + bytes([payload[at] ^ 0xFF]) + payload[at + 1:]
        elif edit == "empty":
            payload = b""  # an update header with no payload: it belongs in a Push
        return status_of(self.client.stub.Report, codec.result_to_proto(header, inline=payload),
                         timeout=CALL_TIMEOUT_S)

    def _push_random_header(self, header: pb.ResultHeader) -> tuple[grpc.StatusCode, str]:
        request = pb.PushRequest(result=self._maybe_authenticated(header))
        return status_of(self.client.stub.Push, iter([request]), timeout=CALL_TIMEOUT_S)

    def _report_random_header(self, header: pb.ResultHeader) -> tuple[grpc.StatusCode, str]:
        request = pb.PushRequest(result=self._maybe_authenticated(header))
        return status_of(self.client.stub.Report, request, timeout=CALL_TIMEOUT_S)

    def _maybe_authenticated(self, header: pb.ResultHeader) -> pb.ResultHeader:
        if header.HasField("session") and self.task is not None and len(header.task_id) % 2:
            header.session.CopyFrom(self.client.session_proto)  # sometimes authenticated
            header.task_id = self.task.task_id
        return header

    def _push_chunks_first(self, _: Any) -> tuple[grpc.StatusCode, str]:
        request = pb.PushRequest(chunk=pb.Chunk(offset=0, data=b"x" * 10))
        return status_of(self.client.stub.Push, iter([request]), timeout=CALL_TIMEOUT_S)

    def _oversize(self, _: Any) -> tuple[grpc.StatusCode, str]:
        request = pb.PushRequest(chunk=pb.Chunk(offset=0, data=b"x" * (MAX_MESSAGE_BYTES + 1)))
        return status_of(self.client.stub.Push, iter([request]), timeout=CALL_TIMEOUT_S)

    def _heartbeat(self, _: Any) -> tuple[grpc.StatusCode, str]:
        request = pb.HeartbeatRequest(session=self.client.session_proto)
        return status_of(self.client.stub.Heartbeat, request, timeout=CALL_TIMEOUT_S)

    def _heartbeat_bad_session(self, _: Any) -> tuple[grpc.StatusCode, str]:
        session = pb.Session(client_id=self.client.session.client_id, secret=b"\x00" * 32)
        return status_of(self.client.stub.Heartbeat, pb.HeartbeatRequest(session=session),
                         timeout=CALL_TIMEOUT_S)  # fmt: skip

    def _leave_bad_session(self, _: Any) -> tuple[grpc.StatusCode, str]:
        session = pb.Session(client_id="nobody", secret=b"\x01" * 32)
        return status_of(self.client.stub.Leave, pb.LeaveRequest(session=session),
                         timeout=CALL_TIMEOUT_S)  # fmt: skip

    def _join_random(self, request: pb.JoinRequest) -> tuple[grpc.StatusCode, str]:
        code, details = status_of(self.client.stub.Join, request, timeout=CALL_TIMEOUT_S)
        if code == grpc.StatusCode.OK:  # admitted: leave again, to keep the server lean
            reply = self.client.stub.Join(request, timeout=CALL_TIMEOUT_S)
            self.client.stub.Leave(pb.LeaveRequest(session=reply.session), timeout=CALL_TIMEOUT_S)
        return code, details


def _edit_stream(header: pb.PushRequest, pieces: list[tuple[int, bytes]], edit: str,
                 rng: np.random.Generator) -> list[pb.PushRequest]:  # fmt: skip
    if edit == "shuffle" and len(pieces) > 1:
        order = rng.permutation(len(pieces))
        pieces = [pieces[i] for i in order]
    elif edit == "drop" and pieces:
        del pieces[int(rng.integers(len(pieces)))]
    elif edit == "repeat" and pieces:
        pieces.insert(int(rng.integers(len(pieces) + 1)), pieces[int(rng.integers(len(pieces)))])
    elif edit == "truncate" and pieces:
        pieces = pieces[: int(rng.integers(len(pieces)))]
    elif edit == "flip" and pieces:
        i = int(rng.integers(len(pieces)))
        data = bytearray(pieces[i][1])
        data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
        pieces[i] = (pieces[i][0], bytes(data))
    elif edit == "offset" and pieces:
        i = int(rng.integers(len(pieces)))
        pieces[i] = (int(rng.integers(0, 1 << 62)), pieces[i][1])
    elif edit == "empty":
        pieces.insert(int(rng.integers(len(pieces) + 1)), (0, b""))
    elif edit == "header_only":
        pieces = []
    requests = [header, *codec.chunks_for_push(pieces)]
    if edit == "header_again":
        requests.insert(int(rng.integers(1, len(requests) + 1)), header)
    return requests


# ---- streams cut short by the client --------------------------------------------------
#: What `cancelled_upload` saw after its cancel: the task's upload was released (a new
#: upload of it was accepted), or the round closed meanwhile (a clear refusal).
RELEASED, ROUND_CLOSED = "released", "round closed"


def cancelled_upload(server: ServerHandle, task_timeout_s: float = 20.0) -> str:
    """Start an upload, cancel it mid-stream; the same task's upload must then work
    (the server released it and removed what had arrived), or be answered with a clear
    status (the round closed). Returns `RELEASED` or `ROUND_CLOSED`.

    Raises `AssertionError` when it cannot do its job: no task arrives within
    ``task_timeout_s``, or the server never starts spooling the upload.
    """
    coordinator = server.server.coordinator
    assert coordinator is not None
    spool = coordinator.persistence.state_dir / "spool" / coordinator.run_id
    runner = SessionRunner(server.address)
    try:
        runner.task = runner.client.pull_task(task_timeout_s)
        header, payload = runner._fit_header(
            Weights({n: np.zeros_like(a) for n, a in fuzz_weights().items()})
        )
        pieces = chunked(payload, 16)
        before = set(spool.glob("upload-*")) if spool.exists() else set()
        release = threading.Event()

        def stalled() -> Iterator[pb.PushRequest]:
            yield codec.result_to_proto(header)
            yield from itertools.islice(codec.chunks_for_push(pieces), 2)
            release.wait(CALL_TIMEOUT_S)

        future = runner.client.stub.Push.future(stalled(), timeout=CALL_TIMEOUT_S)
        try:
            # Mid-stream for the server too: its spool file holds the two chunks.
            partial = _wait_for_spool(spool, before, 2 * 16, CALL_TIMEOUT_S)
        finally:
            future.cancel()
            release.set()
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:  # the server notices the cancel asynchronously
            code, details = status_of(runner.client.push, codec.result_to_proto(header), pieces)
            if code != grpc.StatusCode.ALREADY_EXISTS or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        check_status(code, details, "push after a cancelled upload")
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION), (code, details)
        assert not partial.exists(), "the cancelled upload's spool file was kept"
        return RELEASED if code == grpc.StatusCode.OK else ROUND_CLOSED
    finally:
        runner.close()


def _wait_for_spool(folder: Path, before: set[Path], size: int, timeout_s: float) -> Path:
    """The new upload file in ``folder`` once it holds ``size`` bytes (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for path in set(folder.glob("upload-*")) - before if folder.exists() else ():
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_size >= size:
                    return path
        time.sleep(0.01)
    raise AssertionError(f"the server did not spool the upload's first chunks within "
                         f"{timeout_s} s")


def join_request(name: str) -> pb.JoinRequest:
    return codec.join_request_to_proto(JoinRequest(PROTOCOL_VERSION, frozenset({"fit"}), name))
