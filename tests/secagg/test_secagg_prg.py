"""The mask PRG: NIST SP 800-38A known answers, seed sensitivity, and every mask
(whole, in blocks, applied in ranges) against an independent reference.

The reference (`reference_mask`) follows the spec in `fedloom.secagg._prg` with nothing
of the code under test: the seed's SHA-256 (hashlib) gives the AES-128 key and the
nonce, and counter mode is built by hand, block ``j`` of the keystream being AES-ECB
(the `cryptography` package's raw block cipher) of ``nonce || j`` (32-bit big-endian),
read as little-endian uint32 words. Its AES-ECB is checked against FIPS-197's known
answer, and its CTR construction against SP 800-38A's."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedloom.secagg import MaskExpander, aes_ctr_keystream, expand_mask, split_mask_seed
from fedloom.secagg._prg import BLOCK_WORDS, keystream_words

# NIST SP 800-38A, F.5.5 CTR-AES256.Encrypt: key, initial counter block, the four
# plaintext blocks and the ciphertext blocks (ciphertext = plaintext XOR keystream).
SP800_38A_KEY = bytes.fromhex(
    "603deb1015ca71be2b73aef0857d77811f352c073b6108d72d9810a30914dff4")
SP800_38A_COUNTER = bytes.fromhex("f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff")
SP800_38A_PLAIN = bytes.fromhex(
    "6bc1bee22e409f96e93d7e117393172aae2d8a571e03ac9c9eb76fac45af8e51"
    "30c81c46a35ce411e5fbc1191a0a52eff69f2445df4f9b17ad2b417be66c3710")
SP800_38A_CIPHER = bytes.fromhex(
    "601ec313775789a5b7a7f504bbf3d228f443e3ca4d62b59aca84e990cacaf5c5"
    "2b0930daa23de94ce87017ba2d84988ddfc9c58db67aada613c2dd08457941a6")
# F.5.5, block #1: the output block (the keystream itself).
SP800_38A_OUTPUT_1 = bytes.fromhex("0bdf7df1591716335e9a8b15c860c502")
# F.5.1 CTR-AES128.Encrypt (same counter and plaintext): the AES-128 mask PRG's cipher.
SP800_38A_KEY_128 = bytes.fromhex("2b7e151628aed2a6abf7158809cf4f3c")
SP800_38A_CIPHER_128 = bytes.fromhex(
    "874d6191b620e3261bef6864990db6ce9806f66b7970fdff8617187bb9fffdff"
    "5ae4df3edbd5d35e5b4f09020db03eab1e031dda2fbe03d1792170a0f3009cee")


# FIPS-197 appendix C.1: AES-128 of one block.
FIPS197_KEY = bytes.fromhex("000102030405060708090a0b0c0d0e0f")
FIPS197_PLAIN = bytes.fromhex("00112233445566778899aabbccddeeff")
FIPS197_CIPHER = bytes.fromhex("69c4e0d86a7b0430d8cdb78070b4c55a")


def _aes_ecb(key: bytes, blocks: bytes) -> bytes:
    encryptor = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    return encryptor.update(blocks) + encryptor.finalize()


def _ctr_by_hand(key: bytes, nonce: bytes, first_block: int, nbytes: int) -> bytes:
    """CTR keystream from AES-ECB of the counter blocks (SP 800-38A section 6.5)."""
    count = -(-nbytes // 16)
    counters = b"".join(nonce + (first_block + j).to_bytes(4, "big") for j in range(count))
    return _aes_ecb(key, counters)[:nbytes]


def reference_mask(seed: bytes, length: int, first_word: int = 0) -> np.ndarray:
    """Words ``first_word .. first_word + length`` of ``seed``'s mask, from the spec."""
    key, nonce = _restated_split(seed)
    first_block, skip = divmod(first_word, 4)
    stream = _ctr_by_hand(key, nonce, first_block, 4 * (skip + length))
    return np.frombuffer(stream, "<u4")[skip:].copy()


def test_the_reference_is_aes_and_sp800_38a_ctr() -> None:
    assert _aes_ecb(FIPS197_KEY, FIPS197_PLAIN) == FIPS197_CIPHER
    nonce, counter = SP800_38A_COUNTER[:12], int.from_bytes(SP800_38A_COUNTER[12:], "big")
    stream = _ctr_by_hand(SP800_38A_KEY_128, nonce, counter, 64)
    assert bytes(a ^ b for a, b in zip(SP800_38A_PLAIN, stream, strict=True)) == (
        SP800_38A_CIPHER_128)


def _nist_stream(nbytes: int) -> bytes:
    nonce, counter = SP800_38A_COUNTER[:12], int.from_bytes(SP800_38A_COUNTER[12:], "big")
    return aes_ctr_keystream(SP800_38A_KEY, nonce, counter, nbytes)


