"""Key agreement, key derivation, share encryption and commitments for SecAgg+.

- X25519 (RFC 7748) for both key pairs of a client, fresh per round attempt;
- HKDF-SHA256 (RFC 5869) turns a shared secret into a key, with ``info`` binding the
  purpose, the run, round and attempt, the setup digest (participants and parameters)
  and the ordered pair of client ids (sorted, so both ends derive the same key);
- ChaCha20-Poly1305 (RFC 8439) seals the shares the server relays; the associated data
  binds the setup, the attempt's graph seed (so the roster of keys both clients were
  shown), the sender and the receiver, so a share replayed from another round or
  attempt, redirected to another client, turned around, or sent between clients shown
  different rosters fails to open;
- the self-mask commitment is SHA-256 over the setup, the client id and the seed;
- a share commitment is SHA-256 over the setup, the dealer, the holder, the kind of
  share (mask key or self mask) and the share's value: a share is a uniformly random
  element of GF(2**521 - 1) until t of them are known, so its hash hides it;
- what a client signs in an authenticated attempt (`key_statement`,
  `survivors_statement`) is bound to the setup (run, round, attempt, participants and
  their identities, parameters, model and fit config) and, for keys, to the client's id
  and identity.

All failures raise `SecureAggregationError`.
"""

from __future__ import annotations

import hashlib
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedloom.errors import SecureAggregationError
from fedloom.secagg._encoding import PROTOCOL_LABEL, pack
from fedloom.secagg._setup import NONCE_BYTES, SEED_BYTES, RoundSetup
from fedloom.secagg._shamir import SHARE_BYTES

#: Bytes of one sealed share: two 66-byte Shamir shares plus the 16-byte Poly1305 tag.
SEALED_SHARE_BYTES = 2 * SHARE_BYTES + 16


def generate_private_key() -> X25519PrivateKey:
    return X25519PrivateKey.generate()


def public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes_raw()


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes_raw()


def private_key_from_bytes(data: bytes) -> X25519PrivateKey:
    if len(data) != 32:
        raise SecureAggregationError("an X25519 private key is 32 bytes")
    return X25519PrivateKey.from_private_bytes(data)


def agree(private_key: X25519PrivateKey, peer_public_key: bytes) -> bytes:
    """X25519 shared secret; refuses malformed and low-order public keys."""
    try:
        return private_key.exchange(X25519PublicKey.from_public_bytes(peer_public_key))
    except ValueError as exc:  # wrong length, or an all-zero result (low-order point)
        raise SecureAggregationError(f"unusable X25519 public key: {exc}") from exc


_PROBE = X25519PrivateKey.generate()  # any scalar: clamping makes it a multiple of 8


def usable_public_key(public_key: bytes) -> bool:
    """Whether neighbours can agree with ``public_key``: 32 bytes and not a point of
    small order (those give an all-zero X25519 secret for every private key)."""
    try:
        _PROBE.exchange(X25519PublicKey.from_public_bytes(public_key))
    except ValueError:
        return False
    return True


def _pair_info(purpose: bytes, setup: RoundSetup, a: str, b: str) -> bytes:
    first, second = sorted((a, b))
    return PROTOCOL_LABEL + purpose + setup.binding + pack(first, second)


def _hkdf(shared_secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared_secret)


def derive_share_key(shared_secret: bytes, setup: RoundSetup, a: str, b: str) -> bytes:
    """The ChaCha20-Poly1305 key for shares between clients ``a`` and ``b``."""
    return _hkdf(shared_secret, _pair_info(b"share-key", setup, a, b))


def derive_mask_seed(shared_secret: bytes, setup: RoundSetup, a: str, b: str) -> bytes:
    """The 256-bit seed of the pairwise mask between clients ``a`` and ``b``."""
    return _hkdf(shared_secret, _pair_info(b"mask-seed", setup, a, b))


def _share_aad(setup: RoundSetup, graph_seed: bytes, sender: str, receiver: str) -> bytes:
    return PROTOCOL_LABEL + b"share-aad" + setup.binding + pack(graph_seed, sender, receiver)


def seal_share(key: bytes, setup: RoundSetup, sender: str, receiver: str,
               plaintext: bytes, *, graph_seed: bytes) -> tuple[bytes, bytes]:
    """Encrypt ``plaintext`` from ``sender`` to ``receiver``; returns (nonce, ciphertext).

    ``graph_seed`` (`fedloom.secagg.graph_seed`) binds the roster the sender was shown.
    """
    nonce = os.urandom(NONCE_BYTES)
    return nonce, ChaCha20Poly1305(key).encrypt(nonce, plaintext,
                                                _share_aad(setup, graph_seed, sender, receiver))


def open_share(key: bytes, setup: RoundSetup, sender: str, receiver: str,
               nonce: bytes, ciphertext: bytes, *, graph_seed: bytes) -> bytes:
    """Decrypt and authenticate a sealed share; refuses anything tampered or misbound."""
    try:
        return ChaCha20Poly1305(key).decrypt(nonce, ciphertext,
                                             _share_aad(setup, graph_seed, sender, receiver))
    except InvalidTag as exc:
        raise SecureAggregationError(
            f"the share from {sender!r} to {receiver!r} failed authentication (tampered, "
            "replayed from another round or attempt, misaddressed, or sealed under another "
            "roster of keys)"
        ) from exc


def new_seed() -> bytes:
    return os.urandom(SEED_BYTES)


def commit_self_mask(setup: RoundSetup, client_id: str, seed: bytes) -> bytes:
    """SHA-256 commitment to a self-mask seed (hiding: the seed is 256 random bits)."""
    return hashlib.sha256(
        PROTOCOL_LABEL + b"self-mask" + setup.binding + pack(client_id, seed)
    ).digest()


#: The two kinds of share a client deals (and `commit_share` distinguishes).
MASK_KEY, SELF_MASK = "mask-key", "self-mask"


def commit_share(setup: RoundSetup, owner: str, holder: str, kind: str, value: bytes) -> bytes:
    """SHA-256 commitment to the share of ``owner``'s secret dealt to ``holder``."""
    return hashlib.sha256(
        PROTOCOL_LABEL + b"share" + setup.binding + pack(owner, holder, kind, value)
    ).digest()


def key_statement(setup: RoundSetup, client_id: str, cipher_public_key: bytes,
                  mask_public_key: bytes) -> bytes:
    """What a client signs to advertise its keys for the attempt ``setup`` describes."""
    return PROTOCOL_LABEL + b"keys" + setup.binding + pack(
        client_id, setup.identity_of(client_id), cipher_public_key, mask_public_key)


def survivors_statement(setup: RoundSetup, survivors: tuple[str, ...], *,
                        graph_seed: bytes) -> bytes:
    """What a client signs to confirm the survivor set of the attempt ``setup``, under
    the roster of keys (``graph_seed``) it was shown."""
    return PROTOCOL_LABEL + b"survivors" + setup.binding + pack(graph_seed, len(survivors),
                                                                 *survivors)
