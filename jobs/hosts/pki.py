"""The console's certificate authority for the hosts' engines (the join command, jobs/hosts/joins.py).

Who holds what:

- The CA key and certificate live in `SUANLI_CA_DIR` (default: `SUANLI_TLS_DIR/ca`) on the
  machine that runs the console's web process, made once on first use (EC P-256, key file
  0600 in a 0700 folder). The key never leaves it: hosts send a certificate signing request
  and get back a certificate; nothing answers with the key. Several web machines share the
  folder (or its two files) so that they sign with one CA.
- A host's engine key is made on the host (join.sh, openssl) and never leaves it. Its
  certificate says *serverAuth* only and names the host's address as its one subject
  alternative name: whatever the request asked for, the CSR gives its public key and
  nothing else. An engine key can therefore open no other engine (Go's TLS, which dockerd
  uses, refuses a client certificate without *clientAuth*).
- The console's client key for an engine is made here, per host, and stored with the Host
  (encrypted at rest, jobs/base/crypto.py); its certificate says *clientAuth* only.

Layer: hosts, the bottom of it; uses no other part.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from django.conf import settings

CA_DAYS = 3650


class BadRequest(ValueError):
    """A signing request we do not sign; the text says why, for the operator."""


@dataclass(frozen=True)
class Authority:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @property
    def cert_pem(self) -> str:
        return self.cert.public_bytes(serialization.Encoding.PEM).decode()


def ca_dir() -> Path:
    configured = getattr(settings, "SUANLI_CA_DIR", "")
    return Path(configured) if configured else Path(settings.SUANLI_TLS_DIR) / "ca"


def authority() -> Authority:
    """The CA, made on first use. Two processes making it at once: one folder wins (an
    atomic rename), the other reads it."""
    folder = ca_dir()
    if not (folder / "ca.pem").exists():
        _make_ca(folder)
    key = serialization.load_pem_private_key((folder / "ca-key.pem").read_bytes(), None)
    cert = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
    return Authority(key=key, cert=cert)


def _make_ca(folder: Path) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Suanli"),
            x509.NameAttribute(NameOID.COMMON_NAME, "Suanli hosts CA"),
        ]
    )
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    work = Path(tempfile.mkdtemp(prefix=".ca-", dir=folder.parent))  # 0700
    try:
        _write(work / "ca-key.pem", _key_pem(key))
        _write(work / "ca.pem", cert.public_bytes(serialization.Encoding.PEM).decode())
        try:
            os.rename(work, folder)
        except OSError:  # another process made it first (or an empty folder is there)
            if not (folder / "ca.pem").exists():
                folder.rmdir()  # an empty leftover: take its place
                os.rename(work, folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def _key_pem(key) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def read_csr(pem: str) -> x509.CertificateSigningRequest:
    """A CSR we may sign: well-formed, self-signed by its key (the sender holds it), an EC
    key on P-256/P-384 or RSA of 2048 bits or more."""
    try:
        csr = x509.load_pem_x509_csr(pem.encode())
    except (ValueError, TypeError):
        raise BadRequest("the certificate signing request is not a PEM CSR") from None
    if not csr.is_signature_valid:
        raise BadRequest("the certificate signing request is not signed by its own key")
    key = csr.public_key()
    if isinstance(key, ec.EllipticCurvePublicKey):
        if key.curve.name not in ("secp256r1", "secp384r1"):
            raise BadRequest(f"the engine key's curve {key.curve.name} is not P-256 or P-384")
    elif isinstance(key, rsa.RSAPublicKey):
        if key.key_size < 2048:
            raise BadRequest(f"the engine key has {key.key_size} bits; RSA needs 2048 or more")
    else:
        raise BadRequest("the engine key is neither EC (P-256, P-384) nor RSA")
    return csr


def sign_engine(csr: x509.CertificateSigningRequest, *, name: str, address: str) -> str:
    """The engine's server certificate (PEM): the CSR's key, `name` as its common name, the
    address as its only subject alternative name, serverAuth only."""
    ca = authority()
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.cert.subject)
        .public_key(csr.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=settings.SUANLI_HOST_CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(address))]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(_signing_usage(), critical=True)
        .sign(ca.key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def console_client(*, host_name: str) -> tuple[str, str]:
    """(certificate PEM, key PEM) with which the console opens one host's engine:
    clientAuth only, made and kept here."""
    ca = authority()
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"suanli-console:{host_name}")])
        )
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=settings.SUANLI_HOST_CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(_signing_usage(), critical=True)
        .sign(ca.key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode(), _key_pem(key)


def _signing_usage() -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=True,
        data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
        encipher_only=False, decipher_only=False,
    )  # fmt: skip
