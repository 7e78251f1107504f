"""Prometheus metrics of the server (rounds, clients, bytes, rejections, durations).

The collectors live in their own registry, so an application's default registry is
left alone; ``metrics_address`` serves it (`fedloom.server.observability`). Several
servers in one process (tests) share these process-wide collectors. Where each is
updated:

- ``fedloom_rounds_total{status}``, ``fedloom_round_duration_seconds``,
  ``fedloom_last_round``: when a round commits (coordinator);
- ``fedloom_clients_connected``: on join and on removal (leave, silence);
- ``fedloom_tasks_total{kind,outcome}``: when a phase closes: ``accepted``, ``failed``
  (client failure, dropped, deadline) or ``cancelled`` (over-selection);
- ``fedloom_bytes_received_total`` / ``fedloom_bytes_sent_total``: weights chunks in
  Push / Pull (servicer; payload bytes, not protobuf framing);
- ``fedloom_rejected_messages_total{reason}``: every refused message (servicer);
- ``fedloom_privacy_epsilon``: ε spent so far, at the run's δ, when a private round
  commits (``[privacy]``).
"""

from __future__ import annotations

from collections.abc import Mapping

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
    last_round = Gauge(
        "fedloom_last_round", "The last round committed in this process", registry=registry
    )
    tasks = Counter(
        "fedloom_tasks_total",
        "Tasks whose phase closed, by kind and outcome",
        ["kind", "outcome"],
        registry=registry,
    )
    round_seconds = Histogram(
        "fedloom_round_duration_seconds",
        "Wall time of a round",
        buckets=(0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000),
        registry=registry,
    )

    privacy_epsilon = Gauge(
        "fedloom_privacy_epsilon", "Privacy spent so far (epsilon at the run's delta)",
        registry=registry,
    )
    # NaN (no value on a dashboard) until a private round commits: a gauge starts at 0,
    # which would read as "no privacy spent" for a run that has no privacy at all.
    privacy_epsilon.set(float("nan"))

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
    def round_done(cls, status: str, seconds: float, server_round: int | None = None,
                   epsilon: float | None = None) -> None:
        cls.rounds.labels(status=status).inc()
        if epsilon is not None:
            cls.privacy_epsilon.set(epsilon)
        cls.round_seconds.observe(seconds)
        if server_round is not None:
            cls.last_round.set(server_round)

    @classmethod
    def tasks_closed(cls, kind: str, outcomes: Mapping[str, int]) -> None:
        """Count a closed phase's tasks: ``{"accepted": n, "failed": m, ...}``."""
        for outcome, n in outcomes.items():
            if n:
                cls.tasks.labels(kind=kind, outcome=outcome).inc(n)
