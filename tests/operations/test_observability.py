"""Operators' probes: gRPC health, reflection, the Prometheus endpoint and JSON logs."""

from __future__ import annotations

import concurrent.futures
import io
import json
import logging
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from helpers import small_weights
from ops_wire import connect, pull_task, push_zero_update, wait_for
from prometheus_client.parser import text_string_to_metric_families

from fedloom.cli import build_parser
from fedloom.client_sdk.connection import SessionExpiredError
from fedloom.logs import JsonFormatter, configure_logging
from fedloom.messages import Session
from fedloom.server import Server
from fedloom.server.observability import FLEET_SERVICE


def _health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_answers_serving_for_the_server_and_the_fleet_service(server_config) -> None:
    handle = Server(server_config(), initial_weights=small_weights()).start()
    try:
        assert FLEET_SERVICE == "fedloom.v1.Fleet"
        assert _health(handle.address, "") == health_pb2.HealthCheckResponse.SERVING
        assert _health(handle.address, FLEET_SERVICE) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            _health(handle.address, "no.such.Service")
        assert info.value.code() is grpc.StatusCode.NOT_FOUND
    finally:
        handle.stop()
        handle.wait(10)


def test_reflection_lists_and_describes_the_fleet_service(server_config) -> None:
    handle = Server(server_config(), initial_weights=small_weights()).start()
    try:
        with grpc.insecure_channel(handle.address) as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            services = set(database.get_services())
            assert {"fedloom.v1.Fleet", "grpc.health.v1.Health"} <= services
            from google.protobuf.descriptor_pool import DescriptorPool

            fleet = DescriptorPool(database).FindServiceByName("fedloom.v1.Fleet")
            assert {m.name for m in fleet.methods} >= {"Join", "Pull", "Push", "Heartbeat"}
    finally:
        handle.stop()
        handle.wait(10)


