"""Every derivation binds the round attempt the documented way: restated here from the
primitives (HKDF, ChaCha20-Poly1305, SHA-256) and `pack`, field by field, so that the
cached ``RoundSetup.binding`` prefix cannot change a key, a seal, a commitment, a signed
statement or the graph's seed."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedloom.errors import SecureAggregationError
from fedloom.secagg import (
    AdvertisedKeys,
    RoundId,
    RoundSetup,
    SecAggConfig,
    commit_self_mask,
    commit_share,
    derive_mask_seed,
    derive_share_key,
    graph_seed,
    key_statement,
    open_share,
    seal_share,
    survivors_statement,
)
from fedloom.secagg._encoding import pack

LABEL = b"fedloom/secagg/v4/"
CONFIG = SecAggConfig(enabled=True, neighbours=4, threshold=3, max_participants=16)
MODEL = hashlib.sha256(b"model").digest()
FIT_CONFIG = hashlib.sha256(b"fit config").digest()
SETUP = RoundSetup.create(CONFIG, RoundId("run-7", 3, 12), [f"c{i}" for i in range(6)], 10,
                          model_digest=MODEL, config_digest=FIT_CONFIG,
                          identities={"c2": "site-two"}, authenticated=True)
SECRET = bytes(range(32))


def _hkdf(info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(SECRET)


def _fields(*rest: str | bytes | int) -> bytes:
    return pack(SETUP.round_id.encode(), SETUP.digest, *rest)


def test_pack_of_more_fields_extends_the_packed_prefix() -> None:
    assert SETUP.binding == pack(SETUP.round_id.encode(), SETUP.digest)
    assert _fields("c1", "c2") == SETUP.binding + pack("c1", "c2")


def test_the_setup_digest_is_the_documented_hash_of_every_field() -> None:
    encoded = LABEL + b"setup" + pack(
        pack("run-7", 3, 12), 6, "c0", "c1", "c2", "c3", "c4", "c5",
        "c0", "c1", "site-two", "c3", "c4", "c5",  # identities, in participant order
        4, 3, 8.0, 22, 10_000.0, 10, 4,  # k, t, clip, bits, max weight, length, floor
        MODEL, FIT_CONFIG, 1)
    assert SETUP.digest == hashlib.sha256(encoded).digest()


@pytest.mark.parametrize(("field", "value"), [
    ("model_digest", hashlib.sha256(b"another model").digest()),
    ("config_digest", hashlib.sha256(b"another config").digest()),
    ("authenticated", False),
    ("identities", ("c0", "c1", "c2", "c3", "c4", "c5")),
    ("min_survivors", 5),
    ("vector_length", 11),
    ("round_id", RoundId("run-7", 3, 13)),
])
def test_every_setup_field_changes_the_digest(field: str, value: Any) -> None:
    other = dataclasses.replace(SETUP, **{field: value})
    assert other.digest != SETUP.digest and other.binding != SETUP.binding


@pytest.mark.parametrize(("a", "b"), [("c1", "c4"), ("c4", "c1")])
def test_pair_derivations_bind_the_attempt_and_the_unordered_pair(a: str, b: str) -> None:
    assert derive_mask_seed(SECRET, SETUP, a, b) == _hkdf(LABEL + b"mask-seed"
                                                          + _fields("c1", "c4"))
    assert derive_share_key(SECRET, SETUP, a, b) == _hkdf(LABEL + b"share-key"
                                                          + _fields("c1", "c4"))


def test_a_sealed_share_opens_only_under_the_documented_associated_data() -> None:
    key, seed = bytes(32), b"\5" * 32
    nonce, sealed = seal_share(key, SETUP, "c1", "c4", b"share", graph_seed=seed)
    aad = LABEL + b"share-aad" + _fields(seed, "c1", "c4")
    assert ChaCha20Poly1305(key).decrypt(nonce, sealed, aad) == b"share"
    # a client shown another roster (so another graph seed) cannot open it
    with pytest.raises(SecureAggregationError, match="another roster"):
        open_share(key, SETUP, "c1", "c4", nonce, sealed, graph_seed=b"\6" * 32)


def test_the_self_mask_commitment_is_the_documented_hash() -> None:
    seed = b"\7" * 32
    assert commit_self_mask(SETUP, "c2", seed) == hashlib.sha256(
        LABEL + b"self-mask" + _fields("c2", seed)).digest()
    other = dataclasses.replace(SETUP, round_id=RoundId("run-7", 3, 13))
    assert commit_self_mask(other, "c2", seed) != commit_self_mask(SETUP, "c2", seed)


def test_a_share_commitment_binds_the_dealer_the_holder_the_kind_and_the_value() -> None:
    value = b"\3" * 66
    assert commit_share(SETUP, "c1", "c4", "mask-key", value) == hashlib.sha256(
        LABEL + b"share" + _fields("c1", "c4", "mask-key", value)).digest()
    base = commit_share(SETUP, "c1", "c4", "mask-key", value)
    assert commit_share(SETUP, "c4", "c1", "mask-key", value) != base  # direction
    assert commit_share(SETUP, "c1", "c4", "self-mask", value) != base  # kind
    assert commit_share(SETUP, "c1", "c4", "mask-key", b"\4" + value[1:]) != base


def test_the_signed_statements_are_the_documented_bytes() -> None:
    cipher, mask = b"\1" * 32, b"\2" * 32
    # the key statement names the client's id and the identity the setup seats there
    assert key_statement(SETUP, "c2", cipher, mask) == (
        LABEL + b"keys" + _fields("c2", "site-two", cipher, mask))
    seed = b"\5" * 32
    assert survivors_statement(SETUP, ("c0", "c2", "c5"), graph_seed=seed) == (
        LABEL + b"survivors" + _fields(seed, 3, "c0", "c2", "c5"))
    assert survivors_statement(SETUP, ("c0", "c2"), graph_seed=seed) != survivors_statement(
        SETUP, ("c0", "c2", "c5"), graph_seed=seed)
    # confirmed under another roster (another graph seed): another statement
    assert survivors_statement(SETUP, ("c0", "c2"), graph_seed=seed) != survivors_statement(
        SETUP, ("c0", "c2"), graph_seed=b"\6" * 32)


def test_the_graph_seed_is_the_documented_hash_of_the_members_keys() -> None:
    roster = [AdvertisedKeys(SETUP.round_id, f"c{i}", bytes([i + 1]) * 32,
                             bytes([i + 101]) * 32) for i in range(6)]
    fields: list[str | bytes | int] = [6]
    for keys in roster:
        fields += [keys.client_id, keys.cipher_public_key, keys.mask_public_key]
    expected = hashlib.sha256(LABEL + b"graph" + SETUP.binding + pack(*fields)).digest()
    assert graph_seed(SETUP, roster) == expected
    assert graph_seed(SETUP, list(reversed(roster))) == expected  # in member order
