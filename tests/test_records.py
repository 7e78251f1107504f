"""`RoundRecord`: the one record of a round, for the server's history, its run store and
the simulations."""

from __future__ import annotations

import json
import pickle

import pytest

from fedloom import RoundRecord


def _trained() -> RoundRecord:
    return RoundRecord(
        3, fit={"train_loss": 0.4, "num_updates": 5}, evaluate={"accuracy": 0.7},
        server={"test_loss": 0.3, "test_accuracy": 0.9}, num_sampled=6, num_updates=5,
        num_failures=1, duration_s=2.5, secure_aggregation={"survivors": 5, "stage_s": {}})


def test_the_json_form_round_trips_through_the_store_encoding() -> None:
    record = _trained()
    stored = json.loads(json.dumps(record.to_dict()))
    assert RoundRecord.from_dict(stored) == record
    assert pickle.loads(pickle.dumps(record)) == record  # engines pass records to processes


def test_a_record_written_by_a_newer_server_still_loads() -> None:
    data = {**_trained().to_dict(), "a_field_from_the_future": 1}
    assert RoundRecord.from_dict(data) == _trained()


def test_an_unknown_status_is_refused() -> None:
    with pytest.raises(ValueError, match="status"):
        RoundRecord(1, status="maybe")


def test_the_flat_view_is_what_a_simulation_writes() -> None:
    flat = _trained().metrics
    assert flat == {"train_loss": 0.4, "num_updates": 5, "num_failures": 1,
                    "federated_accuracy": 0.7, "test_loss": 0.3, "test_accuracy": 0.9,
                    "seconds": 2.5}
    assert _trained().get("federated_accuracy") == 0.7
    # Round 0 only evaluates the initial model: no fit keys.
    assert RoundRecord(0, server={"test_loss": 2.3}, duration_s=0.1).metrics == {
        "test_loss": 2.3, "seconds": 0.1}
    failed = RoundRecord(2, status="failed", num_failures=4, reason="no updates")
    assert failed.metrics["no_model_reason"] == "no updates"


def test_a_record_keeps_its_own_copy_of_the_sections() -> None:
    fit = {"train_loss": 1.0}
    record = RoundRecord(1, fit=fit)
    fit["train_loss"] = 2.0
    assert record.fit == {"train_loss": 1.0}
