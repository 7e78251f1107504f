"""What a failed attempt hands to the retry, and the fit config's digest by wire types."""

from __future__ import annotations

import enum

import numpy as np
import pytest
from secagg_driver import ids_of, make_inputs, run, setup_round

from fedloom.errors import SecureAggregationError
from fedloom.secagg import SecAggConfig, Stage, config_digest

CONFIG = SecAggConfig(enabled=True, neighbours=4, threshold=3, max_weight=100.0,
                      max_participants=16, bits=24)


def test_a_survivor_that_vanishes_before_consistency_is_left_out_of_the_retry() -> None:
    ids = ids_of(8)
    rnd = setup_round(CONFIG, make_inputs(ids, 20))
    run(rnd, stop_at=Stage.CONSISTENCY)  # every masked input accepted
    rnd.server.drop(ids[3])  # gone before the consistency stage asks it anything
    with pytest.raises(SecureAggregationError, match="did not confirm"):
        run(rnd)
    assert ids[3] in rnd.server.failed_clients
    assert rnd.server.failed_clients == {ids[3]}


def test_clients_that_vanished_are_left_out_of_the_retry_whatever_failed() -> None:
    ids = ids_of(5)  # 5 clients, t = 3: two gone after sharing keys sink the attempt
    rnd = setup_round(CONFIG, make_inputs(ids, 20))
    with pytest.raises(SecureAggregationError):
        run(rnd, drop_at={ids[0]: Stage.MASKED_INPUT, ids[1]: Stage.MASKED_INPUT})
    assert {ids[0], ids[1]} <= rnd.server.failed_clients


class Level(enum.IntEnum):
    HIGH = 3


class Name(enum.StrEnum):
    SGD = "sgd"


def test_the_config_digest_hashes_values_as_the_wire_delivers_them() -> None:
    # a subclass (numpy's float64, an enum member) reaches the client as its base type:
    # both sides must hash the same thing, or every client refuses the round
    sent = {"lr": np.float64(0.1), "level": Level.HIGH, "opt": Name.SGD}
    assert config_digest(sent) == config_digest({"lr": 0.1, "level": 3, "opt": "sgd"})
    # the wire's own types stay apart
    assert config_digest({"a": True}) != config_digest({"a": 1})
    assert config_digest({"a": 1}) != config_digest({"a": 1.0})
    with pytest.raises(ValueError, match="64 bits"):
        config_digest({"big": 1 << 63})
    with pytest.raises(TypeError, match="list"):
        config_digest({"bad": [1]})  # type: ignore[dict-item]
