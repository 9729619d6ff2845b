"""The run's certificate authority, and the short-lived certificates it issues to admitted peers.

Peer-to-peer gRPC runs over mutual TLS. A peer's *identity* is its Ed25519 key (its peer id); its
*TLS key* is a separate ECDSA P-256 key made fresh by every process (the TLS stack gRPC ships cannot
sign handshakes with Ed25519). Admission binds the two: a peer asks, in a record signed with its
identity, for a certificate for its TLS key; the coordinator's CA (an ECDSA key in the journal
directory, its certificate in the signed run manifest) issues one whose common name and DNS name
are the peer id, valid for ``lifetime_s``. Then:

* a server learns who calls from the client certificate (:func:`peer_of`), and refuses a message
  whose ``header.sender`` differs;
* a client names the peer id it expects (``grpc.ssl_target_name_override``), so a reply can only
  come from the key it meant to reach.

Everything here is plain X.509 made with ``cryptography``; nothing is trusted that does not chain to
the run's CA.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CA_NAME = "potluck CA"
CLOCK_SKEW_S = 300.0


class CertError(ValueError):
    """A certificate that does not prove what it claims."""


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def public_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def fingerprint(pem: bytes) -> str:
    """SHA-256 of a PEM blob, hex: how a TLS key or certificate is named in records and logs."""
    return hashlib.sha256(pem).hexdigest()


class CertificateAuthority:
    """The coordinator's CA: one ECDSA key (0600 in the journal directory) and its self-signed certificate."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self.key, self.cert = key, cert
        self.cert_pem = cert.public_bytes(serialization.Encoding.PEM)

    @classmethod
    def load_or_create(cls, path: str | Path, coordinator: str) -> CertificateAuthority:
        path = Path(path)
        if path.exists():
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise CertError(f"{path} is not an ECDSA key")
        else:
            key = ec.generate_private_key(ec.SECP256R1())
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(_pem_key(key))
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{CA_NAME} {coordinator[-32:]}")])  # CN <= 64
        public = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                # the same serial for the same key, so a restarted coordinator's CA certificate is the same one
                .serial_number(int.from_bytes(hashlib.sha256(public).digest()[:16], "big") >> 1)
                .not_valid_before(datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC))
                .not_valid_after(datetime.datetime(2125, 1, 1, tzinfo=datetime.UTC))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                             crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(key, cert)

    def issue(self, peer_id: str, tls_public_pem: bytes, lifetime_s: float) -> bytes:
        """A certificate binding ``tls_public_pem`` to ``peer_id`` for ``lifetime_s`` seconds (PEM)."""
        public = serialization.load_pem_public_key(tls_public_pem)
        if not isinstance(public, ec.EllipticCurvePublicKey) or public.curve.name != "secp256r1":
            raise CertError("a TLS key must be an ECDSA P-256 public key")
        now = _now()
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, peer_id)]))
                .issuer_name(self.cert.subject).public_key(public).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(seconds=CLOCK_SKEW_S))
                .not_valid_after(now + datetime.timedelta(seconds=lifetime_s))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(peer_id.lower())]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .sign(self.key, hashes.SHA256()))
        return cert.public_bytes(serialization.Encoding.PEM)


@dataclass
class TlsIdentity:
    """This process's TLS side: a fresh P-256 key, and the certificate the run's CA issued for it.

    ``generation`` grows with every certificate adopted: servers hand new handshakes the newest
    (gRPC's dynamic credentials ask for it), clients open new channels with it.
    """

    key: ec.EllipticCurvePrivateKey
    cert_pem: bytes = b""
    ca_pem: bytes = b""
    not_after: float = 0.0
    generation: int = 0

    @classmethod
    def generate(cls) -> TlsIdentity:
        return cls(ec.generate_private_key(ec.SECP256R1()))

    @property
    def key_pem(self) -> bytes:
        return _pem_key(self.key)

    @property
    def public_pem(self) -> bytes:
        return public_pem(self.key)

    def adopt(self, cert_pem: bytes, ca_pem: bytes, peer_id: str) -> None:
        """Take a certificate issued for us, after checking it names us and carries our key."""
        info = check_certificate(cert_pem, ca_pem, peer_id)
        if info.public_pem != self.public_pem:
            raise CertError("the certificate is for another TLS key")
        self.cert_pem, self.ca_pem, self.not_after = cert_pem, ca_pem, info.not_after
        self.generation += 1

    def server_credentials(self) -> Any:
        """gRPC server credentials that require a client certificate from the run's CA, and follow renewals."""
        import grpc

        seen = [self.generation]

        def config() -> Any:
            return grpc.ssl_server_certificate_configuration([(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem)

        def fetch() -> Any:  # called by gRPC on new handshakes: a renewed certificate takes over from there
            if self.generation == seen[0]:
                return None
            seen[0] = self.generation
            return config()

        return grpc.dynamic_ssl_server_credentials(config(), fetch, require_client_authentication=True)

    def channel_credentials(self) -> Any:
        import grpc

        if not self.cert_pem:  # not admitted yet: TLS without a client certificate (servers refuse it)
            return grpc.ssl_channel_credentials(root_certificates=self.ca_pem)
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)


@dataclass(frozen=True)
class CertInfo:
    peer_id: str
    public_pem: bytes
    not_after: float


def check_certificate(cert_pem: bytes, ca_pem: bytes, peer_id: str | None = None, now: float | None = None) -> CertInfo:
    """Parse a peer certificate and check it: issued by the run's CA, current, for ``peer_id``."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        ca = x509.load_pem_x509_certificate(ca_pem)
    except ValueError as err:
        raise CertError(f"not a PEM certificate: {err}") from None
    if cert.issuer != ca.subject:
        raise CertError("the certificate was not issued by this run's CA")
    ca_key = ca.public_key()
    if not isinstance(ca_key, ec.EllipticCurvePublicKey):
        raise CertError("the run's CA key is not ECDSA")
    try:
        ca_key.verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256()))
    except Exception:
        raise CertError("the certificate's signature does not verify against the run's CA") from None
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    cn = str(names[0].value) if names else ""
    if peer_id is not None and cn != peer_id:
        raise CertError(f"the certificate names {cn[-6:]!r}, expected {peer_id[-6:]!r}")
    t = _now().timestamp() if now is None else now
    if not cert.not_valid_before_utc.timestamp() <= t <= cert.not_valid_after_utc.timestamp():
        raise CertError("the certificate is not valid now (expired, or from the future)")
    public = cert.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return CertInfo(cn, public, cert.not_valid_after_utc.timestamp())


def token_proof(token: str, run_id: str, peer_id: str, tls_key_pem: str) -> str:
    """What a peer of a private run sends instead of the join token: only someone who knows the token can
    make it, and it is bound to this peer and TLS key (replaying it admits nobody else)."""
    msg = f"potluck-admission|{run_id}|{peer_id}|{fingerprint(tls_key_pem.encode())}".encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def peer_of(auth_context: dict) -> str:
    """The peer id a TLS client proved it is (its certificate's common name), or '' without one."""
    names = auth_context.get("x509_common_name") or []
    return names[0].decode() if names else ""
