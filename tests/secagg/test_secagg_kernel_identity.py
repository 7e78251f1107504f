"""Client certificates in SecAgg+: `SigningIdentity` signs, `PeerVerifier` checks the
certificate against the client CA (chain, validity, clientAuth, a name) and signatures."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa, x25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from secagg_driver import pki

from fedloom import certs
from fedloom.errors import SecureAggregationError
from fedloom.secagg import PeerVerifier, SigningIdentity, certificate_name
from fedloom.secagg._identity import MAX_SIGNATURE_BYTES


def _der(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.DER)


def _leaf(public_key: Any, *, name: str | None = "site-x", days: tuple[int, int] = (-1, 10),
          usage: x509.ObjectIdentifier = ExtendedKeyUsageOID.CLIENT_AUTH,
          sans: list[x509.GeneralName] | None = None,
          issuer: certs.Issued | None = None) -> x509.Certificate:
    """A leaf certificate like `fedloom.certs` makes, with the parts a test varies."""
    ca = issuer or pki().ca
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)] if name else
                        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "no name")])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + datetime.timedelta(days=days[0]))
        .not_valid_after(now + datetime.timedelta(days=days[1]))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False,
                                     False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
                       critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca.key, hashes.SHA256())


def _p256() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


@pytest.mark.parametrize("make_key", [
    _p256,
    ed25519.Ed25519PrivateKey.generate,
    lambda: rsa.generate_private_key(65537, 2048),
], ids=["ecdsa-p256", "ed25519", "rsa-pss"])
def test_a_signature_verifies_under_the_certificate_and_nothing_else(make_key: Any) -> None:
    key = make_key()
    identity = SigningIdentity(_leaf(key.public_key()), key)
    assert identity.name == "site-x"
    assert x509.load_der_x509_certificate(identity.certificate_der) == identity.certificate
    verifier = pki().verifier
    peer = verifier.verify_certificate(identity.certificate_der)
    assert peer.name == "site-x"
    signature = identity.sign(b"the statement")
    assert verifier.verify(peer, signature, b"the statement")
    assert not verifier.verify(peer, signature, b"another statement")
    tampered = bytes([signature[0] ^ 1]) + signature[1:]
    assert not verifier.verify(peer, tampered, b"the statement")
    other = pki().identity("someone-else")
    assert not verifier.verify(peer, other.sign(b"the statement"), b"the statement")
    assert not verifier.verify(peer, b"", b"the statement")
    assert not verifier.verify(peer, b"\0" * (MAX_SIGNATURE_BYTES + 1), b"the statement")


def test_the_drivers_client_certificates_pass() -> None:
    identity = pki().identity("client-042")
    peer = pki().verifier.verify_certificate(identity.certificate_der)
    assert peer.name == identity.name == "client-042"
    # a second check is served from the cache, with the same answer
    assert pki().verifier.verify_certificate(identity.certificate_der) == peer


def test_a_key_that_is_not_the_certificates_is_refused() -> None:
    issued = certs.make_client_cert(pki().ca, "site-y")
    with pytest.raises(SecureAggregationError, match="does not belong"):
        SigningIdentity(issued.cert, _p256())


def test_a_key_type_that_cannot_sign_is_refused_up_front() -> None:
    key = x25519.X25519PrivateKey.generate()
    with pytest.raises(SecureAggregationError, match="cannot sign"):
        SigningIdentity(_leaf(key.public_key()), key)


def test_a_certificate_that_names_nobody_is_refused() -> None:
    key = _p256()
    nameless = _leaf(key.public_key(), name=None)
    with pytest.raises(SecureAggregationError, match="names no identity"):
        SigningIdentity(nameless, key)
    with pytest.raises(SecureAggregationError, match="names no identity"):
        pki().verifier.verify_certificate(_der(nameless))
    # without a CN, the first subjectAltName is the name
    named = _leaf(key.public_key(), name=None, sans=[x509.DNSName("site-z.example")])
    assert certificate_name(named) == "site-z.example"
    assert certificate_name(nameless) is None
    assert pki().verifier.verify_certificate(_der(named)).name == "site-z.example"


@pytest.mark.parametrize("how", ["other-ca", "server-cert", "expired", "not-yet-valid",
                                 "server-auth-usage"])
def test_certificates_that_are_not_client_certificates_of_the_ca_are_refused(how: str) -> None:
    key = _p256()
    if how == "other-ca":
        der = _der(certs.make_client_cert(certs.make_ca("another CA"), "site-x").cert)
    elif how == "server-cert":  # the server's TLS certificate, issued by the same CA
        der = _der(certs.make_server_cert(pki().ca).cert)
    elif how == "expired":
        der = _der(_leaf(key.public_key(), days=(-30, -1)))
    elif how == "not-yet-valid":
        der = _der(_leaf(key.public_key(), days=(1, 30)))
    else:
        der = _der(_leaf(key.public_key(), usage=ExtendedKeyUsageOID.SERVER_AUTH))
    with pytest.raises(SecureAggregationError, match="not valid under the client CA") as info:
        pki().verifier.verify_certificate(der)
    assert "peer_ca / --peer-ca" in str(info.value)  # where an operator sets that CA
    # and with the same key and name as a proper client certificate, it passes
    assert pki().verifier.verify_certificate(_der(_leaf(key.public_key()))).name == "site-x"


@pytest.mark.parametrize("der", [b"", b"\x30\x03\x02\x01\x01", b"\x30" * 9000],
                         ids=["empty", "not-a-certificate", "too-long"])
def test_malformed_certificates_are_refused(der: bytes) -> None:
    with pytest.raises(SecureAggregationError):
        pki().verifier.verify_certificate(der)


def test_loading_from_files(tmp_path: Path) -> None:
    certs.write_certificates(tmp_path, clients=["site-1"])
    identity = SigningIdentity.from_files(tmp_path / "site-1.pem", tmp_path / "site-1.key")
    verifier = PeerVerifier.from_pem_file(tmp_path / "ca.pem")
    peer = verifier.verify_certificate(identity.certificate_der)
    assert peer.name == "site-1" and verifier.verify(peer, identity.sign(b"x"), b"x")
    # the folder's server certificate is no participant
    server = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    with pytest.raises(SecureAggregationError, match="not valid under the client CA"):
        verifier.verify_certificate(_der(server))
    # another folder's CA does not know site-1
    certs.write_certificates(tmp_path / "other", clients=["site-1"])
    with pytest.raises(SecureAggregationError):
        PeerVerifier.from_pem_file(tmp_path / "other" / "ca.pem").verify_certificate(
            identity.certificate_der)
    with pytest.raises(SecureAggregationError, match="cannot read the client certificate"):
        SigningIdentity.from_files(tmp_path / "missing.pem", tmp_path / "site-1.key")
    with pytest.raises(SecureAggregationError, match="cannot read the client CA"):
        PeerVerifier.from_pem_file(tmp_path / "missing.pem")
    with pytest.raises(SecureAggregationError, match="at least one CA"):
        PeerVerifier([])
