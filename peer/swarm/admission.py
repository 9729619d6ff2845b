"""A peer's side of admission: ask the coordinator to certify a fresh TLS key, keep it renewed.

The request is a record signed by the peer's identity (``potluck/<coordinator>/admission``): the
TLS key's public half and, for a private run, a proof that it knows the join token. The answer is
the coordinator's certificate record (``potluck/<coordinator>/certs``), checked before use: signed
by the coordinator, chaining to the CA in the run manifest, naming this peer and this TLS key.
See :mod:`potluck.coordinator.trust.admission` for the coordinator's side and the run's policy.
"""

from __future__ import annotations

import threading
import time

from potluck.protos.net.certs import CertError, TlsIdentity
from potluck.protos.net.swarm import DHTTimeout, JoinError, SwarmNode
from potluck.protos.runtime.log import get_logger
from potluck.protos.wire import work
from potluck.protos.wire.admissions import AdmissionRequest
from potluck.protos.wire.envelope import RecordError, next_seq
from potluck.protos.wire.records import Manifest

log = get_logger(__name__)

REQUEST_TTL_S = 120.0


def request(node: SwarmNode, manifest: Manifest, peer_id: str, tls: TlsIdentity, proof: str, nonce: int = 0) -> int:
    """Store (or refresh) this peer's admission request; returns its ``seq``."""
    req = AdmissionRequest(peer_id=peer_id, run_id=manifest.run_id, tls_key=tls.public_pem.decode(), proof=proof,
                           pow_nonce=nonce, ts=time.time(), seq=next_seq())
    node.request_admission(req, ttl=REQUEST_TTL_S)
    return req.seq


def admit(node: SwarmNode, manifest: Manifest, peer_id: str, tls: TlsIdentity, proof: str, timeout_s: float,
          stopping: threading.Event) -> None:
    """Ask for a certificate and wait for it (re-asking every few seconds); raises JoinError on refusal
    or timeout. On return ``tls`` holds a checked certificate."""
    deadline = time.monotonic() + timeout_s
    asked_at, seqs = 0.0, set()
    nonce = 0
    if manifest.pow_bits and not proof:  # an open run's price of a fresh key (potluck.protos.wire.work)
        t0 = time.monotonic()
        nonce = work.solve(manifest.run_id, peer_id, manifest.pow_bits, stopping)
        log.info("proof of work for admission (%d bits) done in %.1f s", manifest.pow_bits, time.monotonic() - t0)
    while time.monotonic() < deadline and not stopping.is_set():
        try:
            if time.monotonic() - asked_at > 5.0:
                seqs.add(request(node, manifest, peer_id, tls, proof, nonce))
                asked_at = time.monotonic()
            adopted, refusal = take(node, manifest, peer_id, tls, seqs)
        except DHTTimeout as err:  # the DHT process is slow to answer: ask again until the deadline
            log.warning("%s; asking again", err)
            adopted, refusal = False, ""
        if adopted:
            return
        if refusal:  # the coordinator refused one of our requests: a policy, not a delay
            raise JoinError(f"the coordinator refused to admit this peer: {refusal}")
        stopping.wait(0.2)
    if stopping.is_set():
        raise JoinError("stopped while waiting for admission")
    raise JoinError(f"the coordinator did not admit this peer within {timeout_s:.0f} s (is it running?)"
                    + ("; this run is private: pass its join token with --token" if manifest.admission == "private" else ""))


def take(node: SwarmNode, manifest: Manifest, peer_id: str, tls: TlsIdentity,
         asked: set[int] | None = None) -> tuple[bool, str]:
    """Adopt a certificate for our current TLS key if the coordinator published one; else the refusal of
    one of the requests ``asked`` ('' if there is none)."""
    try:
        cert = node.get_certificate(peer_id)
    except RecordError as err:
        log.debug("certificate record refused: %s", err)
        return False, ""
    if cert is None:
        return False, ""
    if cert.refused:
        return False, cert.refused if asked is not None and cert.request_seq in asked else ""
    if cert.cert_pem.encode() == tls.cert_pem:
        return False, ""
    try:
        tls.adopt(cert.cert_pem.encode(), manifest.ca_pem.encode(), peer_id)
    except CertError as err:  # e.g. still the one for this identity's previous TLS key (a restart): wait
        log.debug("certificate record not for this TLS key (yet): %s", err)
        return False, ""
    log.info("admitted: certificate valid for %.0f min", (tls.not_after - time.time()) / 60)
    return True, ""
