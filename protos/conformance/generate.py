"""Write ``vectors.json``: the Fleet protocol's conformance vectors, made by fedloom itself.

Run ``python -m fedloom.protos.conformance.generate`` (or this file as a script) after
a change to the payload layout, the codec or FedAvg, and commit the result; with
``--check`` it only says whether the committed file is current (exit status 1 if not).

Every vector comes from the code the server and the SDK run: `fedloom.payload` lays out
and chunks payloads, `fedloom.protos.codec` builds the messages, `fedloom.strategies`
aggregates. Nothing here re-implements them; the checks below only refuse vectors that
would be ambiguous for a second implementation (a FedAvg result that depends on the
order of the sum). Messages are serialized with protobuf's deterministic option (map
entries sorted by key); the protocol does not fix the order of map entries, so a peer
compares records by value, not by bytes.

This tool composes the protocol wing with the strategies (as the server does); it is a
development tool and is not part of the installed package.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from fedloom.config import TransferConfig
from fedloom.messages import (
    PROTOCOL_VERSION,
    JoinReply,
    JoinRequest,
    NoTask,
    ResultHeader,
    TaskHeader,
)
from fedloom.payload import PayloadInfo, deserialize, iter_chunks, serialize
from fedloom.protos import codec
from fedloom.protos.conformance._cases import (
    FEDAVGS,
    PAYLOADS,
    RUN_ID,
    SESSION,
    TASK_ID,
    VALUES,
    TensorRows,
)
from fedloom.strategies import FedAvg, WeightedMeanAggregator
from fedloom.types import ClientUpdate, Scalar, TaskKind
from fedloom.weights import SUPPORTED_DTYPES, Weights

VECTORS_PATH = Path(__file__).with_name("vectors.json")

FEDAVG_ARITHMETIC = (
    "FedAvg as fedloom.strategies.FedAvg computes it (the weighted mean of the deltas, "
    "then server SGD at learning rate 1). With n_i the num_examples of update i and "
    "N = sum(n_i), for every element of every tensor: S = sum_i n_i * float64(delta_i), "
    "in IEEE-754 binary64; mean64 = S / N, a binary64 division. A floating tensor: "
    "mean = mean64 rounded to the tensor's dtype (to nearest, ties to even), then "
    "new = global + mean, one addition in the tensor's dtype, rounded to nearest. An "
    "integer tensor: mean = mean64 rounded half to even to an integer (numpy.rint), then "
    "new = global + mean in the tensor's dtype (fedloom wraps silently on overflow; no "
    "vector comes near it). Boolean tensors cannot be aggregated: a round over a model "
    "that holds one fails. mean_delta is the rounded mean, before it is added."
)


def b64(data: bytes | memoryview) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


def weights_of(rows: TensorRows) -> Weights:
    return Weights([(name, np.array(values, SUPPORTED_DTYPES[dtype])) for name, dtype, values
                    in rows])


def tensors_view(weights: Weights, payload: bytes | memoryview | None = None) -> list[Any]:
    """Each tensor's name, dtype, shape and values in C order; with the payload, also
    its bytes (its slice of the payload)."""
    out = []
    pos = 0
    for spec in weights.specs():
        row: dict[str, Any] = {"name": spec.name, "dtype": spec.dtype, "shape": list(spec.shape),
                               "values": weights[spec.name].reshape(-1).tolist()}
        if payload is not None:
            row["data_base64"] = b64(payload[pos : pos + spec.nbytes])
            pos += spec.nbytes
        out.append(row)
    return out


def fields(message: Message) -> dict[str, Any]:
    """The message in protobuf's canonical JSON mapping, with the .proto field names and
    the record entries sorted by key."""
    return sort_entries(MessageToDict(message, preserving_proto_field_name=True))


def sort_entries(view: Any) -> Any:
    if isinstance(view, dict):
        return {key: sort_entries(dict(sorted(value.items())) if key == "entries" else value)
                for key, value in view.items()}
    if isinstance(view, list):
        return [sort_entries(item) for item in view]
    return view


def encoded(message: Message) -> str:
    return b64(message.SerializeToString(deterministic=True))


def payload_vector(description: str, chunk_size: int, rows: TensorRows) -> dict[str, Any]:
    weights = weights_of(rows)
    payload = serialize(weights)
    info = PayloadInfo.describe(weights.specs(), payload)
    decoded = deserialize(info.specs, payload)
    assert all(np.array_equal(decoded[name], arr) for name, arr in weights.items())
    header = codec.payload_to_proto(info)
    return {
        "description": description,
        "chunk_size": chunk_size,
        "tensors": tensors_view(weights, payload),
        "header": {"tensors": [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)}
                               for s in info.specs],
                   "total_bytes": info.total_bytes, "sha256": info.sha256.hex()},
        "header_base64": encoded(header),
        "chunks": [{"offset": offset, "data_base64": b64(data)}
                   for offset, data in iter_chunks(payload, chunk_size)],
    }


def fedavg(current: Weights, updates: Sequence[ClientUpdate]) -> Weights:
    result = FedAvg().aggregate_fit(1, current, updates).weights
    assert result is not None, "FedAvg produced no model"
    return result


def raw_bytes(weights: Weights) -> list[bytes]:
    return [arr.tobytes() for arr in weights.values()]


def fedavg_vector(description: str, global_rows: TensorRows,
                  update_rows: Sequence[tuple[int, TensorRows]]) -> dict[str, Any]:
    current = weights_of(global_rows)
    updates = [ClientUpdate(f"client-{i}", weights_of(rows), n, base_round=0)
               for i, (n, rows) in enumerate(update_rows)]
    new = fedavg(current, updates)
    # A vector whose bits depend on the order of the sum would fail a correct peer.
    for order in itertools.permutations(updates):
        assert raw_bytes(fedavg(current, order)) == raw_bytes(new), description
    aggregator = WeightedMeanAggregator()
    aggregator.start(current)
    for update in updates:
        aggregator.accumulate(update)
    mean = aggregator.finalize().delta
    assert mean is not None
    return {
        "description": f"{description} {FEDAVG_ARITHMETIC}",
        "global": tensors_view(current),
        "updates": [{"num_examples": u.num_examples, "delta": tensors_view(u.delta)}
                    for u in updates],
        "mean_delta": tensors_view(mean),
        "new_global": tensors_view(new),
    }


def value_vector(description: str, value: Scalar) -> dict[str, Any]:
    proto = codec.value_to_proto(value)
    return {"description": description, "fields": fields(proto), "encoding_base64": encoded(proto)}


def record_vectors() -> list[dict[str, Any]]:
    config: dict[str, Scalar] = {"server_round": 3, "lr": 0.05, "optimizer": "sgd",
                                 "shuffle": True, "salt": b"\x01\x02"}
    out = []
    for description, record in (
        ("A fit config with every kind of value. Keys are 1..256 characters, at most 256 "
         "entries, strings and bytes at most 4096 long, floats finite (the server refuses "
         "others with INVALID_ARGUMENT).", config),
        ("An empty record: zero bytes.", {}),
    ):
        proto = codec.record_to_proto(record)
        out.append({"description": description, "fields": fields(proto),
                    "encoding_base64": encoded(proto)})
    return out


def message_vectors() -> list[dict[str, Any]]:
    model = weights_of(PAYLOADS[0][2])
    model_payload = serialize(model)
    model_info = PayloadInfo.describe(model.specs(), model_payload)
    delta = Weights({name: -0.1 * arr for name, arr in model.items()})
    delta_info = PayloadInfo.describe(delta.specs(), serialize(delta))
    transfer = TransferConfig()
    join = codec.join_request_to_proto(JoinRequest(
        PROTOCOL_VERSION, frozenset({"fit", "evaluate"}), "site-7"))
    reply = codec.join_reply_to_proto(JoinReply(
        SESSION, PROTOCOL_VERSION, frozenset({"fit", "evaluate"}), RUN_ID,
        heartbeat_interval_s=10.0, long_poll_s=20.0, chunk_size=transfer.chunk_size,
        max_message_bytes=transfer.max_message_bytes,
        max_model_bytes=transfer.max_model_bytes))
    task = codec.task_to_proto(TaskHeader(
        TASK_ID, RUN_ID, 3, TaskKind.FIT, {"server_round": 3, "lr": 0.05}, 300.0, model_info))
    fit = codec.result_to_proto(ResultHeader(
        SESSION, TASK_ID, 3, TaskKind.FIT, num_examples=30, base_round=2,
        metrics={"train_loss": 0.25}, update=delta_info))
    evaluation = codec.result_to_proto(ResultHeader(
        SESSION, TASK_ID, 3, TaskKind.EVALUATE, num_examples=30, loss=0.5,
        metrics={"accuracy": 0.875}))
    finished = codec.no_task_to_proto(NoTask(retry_after_s=0.0, run_finished=True))
    # The same task and fit result to a session granted "inline": the payload inside.
    inline_task = codec.task_to_proto(TaskHeader(
        TASK_ID, RUN_ID, 3, TaskKind.FIT, {"server_round": 3, "lr": 0.05}, 300.0, model_info),
        inline=model_payload)
    inline_fit = codec.result_to_proto(ResultHeader(
        SESSION, TASK_ID, 3, TaskKind.FIT, num_examples=30, base_round=2,
        metrics={"train_loss": 0.25}, update=delta_info), inline=serialize(delta))
    chunk = next(iter_chunks(model_payload, 16))
    rows: list[tuple[str, Message | bytes]] = [
        ("JoinRequest: protocol version 5; capabilities in any order (fedloom sorts them).",
         join),
        ("JoinResponse: the session (client_id and the secret every later call carries), "
         "the run, the timing and the transfer limits; no codec granted.", reply),
        ("TaskHeader of a fit task for round 3: it carries the model of round 2, whose "
         "PayloadHeader is the first payload vector's; the fit config names the round.",
         task.task),
        ("PullResponse holding that TaskHeader: how it travels on the Tasks stream.", task),
        ("PullResponse holding the model's first chunk (16 bytes): offset 0 is not written.",
         codec.chunk_frame(*chunk)),
        ("PullResponse holding NoTask with run_finished: the run is over, leave.", finished),
        ("ResultHeader of that fit task: round 3 as the task names it, base_round 2 (the "
         "round whose model the delta is from: the task's round - 1), the update's "
         "PayloadHeader (delta = -0.1 * the model), metrics.", fit.result),
        ("PushRequest holding that ResultHeader: the first message of a Push stream.", fit),
        ("PushRequest holding an evaluate result, the one message of a Report call.",
         evaluation),
        ("PullResponse holding that fit task with its model inside (inline_payload), as a "
         "session granted the \"inline\" capability gets it: no chunk follows.",
         inline_task),
        ("PushRequest holding that fit result with its delta inside (inline_payload): the "
         "one message of a Report call from a session granted \"inline\".", inline_fit),
    ]
    out = []
    for description, message in rows:
        if isinstance(message, bytes):  # a ready-made chunk frame: the same bytes as protobuf's
            parsed = type(finished).FromString(message)
            assert parsed.SerializeToString() == message
            message = parsed
        out.append({"message": message.DESCRIPTOR.name, "description": description,
                    "fields": fields(message), "encoding_base64": encoded(message)})
    return out


def build_vectors() -> dict[str, Any]:
    return {
        "about": (
            "Conformance vectors of fedloom's Fleet protocol, made by fedloom's own code "
            "(protos/conformance/generate.py); tests/protocol checks that they are current. "
            "Tensor values are in C (row-major) order; 'fields' is a message in protobuf's "
            "canonical JSON mapping with the .proto field names (64-bit integers as decimal "
            "strings, bytes as base64); encodings use protobuf's deterministic serialization "
            "(map entries sorted by key), but a peer may order map entries as it likes."
        ),
        "protocol_version": PROTOCOL_VERSION,
        "proto": "protos/fedloom/v1/fleet.proto",
        "payloads": [payload_vector(*row) for row in PAYLOADS],
        "fedavg": [fedavg_vector(*row) for row in FEDAVGS],
        "values": [value_vector(*row) for row in VALUES],
        "records": record_vectors(),
        "messages": message_vectors(),
    }


def render(vectors: dict[str, Any]) -> str:
    """The file's text: JSON, one key per line, each list of plain values on one line."""
    return _render(vectors, "") + "\n"


def _render(value: Any, indent: str) -> str:
    inner = indent + " "
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(key)}: {_render(item, inner)}" for key, item in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and any(isinstance(item, dict | list) for item in value):
        items = [inner + _render(item, inner) for item in value]
        return "[\n" + ",\n".join(items) + "\n" + indent + "]"
    return json.dumps(value, ensure_ascii=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write the Fleet protocol's conformance vectors (vectors.json).")
    parser.add_argument("--check", action="store_true",
                        help="only compare with the committed file (exit status 1 if stale)")
    args = parser.parse_args(argv)
    text = render(build_vectors())
    if args.check:
        current = VECTORS_PATH.exists() and VECTORS_PATH.read_text(encoding="utf-8") == text
        print(f"{VECTORS_PATH}: {'current' if current else 'stale: run without --check'}")
        return 0 if current else 1
    VECTORS_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {VECTORS_PATH} ({len(text.encode())} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
