"""The mask PRG: RFC 8439 known answers, an independent implementation, seed sensitivity."""

from __future__ import annotations

import numpy as np
import pytest

from fedloom.secagg import MASK_NONCE, MaskExpander, chacha20_keystream, expand_mask

KEY_00_1F = bytes(range(32))

# RFC 8439 section 2.3.2 (block function): key 00..1f, nonce 00:00:00:09:00:00:00:4a:
# 00:00:00:00, block count 1 -> the serialized block below.
RFC_2_3_2 = bytes.fromhex(
    "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
    "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e"
)
# RFC 8439 appendix A.1, test vectors #1 and #2: zero key, zero nonce, block 0 and 1.
RFC_A1_1 = bytes.fromhex(
    "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
    "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"
)
RFC_A1_2 = bytes.fromhex(
    "9f07e7be5551387a98ba977c732d080dcb0f29a048e3656912c6533e32ee7aed"
    "29b721769ce64e43d57133b074d839d531ed1f28510afb45ace10a1f4b794d6f"
)
# RFC 8439 section 2.4.2: the keystream (plaintext XOR ciphertext) starts at block 1
# with nonce 00:00:00:00:00:00:00:4a:00:00:00:00; the first 64 bytes of the example.
RFC_2_4_2_PLAIN = b"Ladies and Gentlemen of the class of '99: If I could offer you o"
RFC_2_4_2_CIPHER = bytes.fromhex(
    "6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0b"
    "f91b65c5524733ab8f593dabcd62b3571639d624e65152ab8f530c359f0861d8"
)


def test_rfc8439_block_function() -> None:
    nonce = bytes.fromhex("000000090000004a00000000")
    assert chacha20_keystream(KEY_00_1F, nonce, 1, 64) == RFC_2_3_2


def test_rfc8439_appendix_a1() -> None:
    assert chacha20_keystream(bytes(32), bytes(12), 0, 64) == RFC_A1_1
    assert chacha20_keystream(bytes(32), bytes(12), 1, 64) == RFC_A1_2
    # the counter is the first 4 bytes, little-endian: block 1 is bytes 64..128 of block 0's
    assert chacha20_keystream(bytes(32), bytes(12), 0, 128)[64:] == RFC_A1_2


def test_rfc8439_encryption_example() -> None:
    nonce = bytes.fromhex("000000000000004a00000000")
    stream = chacha20_keystream(KEY_00_1F, nonce, 1, 64)
    assert bytes(a ^ b for a, b in zip(RFC_2_4_2_PLAIN, stream, strict=True)) == RFC_2_4_2_CIPHER


def test_mask_is_the_little_endian_keystream_of_the_seed() -> None:
    seed = bytes(range(100, 132))
    mask = expand_mask(seed, 1000)
    stream = chacha20_keystream(seed, MASK_NONCE, 0, 4000)
    assert mask.dtype == np.uint32
    assert np.array_equal(mask, np.frombuffer(stream, "<u4"))


def test_mask_matches_an_independent_chacha20() -> None:
    chacha = pytest.importorskip("Crypto.Cipher.ChaCha20")  # PyCryptodome, via flwr
    seed = bytes(range(7, 39))
    reference = chacha.new(key=seed, nonce=MASK_NONCE).encrypt(bytes(4 * 4099))
    assert np.array_equal(expand_mask(seed, 4099), np.frombuffer(reference, "<u4"))


def test_expander_reuses_buffers_without_mixing_seeds() -> None:
    expander = MaskExpander(333)
    a = expander.expand(b"a" * 32).copy()
    b = expander.expand(b"b" * 32).copy()
    assert np.array_equal(a, expand_mask(b"a" * 32, 333))
    assert np.array_equal(b, expand_mask(b"b" * 32, 333))
    acc = np.zeros(333, np.uint32)
    expander.add_to(acc, b"a" * 32)
    expander.subtract_from(acc, b"a" * 32)
    assert not acc.any()


def test_shorter_mask_is_a_prefix() -> None:
    seed = bytes(32)
    assert np.array_equal(expand_mask(seed, 17), expand_mask(seed, 100)[:17])


@pytest.mark.parametrize("position", range(32))
def test_flipping_any_seed_byte_changes_the_mask(position: int) -> None:
    seed = bytes(range(32))
    flipped = bytearray(seed)
    flipped[position] ^= 0x01
    a, b = expand_mask(seed, 256), expand_mask(bytes(flipped), 256)
    # an unrelated stream: about all words differ (equal with probability 2**-32 each)
    assert (a != b).sum() >= 250


def test_mask_words_look_uniform() -> None:
    mask = expand_mask(bytes(range(32)), 1 << 16)
    counts = np.bincount((mask >> 24).astype(np.int64), minlength=256)
    chi2 = float((((counts - 256.0) ** 2) / 256.0).sum())
    assert chi2 < 400  # 255 degrees of freedom; p < 1e-8 beyond 400


def test_bad_seed_length_is_refused() -> None:
    with pytest.raises(ValueError):
        expand_mask(bytes(16), 10)
