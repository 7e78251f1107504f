"""The receiver's check of an encoded update agrees with decoding it.

A server checks every encoded update before it accepts it (`check_encoded`, one
`Codec.check_tensor` per tensor) and decodes it only as the strategy folds it; the
check looks at the parts and decodes only where they cannot vouch for the result. The
oracle is the decode itself: for any parts a hostile client may send (raw bytes of the
right layout) and for honest parts with one value changed, the check must refuse
exactly when ``decode_tensor`` refuses or yields a non-finite value.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from property_budget import examples

from fedloom import Weights
from fedloom.compression import (
    Codec,
    CompressionError,
    check_encoded,
    encode,
    encoded_layout,
    make_codec,
)
from fedloom.weights import TensorSpec

CODECS = {
    "fp16": make_codec("fp16"),
    "bf16": make_codec("bf16"),
    "q8": make_codec("q8", block=4),
    "q4": make_codec("q4", block=4),
    "topk": make_codec("topk", fraction=0.4),
}
DTYPES = ("float16", "float32", "float64")
#: Every codec with every floating dtype it encodes (fp16 leaves float16 as it is).
PAIRS = [(name, dtype) for name in sorted(CODECS) for dtype in DTYPES
         if CODECS[name].applies(TensorSpec("w", dtype, (1,)))]


def _decode_refuses(codec: Codec, parts: list[np.ndarray], spec: TensorSpec) -> bool:
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            values = codec.decode_tensor(parts, spec)
    except CompressionError:
        return True
    return bool(values.size) and not bool(np.isfinite(values).all())


def _check_refuses(codec: Codec, parts: list[np.ndarray], spec: TensorSpec) -> bool:
    try:
        codec.check_tensor(parts, spec)
    except CompressionError:
        return True
    return False


def _agree(codec: Codec, parts: list[np.ndarray], spec: TensorSpec) -> bool:
    expected = _decode_refuses(codec, parts, spec)
    assert _check_refuses(codec, parts, spec) == expected, (codec, spec, parts)
    return expected


@pytest.mark.parametrize("codec_name, dtype", PAIRS)
@settings(max_examples=examples(25), deadline=None)
@given(n=st.integers(1, 13), data=st.data())
def test_any_bytes_of_the_right_layout(codec_name, dtype, n, data) -> None:  # type: ignore[no-untyped-def]
    codec = CODECS[codec_name]
    spec = TensorSpec("w", dtype, (n,))
    parts = []
    for part in codec.part_specs(spec):
        raw = data.draw(st.binary(min_size=part.nbytes, max_size=part.nbytes))
        parts.append(np.frombuffer(raw, part.numpy_dtype).copy())
    _agree(codec, parts, spec)


@pytest.mark.parametrize("codec_name, dtype", PAIRS)
@settings(max_examples=examples(40), deadline=None)
@given(values=st.lists(st.floats(-6e4, 6e4, width=32), min_size=1, max_size=13),
       which=st.integers(0, 1), position=st.integers(0, 12),
       replacement=st.sampled_from([0, 1, -1, 7, 8, -8, 127, -128, 255, 65504.0, 65520.0,
                                    1e6, 3.4e38, np.inf, -np.inf, np.nan, 1 << 20, 1 << 31]))
def test_honest_parts_with_one_value_changed(codec_name, dtype, values, which, position,  # type: ignore[no-untyped-def]
                                             replacement) -> None:
    codec = CODECS[codec_name]
    spec = TensorSpec("w", dtype, (len(values),))
    with np.errstate(over="ignore"):
        flat = np.asarray(values, np.float32).astype(spec.numpy_dtype)
    if not np.isfinite(flat).all():
        return  # not an honest tensor (beyond float16's range)
    try:
        parts = list(codec.encode_tensor(flat, spec, np.random.default_rng(0)))
    except CompressionError:
        return  # the encoder refuses it (fp16 beyond its range): nothing to send
    assert not _agree(codec, [p.copy() for p in parts], spec)  # honest parts pass
    part = parts[which % len(parts)].copy()
    if part.size == 0:
        return
    with np.errstate(over="ignore", invalid="ignore"):
        try:
            part[position % part.size] = np.asarray(replacement).astype(part.dtype)
        except (OverflowError, ValueError):
            return
    parts[which % len(parts)] = part
    _agree(codec, parts, spec)


@pytest.mark.parametrize("codec_name", sorted(CODECS))
def test_check_encoded_walks_every_tensor(codec_name) -> None:  # type: ignore[no-untyped-def]
    codec = CODECS[codec_name]
    model = Weights({"a": np.linspace(-1, 1, 10, dtype=np.float32),
                     "steps": np.array(3, np.int64),
                     "b": np.full((2, 3), 0.5, np.float64)})
    encoded = encode(codec, model, np.random.default_rng(1))
    check_encoded(codec, model.specs(), encoded)  # honest: passes
    # Break the last floating tensor's first part: the check must get that far.
    last = next(s for s in encoded_layout(codec, model.specs()) if s.name.startswith("b|"))
    broken = {name: np.array(encoded[name]) for name in encoded}
    bad = np.full(last.shape, 0, last.numpy_dtype)
    if codec_name in ("fp16",):
        bad = np.full(last.shape, np.inf, last.numpy_dtype)
    elif codec_name == "bf16":
        bad = np.full(last.shape, 0x7F80, last.numpy_dtype)  # +inf's bits
    elif codec_name in ("q8", "q4"):
        bad = np.full(last.shape, -1.0, last.numpy_dtype)  # a negative scale
    elif codec_name == "topk":
        bad = np.full(last.shape, 10**6, last.numpy_dtype)  # an index past the tensor
    broken[last.name] = bad.reshape(last.shape)
    with pytest.raises(CompressionError):
        check_encoded(codec, model.specs(), broken)
    # A part of the wrong dtype is refused before anything is read from it.
    broken[last.name] = bad.astype(np.float64) if bad.dtype != np.float64 else bad.astype(
        np.float32)
    with pytest.raises(CompressionError, match="expected"):
        check_encoded(codec, model.specs(), broken)
