"""Every derivation binds the round attempt the documented way: restated here from the
primitives (HKDF, ChaCha20-Poly1305, SHA-256) and `pack`, field by field, so that the
cached ``RoundSetup.binding`` prefix cannot change a key, a seal or a commitment."""

from __future__ import annotations

import hashlib

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedloom.secagg import (
    RoundId,
    RoundSetup,
    SecAggConfig,
    commit_self_mask,
    derive_mask_seed,
    derive_share_key,
    seal_share,
)
from fedloom.secagg._encoding import pack

LABEL = b"fedloom/secagg/v3/"
CONFIG = SecAggConfig(enabled=True, neighbours=4, threshold=3, max_participants=16)
SETUP = RoundSetup.create(CONFIG, RoundId("run-7", 3, 12), [f"c{i}" for i in range(6)], 10)
SECRET = bytes(range(32))


def _hkdf(info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(SECRET)


def _fields(*rest: str | bytes) -> bytes:
    return pack(SETUP.round_id.encode(), SETUP.digest, *rest)


def test_pack_of_more_fields_extends_the_packed_prefix() -> None:
    assert SETUP.binding == pack(SETUP.round_id.encode(), SETUP.digest)
    assert _fields("c1", "c2") == SETUP.binding + pack("c1", "c2")


@pytest.mark.parametrize(("a", "b"), [("c1", "c4"), ("c4", "c1")])
def test_pair_derivations_bind_the_attempt_and_the_unordered_pair(a: str, b: str) -> None:
    assert derive_mask_seed(SECRET, SETUP, a, b) == _hkdf(LABEL + b"mask-seed"
                                                          + _fields("c1", "c4"))
    assert derive_share_key(SECRET, SETUP, a, b) == _hkdf(LABEL + b"share-key"
                                                          + _fields("c1", "c4"))


def test_a_sealed_share_opens_only_under_the_documented_associated_data() -> None:
    key = bytes(32)
    nonce, sealed = seal_share(key, SETUP, "c1", "c4", b"share")
    aad = LABEL + b"share-aad" + _fields("c1", "c4")
    assert ChaCha20Poly1305(key).decrypt(nonce, sealed, aad) == b"share"


def test_the_self_mask_commitment_is_the_documented_hash() -> None:
    seed = b"\7" * 32
    assert commit_self_mask(SETUP, "c2", seed) == hashlib.sha256(
        LABEL + b"self-mask" + _fields("c2", seed)).digest()
    other = RoundSetup.create(CONFIG, RoundId("run-7", 3, 13), SETUP.participants, 10)
    assert commit_self_mask(other, "c2", seed) != commit_self_mask(SETUP, "c2", seed)
