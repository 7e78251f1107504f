"""A client's words reach the server's log and `fedloom runs` escaped.

The adversary is one client. What it may send: a task failure message, a leave reason
and string metrics of its choosing. What it must not get: a log line that looks like
the server's own (a newline, then a forged timestamp and message), a forged row in
``fedloom runs RUN --clients``, or an escape sequence that drives the operator's
terminal.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
from lifecycle_support import ClientThreads, GatedClient, RawSession, tiny_weights, wait_until

from fedloom._text import one_line
from fedloom.client_sdk import FitOutput
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.server import Server
from fedloom.server.run_report import print_runs

FORGED = "\n2026-12-06 14:00:00,000 INFO fedloom.server: client 0000 (admin) joined\x1b[2K"


class _FailsWithForgery(GatedClient):
    def fit(self, weights, config):  # type: ignore[no-untyped-def]
        raise RuntimeError("bad data" + FORGED)


class _ForgesMetrics(GatedClient):
    def fit(self, weights, config):  # type: ignore[no-untyped-def]
        out = super().fit(weights, config)
        return FitOutput(out.weights, out.num_examples,
                         {"note": "ok" + FORGED, "bad\nkey": 1.0})


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_one_line_escapes_what_is_not_printable() -> None:
    assert one_line("a\nb\x1b[2K\tc\x00") == "a\\nb\\x1b[2K\\tc\\x00"
    assert one_line("plain text, ünïcode") == "plain text, ünïcode"
    assert one_line("x" * 10, 4) == "xxxx... (cut)"
    assert one_line(None) == ""


def _assert_escaped(messages: list[str]) -> None:
    assert messages
    for message in messages:
        assert "\n" not in message and "\x1b" not in message
        assert "\\n2026-12-06 14:00:00,000 INFO" in message  # kept, escaped


def test_a_failure_message_cannot_forge_log_lines(
        server_config, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    config = server_config(num_rounds=1, min_clients=1, min_fit_clients=1,
                           fraction_evaluate=0.0, round_timeout_s=5.0, finished_grace_s=0.0)
    with caplog.at_level(logging.INFO, logger="fedloom.server"):
        handle = Server(config, initial_weights=tiny_weights()).start()
        pool = ClientThreads(handle.address, [_FailsWithForgery()])  # type: ignore[arg-type]
        try:
            assert [r.status for r in handle.wait(30)] == ["failed"]
        finally:
            pool.close()
    _assert_escaped([m for m in _messages(caplog) if "reported a failure" in m])


def test_a_leave_reason_cannot_forge_log_lines(
        server_config, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    config = server_config(min_clients=5)  # no round starts
    with caplog.at_level(logging.INFO, logger="fedloom.server"):
        handle = Server(config, initial_weights=tiny_weights()).start()
        raw = RawSession(handle.address, "leaver")
        try:
            raw.stub.Leave(pb.LeaveRequest(session=codec.session_to_proto(raw.session),
                                           reason="bye" + FORGED), timeout=10)
            wait_until(lambda: any("left: bye" in m for m in _messages(caplog)), 10)
        finally:
            raw.close()
            handle.stop()
            handle.wait(30)
    _assert_escaped([m for m in _messages(caplog) if "left: bye" in m])


def test_fedloom_runs_shows_client_metric_strings_escaped(server_config) -> None:  # type: ignore[no-untyped-def]
    config = server_config(num_rounds=1, min_clients=1, min_fit_clients=1,
                           fraction_evaluate=0.0, finished_grace_s=0.0)
    handle = Server(config, initial_weights=tiny_weights()).start()
    pool = ClientThreads(handle.address, [_ForgesMetrics()])  # type: ignore[arg-type]
    try:
        assert [r.status for r in handle.wait(30)] == ["ok"]
    finally:
        pool.close()
    out = io.StringIO()
    print_runs(Path(config.state_dir), handle.server.coordinator.run_id, clients=True, out=out)
    lines = out.getvalue().splitlines()
    assert "\x1b" not in out.getvalue()
    assert len(lines) == 3  # the title, the header, the one client's fit row
    assert "note=ok\\n2026-12-06" in lines[2] and "bad\\nkey=1" in lines[2]
