"""The zstd stage: lossless compression of a payload's bytes, after any codec.

A client asks for it per direction at Join by name: a codec with the ``+zstd`` suffix
(``"q8+zstd"``: q8, then zstd) or ``"zstd"`` alone (plain float32, compressed). The
payload's header keeps describing the bytes *before* compression (layout, size, SHA-256:
the digest still proves the content), and ``PayloadInfo.wire_bytes`` gives the size of
the zstd stream the chunks carry. A sender uses the stage only when the stream is
smaller than the payload (a grant is a permission, not a duty).

`ZstdReceiver` decompresses the stream as its chunks arrive into a `PayloadReceiver`
(or anything with its ``feed``/``finish``), so the receiver never holds more than a
chunk in and `PIECE_BYTES` out. It is written for hostile input:

- **Decompression bombs.** Output is produced in pieces of at most `PIECE_BYTES`
  (zstandard's ``stream_writer`` with a bounded ``write_size``), and each piece goes to
  the payload receiver, which refuses the first byte past the header's ``total_bytes``:
  a frame that expands without bound is refused after at most one piece of excess,
  never buffered.
- **Window size.** A frame's window (for a single-segment frame, its content size) is at
  most `MAX_WINDOW_BYTES`, 2 MiB: the decoder's own memory per stream (zstd's levels 1
  to 7 at their defaults stay within it; fedloom sends level 1, a 512 KiB window).
- **Anything else** (not a zstd stream, a stream that ends early, output that is short
  or not the digest's): refused, by zstandard or by the payload receiver's checks.

The stream may hold several frames (RFC 8878 allows their concatenation); fedloom sends
one. zstandard is an optional dependency (``pip install 'fedloom[zstd]'``), imported
only when the stage is used.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from types import ModuleType
from typing import Protocol

from fedloom.errors import ConfigError, MessageRejectedError, RejectReason

#: The stage's name alone (plain float32, compressed), and its suffix after a codec.
ZSTD = "zstd"
ZSTD_SUFFIX = "+zstd"
#: What a fedloom sender compresses with: zstd's fastest standard level.
LEVEL = 1
#: The largest window a receiver accepts (zstd's default limit is 128 MiB).
MAX_WINDOW_BYTES = 1 << 21
#: The most decompressed bytes produced at a time (zstd's largest block).
PIECE_BYTES = 1 << 17
#: What to install for the stage.
EXTRA = "pip install 'fedloom[zstd]'"


def split_stage(name: str) -> tuple[str, bool]:
    """A name as a client asks for it, or a server lists it, as ``(codec, zstd)``.

    >>> split_stage("q8+zstd"), split_stage("zstd"), split_stage("q8")
    (('q8', True), ('', True), ('q8', False))
    """
    if name == ZSTD:
        return "", True
    if name.endswith(ZSTD_SUFFIX):
        return name[: -len(ZSTD_SUFFIX)], True
    return name, False


def stage_name(codec: str, zstd: bool) -> str:
    """The inverse of `split_stage` (``""`` for no codec and no stage)."""
    if not zstd:
        return codec
    return f"{codec}{ZSTD_SUFFIX}" if codec else ZSTD


def stage_names(codecs: Iterable[str]) -> tuple[str, ...]:
    """Every name a direction whose codecs are ``codecs`` accepts: each codec, each
    codec followed by the zstd stage, and the stage alone."""
    codecs = tuple(codecs)
    return (*codecs, *(c + ZSTD_SUFFIX for c in codecs), ZSTD)


def _zstandard(setting: str) -> ModuleType:
    try:
        return importlib.import_module("zstandard")
    except ImportError as exc:
        raise ConfigError(setting, f"the zstd stage needs the zstandard package: {EXTRA} "
                                   f"(or list names without '{ZSTD_SUFFIX}')") from exc


def require_zstd(setting: str, names: Iterable[str]) -> None:
    """Raise `ConfigError` naming ``setting`` and the extra to install when ``names``
    use the zstd stage and zstandard is not installed."""
    if any(split_stage(name)[1] for name in names):
        _zstandard(setting)


def compress(payload: bytes | memoryview) -> bytes | None:
    """``payload`` as one zstd frame (level `LEVEL`, content size in its header), or
    None when the frame would not be smaller: send the payload plain then."""
    zstandard = _zstandard("zstd")
    frame: bytes = zstandard.ZstdCompressor(level=LEVEL).compress(payload)
    return frame if len(frame) < len(payload) else None


class PayloadSink(Protocol):
    """What a `ZstdReceiver` feeds: `fedloom.payload.PayloadReceiver`'s interface."""

    @property
    def received(self) -> int: ...

    def feed(self, offset: int, data: bytes) -> None: ...

    def finish(self) -> None: ...


class ZstdReceiver:
    """Check the chunks of a zstd stream of ``wire_bytes`` bytes (order, sizes) and
    decompress them, as they arrive, into ``payload`` (see the module docstring).

    Raises `MessageRejectedError` (INVALID) at the first problem, here or in
    ``payload``'s checks; nothing is decompressed past a bad chunk.
    """

    def __init__(self, payload: PayloadSink, wire_bytes: int, *, max_chunk_bytes: int) -> None:
        zstandard = _zstandard("zstd")
        self._error: type[Exception] = zstandard.ZstdError
        self._payload = payload
        self._wire_bytes = wire_bytes
        self._max_chunk = max_chunk_bytes
        self._received = 0
        decompressor = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES)
        self._writer = decompressor.stream_writer(_Pieces(payload), write_size=PIECE_BYTES)

    @property
    def received(self) -> int:
        """Compressed bytes received so far."""
        return self._received

    def feed(self, offset: int, data: bytes) -> None:
        if offset != self._received:
            raise _invalid(f"chunk at offset {offset} of the zstd stream arrived, expected "
                           f"offset {self._received}")
        if len(data) == 0 or len(data) > self._max_chunk:
            raise _invalid(f"chunk of {len(data)} bytes; chunks must hold "
                           f"1..{self._max_chunk} bytes")
        if self._received + len(data) > self._wire_bytes:
            raise _invalid(f"the zstd stream exceeds the {self._wire_bytes} bytes "
                           "(wire_bytes) its header declares")
        self._received += len(data)
        try:
            self._writer.write(data)
        except self._error as exc:
            raise _invalid(f"the payload is not a valid zstd stream: {exc}") from None

    def finish(self) -> None:
        if self._received != self._wire_bytes:
            raise _invalid(f"the zstd stream ended after {self._received} of "
                           f"{self._wire_bytes} bytes")
        self._payload.finish()  # all of the payload, and its digest


class _Pieces:
    """The decompressor's output, piece by piece, into the payload's checks in order."""

    def __init__(self, payload: PayloadSink) -> None:
        self._payload = payload

    def write(self, data: bytes) -> int:
        if data:
            self._payload.feed(self._payload.received, data)  # refuses bytes past total_bytes
        return len(data)


def _invalid(message: str) -> MessageRejectedError:
    return MessageRejectedError(RejectReason.INVALID, message)
