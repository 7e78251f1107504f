"""`FrozenRecord`: configs and metrics are checked once, then cannot change."""

from __future__ import annotations

import copy
import json
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from fedloom.client_sdk import FitOutput
from fedloom.protos import codec
from fedloom.types import MAX_INT, MIN_INT, ClientUpdate, FitPlan, FrozenRecord, validate_record
from fedloom.weights import Weights

CHANGES: dict[str, Callable[[Any], object]] = {
    "set": lambda r: r.__setitem__("loss", 1.0),
    "delete": lambda r: r.__delitem__("loss"),
    "update": lambda r: r.update(loss=1.0),
    "or-assign": lambda r: r.__ior__({"loss": 1.0}),
    "pop": lambda r: r.pop("loss"),
    "popitem": lambda r: r.popitem(),
    "setdefault": lambda r: r.setdefault("other", 1),
    "clear": lambda r: r.clear(),
}


def _weights() -> Weights:
    return Weights({"w": np.zeros(3, np.float32)})


@pytest.mark.parametrize("change", CHANGES, ids=list(CHANGES))
def test_a_validated_record_refuses_every_change(change: str) -> None:
    record = validate_record({"loss": 0.5, "name": "a"}, "metrics")
    with pytest.raises(TypeError, match="read-only"):
        CHANGES[change](record)
    assert record == {"loss": 0.5, "name": "a"}


def test_the_frozen_dataclasses_cannot_have_their_records_changed() -> None:
    out = FitOutput(_weights(), 3, {"loss": 0.5})
    with pytest.raises(TypeError, match="read-only"):
        out.metrics["loss"] = float("nan")  # type: ignore[index]
    plan = FitPlan(("1",), {"lr": 0.1})
    with pytest.raises(TypeError, match="read-only"):
        plan.config["lr"] = "not a number"  # type: ignore[index]


def test_a_validated_record_is_passed_on_unchecked_and_unchanged() -> None:
    out = FitOutput(_weights(), 3, {"loss": 0.5})
    update = ClientUpdate("1", out.weights, out.num_examples, 0, out.metrics)
    assert update.metrics is out.metrics  # not copied, not checked again
    assert validate_record(out.metrics, "metrics") is out.metrics


def test_a_plain_dict_is_still_checked_and_copied() -> None:
    raw = {"loss": 0.5}
    record = validate_record(raw, "metrics")
    assert type(record) is FrozenRecord and record == raw and record is not raw
    raw["loss"] = float("inf")  # the caller's dict may change; the record does not
    assert record["loss"] == 0.5
    with pytest.raises(ValueError, match="not finite"):
        validate_record(raw, "metrics")
    with pytest.raises(ValueError, match="not a bool, int, float, str or bytes"):
        ClientUpdate("1", _weights(), 3, 0, {"loss": [1.0]})  # type: ignore[dict-item]


def test_a_frozen_record_made_directly_is_checked_too() -> None:
    # validate_record trusts a FrozenRecord, so none may exist unchecked.
    with pytest.raises(ValueError, match=r"config\['lr'\]: nan is not finite"):
        FrozenRecord({"lr": float("nan")}, "config")
    with pytest.raises(ValueError, match="key 1 must be a string"):
        FrozenRecord({1: 2})  # type: ignore[dict-item]
    assert FrozenRecord() == {} and FrozenRecord({"a": 1}) == {"a": 1}
    with pytest.raises(TypeError, match="read-only"):
        FrozenRecord.fromkeys(["a"], 1)
    merged = validate_record({"a": 1}, "m") | {"b": 2}
    assert type(merged) is dict and merged == {"a": 1, "b": 2}


@pytest.mark.parametrize("value", [MAX_INT + 1, MIN_INT - 1, 2**70])
def test_an_int_the_wire_cannot_carry_is_refused_naming_the_range(value: int) -> None:
    """Refused where the record is made: it used to pass, and the client died at push
    (protobuf's "Value out of range"), outside the task's error handling."""
    with pytest.raises(ValueError, match=r"fit metrics\['n'\]: -?\d+ is outside the signed "
                                         r"64-bit range \[-2\*\*63, 2\*\*63 - 1\]"):
        FitOutput(_weights(), 3, {"n": value})
    with pytest.raises(ValueError, match="outside the signed 64-bit range"):
        FitPlan(("1",), {"n": value})


def test_numpy_scalars_are_taken_as_the_python_scalars_they_hold() -> None:
    """As a server's metrics hook's output is: a metric computed with numpy (a float32
    model's mean, a count) needs no unwrapping, and travels and stores as JSON."""
    out = FitOutput(_weights(), 3, {"acc": np.float32(0.5), "seen": np.int64(7),
                                    "ok": np.bool_(True), "loss": np.float64(0.25),
                                    "tag": np.str_("a")})
    assert out.metrics == {"acc": 0.5, "seen": 7, "ok": True, "loss": 0.25, "tag": "a"}
    assert [type(v) for v in out.metrics.values()] == [float, int, bool, float, str]
    assert codec.record_from_proto(codec.record_to_proto(out.metrics), "m") == out.metrics
    assert json.loads(json.dumps(out.metrics)) == out.metrics
    with pytest.raises(ValueError, match=r"fit metrics\['n'\]: \d+ is outside the signed"):
        FitOutput(_weights(), 3, {"n": np.uint64(2**64 - 1)})
    with pytest.raises(ValueError, match=r"fit metrics\['t'\]: nan is not finite"):
        FitOutput(_weights(), 3, {"t": np.float32("nan")})
    with pytest.raises(ValueError, match="complex is not a bool, int, float, str or bytes"):
        FitOutput(_weights(), 3, {"z": np.complex64(1j)})


def test_the_ints_at_the_ends_of_the_range_travel() -> None:
    record = validate_record({"low": MIN_INT, "high": MAX_INT, "flag": True}, "metrics")
    back = codec.record_from_proto(codec.record_to_proto(record), "metrics")
    assert back == {"low": -(2**63), "high": 2**63 - 1, "flag": True}


def test_a_frozen_record_pickles_copies_and_serialises_as_a_dict() -> None:
    record = validate_record({"loss": 0.5, "round": 2, "tag": b"x"}, "metrics")
    back = pickle.loads(pickle.dumps(record))
    assert type(back) is FrozenRecord and back == record
    assert copy.copy(record) is record and copy.deepcopy(record) is record
    assert json.loads(json.dumps({k: v for k, v in record.items() if k != "tag"})) == {
        "loss": 0.5, "round": 2}
    assert json.dumps(validate_record({"a": 1}, "m")) == '{"a": 1}'
    changeable = record.copy()
    changeable["loss"] = 1.0
    assert type(changeable) is dict and record["loss"] == 0.5
    assert dict(record, loss=2.0) == {"loss": 2.0, "round": 2, "tag": b"x"}
