"""The mask PRG: a 256-bit seed expanded into uint32 words by the AES-128-CTR keystream.

AES in counter mode (NIST SP 800-38A) from the `cryptography` package (OpenSSL, with the
CPU's AES instructions), in bulk: the keystream is the encryption of zeros into a reused
buffer, viewed as little-endian uint32 with `np.frombuffer` (no Python loop per
element). A 32-byte seed is hashed, ``h = SHA-256(label || seed)`` (every seed bit
counts), into the AES-128 key (``h[0:16]``) and the 96-bit nonce (``h[16:28]``) of the
counter blocks; counter block ``j`` is the nonce followed by ``j`` as a 32-bit
big-endian integer (the layout of GCM's counter blocks), so a mask of ``n``
words uses blocks ``0 .. ceil(n / 4) - 1``, and 2**32 blocks cover the longest vector
(`MAX_VECTOR_LENGTH` words) without the counter wrapping. Every seed is used for one
mask only (seeds are fresh per round attempt and per pair, see
`fedloom.secagg.derive_mask_seed`); with a per-seed 96-bit nonce, masks under different
keys (almost surely) never encrypt the same counter block, so a batch search for one of
many keys cannot amortise its work across masks.

Why AES-128: expanding masks is the hot path of a secure round (k + 1 masks per client,
as many again on the server when clients drop), and no secret behind a mask is stronger
than 128 bits. The pairwise seeds come from X25519 agreements (about 128-bit security,
RFC 7748 section 1), and the self-mask seed travels in Shamir shares sealed under keys
from those same agreements; a 256-bit AES key would guard a door in a 128-bit wall.
With AES instructions OpenSSL's AES-128-CTR makes 4 MB of mask in 0.43 ms, AES-256-CTR
in 0.58 ms and ChaCha20 in 1.7 ms (measured on the benchmark machine). Protocol v1 used
ChaCha20 and v2 AES-256-CTR; v3 introduced this PRG and v4 (signed keys, the
consistency stage) keeps it. The seed label is built from the protocol label
(`fedloom.secagg._encoding`), so parties of different versions refuse each other's
shares and commitments instead of mixing masks.

`MaskExpander.apply` adds many masks to one accumulator block by block: each block of
the accumulator stays in cache while every seed's keystream for it is generated and
added, so a client's k + 1 masks (or the server's unmasking) cost one pass over memory
instead of two per mask. A range may start at any AES block (4 words), so disjoint
ranges can be filled by different threads (OpenSSL and numpy release the GIL).

Flower 1.42 instead seeds ``np.random.RandomState`` with a 32-bit fold of the seed: a
mask then has 2**32 possible values and can be searched. Here the seed keys AES.

>>> # NIST SP 800-38A F.5.1 (CTR-AES128): key 2b7e1516..., counter f0f1...feff, block 1
>>> key = bytes.fromhex("2b7e151628aed2a6abf7158809cf4f3c")
>>> aes_ctr_keystream(key, bytes(range(0xF0, 0xFC)), 0xFCFDFEFF, 16).hex()
'ec8cdf7398607cb0f2d21675ea9ea1e4'
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedloom.secagg._encoding import PROTOCOL_LABEL
from fedloom.secagg._setup import MAX_VECTOR_LENGTH, SEED_BYTES

#: Bytes of the AES-128 key of a mask, and of its counter-block nonce.
MASK_KEY_BYTES = 16
_NONCE_BYTES = 12
#: Domain label of the seed hash: the protocol's versioned label (`_crypto`) + purpose.
_SEED_LABEL = PROTOCOL_LABEL + b"mask-prg/"
_BLOCK = 64  # slack OpenSSL may need beyond the input in an output buffer
_AES_WORDS = 4  # uint32 words per AES block


def aes_ctr_keystream(key: bytes, nonce: bytes, counter: int, nbytes: int) -> bytes:
    """``nbytes`` of the AES-CTR keystream from counter block ``nonce || counter``.

    ``key`` is 16 or 32 bytes (AES-128 or AES-256); ``counter`` is the 32-bit big-endian
    low part of the counter block; the stream must not run past block 2**32 - 1 (the
    counter would carry into the nonce).
    """
    blocks = -(-nbytes // 16)
    if (len(key) not in (16, 32) or len(nonce) != _NONCE_BYTES or counter < 0
            or counter + blocks > 1 << 32):
        raise ValueError("AES-CTR needs a 16- or 32-byte key, a 12-byte nonce and a 32-bit "
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


def split_mask_seed(seed: bytes) -> tuple[bytes, bytes]:
    """The AES-128 key and the 96-bit counter-block nonce of ``seed``'s mask: the first
    16 and the next 12 bytes of ``SHA-256(label || seed)`` (about 1 us a seed)."""
    _check_seed(seed)
    digest = hashlib.sha256(_SEED_LABEL + seed).digest()
    return digest[:MASK_KEY_BYTES], digest[MASK_KEY_BYTES : MASK_KEY_BYTES + _NONCE_BYTES]


def _keystream(seed: bytes, block: int) -> Any:
    """An AES-128-CTR encryptor for ``seed``'s mask from counter block ``block`` (its
    keystream is the mask from word ``4 * block`` on)."""
    key, nonce = split_mask_seed(seed)
    return Cipher(algorithms.AES(key), modes.CTR(nonce + block.to_bytes(4, "big"))
                  ).encryptor()


def expand_mask(seed: bytes, length: int) -> np.ndarray:
    """A fresh uint32 array: the mask of ``length`` words for ``seed``."""
    return MaskExpander(length).expand(seed).copy()
