"""A small certificate authority for fedloom: a CA, a server certificate, client certificates.

``fedloom certs`` calls `write_certificates`; the functions below are also usable from
Python (the demo makes a throwaway set in a temporary folder). Everything is ECDSA P-256
with SHA-256 signatures, made with the ``cryptography`` package, written as PEM; private
keys are written with mode 0600 and never overwritten unless asked.

- The CA is self-signed (``BasicConstraints(ca=True, path_length=0)``, key usage
  ``keyCertSign`` + ``cRLSign``).
- The server certificate names every host a client may dial in its subjectAltName
  (DNS names and IP addresses; by default ``localhost`` and ``127.0.0.1``): TLS clients
  check the name they dialled against the SANs, not against the CN.
- A client certificate carries the client's name as its CN, which a mutual-TLS server
  takes as the client's identity, and ``extendedKeyUsage = clientAuth``.

This is a convenience for a quick secure set-up and for tests, not a PKI: there is no
revocation list (revoke a client with the server's allow-list) and the CA key sits in a
file. An organisation with its own CA should use it instead.

Example::

    >>> import tempfile
    >>> out = tempfile.mkdtemp()
    >>> files = write_certificates(out, clients=["site-1"])
    >>> sorted(p.name for p in files)
    ['ca.key', 'ca.pem', 'server.key', 'server.pem', 'site-1.key', 'site-1.pem']
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedloom.errors import ConfigError

DEFAULT_HOSTS = ("localhost", "127.0.0.1")
CA_DAYS = 3650
LEAF_DAYS = 825  # the longest leaf lifetime browsers and most TLS stacks accept
_CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")


@dataclasses.dataclass(frozen=True)
class Issued:
    """A certificate and its private key."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )


def check_client_name(name: str) -> str:
    """A client name usable as a certificate CN and as a token name, or `ConfigError`."""
    if not _CLIENT_NAME.fullmatch(name):
        raise ConfigError(
            "client name",
            f"{name!r} is not a valid client name: use 1-128 letters, digits, '.', '_', "
            "'@' or '-', starting with a letter or digit",
        )
    return name


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey, days: int
) -> x509.CertificateBuilder:
    if days < 1:
        raise ConfigError("days", "a certificate must be valid for at least 1 day")
    now = _now()
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate clock skew
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )


def _key_usage(*, digital_signature: bool = False, cert_sign: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def make_ca(common_name: str = "fedloom CA", days: int = CA_DAYS) -> Issued:
    """A self-signed certificate authority that may sign leaf certificates only."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        _builder(name, name, key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert, key)


def _leaf(
    ca: Issued,
    common_name: str,
    usage: x509.ObjectIdentifier,
    sans: Sequence[x509.GeneralName],
    days: int,
) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    builder = (
        _builder(subject, ca.cert.subject, key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
            critical=False,
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return Issued(builder.sign(ca.key, hashes.SHA256()), key)


def host_names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    """subjectAltName entries: an IP address where the host parses as one, else DNS."""
    names: list[x509.GeneralName] = []
    for host in hosts:
        host = host.strip()
        if not host:
            raise ConfigError("--host", "an empty host name")
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if not re.fullmatch(r"(\*\.)?[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", host):
                raise ConfigError(
                    "--host", f"{host!r} is neither an IP address nor a DNS name"
                ) from None
            names.append(x509.DNSName(host))
    return names


def make_server_cert(
    ca: Issued, hosts: Sequence[str] = DEFAULT_HOSTS, days: int = LEAF_DAYS
) -> Issued:
    """A server certificate valid for each of ``hosts`` (DNS names or IP addresses)."""
    if not hosts:
        raise ConfigError("--host", "a server certificate needs at least one host name")
    sans = host_names(hosts)
    return _leaf(ca, hosts[0], ExtendedKeyUsageOID.SERVER_AUTH, sans, days)


def make_client_cert(ca: Issued, name: str, days: int = LEAF_DAYS) -> Issued:
    """A client certificate whose CN is ``name``: its identity on a mutual-TLS server."""
    return _leaf(ca, check_client_name(name), ExtendedKeyUsageOID.CLIENT_AUTH, (), days)


def load_ca(folder: str | Path) -> Issued:
    """Read ``ca.pem`` and ``ca.key`` from ``folder``."""
    folder = Path(folder)
    try:
        cert = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
        key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), None)
    except FileNotFoundError as exc:
        raise ConfigError("--out", f"{folder} has ca.pem but no ca.key to sign with") from exc
    except ValueError as exc:
        raise ConfigError("--out", f"cannot read the CA in {folder}: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError("--out", f"{folder / 'ca.key'} is not an EC key made by fedloom certs")
    return Issued(cert, key)


def _write(path: Path, data: bytes, *, private: bool, force: bool) -> Path:
    if path.exists() and not force:
        raise ConfigError("--force", f"{path} exists; pass --force to replace it")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def write_issued(folder: Path, stem: str, issued: Issued, *, force: bool = False) -> list[Path]:
    """Write ``<stem>.pem`` (0644) and ``<stem>.key`` (0600) into ``folder``."""
    return [
        _write(folder / f"{stem}.key", issued.key_pem(), private=True, force=force),
        _write(folder / f"{stem}.pem", issued.cert_pem(), private=False, force=force),
    ]


def write_certificates(
    out: str | Path,
    *,
    hosts: Sequence[str] | None = None,
    clients: Sequence[str] = (),
    days: int = LEAF_DAYS,
    force: bool = False,
) -> list[Path]:
    """Create (or extend) a certificate folder; returns the files written.

    The CA (``ca.pem``/``ca.key``) is made when absent and reused when present, so
    clients can be added later. The server certificate (``server.pem``/``server.key``)
    is made with a new CA, when absent, or when ``hosts`` is given (replacing an existing
    file needs ``force``).
    Each client gets ``<name>.pem``/``<name>.key``.
    """
    folder = Path(out)
    if {"ca", "server"} & set(clients):
        raise ConfigError("--client", "'ca' and 'server' are reserved file names")
    for name in clients:
        check_client_name(name)
    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    new_ca = not (folder / "ca.pem").exists()
    if new_ca:
        ca = make_ca()
        written += write_issued(folder, "ca", ca, force=force)
    else:
        ca = load_ca(folder)
    if new_ca or hosts is not None or not (folder / "server.pem").exists():
        server = make_server_cert(ca, tuple(hosts) if hosts is not None else DEFAULT_HOSTS, days)
        written += write_issued(folder, "server", server, force=force)
    for name in clients:
        written += write_issued(folder, name, make_client_cert(ca, name, days), force=force)
    return written
