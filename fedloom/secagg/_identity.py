"""Who signs what in an authenticated SecAgg+ round: client certificates and signatures.

Against a server that may deviate from the protocol, clients must recognise each
other's messages without trusting the server that relays them. fedloom uses the PKI
that mutual TLS already needs: every client holds a certificate issued by the client CA
(``fedloom certs`` makes one) and its private key. A client signs, with that key, the
public keys it advertises for a round attempt and the survivor set it confirms; every
other client checks the signature against the certificate, the certificate against the
CA it trusts, and the certificate's name against the identity the round's setup seats
in that place. A server that substitutes a key, invents a participant or forges a
confirmation is caught, because it holds no client's private key.

- `SigningIdentity`: this client's certificate and private key; `sign`.
- `PeerVerifier`: the client CA's certificates; `verify_certificate` (chain, validity
  period, ``extendedKeyUsage = clientAuth``: the server's own certificate, issued by the
  same CA for TLS, is refused as a participant) with a cache, and `verify`.
- `certificate_name`: the identity a certificate names (its CN, else its first
  subjectAltName), the rule the server applies to a mutual-TLS peer.

Signatures: ECDSA with SHA-256 for EC keys (``fedloom certs`` makes P-256 keys),
Ed25519 and Ed448, RSA-PSS with SHA-256; other key types are refused. All checks use the
``cryptography`` package (OpenSSL and its Rust X.509 verifier). Trust rests on the CA:
whoever holds the client CA's key can mint identities, so it must not be held by the
party that runs the aggregation server (see docs/secure-aggregation.md).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, padding, rsa
from cryptography.x509 import verification
from cryptography.x509.oid import NameOID

from fedloom.errors import SecureAggregationError

#: Largest certificate (DER) and signature a message may carry.
MAX_CERTIFICATE_BYTES = 8192
MAX_SIGNATURE_BYTES = 1024

SigningKey = (ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey
              | ed448.Ed448PrivateKey | rsa.RSAPrivateKey)
VerifyingKey = (ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey
                | ed448.Ed448PublicKey | rsa.RSAPublicKey)


def certificate_name(certificate: x509.Certificate) -> str | None:
    """The identity ``certificate`` names: its CN, else its first subjectAltName."""
    names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if names and isinstance(names[0].value, str) and names[0].value:
        return names[0].value
    try:
        sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return None
    for general in sans.value:
        value = getattr(general, "value", None)
        if isinstance(value, str) and value:
            return value
    return None


def _pss() -> padding.PSS:
    return padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)


def sign(key: Any, data: bytes) -> bytes:
    """Sign ``data`` with a certificate's private key (ECDSA, EdDSA or RSA-PSS)."""
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey):
        return key.sign(data)
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, _pss(), hashes.SHA256())
    raise SecureAggregationError(
        f"a {type(key).__name__} cannot sign SecAgg+ messages: use an EC (ECDSA), Ed25519, "
        "Ed448 or RSA key for the client certificate")


def verify(public_key: Any, signature: bytes, data: bytes) -> bool:
    """Whether ``signature`` is a valid signature of ``data`` under ``public_key``."""
    if not isinstance(signature, bytes) or not 0 < len(signature) <= MAX_SIGNATURE_BYTES:
        return False
    try:
        if isinstance(public_key, ec.EllipticCurvePublicKey):
            public_key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(public_key, ed25519.Ed25519PublicKey | ed448.Ed448PublicKey):
            public_key.verify(signature, data)
        elif isinstance(public_key, rsa.RSAPublicKey):
            public_key.verify(signature, data, _pss(), hashes.SHA256())
        else:
            return False
    except (InvalidSignature, UnsupportedAlgorithm, ValueError):
        return False
    return True


@dataclasses.dataclass(frozen=True, eq=False)
class SigningIdentity:
    """A client's certificate and the private key that signs its SecAgg+ messages.

    Attributes:
        certificate: the client certificate (issued by the client CA).
        private_key: its private key.
        name: the identity the certificate names (`certificate_name`).
        certificate_der: the certificate in DER, as it travels in a message.
    """

    certificate: x509.Certificate
    private_key: Any
    name: str = dataclasses.field(init=False)
    certificate_der: bytes = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        name = certificate_name(self.certificate)
        if name is None:
            raise SecureAggregationError("the client certificate names no identity (no CN "
                                         "and no subjectAltName)")
        if self.private_key.public_key() != self.certificate.public_key():
            raise SecureAggregationError("the private key does not belong to the client "
                                         "certificate")
        der = self.certificate.public_bytes(serialization.Encoding.DER)
        if len(der) > MAX_CERTIFICATE_BYTES:
            raise SecureAggregationError(f"the client certificate is {len(der)} bytes; at most "
                                         f"{MAX_CERTIFICATE_BYTES} travel in a message")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "certificate_der", der)
        sign(self.private_key, b"probe")  # refuse an unusable key type now, not mid-round

    @classmethod
    def from_files(cls, cert: str | Path, key: str | Path) -> SigningIdentity:
        """Load a PEM certificate and its (unencrypted) PEM private key."""
        try:
            certificate = x509.load_pem_x509_certificate(Path(cert).read_bytes())
            private_key = serialization.load_pem_private_key(Path(key).read_bytes(), None)
        except (OSError, ValueError, TypeError) as exc:
            raise SecureAggregationError(f"cannot read the client certificate {cert} and key "
                                         f"{key}: {exc}") from exc
        return cls(certificate, private_key)

    def sign(self, data: bytes) -> bytes:
        return sign(self.private_key, data)


