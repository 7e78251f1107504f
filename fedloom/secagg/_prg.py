"""The mask PRG: a 256-bit seed expanded into uint32 words by the ChaCha20 keystream.

ChaCha20 (RFC 8439) from the `cryptography` package (OpenSSL), in bulk: the keystream
is the encryption of zeros into a reused buffer, viewed as little-endian uint32 with
`np.frombuffer` (no Python loop per element). A mask of ``n`` words uses blocks
``0 .. ceil(n / 16) - 1`` of the stream keyed by the seed, with the fixed 96-bit nonce
``b"fedloom-mask"``: every seed is used for one mask only (seeds are fresh per round
attempt and per pair, see `fedloom.secagg.derive_mask_seed`), so the nonce need not vary.

Flower 1.42 instead seeds ``np.random.RandomState`` with a 32-bit fold of the seed: a
mask then has 2**32 possible values and can be searched. Here the full 256-bit seed is
the key.

>>> # RFC 8439 A.1 test vector #1 (zero key, zero nonce, block 0): 76 b8 e0 ad a0 f1 3d 90
>>> np.frombuffer(chacha20_keystream(bytes(32), bytes(12), 0, 8), "<u4")
array([2917185654, 2419978656], dtype=uint32)
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from fedloom.secagg._messages import MAX_VECTOR_LENGTH, SEED_BYTES

#: The 96-bit ChaCha20 nonce of every mask stream (exactly 12 bytes).
MASK_NONCE = b"fedloom-mask"
_BLOCK = 64


def chacha20_keystream(key: bytes, nonce: bytes, counter: int, nbytes: int) -> bytes:
    """``nbytes`` of the RFC 8439 ChaCha20 keystream from block ``counter``.

    `cryptography`'s ChaCha20 takes a 16-byte nonce: the initial 32-bit block counter,
    little-endian, followed by RFC 8439's 96-bit nonce.
    """
    if len(key) != 32 or len(nonce) != 12 or not 0 <= counter < 1 << 32:
        raise ValueError("ChaCha20 needs a 32-byte key, a 12-byte nonce and a 32-bit counter")
    full_nonce = counter.to_bytes(4, "little") + nonce
    encryptor = Cipher(algorithms.ChaCha20(key, full_nonce), mode=None).encryptor()
    return encryptor.update(bytes(nbytes))


class MaskExpander:
    """Expands seeds into masks of one fixed length, reusing its buffers.

    Each `expand` returns a read-only view into the expander's buffer that is valid
    until the next call; `add_to` and `subtract_from` fold a mask into a uint32
    accumulator in place (numpy's uint32 arithmetic wraps modulo 2**32).
    """

    def __init__(self, length: int) -> None:
        if not 0 < length <= MAX_VECTOR_LENGTH:
            raise ValueError(f"mask length must be in 1..{MAX_VECTOR_LENGTH}, got {length}")
        self.length = length
        self._zeros = bytes(4 * length)
        # OpenSSL may write up to one block beyond the input into the output buffer.
        self._out = bytearray(4 * length + _BLOCK)
        self._view = np.frombuffer(self._out, dtype="<u4", count=length)

    def expand(self, seed: bytes) -> np.ndarray:
        if len(seed) != SEED_BYTES:
            raise ValueError(f"a mask seed must be {SEED_BYTES} bytes")
        encryptor = Cipher(
            algorithms.ChaCha20(seed, bytes(4) + MASK_NONCE), mode=None
        ).encryptor()
        encryptor.update_into(self._zeros, self._out)
        view = self._view.view()
        view.flags.writeable = False
        return view

    def add_to(self, accumulator: np.ndarray, seed: bytes) -> None:
        np.add(accumulator, self.expand(seed), out=accumulator)

    def subtract_from(self, accumulator: np.ndarray, seed: bytes) -> None:
        np.subtract(accumulator, self.expand(seed), out=accumulator)


def expand_mask(seed: bytes, length: int) -> np.ndarray:
    """A fresh uint32 array: the mask of ``length`` words for ``seed``."""
    return MaskExpander(length).expand(seed).copy()
