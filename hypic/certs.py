"""A throwaway certificate authority for a local or test mesh (`hypic up --tls`, `hypic certs`).

    certs = generate_mesh_certs(Path("tls"))        # ca.pem, <name>.pem, <name>.key per name
    certs.ca, certs.cert("scatter"), certs.key("scatter")

One certificate per role, its subject common name the role ("segcache", "scatter", "combine",
"router", "front", "client"): segcache grants the writer role by that name (scatter, combine). Every
certificate is valid for the role's own host name, localhost and 127.0.0.1 (plus `extra_hosts`,
e.g. compose service names), for both server and client authentication, for `days` days. The CA
key is written beside them: whoever can read the directory can mint identities, so it is for a
local mesh only; a deployment issues certificates from its own CA (docs/security.md).
"""
from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLES = ("segcache", "scatter", "combine", "router", "front", "client")


@dataclass(frozen=True)
class MeshCerts:
    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    def cert(self, name: str) -> Path:
        return self.dir / f"{name}.pem"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"

    def flags(self, name: str) -> list[str]:
        """The service flags that make `name` a mutual-TLS member of the mesh."""
        return ["--tls-cert", str(self.cert(name)), "--tls-key", str(self.key(name)),
                "--tls-ca", str(self.ca)]


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hypic local mesh"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    out: list[x509.GeneralName] = []
    for h in dict.fromkeys(hosts):  # de-duplicated, in order
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(out)


def _builder(subject: x509.Name, issuer: x509.Name, public_key, days: int) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=days)))


def generate_mesh_certs(out_dir: str | os.PathLike[str], names: Sequence[str] = ROLES, *,
                        extra_hosts: Sequence[str] = (), days: int = 30) -> MeshCerts:
    """A fresh CA and one certificate per name in `out_dir` (created; files overwritten)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("hypic throwaway CA")
    ca_cert = (_builder(ca_name, ca_name, ca_key.public_key(), days)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    certs = MeshCerts(out)
    certs.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(out / "ca.key", ca_key)
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (_builder(_name(name), ca_name, key.public_key(), days)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(_san([name, "localhost", "127.0.0.1", *extra_hosts]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        certs.cert(name).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(certs.key(name), key)
    return certs
