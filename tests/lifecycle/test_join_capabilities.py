"""Capabilities at Join: the reply is the negotiated set, not the server's list.

A client learns from the reply which task kinds it will be sent: the kinds it asked for
that the server knows. Names the server does not know are ignored (a newer client may
know kinds an older server does not), and a client without "fit" is refused.
"""

from __future__ import annotations

import pytest

from fedloom.config import ServerConfig
from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.messages import PROTOCOL_VERSION, JoinRequest
from fedloom.protos import codec
from fedloom.server.fleet import Fleet


def _fleet(tmp_path) -> Fleet:  # type: ignore[no-untyped-def]
    return Fleet(ServerConfig(insecure=True, state_dir=str(tmp_path)), "run-1")


@pytest.mark.parametrize("asked, granted", [
    ({"fit"}, {"fit"}),
    ({"fit", "evaluate"}, {"fit", "evaluate"}),
    ({"fit", "evaluate", "secagg"}, {"fit", "evaluate", "secagg"}),
    ({"fit", "stream-v9", "evaluate"}, {"fit", "evaluate"}),
])
def test_the_reply_lists_what_was_granted(tmp_path, asked, granted) -> None:  # type: ignore[no-untyped-def]
    fleet = _fleet(tmp_path)
    reply = fleet.join(JoinRequest(PROTOCOL_VERSION, frozenset(asked), "site"))
    assert set(reply.capabilities) == granted
    record = fleet.registry.get(reply.session.client_id)
    assert record is not None and set(record.info.capabilities) == granted
    # and the wire carries exactly that set, sorted
    wire = codec.join_reply_to_proto(reply)
    assert list(wire.capabilities) == sorted(granted)


def test_a_client_without_fit_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MessageRejectedError, match="must support 'fit'") as refused:
        _fleet(tmp_path).join(JoinRequest(PROTOCOL_VERSION, frozenset({"evaluate"}), "site"))
    assert refused.value.reason is RejectReason.INVALID
