"""Proof of work for open admission: a fresh key must cost compute, so a crowd of them costs a crowd's.

An open run admits anyone; ``admission.pow_bits`` makes each new key find a nonce such that
``sha256(run id | peer id | nonce)`` starts with that many zero bits, about ``2 ** bits`` hashes (20
bits: about a second of one core; every further bit doubles it). It is bound to the run and to the key,
so it is paid once per key per run and cannot be reused for another key. It buys time, not safety:
probation (:mod:`potluck.coordinator.trust.trust`) is what keeps fresh keys from owning shards or voting.
"""

from __future__ import annotations

import hashlib
import threading


def _digest(run_id: str, peer_id: str, nonce: int) -> bytes:
    return hashlib.sha256(f"potluck-admission|{run_id}|{peer_id}|{nonce}".encode()).digest()


def zero_bits(run_id: str, peer_id: str, nonce: int) -> int:
    """Leading zero bits of the work's hash for ``nonce``."""
    value = int.from_bytes(_digest(run_id, peer_id, nonce), "big")
    return 256 - value.bit_length()


def solve(run_id: str, peer_id: str, bits: int, stopping: threading.Event | None = None) -> int:
    """The smallest nonce with ``bits`` leading zero bits (0 when ``bits`` is 0), or -1 if ``stopping`` is set
    before it is found."""
    if bits <= 0:
        return 0
    prefix = f"potluck-admission|{run_id}|{peer_id}|".encode()
    limit = 1 << (256 - bits)
    start = 0
    while True:
        for nonce in range(start, start + 4096):
            if int.from_bytes(hashlib.sha256(prefix + str(nonce).encode()).digest(), "big") < limit:
                return nonce
        start += 4096
        if stopping is not None and stopping.is_set():
            return -1
