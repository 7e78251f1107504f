"""Prometheus metrics of the server (rounds, clients, bytes, rejections, durations).

The collectors live in their own registry, so several servers in one process (tests)
do not clash with each other or with an application's default registry; serve it with
``prometheus_client.start_http_server(port, registry=ServerMetrics.registry)``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServerMetrics:
    registry = CollectorRegistry(auto_describe=True)
    rounds = Counter(
        "fedloom_rounds_total", "Rounds completed, by status", ["status"], registry=registry
    )
    clients = Gauge("fedloom_clients_connected", "Clients with a live session", registry=registry)
    received = Counter("fedloom_bytes_received_total", "Payload bytes received", registry=registry)
    sent = Counter("fedloom_bytes_sent_total", "Payload bytes sent", registry=registry)
    rejections = Counter(
        "fedloom_rejected_messages_total",
        "Messages refused, by reason",
        ["reason"],
        registry=registry,
    )
    round_seconds = Histogram(
        "fedloom_round_duration_seconds",
        "Wall time of a round",
        buckets=(0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000),
        registry=registry,
    )

    @classmethod
    def rejected(cls, reason: str) -> None:
        cls.rejections.labels(reason=str(reason)).inc()

    @classmethod
    def bytes_in(cls, n: int) -> None:
        cls.received.inc(n)

    @classmethod
    def bytes_out(cls, n: int) -> None:
        cls.sent.inc(n)

    @classmethod
    def round_done(cls, status: str, seconds: float) -> None:
        cls.rounds.labels(status=status).inc()
        cls.round_seconds.observe(seconds)
