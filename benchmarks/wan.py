"""Round time over an emulated high-latency link, by the server's stream window.

The server in this process, one client in a thread, and between them a TCP proxy that
holds every byte for ``rtt / 2`` in each direction (this machine has no ``netem``).
The proxy adds latency only, not a bandwidth limit, so what it shows is HTTP/2 flow
control: an upload can have at most one receive window of bytes in flight per round
trip. Each case runs fit-only rounds (the client adds 1 to every weight) and reports
the median round after the first.

    python benchmarks/wan.py                                  # 0/50/200 ms x 0, 1, 4 MiB
    python benchmarks/wan.py --rtt-ms 200 --windows 0,4194304 --params 2.5M

``window 0`` is gRPC's default (what the server uses unless
``transfer.stream_window_bytes`` is set); the server's memory cost of a larger window
is in benchmarks/README.md (transfer, 50 clients).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from _report import write_report
from transfer import parse_size

from fedloom import ServerConfig, Weights
from fedloom.client_sdk import Client, EvaluateOutput, FitOutput, start_client
from fedloom.config import ClientConfig, TransferConfig
from fedloom.server import Server

RESULTS = Path(__file__).resolve().parent / "results"


class _AddOne(Client):
    def fit(self, weights, config):  # type: ignore[no-untyped-def]
        return FitOutput(Weights({k: a + 1 for k, a in weights.items()}), 1, {})

    def evaluate(self, weights, config):  # type: ignore[no-untyped-def]
        return EvaluateOutput(0.0, 1, {})


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float
) -> None:
    """Copy ``reader`` to ``writer``, each piece delivered ``delay_s`` after it came."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not data:
                writer.close()
                return
            writer.write(data)
            await writer.drain()

    delivery = asyncio.create_task(deliver())
    while True:
        data = await reader.read(1 << 16)
        queue.put_nowait((loop.time() + delay_s, data))
        if not data:
            break
    await delivery


def start_proxy(target_port: int, one_way_s: float) -> int:
    """A latency proxy to ``127.0.0.1:target_port`` in a daemon thread; its port."""
    ports: list[int] = []

    async def main() -> None:
        async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", target_port)
            await asyncio.gather(
                _pipe(client_r, server_w, one_way_s),
                _pipe(server_r, client_w, one_way_s),
                return_exceptions=True,
            )

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        ports.append(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    threading.Thread(target=lambda: asyncio.run(main()), daemon=True).start()
    while not ports:
        time.sleep(0.01)
    return ports[0]


def run_case(num_params: int, rtt_ms: float, window: int, rounds: int,
             separate_uploads: bool = True) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fedloom-wan-") as state_dir:
        config = ServerConfig(
            address="127.0.0.1:0", num_rounds=rounds, min_clients=1, min_fit_clients=1,
            fraction_evaluate=0.0, insecure=True, state_dir=state_dir, progress=False,
            round_timeout_s=600.0, transfer=TransferConfig(stream_window_bytes=window),
        )  # fmt: skip
        weights = Weights({"w": np.zeros(num_params, np.float32)})
        handle = Server(config, initial_weights=weights).start()
        port = start_proxy(handle.port, rtt_ms / 2000)
        client_config = ClientConfig(
            server_address=f"127.0.0.1:{port}", insecure=True, rpc_timeout_s=600.0,
            separate_upload_connection=separate_uploads,
        )
        client = threading.Thread(
            target=start_client,
            args=(client_config.server_address, _AddOne()),
            kwargs={"config": client_config, "handle_signals": False},
            daemon=True,
        )
        client.start()
        history = handle.wait(1800)
    durations = [r.duration_s for r in history if r.status == "ok"]
    steady = statistics.median(durations[1:]) if len(durations) > 1 else float("nan")
    model_mb = num_params * 4 / 1e6
    return {
        "params": num_params, "rtt_ms": rtt_ms, "window": window, "round_s": steady,
        "separate_upload_connection": separate_uploads,
        "mb_per_s": 2 * model_mb / steady, "rounds_ok": len(durations),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="2.5M", help="float32 parameters (10 MB)")
    parser.add_argument("--rtt-ms", default="0,50,200", help="round-trip times to emulate")
    parser.add_argument("--windows", default="0,1048576,4194304",
                        help="server stream windows in bytes (0: gRPC's default)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--shared-upload-connection", action="store_true",
                        help="the client pushes on its long-lived channel (for A/B)")
    parser.add_argument("--out", type=Path, default=None, help="JSON report path")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    num_params = parse_size(args.params)
    results = []
    print(f"{'rtt ms':>7} {'window':>9} {'round s':>8} {'MB/s':>7}")
    for rtt in (float(x) for x in args.rtt_ms.split(",")):
        for window in (int(x) for x in args.windows.split(",")):
            r = run_case(num_params, rtt, window, args.rounds,
                         separate_uploads=not args.shared_upload_connection)
            results.append(r)
            print(f"{rtt:7.0f} {window:9d} {r['round_s']:8.3f} {r['mb_per_s']:7.1f}", flush=True)
    write_report("wan", args, results, [], args.out or RESULTS / "wan.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
