"""Malformed requests to the health and reflection services (issue 20, item 8).

They used to earn UNKNOWN ("Unexpected <class 'DecodeError'>") and an ERROR traceback
each, a cheap way to flood the log; now they are refused like malformed Fleet messages:
INVALID_ARGUMENT, and at most one warning line per interval however many arrive.
"""

from __future__ import annotations

import logging

import grpc
import pytest
from lifecycle_support import tiny_weights

from fedloom.server import Server, wire

#: A length-delimited field 1 that announces 5 bytes and carries 2: not protobuf.
MALFORMED = b"\x0a\x05ab"
CALLS = {
    "/grpc.health.v1.Health/Check": "unary_unary",
    "/grpc.health.v1.Health/Watch": "unary_stream",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": "stream_stream",
}


def _call(channel: grpc.Channel, method: str) -> grpc.StatusCode:
    kind = CALLS[method]
    raw = getattr(channel, kind)(method, request_serializer=None, response_deserializer=None)
    try:
        if kind == "unary_unary":
            raw(MALFORMED, timeout=5)
        elif kind == "unary_stream":
            list(raw(MALFORMED, timeout=5))
        else:
            list(raw(iter([MALFORMED]), timeout=5))
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_malformed_probe_requests_are_refused_clearly_and_quietly(
        server_config, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(wire, "refusals", wire.RefusalLog(interval_s=60.0))  # a fresh one
    handle = Server(server_config(min_clients=9), initial_weights=tiny_weights()).start()
    try:
        with (grpc.insecure_channel(handle.address) as channel,
              caplog.at_level(logging.INFO)):
            codes = [_call(channel, method) for method in CALLS for _ in range(10)]
    finally:
        handle.stop()
        handle.wait(10)
    assert set(codes) == {grpc.StatusCode.INVALID_ARGUMENT}, codes
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    refusals = [r for r in caplog.records if "not valid protobuf" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]  # 30 refusals, one line


def test_the_refusal_log_says_how_many_lines_it_held_back(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = wire.RefusalLog(interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="fedloom.server"):
        for second in range(25):
            now[0] = float(second)
            log.refused("Check", "ipv4:10.0.0.7:5000", "malformed")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3  # at 0, 10 and 20 s
    assert lines[1].endswith("(and 9 more in the last 10 s)")
