"""The mask PRG: a 256-bit seed expanded into uint32 words by the AES-256-CTR keystream.

AES-256 in counter mode (NIST SP 800-38A) from the `cryptography` package (OpenSSL, with
the CPU's AES instructions), in bulk: the keystream is the encryption of zeros into a
reused buffer, viewed as little-endian uint32 with `np.frombuffer` (no Python loop per
element). The seed is the key; counter block ``j`` is the fixed 96-bit nonce
``b"fedloom-mask"`` followed by ``j`` as a 32-bit big-endian integer (the layout of
GCM's counter blocks), so a mask of ``n`` words uses blocks ``0 .. ceil(n / 4) - 1``.
Every seed is used for one mask only (seeds are fresh per round attempt and per pair,
see `fedloom.secagg.derive_mask_seed`), so the nonce need not vary; 2**32 blocks cover
the longest vector (`MAX_VECTOR_LENGTH` words) without the counter wrapping.

Why AES-CTR and not ChaCha20 (protocol v1 used ChaCha20, RFC 8439): expanding masks is
the hot path of a secure round (k + 1 masks per client, as many again on the server
when clients drop), and with AES instructions OpenSSL's AES-256-CTR makes 4 MB of mask
in 0.6 ms where ChaCha20 takes 1.7 ms (measured on the benchmark machine); both are
standard stream ciphers keyed by the full 256-bit seed. The protocol label moved to v2
with it (`fedloom.secagg._crypto`), so clients and servers of the two versions refuse
each other's shares and commitments instead of mixing masks.

`MaskExpander.apply` adds many masks to one accumulator block by block: each block of
the accumulator stays in cache while every seed's keystream for it is generated and
added, so a client's k + 1 masks (or the server's unmasking) cost one pass over memory
instead of two per mask. A range may start at any AES block (4 words), so disjoint
ranges can be filled by different threads (OpenSSL and numpy release the GIL).

Flower 1.42 instead seeds ``np.random.RandomState`` with a 32-bit fold of the seed: a
mask then has 2**32 possible values and can be searched. Here the full 256-bit seed is
the key.

>>> # NIST SP 800-38A F.5.5 (CTR-AES256): key 603deb10..., counter f0f1...feff, block 1
>>> key = bytes.fromhex("603deb1015ca71be2b73aef0857d77811f352c073b6108d72d9810a30914dff4")
>>> aes_ctr_keystream(key, bytes(range(0xF0, 0xFC)), 0xFCFDFEFF, 16).hex()
'0bdf7df1591716335e9a8b15c860c502'
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedloom.secagg._messages import MAX_VECTOR_LENGTH, SEED_BYTES

#: The 96-bit nonce of every mask stream (exactly 12 bytes): the first 12 bytes of each
#: AES-CTR counter block.
MASK_NONCE = b"fedloom-mask"
_BLOCK = 64  # slack OpenSSL may need beyond the input in an output buffer
_AES_WORDS = 4  # uint32 words per AES block


def aes_ctr_keystream(key: bytes, nonce: bytes, counter: int, nbytes: int) -> bytes:
    """``nbytes`` of the AES-256-CTR keystream from counter block ``nonce || counter``.

    ``counter`` is the 32-bit big-endian low part of the counter block; the stream
    must not run past block 2**32 - 1 (the counter would carry into the nonce).
    """
    blocks = -(-nbytes // 16)
    if len(key) != 32 or len(nonce) != 12 or counter < 0 or counter + blocks > 1 << 32:
        raise ValueError("AES-256-CTR needs a 32-byte key, a 12-byte nonce and a 32-bit "
                         "counter that does not wrap")
    encryptor = Cipher(algorithms.AES(key), modes.CTR(nonce + counter.to_bytes(4, "big"))
                       ).encryptor()
    return encryptor.update(bytes(nbytes))


#: Words per block of `MaskExpander.apply` (256 KiB of uint32 and as much keystream: the
#: block stays in cache while every mask is added). A multiple of 4 (one AES block).
BLOCK_WORDS = 1 << 16


class MaskExpander:
    """Expands seeds into masks of one fixed length, reusing its buffers.

    Each `expand` returns a read-only view into the expander's buffer that is valid
    until the next call; `add_to` and `subtract_from` fold a mask into a uint32
    accumulator in place (numpy's uint32 arithmetic wraps modulo 2**32); `apply` folds
    many masks at once, block by block. One expander per thread.
    """

    def __init__(self, length: int) -> None:
        if not 0 < length <= MAX_VECTOR_LENGTH:
            raise ValueError(f"mask length must be in 1..{MAX_VECTOR_LENGTH}, got {length}")
        self.length = length
        self._out: bytearray | None = None  # the whole mask (expand), made on first use
        self._view = np.zeros(0, dtype="<u4")
        # OpenSSL may write up to one block beyond the input into the output buffer.
        self._block = bytearray(4 * min(length, BLOCK_WORDS) + _BLOCK)
        self._block_view = np.frombuffer(self._block, dtype="<u4",
                                         count=min(length, BLOCK_WORDS))
        self._zeros = memoryview(bytes(4 * min(length, BLOCK_WORDS)))

    def expand(self, seed: bytes) -> np.ndarray:
        _check_seed(seed)
        if self._out is None:
            self._out = bytearray(4 * self.length + _BLOCK)
            self._view = np.frombuffer(self._out, dtype="<u4", count=self.length)
        encryptor = _keystream(seed, 0)
        for start in range(0, self.length, BLOCK_WORDS):
            stop = min(self.length, start + BLOCK_WORDS)
            encryptor.update_into(self._zeros[: 4 * (stop - start)],
                                  memoryview(self._out)[4 * start:])
        view = self._view.view()
        view.flags.writeable = False
        return view

    def add_to(self, accumulator: np.ndarray, seed: bytes) -> None:
        self.apply(accumulator, [(seed, 1)])

    def subtract_from(self, accumulator: np.ndarray, seed: bytes) -> None:
        self.apply(accumulator, [(seed, -1)])

    def apply(self, accumulator: np.ndarray, masks: Sequence[tuple[bytes, int]],
              start: int = 0, stop: int | None = None) -> None:
        """``accumulator[start:stop] += sign * mask(seed)[start:stop]`` for every
        ``(seed, sign)`` of ``masks`` (sign +1 or -1), modulo 2**32, in place.

        Block by block: the same result as `add_to` / `subtract_from` per seed, with one
        pass over the accumulator. ``start`` must be a multiple of 4 words (an AES block),
        so that threads can fill disjoint ranges, each with its own expander.
        """
        stop = self.length if stop is None else stop
        if accumulator.dtype != np.dtype("<u4") or accumulator.shape != (self.length,):
            raise ValueError(f"the accumulator must be uint32[{self.length}]")
        if not 0 <= start <= stop <= self.length or start % _AES_WORDS:
            raise ValueError(f"range {start}..{stop} is not a block-aligned part of the mask")
        streams = []
        for seed, sign in masks:
            _check_seed(seed)
            if sign not in (1, -1):
                raise ValueError(f"a mask's sign is +1 or -1, got {sign}")
            streams.append((_keystream(seed, start // _AES_WORDS),
                            np.add if sign > 0 else np.subtract))
        for a in range(start, stop, BLOCK_WORDS):
            b = min(stop, a + BLOCK_WORDS)
            part, key = accumulator[a:b], self._block_view[: b - a]
            zeros = self._zeros[: 4 * (b - a)]
            for encryptor, fold in streams:
                encryptor.update_into(zeros, self._block)
                fold(part, key, out=part)


def keystream_words(seed: bytes, length: int, block: int = BLOCK_WORDS) -> Iterator[np.ndarray]:
    """The mask of ``seed`` (``length`` words) in successive blocks of at most ``block``
    words: read-only views into one reused buffer, each valid until the next is made.

    Also a fast source of uniform noise (e.g. stochastic rounding in `quantize`).
    """
    _check_seed(seed)
    if not 0 < length <= MAX_VECTOR_LENGTH:
        raise ValueError(f"mask length must be in 1..{MAX_VECTOR_LENGTH}, got {length}")
    if block <= 0:
        raise ValueError(f"block must be a positive number of words, got {block}")
    size = min(length, block)
    buffer, zeros = bytearray(4 * size + _BLOCK), memoryview(bytes(4 * size))
    words = np.frombuffer(buffer, dtype="<u4", count=size)
    words.flags.writeable = False
    encryptor = _keystream(seed, 0)
    for start in range(0, length, size):
        count = min(size, length - start)
        encryptor.update_into(zeros[: 4 * count], buffer)
        yield words[:count]


def _check_seed(seed: bytes) -> None:
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a mask seed must be {SEED_BYTES} bytes")


def _keystream(seed: bytes, block: int) -> Any:
    """An AES-256-CTR encryptor keyed by ``seed`` from counter block ``block`` (its
    keystream is the mask from word ``4 * block`` on)."""
    return Cipher(algorithms.AES(seed), modes.CTR(MASK_NONCE + block.to_bytes(4, "big"))
                  ).encryptor()


def expand_mask(seed: bytes, length: int) -> np.ndarray:
    """A fresh uint32 array: the mask of ``length`` words for ``seed``."""
    return MaskExpander(length).expand(seed).copy()
