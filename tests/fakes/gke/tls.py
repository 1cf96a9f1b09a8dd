"""A throwaway certificate authority and server certificate for the fake API server.

Clients verify the fake's TLS exactly as they verify a real cluster's: kubectl sends the bearer
token only over TLS, and `load_incluster_config` always builds an `https://` URL checked against
the service account's `ca.crt`. So the fake serves HTTPS with a CA made at start, and the
kubeconfig / service-account files it writes carry that CA. The server certificate names
127.0.0.1, localhost and `kubernetes.default.svc` (what a pod dials), plus any extra IPs.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from typing import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes


DNS_NAMES = ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
             "kubernetes.default.svc.cluster.local")


def make_pki(ips: Iterable[str] = (), dns_names: Iterable[str] = ()) -> Pki:
    """A new CA and a server certificate signed by it (ECDSA P-256: fast to make, one day valid)."""
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake-gke-ca")])
    ca = (x509.CertificateBuilder()
          .subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    all_ips = []
    for ip in ["127.0.0.1", *ips]:
        addr = ipaddress.ip_address(ip)
        if addr not in all_ips and not addr.is_unspecified:
            all_ips.append(addr)
    names = list(dict.fromkeys([*DNS_NAMES, *dns_names]))
    san = x509.SubjectAlternativeName([*(x509.DNSName(n) for n in names), *(x509.IPAddress(a) for a in all_ips)])
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(san, critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return Pki(
        ca_pem=ca.public_bytes(serialization.Encoding.PEM),
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()),
    )