def test_reflection_can_be_turned_off(server_config) -> None:
    handle = Server(server_config(reflection=False), initial_weights=small_weights()).start()
    try:
        with grpc.insecure_channel(handle.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                ProtoReflectionDescriptorDatabase(channel).get_services()
            assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED
        assert _health(handle.address, "") == health_pb2.HealthCheckResponse.SERVING
    finally:
        handle.stop()
        handle.wait(10)


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _value(samples, name: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_are_off_by_default(server_config) -> None:
    handle = Server(server_config(), initial_weights=small_weights()).start()
    try:
        assert handle.server.metrics_port is None
    finally:
        handle.stop()
        handle.wait(10)


def test_metrics_endpoint_shows_the_counters_moving_after_a_round(server_config) -> None:
    config = server_config(num_rounds=2, fraction_evaluate=0.0, metrics_address="127.0.0.1:0")
    handle = Server(config, initial_weights=small_weights()).start()
    port = handle.server.metrics_port
    assert port is not None
    model_bytes = small_weights().nbytes  # 15 float32 = 60 bytes
    before = _scrape(port)
    # One Pull per task: a Tasks stream would be sent round 2's weights as soon as its
    # tasks exist, and this test counts the bytes of round 1 alone.
    conns = [connect(handle.address, f"c{i}", task_stream=False) for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        tasks = list(pool.map(pull_task, conns))
    for conn, (task, weights) in zip(conns, tasks, strict=True):
        push_zero_update(conn, task, weights)
    coordinator = handle.server.coordinator
    assert coordinator is not None
    wait_for(lambda: len(coordinator.history) >= 1)
    real = conns[0].session
    assert real is not None
    conns[0].session = Session("forged", b"x" * 32)
    with pytest.raises(SessionExpiredError):
        conns[0].heartbeat()  # refused: UNAUTHENTICATED, counted as unknown_client
    conns[0].session = real
    after = _scrape(port)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("fedloom_rounds_total", status="ok") == 1
    assert delta("fedloom_round_duration_seconds_count") == 1
    assert _value(after, "fedloom_last_round") == 1
    assert _value(after, "fedloom_clients_connected") == 3
    assert delta("fedloom_tasks_total", kind="fit", outcome="accepted") == 3
    # Round 1's weights went to 3 clients and 3 deltas came back; round 2's tasks are
    # issued but not pulled yet, so nothing more was sent.
    assert delta("fedloom_bytes_sent_total") == 3 * model_bytes
    assert delta("fedloom_bytes_received_total") == 3 * model_bytes
    assert delta("fedloom_rejected_messages_total", reason="unknown_client") == 1
    handle.stop()
    handle.wait(10)
    for conn in conns:
        conn.close()
    with pytest.raises(urllib.error.URLError):
        _scrape(port)  # the endpoint closes with the server


def test_metrics_address_in_use_is_a_config_error(server_config) -> None:
    first = Server(
        server_config(metrics_address="127.0.0.1:0"), initial_weights=small_weights()
    ).start()
    try:
        taken = f"127.0.0.1:{first.server.metrics_port}"
        from fedloom.errors import ConfigError

        second = Server(
            server_config(metrics_address=taken, state_dir=first.server.config.state_dir + "2"),
            initial_weights=small_weights(),
        )
        with pytest.raises(ConfigError, match="metrics_address"):
            second.start().wait(10)
    finally:
        first.stop()
        first.wait(10)


# -- structured logs ---------------------------------------------------------------------
def test_json_formatter_writes_one_object_per_line_with_the_extra_fields() -> None:
    logger = logging.getLogger("fedloom.test.json")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("client %s joined", "abc", extra={"client": "abc", "round": 3})
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("it broke", extra={"obj": object()})
    finally:
        logger.removeHandler(handler)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["level"] == "WARNING" and first["logger"] == "fedloom.test.json"
    assert first["message"] == "client abc joined"
    assert (first["client"], first["round"]) == ("abc", 3)
    assert first["ts"].endswith("Z")
    assert "ValueError: boom" in second["exception"]
    assert second["obj"].startswith("<object")  # not JSON: written as its str


def test_server_logs_in_json_name_the_client_and_the_round(server_config) -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    configure_logging("INFO", "json", stream=stream)
    try:
        config = server_config(num_rounds=1, fraction_evaluate=0.0)
        handle = Server(config, initial_weights=small_weights()).start()
        conns = [connect(handle.address, f"site-{i}") for i in range(3)]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            tasks = list(pool.map(pull_task, conns))
        for conn, (task, weights) in zip(conns, tasks, strict=True):
            push_zero_update(conn, task, weights)
        handle.wait(20)
        for conn in conns:
            conn.close()
    finally:
        root.setLevel(saved[0])
        for h in [h for h in root.handlers if h not in saved[1]]:
            root.removeHandler(h)
    entries = [json.loads(line) for line in stream.getvalue().splitlines()]
    joins = [e for e in entries if e["message"].startswith("client ") and "joined" in e["message"]]
    assert sorted(e["client_name"] for e in joins) == ["site-0", "site-1", "site-2"]
    assert all(e["client"] for e in joins)
    rounds = [e for e in entries if e.get("round") == 1 and e.get("status") == "ok"]
    assert rounds and rounds[0]["updates"] == 3


def test_log_format_flag_exists_on_server_and_client() -> None:
    parser = build_parser()
    assert parser.parse_args(["server", "--log-format", "json"]).log_format == "json"
    args = parser.parse_args(["client", "--server", "h:1", "--app", "m:a", "--log-format", "json"])
    assert args.log_format == "json"
    with pytest.raises(SystemExit):
        parser.parse_args(["server", "--log-format", "xml"])


def test_configure_logging_replaces_its_own_handler_and_keeps_others() -> None:
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    first, second = io.StringIO(), io.StringIO()
    try:
        configure_logging("INFO", "json", stream=first)
        configure_logging("INFO", "text", stream=second)
        logging.getLogger("fedloom.test").info("hello %d", 7)
        assert first.getvalue() == ""
        assert second.getvalue().rstrip().endswith("INFO fedloom.test: hello 7")
        assert all(h in root.handlers for h in saved[1])  # pytest's own stay
        with pytest.raises(ValueError, match="json"):
            configure_logging("INFO", "yaml")
    finally:
        root.setLevel(saved[0])
        for h in [h for h in root.handlers if h not in saved[1]]:
            root.removeHandler(h)


def test_configure_logging_without_a_stream_follows_stderr_as_it_is_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    first, later = io.StringIO(), io.StringIO()
    try:
        monkeypatch.setattr(sys, "stderr", first)
        configure_logging("INFO", "text")
        logging.getLogger("fedloom.test").info("one")
        first.close()  # e.g. a test runner's capture, closed after its test
        monkeypatch.setattr(sys, "stderr", later)
        logging.getLogger("fedloom.test").info("two")
        assert later.getvalue().rstrip().endswith("INFO fedloom.test: two")
    finally:
        root.setLevel(saved[0])
        for h in [h for h in root.handlers if h not in saved[1]]:
            root.removeHandler(h)


def test_epsilon_has_no_value_until_a_private_round_commits() -> None:
    # A fresh process (these collectors are process-wide): a gauge would start at 0,
    # which reads as "no privacy spent" on a run that has no privacy at all.
    probe = ("import math; from fedloom.server.metrics import ServerMetrics as M; "
             "print(math.isnan(M.registry.get_sample_value('fedloom_privacy_epsilon')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "True"
