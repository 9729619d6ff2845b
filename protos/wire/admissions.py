"""The admission records: what a peer asks under ``potluck/<coordinator>/admission`` and what the
coordinator answers under ``.../certs`` (one subkey per peer id; see :mod:`potluck.protos.wire.records`)."""

from __future__ import annotations

from pydantic import Field

from potluck.protos.wire.envelope import Record
from potluck.protos.wire.records import ID_LEN, TEXT_LEN


class AdmissionRequest(Record):
    """A peer asking to take part: its fresh TLS key to certify, and for a private run a token proof."""

    peer_id: str = Field(max_length=ID_LEN)
    run_id: str = Field(max_length=ID_LEN)
    tls_key: str = Field(max_length=1024, description="PEM of the ECDSA P-256 public key to certify")
    proof: str = Field("", max_length=128, description="HMAC of peer id and TLS key under the join token")
    pow_nonce: int = Field(0, ge=0, description="admission.pow_bits: a nonce making sha256(run id, peer id, nonce) "
                           "start with that many zero bits")
    ts: float = 0.0
    seq: int = 0


class Certificate(Record):
    """The coordinator's answer to an admission request: a certificate, or why there is none."""

    peer_id: str = Field(max_length=ID_LEN)
    cert_pem: str = Field("", max_length=4096)
    refused: str = Field("", max_length=TEXT_LEN, description="why the request was refused (for good: a policy)")
    request_seq: int = Field(0, description="the request this answers (a refusal of an older one does not count)")
    not_after: float = 0.0
    seq: int = 0
