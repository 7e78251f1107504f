"""The receivers' peak memory when a model far larger than a gRPC message moves.

A model many times the message limit (here 48 MB through 160 KiB messages
of 64 KiB chunks) moves both ways, and each receiver's peak resident memory stays a
small multiple of the model:

- the server receives 4 uploads, which it must verify and spool (not hold), then
  aggregates: its peak above its idle footprint (imports done, no model yet) holds the
  global model, the mean and the new model, not the uploads;
- a client receives the model in chunks: when its ``fit`` starts, its peak above its
  idle footprint is the received model plus chunk-sized buffers, not the chunks kept
  and joined.

Every process is spawned and reads its own ``VmHWM`` (the kernel's peak-RSS counter),
so the bounds are behavioural, not timings (one client per process, so that a
client's peak is its own). Linux only.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import sys
import tempfile
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

#: 48 MB of float32: large enough that gRPC's own receive buffering (the HTTP/2 window
#: it has granted, megabytes when the client falls behind on a busy machine) stays small
#: beside one model, so the bounds tell one received model from two.
PARAMS = 12_000_000
MODEL = 4 * PARAMS
CLIENTS = 4  # one per process: each reads its own peak
MB = 1 << 20


def _kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _idle() -> int:
    gc.collect()
    return _kib("VmRSS")


def _transfer() -> Any:
    from fedloom.config import TransferConfig

    return TransferConfig(chunk_size=64 * 1024, max_message_bytes=160 * 1024)


def _serve(report: Connection) -> None:
    from fedloom import ServerConfig, Weights
    from fedloom.server import Server

    idle = _idle()
    with tempfile.TemporaryDirectory() as state_dir:
        config = ServerConfig(
            address="127.0.0.1:0",
            num_rounds=1,
            min_clients=CLIENTS,
            min_fit_clients=CLIENTS,
            fraction_evaluate=0.0,
            state_dir=state_dir,
            progress=False,
            insecure=True,
            transfer=_transfer(),
        )
        weights = Weights({"w": np.full(PARAMS, 0.5, np.float32)})
        handle = Server(config, initial_weights=weights).start()
        del weights
        report.send(handle.port)
        history = handle.wait(240)
    report.send({"idle": idle, "peak": _kib("VmHWM"), "status": history[-1].status})


def _client(address: str, report: Connection) -> None:
    from fedloom import Weights
    from fedloom.client_sdk import Client, EvaluateOutput, FitOutput, start_client
    from fedloom.config import ClientConfig

    idle = _idle()
    at_fit: list[int] = []

    class Lean(Client):
        def fit(self, weights: Weights, config: Any) -> FitOutput:
            at_fit.append(_kib("VmHWM"))  # the peak so far: receiving the model
            return FitOutput(Weights((n, a + np.float32(1)) for n, a in weights.items()), 5, {})

        def evaluate(self, weights: Weights, config: Any) -> EvaluateOutput:
            return EvaluateOutput(0.0, 5, {})

    config = ClientConfig(server_address=address, insecure=True, transfer=_transfer())
    start_client(address, Lean(), config=config, handle_signals=False)
    report.send({"idle": idle, "at_fit": at_fit})


@pytest.fixture(scope="module")
def measured() -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    server_end, server_report = ctx.Pipe(duplex=False)
    server = ctx.Process(target=_serve, args=(server_report,))
    server.start()
    assert server_end.poll(120), "the server did not start"
    address = f"127.0.0.1:{server_end.recv()}"
    workers, ends = [], []
    for _ in range(CLIENTS):
        end, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_client, args=(address, child))
        proc.start()
        workers.append(proc)
        ends.append(end)
    try:
        assert server_end.poll(240), "the round did not finish"
        result = {"server": server_end.recv(), "clients": [e.recv() for e in ends]}
    finally:
        for proc in [server, *workers]:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return result


def test_the_model_is_far_larger_than_a_message() -> None:
    assert 100 * _transfer().max_message_bytes < MODEL


def test_server_peak_holds_model_copies_not_uploads(measured: dict[str, Any]) -> None:
    server = measured["server"]
    assert server["status"] == "ok"
    above = server["peak"] - server["idle"]
    # Global model, mean and new model (3x), plus buffers; holding the 4 uploads alone
    # would add 4x.
    assert above < 4 * MODEL + 24 * MB, f"server peak {above / MODEL:.2f}x the model"


def test_client_receives_the_model_into_one_buffer(measured: dict[str, Any]) -> None:
    for client in measured["clients"]:
        assert len(client["at_fit"]) == 1
        above = client["at_fit"][0] - client["idle"]
        # One received model (not its chunks kept as well), plus chunk-sized buffers.
        assert above < 1.5 * MODEL + 8 * MB, f"client peak {above / MODEL:.2f}x the model"
