"""Connected clients: sessions, liveness and their task mailboxes."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import secrets
import time

from fedloom.compression import CodecSpec
from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.messages import Session
from fedloom.types import ClientInfo


@dataclasses.dataclass(eq=False)
class ClientRecord:
    """A joined client. Only a hash of its session secret is kept."""

    info: ClientInfo
    secret_hash: bytes
    last_seen: float
    wakeup: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    #: The authenticated identity (certificate, token), or None: ``info.name`` is then
    #: only a label the client chose, which proves nothing and keys nothing.
    identity: str | None = None
    peer: str = ""  # the address the client joined from ("" when unknown)
    #: The codecs granted at Join (`fedloom.server.compression.grant`); None: plain.
    upload_codec: CodecSpec | None = None
    download_codec: CodecSpec | None = None
    #: Whether the zstd stage was granted too, per direction.
    upload_zstd: bool = False
    download_zstd: bool = False

    @property
    def client_id(self) -> str:
        return self.info.client_id


def _hash(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


class ClientRegistry:
    """Sessions of connected clients. Runs on the server's event loop (not thread-safe)."""

    def __init__(self, max_clients: int) -> None:
        self._clients: dict[str, ClientRecord] = {}
        self._max = max_clients
        self.changed = asyncio.Event()  # set whenever a client joins or leaves

    def __len__(self) -> int:
        return len(self._clients)

    def __contains__(self, client_id: str) -> bool:
        return client_id in self._clients

    def infos(self) -> list[ClientInfo]:
        return [c.info for c in self._clients.values()]

    def records(self) -> list[ClientRecord]:
        return list(self._clients.values())

    def get(self, client_id: str) -> ClientRecord | None:
        return self._clients.get(client_id)

    def join(self, name: str, capabilities: frozenset[str], identity: str | None = None,
             peer: str = "") -> tuple[ClientRecord, Session]:
        if len(self._clients) >= self._max:
            raise MessageRejectedError(
                RejectReason.TOO_LARGE,
                f"the server holds its maximum of {self._max} clients; try again later",
            )
        client_id = secrets.token_hex(8)
        secret = secrets.token_bytes(32)
        record = ClientRecord(
            ClientInfo(client_id, name or client_id, capabilities), _hash(secret), time.monotonic(),
            identity=identity, peer=peer,
        )
        self._clients[client_id] = record
        self.changed.set()
        return record, Session(client_id, secret)

    def authenticate(self, session: Session) -> ClientRecord:
        """The client behind ``session``; UNKNOWN_CLIENT if none (it should re-join)."""
        record = self._clients.get(session.client_id)
        if record is None or not hmac.compare_digest(record.secret_hash, _hash(session.secret)):
            raise MessageRejectedError(
                RejectReason.UNKNOWN_CLIENT,
                "unknown or expired session; join again (the server may have restarted)",
            )
        record.last_seen = time.monotonic()
        return record

    def remove(self, client_id: str) -> ClientRecord | None:
        record = self._clients.pop(client_id, None)
        if record is not None:
            record.wakeup.set()
            self.changed.set()
        return record

    def expired(self, timeout_s: float) -> list[str]:
        """Ids of clients not seen for ``timeout_s`` seconds."""
        now = time.monotonic()
        return [cid for cid, c in self._clients.items() if now - c.last_seen > timeout_s]
