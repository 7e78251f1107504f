"""Hostile encoded updates over real gRPC: each is refused with its status, its task fails,
the server logs it and carries on, and the round completes with the honest clients.

The hostile clients are raw `Connection`s driven from the test: they join with their
own codec requests, take their fit task and push a forged result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from compression_support import (
    EncodeLog,
    client_threads,
    joined,
    next_fit_task,
    rounds_committed,
)
from helpers import ScriptedClient, small_weights

from fedloom import Weights
from fedloom.compression import CodecSpec, decode, encode
from fedloom.config import CompressionConfig, TransferConfig
from fedloom.errors import ResultRefusedError
from fedloom.messages import ResultHeader
from fedloom.payload import PayloadInfo, serialize
from fedloom.server import Server
from fedloom.types import TaskKind

Q8 = CodecSpec("q8", block=4)
TOPK = CodecSpec("topk", fraction=0.5)
EXAMPLES = 5


def _delta() -> Weights:
    rng = np.random.default_rng(11)
    return Weights({n: rng.normal(size=a.shape).astype(a.dtype)
                    for n, a in small_weights().items()})


def _encoded(spec: CodecSpec) -> Weights:
    return encode(spec.build(), _delta(), np.random.default_rng(0))


def _tamper(weights: Weights, name: str, change: Callable[[np.ndarray], None]) -> Weights:
    arrays = {n: np.array(a) for n, a in weights.items()}
    change(arrays[name])
    return Weights(arrays)


def _out_of_range_index(index: np.ndarray) -> None:
    index[-1] = 12  # "w" has 12 values: one past its end


def _code_off_the_levels(codes: np.ndarray) -> None:
    codes[0] = -128  # q8 codes lie in [-127, 127]


# name -> (codecs asked at Join, the codec the header claims, the payload, the status)
HOSTILE: dict[str, tuple[tuple[str, ...], CodecSpec | None, Weights,
                         grpc.StatusCode | None]] = {
    "ungranted": ((), Q8, _encoded(Q8), grpc.StatusCode.FAILED_PRECONDITION),
    "other-codec": (("q8",), TOPK, _encoded(TOPK), grpc.StatusCode.FAILED_PRECONDITION),
    "wrong-layout": (("q8",), Q8, _encoded(CodecSpec("q8", block=8)),
                     grpc.StatusCode.INVALID_ARGUMENT),
    "bad-index": (("topk",), TOPK, _tamper(_encoded(TOPK), "w|idx", _out_of_range_index),
                  grpc.StatusCode.INVALID_ARGUMENT),
    "bad-code": (("q8",), Q8, _tamper(_encoded(Q8), "w|q8", _code_off_the_levels),
                 grpc.StatusCode.INVALID_ARGUMENT),
    # Granted q8, sends plain float32: allowed (a grant is a permission).
    "plain": (("q8",), None, _delta(), None),
}


@pytest.mark.parametrize("rpc", ["Push", "Report"])
def test_each_hostile_update_is_refused_and_the_round_completes_without_it(
        server_config, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,  # type: ignore[no-untyped-def]
        rpc: str) -> None:
    """Through Push (header, then chunks) and through Report (the small payload inside
    its header, the "inline" capability): the same refusals."""
    config = server_config(num_rounds=1, min_clients=2 + len(HOSTILE), min_fit_clients=2,
                           fraction_evaluate=0.0, client_timeout_s=20.0,
                           compression=CompressionConfig(upload=("q8", "topk"), quantize_block=4,
                                                         topk_fraction=0.5))
    log = EncodeLog(monkeypatch)
    handle = Server(config, initial_weights=small_weights()).start()
    connections = joined(handle.address, HOSTILE,
                         transfer=TransferConfig(inline_payloads=rpc == "Report"))
    honest = {f"h{i}": ScriptedClient(seed=i, num_examples=10 + i) for i in range(2)}
    statuses: dict[str, grpc.StatusCode | None] = {}
    stale: dict[str, str] = {}
    try:
        with caplog.at_level(logging.WARNING, logger="fedloom.server"), client_threads(
                handle.address, {n: (c, {"upload_codecs": ("q8",)}) for n, c in honest.items()}):
            for name, (_, claimed, payload_weights, _status) in HOSTILE.items():
                connection = connections[name]
                task = next_fit_task(connection)
                payload = serialize(payload_weights)
                result = ResultHeader(connection.session, task.task_id, task.round, TaskKind.FIT,
                                      num_examples=EXAMPLES, base_round=task.round - 1,
                                      update=PayloadInfo.describe(payload_weights.specs(),
                                                                  payload),
                                      codec=claimed)
                try:
                    connection.push(result, payload)
                    statuses[name] = None
                except ResultRefusedError as exc:
                    statuses[name] = exc.code  # type: ignore[assignment]
                if name in ("ungranted", "bad-code"):  # its task failed: sent again, told why
                    with pytest.raises(ResultRefusedError) as again:
                        connection.push(result, payload)
                    stale[name] = str(again.value)
            history = handle.wait(60)
    finally:
        for connection in connections.values():
            connection.close()
    assert statuses == {name: case[3] for name, case in HOSTILE.items()}
    record = history[-1]
    assert record.status == "ok"
    assert (record.num_updates, record.num_failures) == (3, len(HOSTILE) - 1)
    rejected = " ".join(r.getMessage() for r in caplog.records
                        if f"{rpc} rejected" in r.getMessage())
    assert "was not granted" in rejected and "not the model's layout" in rejected
    assert "must be strictly increasing and below 12" in rejected
    assert "must lie in [-127, 127]" in rejected
    assert "round 1 closed: update refused: " in stale["ungranted"]
    assert "was not granted" in stale["ungranted"]  # refused at its header
    assert "round 1 closed: update refused: the update does not decode with q8" \
        in stale["bad-code"]  # refused when its whole payload was checked
    # The server's own line for an update refused for its encoding names the client.
    ungranted = connections["ungranted"].session.client_id
    assert any(r.getMessage().startswith(f"client {ungranted}: ") and "was not granted"
               in r.getMessage() for r in caplog.records)

    # The new model is the mean of what the honest clients sent (and the plain update).
    specs = small_weights().specs()
    updates = [(c.num_examples, decode(log.of(n)[0].codec, specs, log.of(n)[0].encoded))
               for n, c in honest.items()]
    updates.append((EXAMPLES, _delta()))
    total = sum(n for n, _ in updates)
    got = rounds_committed(config.state_dir)[1]
    for name in got:
        want = sum(n * np.asarray(d[name], np.float64) for n, d in updates) / total
        np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-6)


def test_finite_updates_that_overflow_the_model_fail_their_round_and_it_stays_finite(
        server_config) -> None:  # type: ignore[no-untyped-def]
    # Every value is float32's largest finite one: each update passes every check, but
    # the second round's step (3.4e38 + 3.4e38) would overflow the model to infinity,
    # which every client would then refuse: the run would be stuck for good.
    config = server_config(num_rounds=3, min_clients=1, min_fit_clients=1,
                           fraction_evaluate=0.0, keep_checkpoints=10)
    handle = Server(config, initial_weights=small_weights()).start()
    connection = joined(handle.address, {"mallory": ((),)})["mallory"]
    huge = Weights({n: np.full(a.shape, np.finfo(np.float32).max, np.float32)
                    for n, a in small_weights().items()})
    payload = serialize(huge)
    try:
        for _ in range(3):
            task = next_fit_task(connection)
            connection.push(ResultHeader(
                connection.session, task.task_id, task.round, TaskKind.FIT,
                num_examples=EXAMPLES, base_round=task.round - 1,
                update=PayloadInfo.describe(huge.specs(), payload)), payload)
        history = handle.wait(60)
    finally:
        connection.close()
    assert [r.status for r in history if r.round > 0] == ["ok", "failed", "failed"]
    assert "would make tensor" in history[-1].reason and "non-finite" in history[-1].reason
    models = rounds_committed(config.state_dir)
    assert sorted(models) == [0, 1, 2, 3]
    for weights in models.values():  # what every client is sent: finite, as before
        assert all(np.isfinite(a).all() for a in weights.values())
