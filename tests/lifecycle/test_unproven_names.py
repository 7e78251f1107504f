"""Quarantine and sessions when a client's name is only a label (issue 20, item 2).

On a server without proven identities (``insecure``, or TLS with ``auth.anonymous``)
the name a client joins with is its own choice. Quarantine used to be keyed by it: a
client joining as "site-A" and misbehaving ended the real site-A's session and shut
it out, and one with an empty name escaped by joining again. Now such a client is
quarantined by its session and its peer address; a proven identity (token,
certificate) is still quarantined as itself. A client that joins again ends its
previous session itself, so no ghost is left behind under its name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from lifecycle_support import (
    ClientThreads,
    GatedClient,
    RawSession,
    join_status,
    tiny_weights,
    wait_until,
)

from fedloom.client_sdk import runner as runner_module
from fedloom.client_sdk.connection import Connection
from fedloom.config import AuthConfig
from fedloom.errors import TransportError
from fedloom.server import Server
from fedloom.tokens import TokenStore

INVALID = grpc.StatusCode.INVALID_ARGUMENT
OK = grpc.StatusCode.OK
QUARANTINED = grpc.StatusCode.RESOURCE_EXHAUSTED
ENDED = grpc.StatusCode.UNAUTHENTICATED


def _server(server_config, **overrides: Any):  # type: ignore[no-untyped-def]
    # min_clients out of reach: no round starts, the sessions only wait.
    config = server_config(num_rounds=1, min_clients=9, min_fit_clients=1,
                           quarantine_after=3, quarantine_s=30.0, **overrides)
    return Server(config, initial_weights=tiny_weights()).start()


@pytest.mark.parametrize("label", ["site-A", ""], ids=["borrowed name", "empty name"])
def test_an_unproven_client_is_quarantined_by_session_and_address(
        server_config, label: str) -> None:  # type: ignore[no-untyped-def]
    handle = _server(server_config)
    honest = RawSession(handle.address, "site-A")
    mallory = RawSession(handle.address, label)
    try:
        assert [mallory.send_invalid() for _ in range(3)] == [INVALID] * 3
        assert mallory.heartbeat() == ENDED  # its own session ended
        assert honest.heartbeat() == OK  # the real site-A's did not: a name proves nothing
        # Joining again from its address, under any name, is refused while it lasts.
        for name in {label, "site-A", "", "someone-else"}:
            assert join_status(handle.address, name) == QUARANTINED
        coordinator = handle.server.coordinator
        assert coordinator is not None
        assert coordinator.quarantine.remaining_s("site-A") == 0.0  # the label is not
    finally:
        honest.close()
        mallory.close()
        handle.stop()
        handle.wait(10)


def test_a_proven_identity_is_still_quarantined_as_itself(
        server_config, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store = TokenStore(tmp_path / "tokens.toml")
    tokens = {name: store.add(name) for name in ("site-A", "site-B")}
    handle = _server(server_config, auth=AuthConfig(tokens_file=str(store.path)))
    mallory = RawSession(handle.address, "", tokens["site-A"])
    try:
        assert [mallory.send_invalid() for _ in range(3)] == [INVALID] * 3
        assert mallory.heartbeat() == ENDED
        assert join_status(handle.address, "", tokens["site-A"]) == QUARANTINED
        # Another identity from the same address is not touched by site-A's quarantine.
        assert join_status(handle.address, "", tokens["site-B"]) == OK
    finally:
        mallory.close()
        handle.stop()
        handle.wait(10)


class _BreaksOnce(Connection):
    """The first pull of each client fails as a broken connection would, with its
    session still alive on the server (no call of it open there)."""

    broken: dict[str, str] = {}  # client name -> the session whose pull broke

    def pull(self) -> Any:
        if self.config.name not in self.broken:
            assert self.session is not None
            self.broken[self.config.name] = self.session.client_id
            raise TransportError("the network blinked")
        return super().pull()


def test_a_client_that_joins_again_leaves_no_ghost_session(
        server_config, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    _BreaksOnce.broken = {}
    monkeypatch.setattr(runner_module, "Connection", _BreaksOnce)
    handle = _server(server_config, client_timeout_s=60.0)
    coordinator = handle.server.coordinator
    assert coordinator is not None

    def sessions() -> list[str]:
        return [i.client_id for i in coordinator.registry.infos() if i.name == "site-0"]

    pool = ClientThreads(handle.address, [GatedClient()])  # type: ignore[arg-type]
    try:
        wait_until(lambda: "site-0" in _BreaksOnce.broken, what="the first pull to break")
        first = _BreaksOnce.broken["site-0"]
        # Joined again, and the old session is gone now, not client_timeout_s (60 s) later.
        wait_until(lambda: len(sessions()) == 1 and sessions()[0] != first, 5.0,
                   "exactly one session of site-0, the new one")
    finally:
        pool.close()
        handle.stop()
        handle.wait(10)
