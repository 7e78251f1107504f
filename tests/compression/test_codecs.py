"""Codecs against independent references and their stated error bounds.

fp16 and bf16 must equal PyTorch's own casts (round to nearest even); stochastic
quantization must stay within one level of its block and be unbiased; top-k must keep
exactly the largest magnitudes; every decoder must refuse parts no honest encoder
produces (the receiver is the server, and the sender may be hostile).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from property_budget import examples

from fedloom import Weights
from fedloom.compression import (
    CODECS,
    CompressionError,
    QuantizeCodec,
    TopKCodec,
    decode,
    encode,
    encoded_bytes,
    encoded_layout,
    make_codec,
)

FLOATS = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)


def _vector() -> st.SearchStrategy[np.ndarray]:
    return st.integers(1, 700).flatmap(lambda n: arrays(np.float32, n, elements=FLOATS))


def _roundtrip(codec_name: str, values: np.ndarray, seed: int = 0, **settings_: object
               ) -> np.ndarray:
    codec = make_codec(codec_name, **settings_)
    weights = Weights({"w": values})
    encoded = encode(codec, weights, np.random.default_rng(seed))
    assert [s.name for s in encoded.specs()] == [s.name for s in
                                                  encoded_layout(codec, weights.specs())]
    return np.asarray(decode(codec, weights.specs(), encoded)["w"])


@settings(max_examples=examples(100))
@given(_vector())
def test_fp16_equals_torch_half(values: np.ndarray) -> None:
    want = torch.from_numpy(values).half().float().numpy()
    np.testing.assert_array_equal(_roundtrip("fp16", values), want)


@settings(max_examples=examples(100))
@given(_vector())
def test_bf16_equals_torch_bfloat16(values: np.ndarray) -> None:
    want = torch.from_numpy(values).to(torch.bfloat16).float().numpy()
    got = _roundtrip("bf16", values)
    np.testing.assert_array_equal(got, want)
    assert (np.abs(got - values) <= np.maximum(np.abs(values) * 2.0**-8, 2.0**-134)).all()


def test_bf16_rounds_ties_to_even() -> None:
    # 1 + 2**-8 is halfway between bf16's 1 and 1 + 2**-7: ties go to the even one, 1.
    tie = np.array([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8], np.float32)
    np.testing.assert_array_equal(_roundtrip("bf16", tie), [1.0, 1.0 + 2.0**-6])


def test_fp16_refuses_values_it_cannot_carry() -> None:
    with pytest.raises(CompressionError, match="use the bf16 codec"):
        _roundtrip("fp16", np.array([1e5], np.float32))


@pytest.mark.parametrize("bits", [8, 4])
@settings(max_examples=examples(150))
@given(values=_vector(), block=st.integers(1, 300), seed=st.integers(0, 2**32 - 1))
def test_quantization_stays_within_one_level_of_its_block(
        bits: int, values: np.ndarray, block: int, seed: int) -> None:
    got = _roundtrip(f"q{bits}", values, seed, block=block)
    levels = (1 << (bits - 1)) - 1
    padded = np.zeros(-(-values.size // block) * block, np.float64)
    padded[:values.size] = values
    scale = np.repeat(np.abs(padded.reshape(-1, block)).max(axis=1), block)[:values.size]
    error = np.abs(got.astype(np.float64) - values)
    assert (error <= scale / levels * (1 + 1e-6) + 1e-30).all()
    assert (np.sign(got) * np.sign(values) >= 0).all()  # never flips a sign


@pytest.mark.parametrize("bits", [8, 4])
def test_quantization_is_unbiased(bits: int) -> None:
    """The mean of many independent encodings converges on the value (CLT bound)."""
    rng = np.random.default_rng(5)
    values = rng.normal(size=64).astype(np.float32)
    trials = 4000
    total = np.zeros(values.size)
    for seed in range(trials):
        total += _roundtrip(f"q{bits}", values, seed, block=64)
    levels = (1 << (bits - 1)) - 1
    step = float(np.max(np.abs(values))) / levels  # a rounding's spread is at most 1 step
    bound = 5 * (step / 2) / math.sqrt(trials)
    assert np.max(np.abs(total / trials - values)) < bound


def test_values_on_the_grid_are_exact() -> None:
    codec = QuantizeCodec(bits=4, block=8)
    values = np.array([0, 1, -2, 3, -4, 5, -6, 7], np.float32) * 0.5  # scale 3.5, L = 7
    np.testing.assert_array_equal(_roundtrip("q4", values, block=8), values)
    assert codec.part_specs(Weights({"w": values}).specs()[0])[1].shape == (4,)  # 2 per byte


@settings(max_examples=examples(100))
@given(values=_vector(), fraction=st.floats(0.001, 1.0))
def test_topk_keeps_exactly_the_largest_magnitudes(values: np.ndarray, fraction: float) -> None:
    codec = TopKCodec(fraction)
    k = codec.k(values.size)
    assert k == min(values.size, max(1, math.ceil(fraction * values.size - 1e-9)))
    got = _roundtrip("topk", values, fraction=fraction)
    kept = np.flatnonzero(got)
    # Every value sent is exact; nothing dropped is larger than anything kept.
    np.testing.assert_array_equal(got[kept], values[kept])
    magnitudes = np.sort(np.abs(values))[::-1]
    threshold = magnitudes[k - 1]
    assert np.count_nonzero(got) <= k
    assert (np.abs(values[got == 0]) <= threshold).all()
    assert np.sum(np.abs(got)) == pytest.approx(float(np.sum(magnitudes[:k])), rel=1e-6)


def test_sizes_match_the_documented_ratios() -> None:
    specs = Weights({"w": np.zeros(1_000_000, np.float32), "steps": np.zeros(3, np.int64)}
                    ).specs()
    raw = 4_000_000
    assert encoded_bytes(make_codec("fp16"), specs) == raw // 2 + 24
    assert raw / (encoded_bytes(make_codec("q8"), specs) - 24) == pytest.approx(3.94, 0.01)
    assert raw / (encoded_bytes(make_codec("q4"), specs) - 24) == pytest.approx(7.76, 0.01)
    assert raw / (encoded_bytes(make_codec("topk", fraction=0.01), specs) - 24) == 50


def test_integer_tensors_travel_as_they_are() -> None:
    # in their own shapes: BatchNorm's 0-dim num_batches_tracked came back as int64[1]
    # from a decoded download, and every update of that client was refused
    weights = Weights({"w": np.ones(10, np.float32), "steps": np.array([7], np.int64),
                       "count": np.array(3, np.int64),
                       "table": np.arange(6, dtype=np.int32).reshape(2, 3)})
    for name in CODECS:
        codec = make_codec(name)
        encoded = encode(codec, weights, np.random.default_rng(0))
        np.testing.assert_array_equal(encoded["steps"], [7])
        decoded = decode(codec, weights.specs(), encoded)
        for tensor in ("steps", "count", "table"):
            assert decoded[tensor].shape == weights[tensor].shape, (name, tensor)
            np.testing.assert_array_equal(decoded[tensor], weights[tensor])
        decoded.check_same_layout(weights)  # what the client's upload is checked against


def _encoded(name: str, **settings_: object) -> tuple[object, Weights, Weights]:
    codec = make_codec(name, **settings_)
    weights = Weights({"w": np.linspace(-1, 1, 20, dtype=np.float32)})
    return codec, weights, encode(codec, weights, np.random.default_rng(0))


def _tampered(encoded: Weights, part: str, value: np.ndarray) -> dict[str, np.ndarray]:
    out = {n: np.array(a) for n, a in encoded.items()}
    out[part] = value.astype(out[part].dtype)
    return out


@pytest.mark.parametrize(("codec_name", "part", "change", "message"), [
    ("topk", "w|idx", lambda a: np.where(np.arange(a.size) == a.size - 1, 99, a),
     "strictly increasing and below 20"),
    ("topk", "w|idx", lambda a: np.sort(np.append(a[:-1], a[0])), "strictly increasing"),
    ("topk", "w|val", lambda a: np.where(np.arange(a.size) == 0, np.nan, a), "finite"),
    ("q8", "w|q8", lambda a: np.where(np.arange(a.size) == 0, -128, a), "[-127, 127]"),
    ("q8", "w|scale", lambda a: -np.abs(a) - 1, "finite and >= 0"),
    ("q4", "w|q4", lambda a: np.where(np.arange(a.size) == 0, 0, a), "[-7, 7]"),
    ("fp16", "w|f16", lambda a: np.where(np.arange(a.size) == 0, np.inf, a), "non-finite"),
    ("bf16", "w|bf16", lambda a: np.where(np.arange(a.size) == 0, 0x7F80, a), "non-finite"),
])
def test_decoders_refuse_parts_no_honest_encoder_makes(codec_name, part, change, message) -> None:  # type: ignore[no-untyped-def]
    codec, weights, encoded = _encoded(codec_name, **({"fraction": 0.2} if codec_name == "topk"
                                                       else {}))
    tampered = _tampered(encoded, part, change(np.asarray(encoded[part])))
    with pytest.raises(CompressionError, match=message.replace("[", r"\[").replace("]", r"\]")):
        decode(codec, weights.specs(), tampered)  # type: ignore[arg-type]


def test_a_part_of_the_wrong_layout_is_refused() -> None:
    codec, weights, encoded = _encoded("q8")
    wrong = {n: np.array(a) for n, a in encoded.items()}
    wrong["w|q8"] = wrong["w|q8"][:-1]
    with pytest.raises(CompressionError, match=r"part 'w\|q8' is int8\[19\], expected"):
        decode(codec, weights.specs(), wrong)  # type: ignore[arg-type]
    del wrong["w|q8"]
    with pytest.raises(CompressionError, match="has no part"):
        decode(codec, weights.specs(), wrong)  # type: ignore[arg-type]


def test_unknown_codecs_and_settings_are_named() -> None:
    with pytest.raises(CompressionError, match="unknown codec 'zip'"):
        make_codec("zip")
    with pytest.raises(CompressionError, match=r"does not take \['fraction'\]"):
        make_codec("q8", fraction=0.1)
    with pytest.raises(CompressionError, match="bits must be 4 or 8"):
        QuantizeCodec(bits=2)
    with pytest.raises(CompressionError, match=r"fraction must be in \(0, 1\]"):
        TopKCodec(0.0)


def test_a_name_that_clashes_with_a_part_is_refused() -> None:
    weights = Weights({"w": np.ones(4, np.float32), "w|f16": np.ones(4, np.float16)})
    with pytest.raises(CompressionError, match=r"names 'w\|f16' twice"):
        encoded_layout(make_codec("fp16"), weights.specs())


def test_decoded_weights_decode_each_tensor_on_access() -> None:
    from fedloom.compression import DecodedWeights

    weights = Weights({"a": np.linspace(-1, 1, 30, dtype=np.float32).reshape(5, 6),
                       "b": np.arange(4, dtype=np.int32),
                       "c": np.full(7, 0.25, np.float32)})
    codec = make_codec("q8", block=4)
    encoded = encode(codec, weights, np.random.default_rng(3))
    lazy = DecodedWeights(codec, weights.specs(), encoded)
    eager = decode(codec, weights.specs(), encoded)
    assert list(lazy) == ["a", "b", "c"] and lazy.specs() == weights.specs()
    for name in weights:
        np.testing.assert_array_equal(lazy[name], eager[name])
        assert not lazy[name].flags.writeable
    broken = {n: np.array(a) for n, a in encoded.items()}
    broken["c|scale"] = -broken["c|scale"] - 1
    lazy = DecodedWeights(codec, weights.specs(), broken)
    np.testing.assert_array_equal(lazy["a"], eager["a"])  # each tensor checked on its own
    with pytest.raises(CompressionError, match="finite and >= 0"):
        lazy["c"]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantization_of_subnormal_blocks_stays_exact_in_range(bits: int) -> None:
    # A block's scale can be subnormal: levels / scale overflows float32, |x| / scale not.
    tiny = np.array([0.0, 1e-45, -3e-45, 7e-45, 0.0, -1e-44, 2e-45, 0.0], np.float32)
    with np.errstate(over="raise", invalid="raise"):  # no overflow, no NaN on the way
        got = _roundtrip(f"q{bits}", tiny, seed=4, block=4)
    levels = (1 << (bits - 1)) - 1
    scale = np.repeat(np.abs(tiny.reshape(-1, 4)).max(axis=1), 4)
    assert (np.abs(got.astype(np.float64) - tiny) <= scale / levels * (1 + 1e-6) + 1e-45).all()
    assert (got[tiny == 0] == 0).all() and (np.sign(got) * np.sign(tiny) >= 0).all()
