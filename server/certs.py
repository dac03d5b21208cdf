"""`edge-hub certs`: a small CA for one star, the broker's certificate, one client certificate
per device (the `cryptography` package; EC P-256 keys, fast on a Jetson's CPU).

Layout of DIR (re-running keeps the CA and every existing certificate; it adds what is new):

    ca.crt ca.key              the star's CA (keep ca.key off the devices)
    broker.crt broker.key      the broker's certificate: every --host as a subject alt name
    clients/NAME.crt NAME.key  one per device; the broker takes the certificate's CN as the
                               client's username (its ACL identity), so it must be the client id
"""
from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from edge.wire.protocol import check_id

VALID_DAYS = 825


class CertError(RuntimeError):
    """A certificate could not be made or read; the message says what to do."""


@dataclass(frozen=True)
class TlsFiles:
    """The files one party needs: the CA to verify the other side, its own cert and key."""
    ca: Path
    cert: Path
    key: Path

    def check(self) -> "TlsFiles":
        for p in (self.ca, self.cert, self.key):
            if not Path(p).is_file():
                raise CertError(f"{p} is missing: make it with `edge-hub certs --out DIR ...`")
        return self


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    os.chmod(path, 0o600)


def _read(path: Path):
    return x509.load_pem_x509_certificate(path.read_bytes())


def _read_key(path: Path):
    return serialization.load_pem_private_key(path.read_bytes(), password=None)


def _cert(subject: str, issuer_name, issuer_key, pub, *, ca: bool, sans: Iterable = (), usage=None):
    now = dt.datetime.now(dt.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    b = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name or name)
         .public_key(pub).serial_number(x509.random_serial_number())
         .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=VALID_DAYS))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True))
    sans = list(sans)
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if usage is not None:
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                          content_commitment=False, key_encipherment=False,
                                          data_encipherment=False, key_agreement=False,
                                          encipher_only=False, decipher_only=False), critical=True)
    return b.sign(issuer_key, hashes.SHA256())


def _san(host: str):
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_certs(out: str | os.PathLike, hosts: Iterable[str] = ("localhost", "127.0.0.1"),
               clients: Iterable[str] = ()) -> List[str]:
    """Make what is missing under `out`; returns the paths written (empty: nothing to do)."""
    out = Path(out)
    (out / "clients").mkdir(parents=True, exist_ok=True)
    written: List[str] = []
    ca_crt, ca_key = out / "ca.crt", out / "ca.key"
    if not ca_crt.exists():
        key = _key()
        _write_key(ca_key, key)
        ca_crt.write_bytes(_cert("StarSun star CA", None, key, key.public_key(), ca=True)
                           .public_bytes(serialization.Encoding.PEM))
        written += [str(ca_crt), str(ca_key)]
    try:
        ca, cakey = _read(ca_crt), _read_key(ca_key)
    except (OSError, ValueError) as e:
        raise CertError(f"cannot read the CA in {out}: {e}; remove ca.crt and ca.key to start anew") from None
    hosts = list(dict.fromkeys(hosts))
    if not hosts:
        raise CertError("the broker's certificate needs at least one --host (name or address devices use)")
    b_crt, b_key = out / "broker.crt", out / "broker.key"
    if not b_crt.exists() or set(_sans(b_crt)) != set(hosts):
        key = _key()
        _write_key(b_key, key)
        b_crt.write_bytes(_cert(hosts[0], ca.subject, cakey, key.public_key(), ca=False,
                                sans=[_san(h) for h in hosts], usage=ExtendedKeyUsageOID.SERVER_AUTH)
                          .public_bytes(serialization.Encoding.PEM))
        written += [str(b_crt), str(b_key)]
    for name in clients:
        check_id(name, "client id")
        c_crt, c_key = out / "clients" / f"{name}.crt", out / "clients" / f"{name}.key"
        if c_crt.exists():
            continue
        key = _key()
        _write_key(c_key, key)
        c_crt.write_bytes(_cert(name, ca.subject, cakey, key.public_key(), ca=False,
                                usage=ExtendedKeyUsageOID.CLIENT_AUTH).public_bytes(serialization.Encoding.PEM))
        written += [str(c_crt), str(c_key)]
    return written


def _sans(path: Path) -> List[str]:
    try:
        ext = _read(path).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (x509.ExtensionNotFound, ValueError, OSError):
        return []
    return [str(v) for v in ext.get_values_for_type(x509.DNSName)] + \
           [str(v) for v in ext.get_values_for_type(x509.IPAddress)]


def broker_files(out: str | os.PathLike) -> TlsFiles:
    out = Path(out)
    return TlsFiles(out / "ca.crt", out / "broker.crt", out / "broker.key").check()


def client_files(out: str | os.PathLike, name: str) -> TlsFiles:
    out = Path(out)
    return TlsFiles(out / "ca.crt", out / "clients" / f"{name}.crt", out / "clients" / f"{name}.key").check()


def common_name(cert: str | os.PathLike) -> Optional[str]:
    attrs = _read(Path(cert)).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(attrs[0].value) if attrs else None