def test_sp800_38a_ctr_aes256() -> None:
    stream = _nist_stream(64)
    assert stream[:16] == SP800_38A_OUTPUT_1
    assert bytes(a ^ b for a, b in zip(SP800_38A_PLAIN, stream, strict=True)) == SP800_38A_CIPHER


def test_sp800_38a_ctr_aes128() -> None:
    nonce, counter = SP800_38A_COUNTER[:12], int.from_bytes(SP800_38A_COUNTER[12:], "big")
    stream = aes_ctr_keystream(SP800_38A_KEY_128, nonce, counter, 64)
    assert bytes(a ^ b for a, b in zip(SP800_38A_PLAIN, stream, strict=True)) == (
        SP800_38A_CIPHER_128)
    with pytest.raises(ValueError):  # AES-192 keys are not used
        aes_ctr_keystream(bytes(24), nonce, 0, 16)


def _restated_split(seed: bytes) -> tuple[bytes, bytes]:
    """The documented key and nonce of a seed's mask, restated independently."""
    digest = hashlib.sha256(b"fedloom/secagg/v4/mask-prg/" + seed).digest()
    return digest[:16], digest[16:28]


def test_a_seed_hashes_into_the_aes128_key_and_the_nonce() -> None:
    seed = bytes(range(32))
    assert split_mask_seed(seed) == _restated_split(seed)
    with pytest.raises(ValueError):
        split_mask_seed(seed[:31])
    # the nonce half matters: two seeds with one key and different nonces differ
    other = seed[:16] + bytes(16)
    assert np.array_equal(expand_mask(other, 64), reference_mask(other, 64))
    assert not np.array_equal(expand_mask(seed, 64), expand_mask(other, 64))


def test_the_counter_is_the_low_32_bits_big_endian() -> None:
    # block 2 of F.5.5 is counter ...fcfdff00: the stream from counter + 1 is block 2 on
    nonce, counter = SP800_38A_COUNTER[:12], int.from_bytes(SP800_38A_COUNTER[12:], "big")
    assert aes_ctr_keystream(SP800_38A_KEY, nonce, counter + 1, 48) == _nist_stream(64)[16:]
    with pytest.raises(ValueError):  # would carry into the nonce
        aes_ctr_keystream(SP800_38A_KEY, nonce, (1 << 32) - 1, 32)


def test_mask_is_the_little_endian_keystream_of_the_seed() -> None:
    seed = bytes(range(100, 132))
    mask = expand_mask(seed, 1000)
    assert mask.dtype == np.uint32
    assert np.array_equal(mask, reference_mask(seed, 1000))
    stream = aes_ctr_keystream(*split_mask_seed(seed), 0, 4000)
    assert np.array_equal(np.frombuffer(stream, "<u4"), reference_mask(seed, 1000))


def test_a_mask_longer_than_a_block_of_apply_matches_the_reference() -> None:
    seed = bytes(range(7, 39))
    long = BLOCK_WORDS * 2 + 13  # the streams continue across apply's blocks
    reference = reference_mask(seed, long)
    assert np.array_equal(expand_mask(seed, long), reference)
    acc = np.zeros(long, np.uint32)
    MaskExpander(long).apply(acc, [(seed, 1)])
    assert np.array_equal(acc, reference)


def test_mask_matches_an_independent_aes_ctr() -> None:
    aes = pytest.importorskip("Crypto.Cipher.AES")  # PyCryptodome, via flwr
    seed = bytes(range(7, 39))
    key, nonce = _restated_split(seed)
    cipher = aes.new(key, aes.MODE_CTR, nonce=nonce, initial_value=0)
    reference = cipher.encrypt(bytes(4 * 4099))
    assert np.array_equal(expand_mask(seed, 4099), np.frombuffer(reference, "<u4"))
    # a mask longer than one block of apply (the streams continue across blocks)
    long = BLOCK_WORDS * 2 + 13
    cipher = aes.new(key, aes.MODE_CTR, nonce=nonce, initial_value=0)
    reference = np.frombuffer(cipher.encrypt(bytes(4 * long)), "<u4")
    assert np.array_equal(expand_mask(seed, long), reference)
    acc = np.zeros(long, np.uint32)
    MaskExpander(long).apply(acc, [(seed, 1)])
    assert np.array_equal(acc, reference)


