"""The codec contract: one tensor in, a fixed set of named parts out, and back.

A codec turns each floating-point tensor of a `Weights` into *parts* — ordinary
tensors (``name|q``, ``name|scale``, ...) whose specs follow from the original spec
alone — so an encoded update is itself a `Weights` with a layout both sides know in
advance: it travels, chunked and digested, exactly as any payload does, and a receiver
can check its size before a byte arrives. Tensors a codec does not apply to (integer
buffers such as ``num_batches_tracked``) travel as they are.

`decode` is written for hostile input: a part out of its codec's range (an index past
the tensor, a code outside the levels, a negative scale) raises `CompressionError`
rather than producing a tensor.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar

import numpy as np

from fedloom.errors import FedloomError
from fedloom.weights import MAX_NAME_LENGTH, TensorSpec, Weights

#: Separates a tensor's name from its part's in an encoded layout.
PART_SEPARATOR = "|"
FLOAT_DTYPES = ("float16", "float32", "float64")


class CompressionError(FedloomError, ValueError):
    """A tensor cannot be encoded, or an encoded payload does not decode."""


def part_name(name: str, part: str) -> str:
    full = f"{name}{PART_SEPARATOR}{part}"
    if len(full) > MAX_NAME_LENGTH:
        raise CompressionError(
            f"tensor name {name[:40]!r}... is too long to carry a codec part "
            f"({len(full)} > {MAX_NAME_LENGTH} characters)")
    return full


class Codec(abc.ABC):
    """Encodes floating-point tensors into fixed-layout parts (see the module docstring)."""

    #: The codec's wire name (what a server lists and a client asks for).
    name: str = ""
    #: True when ``E[decode(encode(x))] == x`` (stochastic rounding); top-k is not.
    unbiased: ClassVar[bool] = False

    def applies(self, spec: TensorSpec) -> bool:
        """Whether this codec encodes ``spec`` (else the tensor travels as it is)."""
        return spec.dtype in FLOAT_DTYPES

    @abc.abstractmethod
    def part_specs(self, spec: TensorSpec) -> tuple[TensorSpec, ...]:
        """The parts ``spec`` is encoded into: names, dtypes and shapes."""

    @abc.abstractmethod
    def encode_tensor(self, flat: np.ndarray, spec: TensorSpec,
                      rng: np.random.Generator) -> tuple[np.ndarray, ...]:
        """The parts of one tensor (``flat``: its values, 1-D), in `part_specs` order."""

    @abc.abstractmethod
    def decode_tensor(self, parts: Sequence[np.ndarray], spec: TensorSpec) -> np.ndarray:
        """The tensor (1-D, ``spec``'s dtype) from its parts; `CompressionError` for parts
        no honest encoder produces."""

    def check_tensor(self, parts: Sequence[np.ndarray], spec: TensorSpec) -> None:
        """Raise `CompressionError` exactly when ``decode_tensor`` would, or would give
        a non-finite value; decodes nothing where the parts alone tell.

        A receiver checks a whole update before it accepts it, and decodes it again
        only as the strategy folds it: the check must not cost a second decode. This
        default decodes (the reference behaviour the codecs' own checks are tested
        against).
        """
        with np.errstate(over="ignore"):  # an overflow is what this looks for
            values = self.decode_tensor(parts, spec)
        if values.size and not np.isfinite(values).all():
            raise CompressionError(f"tensor {spec.name!r} decodes to non-finite values")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def encoded_layout(codec: Codec, specs: Sequence[TensorSpec]) -> tuple[TensorSpec, ...]:
    """The layout of ``specs`` once encoded: each tensor's parts, or the tensor itself."""
    out: list[TensorSpec] = []
    for spec in specs:
        out.extend(codec.part_specs(spec) if codec.applies(spec) else (spec,))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        clash = next(n for n in names if names.count(n) > 1)
        raise CompressionError(
            f"the encoded layout names {clash!r} twice: a tensor name contains "
            f"{PART_SEPARATOR!r}; rename it to use codec {codec.name}")
    return tuple(out)


def encoded_bytes(codec: Codec, specs: Sequence[TensorSpec]) -> int:
    """Bytes of ``specs`` once encoded (the payload's size on the wire)."""
    return sum(s.nbytes for s in encoded_layout(codec, specs))


def encode(codec: Codec, weights: Weights, rng: np.random.Generator) -> Weights:
    """``weights`` encoded with ``codec``: a `Weights` of `encoded_layout`."""
    out: list[tuple[str, np.ndarray]] = []
    for spec in weights.specs():
        array = np.asarray(weights[spec.name])
        if not codec.applies(spec):
            out.append((spec.name, array))
            continue
        parts = codec.encode_tensor(array.reshape(-1), spec, rng)
        for part_spec, part in zip(codec.part_specs(spec), parts, strict=True):
            out.append((part_spec.name, part.reshape(part_spec.shape)))
    encoded_layout(codec, weights.specs())  # refuses clashing names
    return Weights(out)


def decode(codec: Codec, specs: Sequence[TensorSpec],
           encoded: Mapping[str, np.ndarray]) -> Weights:
    """The tensors of ``specs`` from their encoded parts (``encoded``'s layout must be
    ``encoded_layout(codec, specs)``; checked). Raises `CompressionError`."""
    out: list[tuple[str, np.ndarray]] = []
    for spec in specs:
        if not codec.applies(spec):  # its own tensor, in its own shape
            out.append((spec.name, _part(encoded, spec).reshape(spec.shape)))
            continue
        parts = [_part(encoded, p) for p in codec.part_specs(spec)]
        flat = codec.decode_tensor(parts, spec)
        out.append((spec.name, flat.reshape(spec.shape)))
    return Weights(out)


def check_encoded(codec: Codec, specs: Sequence[TensorSpec],
                  encoded: Mapping[str, np.ndarray]) -> None:
    """Raise `CompressionError` unless every tensor of ``specs`` decodes from
    ``encoded`` to finite values (`Codec.check_tensor`), one tensor at a time."""
    for spec in specs:
        if codec.applies(spec):
            codec.check_tensor([_part(encoded, p) for p in codec.part_specs(spec)], spec)
        else:
            _part(encoded, spec)  # its dtype and shape; its bytes were checked on receipt


def _part(encoded: Mapping[str, np.ndarray], spec: TensorSpec) -> np.ndarray:
    try:
        array = np.asarray(encoded[spec.name])
    except KeyError:
        raise CompressionError(f"the encoded payload has no part {spec.name!r}") from None
    if array.dtype != spec.numpy_dtype or array.shape != spec.shape:
        raise CompressionError(
            f"part {spec.name!r} is {array.dtype}{list(array.shape)}, expected "
            f"{spec.dtype}{list(spec.shape)}")
    return array.reshape(-1)


class DecodedWeights(Weights):
    """Read-only `Weights` over an encoded payload that decodes one tensor per access.

    What a receiver folds: an aggregator that reads an update tensor by tensor holds one
    decoded tensor at a time, never a whole decoded update. Each access decodes (and
    checks) again; nothing is cached.
    """

    __slots__ = ("_codec", "_encoded", "_specs")

    def __init__(self, codec: Codec, specs: Sequence[TensorSpec],
                 encoded: Mapping[str, np.ndarray]) -> None:
        super().__init__()
        self._codec = codec
        self._specs = {spec.name: spec for spec in specs}
        self._encoded = encoded

    def __getitem__(self, name: str) -> np.ndarray:
        spec = self._specs[name]
        if self._codec.applies(spec):
            parts = [_part(self._encoded, p) for p in self._codec.part_specs(spec)]
            array = self._codec.decode_tensor(parts, spec).reshape(spec.shape)
        else:  # a view of the payload's own tensor
            array = _part(self._encoded, spec).reshape(spec.shape)
        array.flags.writeable = False
        return array

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def specs(self) -> tuple[TensorSpec, ...]:
        return tuple(self._specs.values())
