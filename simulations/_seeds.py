"""`numpy.random.SeedSequence`'s first state word for many 3-word entropies at once.

`fedloom.simulations.plan.fit_seed` derives each client's seed as
``SeedSequence([base_seed, client_index, server_round]).generate_state(1)[0]``. Building
one `SeedSequence` per client costs about 4 us, which is most of what a round of a
hundred vectorized clients spends outside training. This module computes the same word
for a whole round in one pass of numpy uint32 operations (about 50 us for any number of
clients): numpy's algorithm (O'Neill's randutils seed_seq_fe, as NumPy implements it in
``numpy/random/bit_generator.pyx``: a pool of 4 words, ``hashmix`` and ``mix``, then
``generate_state``) applied column-wise. Its hash constants advance the same way for
every input, so they are computed once here. NumPy keeps SeedSequence's output fixed
across releases (it seeds every reproducible stream); the tests compare this mirror
with numpy's own class on random and edge inputs, so a change there would fail them.

Only entropies whose words are each below 2**32 are handled (each is then one word, as
SeedSequence reads it); callers fall back to `SeedSequence` otherwise.
"""

from __future__ import annotations

import numpy as np

_INIT_A, _MULT_A = 0x43B0D7E5, 0x931E8875
_INIT_B, _MULT_B = 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = np.uint32(0xCA01F9DD), np.uint32(0x4973F715)
_POOL = 4  # SeedSequence's default pool size, in words
_SHIFT = np.uint32(16)
_MASK = 0xFFFFFFFF


def _hash_constants() -> list[tuple[np.uint32, np.uint32]]:
    """(xor constant, multiplier) of each ``hashmix`` call of ``mix_entropy``, in order:
    ``value ^= c; c *= MULT_A; value *= c``, so each call uses c before and after."""
    constants, c = [], _INIT_A
    for _ in range(_POOL + _POOL * (_POOL - 1)):
        after = (c * _MULT_A) & _MASK
        constants.append((np.uint32(c), np.uint32(after)))
        c = after
    return constants


_HASH = _hash_constants()
#: ``generate_state``'s first word: ``pool[0] ^ INIT_B``, times ``INIT_B * MULT_B``.
_STATE_XOR, _STATE_MUL = np.uint32(_INIT_B), np.uint32((_INIT_B * _MULT_B) & _MASK)


def first_state_words(entropy: np.ndarray) -> np.ndarray:
    """``SeedSequence(entropy[:, j]).generate_state(1)[0]`` for every column ``j``.

    Args:
        entropy: uint32 of shape ``(words, n)`` with 1 <= words <= 4: column ``j`` is
            one SeedSequence's entropy, one uint32 word per integer.
    """
    if entropy.dtype != np.uint32 or entropy.ndim != 2 or not 1 <= entropy.shape[0] <= _POOL:
        raise ValueError("entropy must be uint32 of shape (words, n), 1 <= words <= 4")
    constants = iter(_HASH)

    def hashmix(value: np.ndarray) -> np.ndarray:
        xor, mul = next(constants)
        value = value ^ xor
        value *= mul
        value ^= value >> _SHIFT
        return value

    zeros = np.zeros(entropy.shape[1], np.uint32)
    pool = [hashmix(entropy[i] if i < entropy.shape[0] else zeros) for i in range(_POOL)]
    for source in range(_POOL):  # mix every word into every other
        for target in range(_POOL):
            if source != target:
                mixed = _MIX_L * pool[target]
                mixed -= _MIX_R * hashmix(pool[source])
                mixed ^= mixed >> _SHIFT
                pool[target] = mixed
    word = pool[0] ^ _STATE_XOR
    word *= _STATE_MUL
    word ^= word >> _SHIFT
    return word
