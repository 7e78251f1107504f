"""The fleet: who is connected. Admission (Join), liveness (heartbeats, the reaper, cut
streams, Leave), strikes and quarantine, and the one wait-for-clients helper.

Whoever must know when a client goes (the task book, a round driver) subscribes with
`Fleet.on_departure`; the fleet knows nothing of rounds or tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from fedloom.config import ServerConfig
from fedloom.errors import ClientsUnavailableError, MessageRejectedError, RejectReason
from fedloom.messages import (
    PROTOCOL_VERSION,
    SERVER_CAPABILITIES,
    Capability,
    JoinReply,
    JoinRequest,
)
from fedloom.server.compression import grant
from fedloom.server.metrics import ServerMetrics
from fedloom.server.progress import RoundReporter
from fedloom.server.quarantine import STRIKES, Quarantine
from fedloom.server.registry import ClientRecord, ClientRegistry
from fedloom.types import ClientInfo

log = logging.getLogger("fedloom.server")

#: Seconds between "waiting for clients" log lines while the count does not change.
WAIT_LOG_S = 30.0


#: ``listener(client_id, reason)``: a client has gone (left, silent, quarantined, ...).
DepartureListener = Callable[[str, str], None]


class Fleet:
    """The connected clients of one run. Lives on the event loop."""

    def __init__(self, config: ServerConfig, run_id: str,
                 reporter: RoundReporter | None = None) -> None:
        self.config = config
        self.run_id = run_id
        self.registry = ClientRegistry(config.max_clients)
        #: Proven identities; and peer addresses, for clients known only by a label.
        self.quarantine = Quarantine(config.quarantine_after, config.quarantine_s)
        self.address_quarantine = Quarantine(config.quarantine_after, config.quarantine_s,
                                             noun="address")
        self._reporter = reporter or RoundReporter(enabled=False)
        self._listeners: list[DepartureListener] = []

    def on_departure(self, listener: DepartureListener) -> None:
        self._listeners.append(listener)

    # -- admission ------------------------------------------------------------------
    def join(self, request: JoinRequest, identity: str | None = None,
             peer: str = "") -> JoinReply:
        """Admit a client from address ``peer``. An authenticated ``identity``
        (`fedloom.server.auth`) names the session and holds one session at a time:
        joining again ends the old one. Without one, the requested name is a label: it
        ends no session (an SDK client that joins again leaves its old session itself)."""
        if request.protocol_version != PROTOCOL_VERSION:
            raise MessageRejectedError(
                RejectReason.INVALID,
                f"protocol version {request.protocol_version} is not supported; "
                f"this server speaks {PROTOCOL_VERSION}: upgrade the client",
            )
        if Capability.FIT not in request.capabilities:
            raise MessageRejectedError(RejectReason.INVALID, "a client must support 'fit'")
        if identity is not None:
            self.quarantine.check(identity)
            for client_id in self._sessions_of(identity):
                self.drop(client_id, "replaced by a new session of its identity")
        elif peer:
            self.address_quarantine.check(peer)
        # Unknown names are ignored (a newer client may know kinds this server does
        # not); the reply lists what was granted, so the client learns what it will get.
        granted = frozenset(request.capabilities & SERVER_CAPABILITIES)
        if not self.config.transfer.inline_payloads:
            granted -= {Capability.INLINE}
        record, session = self.registry.join(
            identity or request.name, granted, identity=identity, peer=peer,
        )
        grants = grant(self.config.compression, request, record.client_id)
        record.upload_codec, record.download_codec = grants.upload, grants.download
        record.upload_zstd, record.download_zstd = grants.upload_zstd, grants.download_zstd
        log.info(
            "client %s (%s) joined; %d connected", record.client_id, record.info.name,
            len(self.registry),
            extra={"client": record.client_id, "client_name": record.info.name,
                   "connected": len(self.registry)},
        )
        ServerMetrics.clients.set(len(self.registry))
        t = self.config.transfer
        return JoinReply(
            session=session,
            protocol_version=PROTOCOL_VERSION,
            capabilities=granted,
            run_id=self.run_id,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            long_poll_s=self.config.long_poll_s,
            chunk_size=t.chunk_size,
            max_message_bytes=t.max_message_bytes,
            max_model_bytes=t.max_model_bytes,
            upload_codec=grants.upload,
            download_codec=grants.download,
            upload_zstd=grants.upload_zstd,
            download_zstd=grants.download_zstd,
        )

    def strike(self, record: ClientRecord, reason: RejectReason) -> None:
        """Count a refused message against its client (`fedloom.server.quarantine`).

        A proven identity is struck as itself: past the limit it is quarantined and
        all its sessions end. A client known only by the name it chose is struck by its
        peer address (a fresh session or name does not wipe its record): past the
        limit Joins from that address are refused for a while and this session ends,
        as does any other that strikes from there meanwhile; no other session does.
        """
        if record.identity is not None:
            if self.quarantine.strike(record.identity, reason):
                log.warning("client %s quarantined for %.0f s", record.identity,
                            self.quarantine.duration_s)
                for client_id in self._sessions_of(record.identity):
                    self.drop(client_id, "quarantined")
            return
        key = record.peer or f"session {record.client_id}"
        quarantine = self.address_quarantine
        if quarantine.strike(key, reason) or (
                reason in STRIKES and quarantine.remaining_s(key) > 0):
            log.warning("client %s (unproven name %r) quarantined; joins from %s refused "
                        "for %.0f s", record.client_id, record.info.name[:64], key,
                        quarantine.remaining_s(key))
            self.drop(record.client_id, "quarantined")

    def _sessions_of(self, identity: str) -> list[str]:
        return [c.client_id for c in self.registry.records() if c.identity == identity]

    def strike_id(self, client_id: str, reason: RejectReason) -> None:
        record = self.registry.get(client_id)
        if record is not None:
            self.strike(record, reason)

    # -- liveness -------------------------------------------------------------------
    def heartbeat(self, record: ClientRecord) -> None:
        record.last_seen = time.monotonic()

    def leave(self, record: ClientRecord, reason: str) -> None:
        self.drop(record.client_id, f"left: {reason[:200]}" if reason else "left")

    def stream_closed(self, record: ClientRecord) -> None:
        """The client's task stream (or long-poll) was cut: it is gone. Its session ends
        at once, so no round waits for it or samples it again (it joins afresh)."""
        self.drop(record.client_id, "its task stream ended")

    def drop(self, client_id: str, reason: str) -> None:
        """End a client's session and tell every listener."""
        if self.registry.remove(client_id) is None:
            return
        log.info(
            "client %s removed (%s); %d connected", client_id, reason, len(self.registry),
            extra={"client": client_id, "reason": reason, "connected": len(self.registry)},
        )
        ServerMetrics.clients.set(len(self.registry))
        for listener in self._listeners:
            listener(client_id, reason)

    def wake(self, client_id: str) -> None:
        """Wake the client's long-poll or task stream (it has a new task)."""
        client = self.registry.get(client_id)
        if client is not None:
            client.wakeup.set()

    def wake_all(self) -> None:
        for info in self.registry.infos():
            self.wake(info.client_id)

    async def reap(self, until: asyncio.Event) -> None:
        """Remove clients whose heartbeats and polls stopped, until ``until`` is set."""
        while not until.is_set():
            for client_id in self.registry.expired(self.config.client_timeout_s):
                self.drop(client_id, "no heartbeat")
            await asyncio.sleep(min(1.0, self.config.heartbeat_interval_s))

    async def wait_for(self, count: int, capability: str = Capability.FIT
                       ) -> list[ClientInfo]:
        """Wait until at least ``count`` connected clients have ``capability``; those
        clients. Reports the wait (progress display, log) while it lasts.

        Raises:
            ClientsUnavailableError: ``min_clients_wait_s`` (when set) passed first.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        limit = self.config.min_clients_wait_s
        announced, announced_at = -1, started
        while True:
            eligible = [c for c in self.registry.infos() if capability in c.capabilities]
            if len(eligible) >= count:
                return eligible
            self._reporter.waiting(len(eligible), count)
            now = loop.time()
            if limit and now - started >= limit:
                raise ClientsUnavailableError(
                    f"only {len(eligible)} of the {count} clients a round needs "
                    f"connected{'' if capability == Capability.FIT else f' support {capability}'}"
                    f" within min_clients_wait_s ({limit:g} s); the server stops with every "
                    "committed round kept: start it again when the clients can come (it "
                    "resumes), or lower min_clients")
            # In the logs too (text and JSON), not only on a terminal: when the count
            # changes, and every WAIT_LOG_S while it does not.
            if len(eligible) != announced or now - announced_at >= WAIT_LOG_S:
                log.info("waiting for clients: %d of %d connected%s (waited %.0f s)",
                         len(eligible), count,
                         "" if capability == Capability.FIT else f" support {capability}",
                         now - started,
                         extra={"connected": len(eligible), "needed": count,
                                "capability": str(capability), "waited_s": now - started})
                announced, announced_at = len(eligible), now
            self.registry.changed.clear()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel
            # that lands as a client joins, and the server then never stops.
            pause = min(5.0, WAIT_LOG_S)
            if limit:
                pause = max(0.0, min(pause, started + limit - now))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):
                    await self.registry.changed.wait()
