"""Probes for operators: gRPC health, server reflection and the Prometheus endpoint.

- **Health** (`grpc.health.v1.Health`, the standard service that ``grpc_health_probe``,
  Kubernetes gRPC probes and load balancers call): ``SERVING`` for the whole server
  (service ``""``) and for ``fedloom.v1.Fleet`` once the port is bound; ``NOT_SERVING``
  while the server shuts down.
- **Reflection** (`grpc.reflection.v1alpha.ServerReflection`): lets ``grpcurl`` and
  similar tools list and call the services without the ``.proto`` files. On by default
  (``reflection = true``); it reveals only the schema, which is public anyway.
- **Metrics**: `fedloom.server.metrics.ServerMetrics` served over HTTP at
  ``metrics_address`` (``HOST:PORT``; off when empty, the default: an unauthenticated
  port is opened only when the operator asks for one).

See docs/operations.md for probing examples.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2
from prometheus_client import start_http_server

from fedloom.errors import ConfigError
from fedloom.protos.fedloom.v1 import fleet_pb2
from fedloom.server.metrics import ServerMetrics
from fedloom.server.wire import add_parsed_service

log = logging.getLogger("fedloom.server")

#: The fully qualified name of the Fleet service, as health checks and reflection name it.
FLEET_SERVICE = fleet_pb2.DESCRIPTOR.services_by_name["Fleet"].full_name


HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]


class Probes:
    """The health service (and reflection) added to one gRPC server.

    Both parse their own requests (`fedloom.server.wire`), as Fleet does: malformed
    bytes from anyone who can reach the port earn INVALID_ARGUMENT and a rate-limited
    warning, not UNKNOWN and an ERROR traceback each.
    """

    def __init__(self, server: grpc.aio.Server, *, reflection_enabled: bool) -> None:
        self.health = health.aio.HealthServicer()
        add_parsed_service(HEALTH, self.health, server)
        if reflection_enabled:
            names = (FLEET_SERVICE, HEALTH.full_name, reflection.SERVICE_NAME)
            add_parsed_service(REFLECTION, reflection.aio.ReflectionServicer(names), server)

    async def serving(self) -> None:
        """Mark the server and the Fleet service SERVING (call once the port is bound)."""
        for service in ("", FLEET_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    async def shutting_down(self) -> None:
        """Answer NOT_SERVING from now on (the server is about to stop)."""
        await self.health.enter_graceful_shutdown()


class MetricsEndpoint:
    """The Prometheus scrape endpoint (``GET /metrics``) in a daemon thread.

    Example::

        endpoint = MetricsEndpoint.start("127.0.0.1:9464")
        ...   # curl http://127.0.0.1:9464/metrics
        endpoint.close()
    """

    def __init__(self, httpd: Any, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread

    @property
    def port(self) -> int:
        return int(self._httpd.server_port)

    @classmethod
    def start_if(cls, address: str) -> MetricsEndpoint | None:
        """`start` when ``address`` is set; None when it is empty (metrics off)."""
        return cls.start(address) if address else None

    @classmethod
    def start(cls, address: str) -> MetricsEndpoint:
        """Serve the metrics at ``HOST:PORT`` (port 0 picks a free one)."""
        host, _, port = address.rpartition(":")
        try:
            httpd, thread = start_http_server(
                int(port), addr=host.strip("[]"), registry=ServerMetrics.registry
            )
        except OSError as exc:
            raise ConfigError("metrics_address", f"cannot listen on {address}: {exc}") from exc
        endpoint = cls(httpd, thread)
        log.info("metrics at http://%s:%d/metrics", host, endpoint.port)
        return endpoint

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5.0)