@dataclasses.dataclass(frozen=True, slots=True)
class VerifiedPeer:
    """A certificate that passed `PeerVerifier.verify_certificate`."""

    name: str
    public_key: Any


def _client_policy() -> verification.ExtensionPolicy:
    # The Web PKI's end-entity rules, except that a client certificate need not carry a
    # subjectAltName (fedloom's carry their identity in the CN).
    return verification.ExtensionPolicy.webpki_defaults_ee().may_be_present(
        x509.SubjectAlternativeName, verification.Criticality.AGNOSTIC, None)


class PeerVerifier:
    """Checks other clients' certificates against the client CA, and their signatures.

    Args:
        ca_certificates: the client CA (and any other trusted roots for client
            certificates).
        cache_size: verified certificates kept (by their SHA-256), so that a peer met
            every round is checked once; the validity period is checked on every use.

    Example::

        peers = PeerVerifier.from_pem_file("pki/ca.pem")
        peer = peers.verify_certificate(der)          # SecureAggregationError if not
        peers.verify(peer, signature, data)
    """

    def __init__(self, ca_certificates: Sequence[x509.Certificate],
                 cache_size: int = 4096) -> None:
        if not ca_certificates:
            raise SecureAggregationError("a peer verifier needs at least one CA certificate")
        self._store = verification.Store(list(ca_certificates))
        self._cache: dict[bytes, tuple[VerifiedPeer, datetime.datetime, datetime.datetime]] = {}
        self._cache_size = cache_size

    @classmethod
    def from_pem_file(cls, path: str | Path) -> PeerVerifier:
        """The CA certificates of a PEM file (e.g. ``ca.pem`` from ``fedloom certs``)."""
        try:
            certificates = x509.load_pem_x509_certificates(Path(path).read_bytes())
        except (OSError, ValueError) as exc:
            raise SecureAggregationError(f"cannot read the client CA {path}: {exc}") from exc
        return cls(certificates)

    def verify_certificate(self, certificate_der: bytes) -> VerifiedPeer:
        """The peer a client certificate names, once it chains to the client CA.

        Raises:
            SecureAggregationError: malformed, expired, not yet valid, not issued by the
                client CA, not a client certificate (``clientAuth``), or naming nobody.
        """
        if not isinstance(certificate_der, bytes) or not 0 < len(certificate_der) <= \
                MAX_CERTIFICATE_BYTES:
            raise SecureAggregationError("a client certificate must be 1.."
                                         f"{MAX_CERTIFICATE_BYTES} bytes of DER")
        fingerprint = hashlib.sha256(certificate_der).digest()
        now = datetime.datetime.now(datetime.UTC)
        cached = self._cache.get(fingerprint)
        if cached is not None:
            peer, not_before, not_after = cached
            if not_before <= now <= not_after:
                return peer
        try:
            certificate = x509.load_der_x509_certificate(certificate_der)
            verifier = (verification.PolicyBuilder().store(self._store).time(now)
                        .extension_policies(ca_policy=verification.ExtensionPolicy
                                            .webpki_defaults_ca(),
                                            ee_policy=_client_policy())
                        .build_client_verifier())
            verifier.verify(certificate, [])
        except (ValueError, verification.VerificationError) as exc:
            raise SecureAggregationError(
                f"a client certificate is not valid under the client CA: {exc} (is the CA "
                "trusted here the one that issued the clients' certificates? a client's "
                "peer_ca / --peer-ca, default root_ca; the server's tls.client_ca)") from exc
        name = certificate_name(certificate)
        if name is None:
            raise SecureAggregationError("a client certificate names no identity")
        peer = VerifiedPeer(name, certificate.public_key())
        if len(self._cache) >= self._cache_size:
            self._cache.clear()
        self._cache[fingerprint] = (peer, certificate.not_valid_before_utc,
                                    certificate.not_valid_after_utc)
        return peer

    @staticmethod
    def verify(peer: VerifiedPeer, signature: bytes, data: bytes) -> bool:
        """Whether ``peer`` signed ``data`` (see `verify`)."""
        return verify(peer.public_key, signature, data)
