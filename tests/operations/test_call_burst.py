"""A burst of calls from many clients at once is answered, not refused.

gRPC refuses calls that wait for the event loop once more than 1,000 are waiting (the
client sees CANCELLED); a round's results from a thousand clients arrive as such a burst.
The server raises that limit with its ``max_clients`` (`fedloom.server.app`).
"""

from __future__ import annotations

import asyncio
import collections

import grpc
from helpers import small_weights

from fedloom.messages import PROTOCOL_VERSION, JoinRequest
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc
from fedloom.server import Server
from fedloom.server.app import grpc_server_options

SESSIONS = 1_500  # one heartbeat each, all at once: half again gRPC's default limit
CONNECTIONS = 50


async def _burst(address: str) -> collections.Counter[str]:
    options = [("grpc.use_local_subchannel_pool", 1)]  # one TCP connection each
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(CONNECTIONS)]
    stubs = [pb_grpc.FleetStub(channel) for channel in channels]
    beats = []
    for i in range(SESSIONS):
        join = JoinRequest(PROTOCOL_VERSION, frozenset({"fit"}), f"burst-{i}")
        stub = stubs[i % CONNECTIONS]
        reply = await stub.Join(codec.join_request_to_proto(join), timeout=30)
        beats.append((stub, pb.HeartbeatRequest(session=reply.session)))
    outcomes: collections.Counter[str] = collections.Counter()

    async def beat(stub: pb_grpc.FleetStub, request: pb.HeartbeatRequest) -> None:
        try:
            await stub.Heartbeat(request, timeout=60)
            outcomes["OK"] += 1
        except grpc.aio.AioRpcError as exc:
            outcomes[exc.code().name] += 1

    await asyncio.gather(*(beat(stub, request) for stub, request in beats))
    for channel in channels:
        await channel.close()
    return outcomes


def test_a_burst_of_heartbeats_from_every_client_is_answered(server_config) -> None:
    # More clients than a round needs: no round starts, only sessions and heartbeats.
    config = server_config(min_clients=SESSIONS + 1, max_clients=SESSIONS,
                           heartbeat_interval_s=5.0, client_timeout_s=60.0)
    handle = Server(config, initial_weights=small_weights()).start()
    try:
        outcomes = asyncio.run(_burst(handle.address))
    finally:
        handle.stop()
        handle.wait(30)
    assert outcomes == {"OK": SESSIONS}


def test_the_waiting_calls_limit_grows_with_max_clients(server_config) -> None:
    def limits(max_clients: int) -> tuple[int, int]:
        options = dict(grpc_server_options(server_config(max_clients=max_clients)))
        return (options["grpc.server.max_pending_requests"],
                options["grpc.server.max_pending_requests_hard_limit"])

    assert limits(100) == (1_000, 2_000)  # never below gRPC's default
    assert limits(5_000) == (10_000, 20_000)
