"""Round time over a bandwidth-limited link: part 2 of benchmarks/compression.py.

A real server (FedAvg, plaintext on loopback) runs in this process; each client runs in
its own spawned process and reaches the server through its own TCP proxy, which paces
each direction with a token bucket (``up_mbit`` client to server, ``down_mbit`` server
to client; one bucket per direction per client, shared by that client's connections,
as one access link would be). The proxies run in one more spawned process, so the
server's and the clients' CPU work does not hold up their pacing. A client's
"training" adds Gaussian noise (standard deviation 1e-3) to every weight: the round
moves the model down and an update up, and costs next to no CPU.

Each case reports the server's round durations (task issued to update aggregated),
their median after round 1, and the bytes each proxy carried per direction (the wire:
gRPC and HTTP/2 framing included), per client and round. The proxies also time when
each direction of each link is busy (reads less than ``GAP`` apart form one transfer;
control frames do not count), which splits a steady round into: the download, the
client's gap (last byte of the model in to first byte of the update out: decoding, the
fit, encoding), the upload, and the server's gap (last byte of the update in to first
byte of the next model out: checking and folding the updates, the checkpoint, the next
broadcast).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

#: Bytes a proxy reads and paces at a time, and the bucket's depth (burst).
PIECE = 16 * 1024
BURST = 32 * 1024
#: Reads of at least MIN_PIECE bytes carry a transfer (smaller ones are control
#: traffic: flow-control frames, heartbeats); pauses shorter than GAP do not end it,
#: and transfers under MIN_TRANSFER bytes (a join, a header) are not counted.
MIN_PIECE = 4096
GAP = 0.3
MIN_TRANSFER = 64 * 1024


class TokenBucket:
    """Lets ``rate`` bytes per second through, in bursts of at most ``burst`` bytes."""

    def __init__(self, rate: float, burst: int = BURST) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.stamp = time.monotonic()
        self.lock = asyncio.Lock()  # first come, first served among connections
        self.carried = 0
        self.transfers: list[list[float]] = []  # [first, last piece's time, bytes]

    async def take(self, size: int) -> None:
        """Wait until ``size`` (at most ``burst``) bytes may go."""
        async with self.lock:
            while True:
                now = time.monotonic()
                self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
                self.stamp = now
                if self.tokens >= size:
                    self.tokens -= size
                    self.carried += size
                    self._record(now, size)
                    return
                await asyncio.sleep((size - self.tokens) / self.rate)

    def _record(self, now: float, size: int) -> None:
        if size < MIN_PIECE:
            return
        if self.transfers and now - self.transfers[-1][1] < GAP:
            self.transfers[-1][1] = now
            self.transfers[-1][2] += size
        else:
            self.transfers.append([now, now, size])

    def big_transfers(self) -> list[list[float]]:
        return [t for t in self.transfers if t[2] >= MIN_TRANSFER]


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                bucket: TokenBucket) -> None:
    try:
        while data := await reader.read(PIECE):
            await bucket.take(len(data))
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _links(target_port: int, rates: list[tuple[float, float]], conn: Connection) -> None:
    buckets = [(TokenBucket(up), TokenBucket(down)) for up, down in rates]

    def handler(up: TokenBucket, down: TokenBucket) -> Any:
        async def handle(client_r: asyncio.StreamReader,
                         client_w: asyncio.StreamWriter) -> None:
            try:
                server_r, server_w = await asyncio.open_connection("127.0.0.1", target_port)
            except OSError:
                client_w.close()
                return
            await asyncio.gather(_pump(client_r, server_w, up), _pump(server_r, client_w, down))
        return handle

    servers = [await asyncio.start_server(handler(up, down), "127.0.0.1", 0)
               for up, down in buckets]
    conn.send([s.sockets[0].getsockname()[1] for s in servers])
    try:  # serve until the parent asks for the counts (or goes away)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        conn.send([(up.carried, down.carried, up.big_transfers(), down.big_transfers())
                   for up, down in buckets])
    except (EOFError, OSError):
        pass
    for server in servers:
        server.close()


def serve_links(target_port: int, rates: list[tuple[float, float]], conn: Connection) -> None:
    """Proxy process: one paced proxy to ``target_port`` per ``(up, down)`` byte rate;
    sends the ports, then on any message the bytes each carried, and exits."""
    asyncio.run(_links(target_port, rates, conn))


def client_main(address: str, index: int, upload: tuple[str, ...],
                download: tuple[str, ...]) -> None:
    """Client process: one SDK client whose fit adds small noise, until the run ends."""
    import logging

    from fedloom import Weights
    from fedloom.client_sdk import Client, EvaluateOutput, FitOutput, start_client
    from fedloom.config import ClientConfig

    logging.basicConfig(level=logging.ERROR)
    rng = np.random.default_rng(index)
    scale = np.float32(1e-3)

    class NoisyStep(Client):
        def fit(self, weights: Weights, config: Any) -> FitOutput:
            return FitOutput(Weights(
                (n, a + rng.standard_normal(a.shape, dtype=np.float32) * scale)
                for n, a in weights.items()), 10, {})

        def evaluate(self, weights: Weights, config: Any) -> EvaluateOutput:
            return EvaluateOutput(0.0, 10, {})

    config = ClientConfig(server_address=address, insecure=True, rpc_timeout_s=600.0,
                          max_reconnect_attempts=5, upload_codecs=upload,
                          download_codecs=download)
    start_client(address, NoisyStep(), name=f"link-{index}", config=config,
                 handle_signals=False, log_to_console=False)


def phases(carried: list[Any], rounds: int) -> dict[str, float] | None:
    """Median seconds of each phase of the rounds after the first, over the clients
    (see the module docstring); None when a link's transfers do not pair into rounds."""
    found: dict[str, list[float]] = {"download_s": [], "client_gap_s": [], "upload_s": [],
                                     "server_gap_s": []}
    for _, _, ups, downs in carried:
        if len(downs) == rounds - 1:  # round 1's model, compressed below MIN_TRANSFER
            downs = [[0.0, 0.0, 0], *downs]  # (its phases are not counted)
        if len(ups) != rounds or len(downs) != rounds:
            return None
        for k in range(1, rounds):
            found["download_s"].append(downs[k][1] - downs[k][0])
            found["client_gap_s"].append(ups[k][0] - downs[k][1])
            found["upload_s"].append(ups[k][1] - ups[k][0])
            found["server_gap_s"].append(downs[k][0] - ups[k - 1][1])
    return {key: statistics.median(values) for key, values in found.items()}


