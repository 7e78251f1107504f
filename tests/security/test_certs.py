"""`fedloom certs`: the chain verifies, the SANs and key usages are right, keys are private.

Two independent verifiers check what `fedloom.certs` makes: cryptography's RFC 5280
path validator (``cryptography.x509.verification``) and the ``openssl verify`` command
(skipped where it is not installed).
"""

from __future__ import annotations

import ipaddress
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from fedloom.certs import load_ca, make_ca, make_client_cert, write_certificates
from fedloom.cli import main
from fedloom.errors import ConfigError


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    out = tmp_path / "pki"
    code = main(
        ["certs", "--out", str(out), "--host", "fl.example.org", "--host", "10.0.0.7",
         "--client", "site-1", "--client", "site-2"]
    )
    assert code == 0
    return out


def test_files_and_modes(pki: Path) -> None:
    names = sorted(p.name for p in pki.iterdir())
    assert names == sorted(
        f"{stem}.{ext}" for stem in ("ca", "server", "site-1", "site-2") for ext in ("pem", "key")
    )
    for path in pki.iterdir():
        mode = stat.S_IMODE(path.stat().st_mode)
        if path.suffix == ".key":
            assert mode == 0o600, path
            assert b"PRIVATE KEY" in path.read_bytes()
        else:
            assert mode & 0o022 == 0, path  # never group- or other-writable


def test_chain_and_names_verify_with_cryptography(pki: Path) -> None:
    ca, server, client = _cert(pki / "ca.pem"), _cert(pki / "server.pem"), _cert(pki / "site-1.pem")
    store = Store([ca])
    for host in (x509.DNSName("fl.example.org"), x509.IPAddress(ipaddress.ip_address("10.0.0.7"))):
        chain = PolicyBuilder().store(store).build_server_verifier(host).verify(server, [])
        assert chain[-1] == ca
    with pytest.raises(VerificationError):  # a name the certificate does not hold
        PolicyBuilder().store(store).build_server_verifier(x509.DNSName("evil.org")).verify(
            server, []
        )
    # The client certificate verifies as a client (cryptography needs a SAN for that;
    # ours carry none, so check the signature and purpose directly).
    client.verify_directly_issued_by(ca)
    eku = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "site-1"


def test_extensions(pki: Path) -> None:
    ca, server = _cert(pki / "ca.pem"), _cert(pki / "server.pem")
    bc = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    ku = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.key_cert_sign and ku.crl_sign and not ku.digital_signature
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["fl.example.org"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7")]
    for leaf in (server, _cert(pki / "site-2.pem")):
        assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        ku = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
        assert ku.digital_signature and not ku.key_cert_sign
        aki = leaf.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
        ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        assert aki.key_identifier == ski.digest
    eku = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]


def test_default_hosts_are_localhost_and_loopback(tmp_path: Path) -> None:
    write_certificates(tmp_path)
    server = _cert(tmp_path / "server.pem")
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_openssl_verifies_purposes_and_names(pki: Path) -> None:
    def verify(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["openssl", "verify", "-CAfile", str(pki / "ca.pem"), *args],
            capture_output=True, text=True, check=False,
        )

    assert verify("-purpose", "sslserver", "-verify_hostname", "fl.example.org",
                  str(pki / "server.pem")).returncode == 0
    assert verify("-purpose", "sslserver", "-verify_ip", "10.0.0.7",
                  str(pki / "server.pem")).returncode == 0
    assert verify("-purpose", "sslclient", str(pki / "site-1.pem")).returncode == 0
    # Each certificate is good for its own purpose only, and for its own names only.
    assert verify("-purpose", "sslserver", str(pki / "site-1.pem")).returncode != 0
    assert verify("-purpose", "sslclient", str(pki / "server.pem")).returncode != 0
    assert verify("-purpose", "sslserver", "-verify_hostname", "evil.org",
                  str(pki / "server.pem")).returncode != 0


def test_adding_a_client_later_reuses_the_ca(pki: Path) -> None:
    before = (pki / "ca.pem").read_bytes(), (pki / "server.pem").read_bytes()
    assert main(["certs", "--out", str(pki), "--client", "site-9"]) == 0
    assert ((pki / "ca.pem").read_bytes(), (pki / "server.pem").read_bytes()) == before
    _cert(pki / "site-9.pem").verify_directly_issued_by(_cert(pki / "ca.pem"))


def test_nothing_is_overwritten_without_force(pki: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    key = (pki / "site-1.key").read_bytes()
    assert main(["certs", "--out", str(pki), "--client", "site-1"]) == 2
    assert "--force" in capsys.readouterr().err
    assert (pki / "site-1.key").read_bytes() == key
    assert main(["certs", "--out", str(pki), "--client", "site-1", "--force"]) == 0
    assert (pki / "site-1.key").read_bytes() != key


def test_bad_names_are_refused(tmp_path: Path) -> None:
    ca = make_ca()
    for bad in ("", "has space", "-lead", "a/b", "x" * 200):
        with pytest.raises(ConfigError):
            make_client_cert(ca, bad)
    with pytest.raises(ConfigError, match="reserved"):
        write_certificates(tmp_path, clients=["server"])
    with pytest.raises(ConfigError, match="neither"):
        write_certificates(tmp_path / "x", hosts=["bad host!"])


def test_a_ca_without_its_key_cannot_sign(pki: Path) -> None:
    (pki / "ca.key").unlink()
    with pytest.raises(ConfigError, match=r"no ca\.key"):
        load_ca(pki)
