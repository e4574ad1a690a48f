"""Throwaway PKI for TLS tests: a CA, a server certificate for localhost/127.0.0.1, client certs."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import pytest

x509 = pytest.importorskip("cryptography.x509")
hashes = pytest.importorskip("cryptography.hazmat.primitives.hashes")
serialization = pytest.importorskip("cryptography.hazmat.primitives.serialization")
ec = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ec")
NameOID = x509.oid.NameOID
ExtendedKeyUsageOID = x509.oid.ExtendedKeyUsageOID


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    # A client certificate signed by a CA the server does not trust.
    rogue_cert: Path
    rogue_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _builder(subject: str, issuer: x509.Name, public_key: object) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _make_ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(common_name, _name(common_name), key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _make_leaf(
    common_name: str,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    *,
    server: bool,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    builder = _builder(common_name, ca_cert.subject, key.public_key()).add_extension(
        x509.BasicConstraints(ca=False, path_length=None), critical=True
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_pki(directory: Path) -> Pki:
    """Writes PEM files for a CA, a server, a trusted client and a rogue client under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = _make_ca("lorarl test CA")
    rogue_ca = _make_ca("rogue CA")
    server_cert, server_key = _make_leaf("localhost", ca, server=True)
    client_cert, client_key = _make_leaf("lorarl test client", ca, server=False)
    rogue_cert, rogue_key = _make_leaf("rogue client", rogue_ca, server=False)
    return Pki(
        ca=_write_cert(ca[0], directory / "ca.pem"),
        server_cert=_write_cert(server_cert, directory / "server.pem"),
        server_key=_write_key(server_key, directory / "server.key"),
        client_cert=_write_cert(client_cert, directory / "client.pem"),
        client_key=_write_key(client_key, directory / "client.key"),
        rogue_cert=_write_cert(rogue_cert, directory / "rogue.pem"),
        rogue_key=_write_key(rogue_key, directory / "rogue.key"),
    )