def _receive(conn: Connection, proc: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.2):
        if not proc.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the link proxy process died or hung")
    return conn.recv()


def run_link_case(num_params: int, rounds: int, clients: int, up_mbit: float,
                  down_mbit: float, upload: tuple[str, ...] = (),
                  download: tuple[str, ...] = ()) -> dict[str, Any]:
    """``rounds`` fit-only rounds of ``clients`` clients, each behind its own paced link;
    the server accepts (and each client asks for) ``upload`` / ``download`` codecs."""
    from _transfer_fedloom import model_arrays

    from fedloom import ServerConfig, Weights
    from fedloom.config import CompressionConfig
    from fedloom.server import Server

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="fedloom-link-") as state_dir:
        config = ServerConfig(
            address="127.0.0.1:0", num_rounds=rounds, min_clients=clients,
            min_fit_clients=clients, fraction_evaluate=0.0, insecure=True,
            state_dir=state_dir, progress=False, keep_checkpoints=1, round_timeout_s=900.0,
            stream_timeout_s=900.0,
            compression=CompressionConfig(upload=upload, download=download),
        )  # fmt: skip
        handle = Server(config, initial_weights=Weights(model_arrays(num_params))).start()
        parent, child = ctx.Pipe()
        rate = [(up_mbit * 1e6 / 8, down_mbit * 1e6 / 8)] * clients
        proxy = ctx.Process(target=serve_links, args=(handle.port, rate, child), daemon=True)
        proxy.start()
        workers = []
        try:
            ports = _receive(parent, proxy, 60)
            started = time.monotonic()
            for i, port in enumerate(ports):
                worker = ctx.Process(target=client_main, daemon=True,
                                     args=(f"127.0.0.1:{port}", i, upload, download))
                worker.start()
                workers.append(worker)
            history = handle.wait(rounds * 600.0)
            wall = time.monotonic() - started
            parent.send("counts")
            carried = _receive(parent, proxy, 30)
        finally:
            handle.stop()
            for proc in [*workers, proxy]:
                proc.join(20)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
    durations = [r.duration_s for r in history if r.round > 0 and r.status == "ok"]
    if len(durations) < 2:
        raise RuntimeError(f"only {len(durations)} of {rounds} rounds completed")
    steady = durations[1:]
    per_round = clients * rounds
    return {
        "params": num_params, "clients": clients, "rounds": rounds,
        "up_mbit": up_mbit, "down_mbit": down_mbit,
        "upload": list(upload), "download": list(download),
        "round_s": statistics.median(steady), "min_round_s": min(steady),
        "max_round_s": max(steady), "durations_s": durations,
        "wire_up_bytes": sum(c[0] for c in carried) / per_round,
        "wire_down_bytes": sum(c[1] for c in carried) / per_round,
        "phases": phases(carried, rounds), "wall_s": wall,
    }  # fmt: skip
