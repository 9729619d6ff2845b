"""HTTPS for the status page: the operator's certificate files, or a self-signed certificate kept in
the journal directory, whose fingerprint the coordinator prints for visitors to compare."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import ssl
from pathlib import Path

from potluck.protos.runtime.log import get_logger

log = get_logger(__name__)

TLS_KEY, TLS_CERT = "status-tls.key", "status-tls.pem"
SELF_SIGNED_DAYS = 825  # the longest validity Apple platforms accept for a TLS server certificate


def status_tls(cert_file: str | None, key_file: str | None, self_signed: bool, directory: Path,
               host: str | None = None) -> tuple[ssl.SSLContext | None, str]:
    """The status server's TLS context and its certificate's SHA-256 fingerprint (``AB:CD:...``).

    With ``cert_file`` and ``key_file`` (PEM; the certificate file may hold the chain), those; with
    ``self_signed``, an ECDSA P-256 certificate for localhost, 127.0.0.1 and ``host``, made once and
    kept in ``directory`` (``status-tls.key`` 0600, ``status-tls.pem``), so its fingerprint, which
    visitors pin, survives restarts; it is made anew only when missing, unreadable or expired.
    Otherwise ``(None, "")``: plain HTTP. A file that cannot be used raises ``ConfigError``.
    """
    # imported here: `potluck status` imports this module for API alone, and should start at once
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from potluck.protos.config.section import ConfigError

    if self_signed and (cert_file or key_file):
        raise ConfigError("status TLS: a self-signed certificate or the given files, not both")
    if not self_signed and not (cert_file or key_file):
        return None, ""
    if self_signed:
        cert_path, key_path = _self_signed(directory, host)
    elif not (cert_file and key_file):
        raise ConfigError("status TLS needs both a certificate file and its key file")
    else:
        cert_path, key_path = Path(cert_file), Path(key_file)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_path, key_path)
        leaf = x509.load_pem_x509_certificates(cert_path.read_bytes())[0]  # the server's own comes first
    except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
        raise ConfigError(f"status TLS: cannot serve certificate {cert_path} with key {key_path}: {err}") from None
    return ctx, cert_fingerprint(leaf.public_bytes(serialization.Encoding.DER))


def cert_fingerprint(der: bytes) -> str:
    """SHA-256 of a DER certificate as browsers show it: upper-case hex pairs joined by colons."""
    return ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())


def _self_signed(directory: Path, host: str | None) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key_path, cert_path = directory / TLS_KEY, directory / TLS_CERT
    now = datetime.datetime.now(datetime.UTC)
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        spki = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        if (cert.public_key().public_bytes(*spki) == key.public_key().public_bytes(*spki)
                and cert.not_valid_after_utc > now + datetime.timedelta(days=1)):
            return cert_path, key_path
        log.warning("the status page's certificate in %s expired or does not match its key: making a new one "
                    "(its fingerprint changes)", directory)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, TypeError) as err:
        log.warning("cannot read the status page's certificate in %s (%s): making a new one", directory, err)

    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    if host and host not in ("localhost", "127.0.0.1"):
        try:
            ip = ipaddress.ip_address(host)
            if not ip.is_unspecified:
                names.append(x509.IPAddress(ip))
        except ValueError:
            names.append(x509.DNSName(host))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "potluck status page")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))  # a visitor's clock a little behind
        .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    _write_replacing(key_path, pem_key, 0o600)
    _write_replacing(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert_path, key_path


def _write_replacing(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to a fresh file of ``mode`` beside ``path``, then move it there: never a readable partial key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
