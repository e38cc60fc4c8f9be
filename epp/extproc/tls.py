"""TLS for the ext_proc port: a certificate from `--cert-path` or a self-signed one.

Like the reference, the self-signed certificate has Organization "Inference Ext", is valid for ten
years and is for server auth; Envoy is configured to skip verification. We use RSA-2048 rather
than the reference's 4096 bits: same compatibility, a much faster start.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def self_signed() -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Inference Ext")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _read_pair(cert_path: str) -> tuple[bytes, bytes]:
    directory = Path(cert_path)
    return (directory / "tls.crt").read_bytes(), (directory / "tls.key").read_bytes()


def server_credentials(cert_path: str, reload: bool = False) -> grpc.ServerCredentials:
    """Credentials for the gRPC port. With `reload`, the files are re-read when they change, so a
    rotated Kubernetes secret takes effect without a restart."""
    if not cert_path:
        cert, key = self_signed()
        return grpc.ssl_server_credentials([(key, cert)])
    cert, key = _read_pair(cert_path)
    if not reload:
        return grpc.ssl_server_credentials([(key, cert)])
    state = {"pair": (cert, key)}

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        try:
            pair = _read_pair(cert_path)
        except OSError:
            return None  # keep serving the last good pair
        if pair == state["pair"]:
            return None
        state["pair"] = pair
        return grpc.ssl_server_certificate_configuration([(pair[1], pair[0])])

    initial = grpc.ssl_server_certificate_configuration([(key, cert)])
    return grpc.dynamic_ssl_server_credentials(initial, fetch)
