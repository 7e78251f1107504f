"""`[compression]` in simulations: the wire's codecs applied where the deployed system
applies them, byte counts per round, and what it cannot be combined with."""

from __future__ import annotations

import numpy as np
import pytest

from fedloom.compression import decode, encode, encoded_bytes, make_codec
from fedloom.errors import ConfigError
from fedloom.simulations.compression import (
    DOWNLOAD_BYTES,
    UPLOAD_BYTES,
    CompressionSpec,
    SimulatedCompression,
)
from fedloom.simulations.runner import run_scenario
from fedloom.simulations.scenario import scenario_from_mapping
from fedloom.types import ClientUpdate
from fedloom.weights import Weights

RNG = np.random.default_rng(0)
MODEL = Weights({"w": RNG.normal(size=(40, 30)).astype(np.float32),
                 "b": RNG.normal(size=30).astype(np.float32),
                 "steps": np.array([3], np.int64)})


def _delta(seed: int) -> Weights:
    rng = np.random.default_rng(seed)
    return Weights((k, rng.normal(size=v.shape).astype(v.dtype) if v.dtype.kind == "f"
                    else np.zeros_like(v)) for k, v in MODEL.items())


def _scenario(**compression: object) -> dict:
    return {"num_clients": 6, "clients_per_round": 3, "rounds": 2, "seed": 3,
            "progress": False, "compression": compression}


@pytest.mark.parametrize(("table", "match"), [
    ({"upload": "zip"}, r"compression\.upload.*'zip' is not one of"),
    ({"download": "q8"}, r"compression\.download.*'q8'.*for updates"),
    ({"upload": "q8", "quantize_block": 0}, r"compression\.quantize_block"),
    ({"upload": "topk", "topk_fraction": 0.0}, r"compression\.topk_fraction"),
    ({"upload": "topk", "topk_fraction": 1.5}, r"compression\.topk_fraction"),
])
def test_bad_compression_tables_are_refused(table: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        scenario_from_mapping(_scenario(**table))


def test_compression_is_refused_where_the_server_refuses_it_or_it_is_not_simulated() -> None:
    secure = {**_scenario(upload="q8"), "clients_per_round": 6,
              "secure_aggregation": {"enabled": True, "neighbours": 4, "threshold": 3}}
    with pytest.raises(ConfigError, match=r"compression.*secure aggregation.*commute"):
        scenario_from_mapping(secure)
    asynchronous = {**_scenario(download="fp16"), "num_rounds": 2,
                    "rounds": {"mode": "async", "concurrency": 2}}
    with pytest.raises(ConfigError, match=r"compression.*not simulated.*async"):
        scenario_from_mapping(asynchronous)


def test_the_broadcast_is_the_decoded_encoding_and_counts_its_bytes() -> None:
    sim = SimulatedCompression(CompressionSpec(download="fp16"))
    received = sim.broadcast(MODEL)
    np.testing.assert_array_equal(received["w"], MODEL["w"].astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(received["steps"], MODEL["steps"])  # integers untouched
    plain = SimulatedCompression(CompressionSpec())
    assert plain.broadcast(MODEL) is MODEL
    assert sim.traffic()[DOWNLOAD_BYTES] == 2 * 1230 + 8  # 1,230 halves + one int64
    assert plain.traffic()[DOWNLOAD_BYTES] == MODEL.nbytes


def test_an_update_is_what_the_server_decodes_with_a_seed_per_client_and_round() -> None:
    spec = CompressionSpec(upload="q8", quantize_block=64)
    sim = SimulatedCompression(spec, base_seed=5)
    update = ClientUpdate("2", _delta(1), 10, 0)
    out = sim.update(update, client_index=2, server_round=1)
    codec = make_codec("q8", block=64)
    encoded = encode(codec, update.delta, np.random.default_rng([5, 2, 1]))
    expected = decode(codec, update.delta.specs(), encoded)
    for name in MODEL:
        np.testing.assert_array_equal(out.delta[name], expected[name])
    assert (out.client_id, out.num_examples) == ("2", 10)
    assert sim.traffic()[UPLOAD_BYTES] == encoded_bytes(codec, MODEL.specs())
    again = SimulatedCompression(spec, base_seed=5).update(update, 2, 2)  # another round
    assert not np.array_equal(again.delta["w"], out.delta["w"])


def test_topk_carries_each_clients_residual_into_its_next_update() -> None:
    sim = SimulatedCompression(CompressionSpec(upload="topk", topk_fraction=0.1))
    first, second = _delta(1), _delta(2)
    sent1 = sim.update(ClientUpdate("0", first, 1, 0), 0, 1).delta
    other = sim.update(ClientUpdate("1", _delta(9), 1, 0), 1, 1).delta  # its own residual
    sent2 = sim.update(ClientUpdate("0", second, 1, 1), 0, 2).delta
    residual = sim._feedback[0].residual
    # Error feedback's invariant: what was sent plus what is kept is what was produced.
    for name in ("w", "b"):
        total = sent1[name].astype(np.float64) + sent2[name] + residual[name]
        np.testing.assert_allclose(total, first[name].astype(np.float64) + second[name],
                                   rtol=0, atol=1e-5)
        assert np.count_nonzero(sent2[name]) <= np.ceil(0.1 * first[name].size)
    assert np.count_nonzero(other["w"]) > 0 and set(sim._feedback) == {0, 1}


def test_a_compressed_run_records_its_bytes_and_is_reproducible() -> None:
    plain = run_scenario(scenario_from_mapping(_scenario()), None)
    squeezed = run_scenario(scenario_from_mapping(_scenario(upload="q8", download="fp16")), None)
    again = run_scenario(scenario_from_mapping(_scenario(upload="q8", download="fp16")), None)
    assert squeezed.weights is not None and again.weights is not None and plain.weights
    for name in squeezed.weights:  # seeded stochastic rounding: the same run twice
        np.testing.assert_array_equal(squeezed.weights[name], again.weights[name])
    assert not squeezed.weights.allclose(plain.weights)
    for ours, base in zip(squeezed.rounds[1:], plain.rounds[1:], strict=True):
        assert base.get(UPLOAD_BYTES) == base.get(DOWNLOAD_BYTES) == plain.weights.nbytes
        assert base.get(UPLOAD_BYTES) / ours.get(UPLOAD_BYTES) > 3.5
        assert ours.get(DOWNLOAD_BYTES) == plain.weights.nbytes // 2
    # 8-bit updates and a half-precision broadcast barely move what the run learns.
    ours, theirs = squeezed.final("test_accuracy"), plain.final("test_accuracy")
    assert ours is not None and theirs is not None and abs(ours - theirs) < 0.03
    assert ours > 2 * squeezed.rounds[0].get("test_accuracy")