def test_apply_adds_and_subtracts_each_mask_modulo_2_32() -> None:
    length = BLOCK_WORDS + 1001  # two blocks, the second partial
    rng = np.random.default_rng(0)
    seeds = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)) for _ in range(5)]
    signs = [1, -1, 1, 1, -1]
    start = rng.integers(0, 2**32, length, dtype=np.uint32)
    # the reference: int64 arithmetic modulo 2**32 over the spec's masks
    expected = start.astype(np.int64)
    for seed, sign in zip(seeds, signs, strict=True):
        expected += sign * reference_mask(seed, length).astype(np.int64)
    expected = (expected % 2**32).astype(np.uint32)
    got = start.copy()
    MaskExpander(length).apply(got, list(zip(seeds, signs, strict=True)))
    assert np.array_equal(got, expected)
    # one mask at a time, on one reused expander: the same
    single = start.copy()
    expander = MaskExpander(length)
    for seed, sign in zip(seeds, signs, strict=True):
        (expander.add_to if sign > 0 else expander.subtract_from)(single, seed)
    assert np.array_equal(single, expected)
    # in ranges (as threads would fill them): the same, whatever the split
    parts = start.copy()
    for a, b in ((0, 4), (4, 1000), (1000, BLOCK_WORDS + 8), (BLOCK_WORDS + 8, length)):
        MaskExpander(length).apply(parts, list(zip(seeds, signs, strict=True)), a, b)
    assert np.array_equal(parts, expected)


@pytest.mark.parametrize(("start", "stop"), [(0, 4), (4, 9), (1000, 1004), (8, 5000)])
def test_apply_in_a_range_adds_exactly_that_range_of_the_mask(start: int, stop: int) -> None:
    seed = bytes(range(40, 72))
    length = 5000
    acc = np.zeros(length, np.uint32)
    MaskExpander(length).apply(acc, [(seed, 1)], start, stop)
    expected = np.zeros(length, np.uint32)
    expected[start:stop] = reference_mask(seed, stop - start, first_word=start)
    assert np.array_equal(acc, expected)


def test_apply_refuses_bad_arguments() -> None:
    expander = MaskExpander(100)
    acc = np.zeros(100, np.uint32)
    with pytest.raises(ValueError):
        expander.apply(acc, [(bytes(32), 2)])  # sign
    with pytest.raises(ValueError):
        expander.apply(acc, [(bytes(31), 1)])  # seed
    with pytest.raises(ValueError):
        expander.apply(acc, [(bytes(32), 1)], 3, 50)  # not block-aligned
    with pytest.raises(ValueError):
        expander.apply(np.zeros(100, np.int64), [(bytes(32), 1)])  # dtype
    with pytest.raises(ValueError):
        expander.apply(np.zeros(99, np.uint32), [(bytes(32), 1)])  # length


def test_expander_reuses_buffers_without_mixing_seeds() -> None:
    expander = MaskExpander(333)
    a = expander.expand(b"a" * 32).copy()
    b = expander.expand(b"b" * 32).copy()
    assert np.array_equal(a, reference_mask(b"a" * 32, 333))
    assert np.array_equal(b, reference_mask(b"b" * 32, 333))
    acc = np.zeros(333, np.uint32)
    expander.add_to(acc, b"a" * 32)
    expander.subtract_from(acc, b"a" * 32)
    assert not acc.any()


def test_shorter_mask_is_a_prefix() -> None:
    seed = bytes(32)
    assert np.array_equal(expand_mask(seed, 17), reference_mask(seed, 17))
    assert np.array_equal(expand_mask(seed, 100), reference_mask(seed, 100))


@pytest.mark.parametrize("position", range(32))
def test_flipping_any_seed_byte_changes_the_mask(position: int) -> None:
    seed = bytes(range(32))
    flipped = bytearray(seed)
    flipped[position] ^= 0x01
    a, b = expand_mask(seed, 256), expand_mask(bytes(flipped), 256)
    assert np.array_equal(a, reference_mask(seed, 256))
    assert np.array_equal(b, reference_mask(bytes(flipped), 256))
    # an unrelated stream: about all words differ (equal with probability 2**-32 each)
    assert (a != b).sum() >= 250


def test_mask_words_look_uniform() -> None:
    mask = expand_mask(bytes(range(32)), 1 << 16)
    assert np.array_equal(mask, reference_mask(bytes(range(32)), 1 << 16))
    counts = np.bincount((mask >> 24).astype(np.int64), minlength=256)
    chi2 = float((((counts - 256.0) ** 2) / 256.0).sum())
    assert chi2 < 400  # 255 degrees of freedom; p < 1e-8 beyond 400


def test_bad_seed_length_is_refused() -> None:
    with pytest.raises(ValueError):
        expand_mask(bytes(16), 10)


@pytest.mark.parametrize("length, block", [(1, 4), (10, 4), (4099, 1000), (8, 8)])
def test_keystream_words_are_the_mask_in_blocks(length: int, block: int) -> None:
    seed = bytes(range(50, 82))
    blocks = [b.copy() for b in keystream_words(seed, length, block)]
    assert all(len(b) <= block for b in blocks)
    assert np.array_equal(np.concatenate(blocks), reference_mask(seed, length))


def test_keystream_words_names_the_bad_argument() -> None:
    with pytest.raises(ValueError, match="mask length"):
        next(keystream_words(bytes(32), 0))
    with pytest.raises(ValueError, match="block"):
        next(keystream_words(bytes(32), 10, block=0))
