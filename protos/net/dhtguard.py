"""What every DHT node of a run agrees to store: its signed records, under its own keys, briefly.

hivemind lets any node store anything anywhere, and a stored value wins by its expiration time.
So a forged heartbeat stored with a later expiry displaced a victim's real ones, and a genuine old
plan re-stored with an hour to live froze membership. Every potluck node (the coordinator's and
each peer's) therefore runs :class:`RunRecords` as its hivemind record validator, at store time and
on every read, and refuses:

* keys that are not this run's (``potluck/<coordinator id>/...``): junk anywhere is not kept;
* values over ``MAX_RECORD_BYTES`` (the coordinator's plan: ``MAX_PLAN_BYTES``);
* records not signed by their author: the coordinator for its manifest, plan and certificates, the
  peer named by the subkey for its heartbeat, link report and admission request;
* records that would outlive their own signed expiry (``_expires`` inside the signed body) or
  live longer than ``MAX_TTL_S``: a replayed record cannot be kept alive past what its author meant.

Readers still check everything again (:func:`potluck.protos.wire.records.unseal`): the DHT is one
layer of the defence, not the trusted one.
"""

from __future__ import annotations

import json
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from potluck.protos.config.runconfig import MAX_RECORD_TTL_S
from potluck.protos.net.identity import verify

MAX_RECORD_BYTES = 64 << 10
# The plan lists every member of its rounds: ~170 bytes a member, so 1,000 members make ~170 KB a round.
# Only the coordinator signs it; hivemind carries up to 4 MiB in a message.
MAX_PLAN_BYTES = 1 << 20
MAX_TTL_S = MAX_RECORD_TTL_S
SKEW_S = 5.0

# who signs the records under each of a run's keys
BY_COORDINATOR = ("manifest", "plan", "plan_head", "certs")
BY_SUBKEY = ("peers", "links", "admission")


def run_key(coordinator: str, kind: str) -> str:
    """The DHT key of one kind of a run's records (the run is named by its coordinator's id)."""
    if kind not in BY_COORDINATOR + BY_SUBKEY:
        raise ValueError(f"unknown record kind {kind!r}")
    return f"potluck/{coordinator}/{kind}"


class RunRecords(RecordValidatorBase):
    def __init__(self, coordinator: str) -> None:
        self.coordinator = coordinator
        self._kinds = {DHTID.generate(source=run_key(coordinator, k)).to_bytes(): k for k in BY_COORDINATOR + BY_SUBKEY}
        self._regular = MSGPackSerializer.dumps(None)

    def validate(self, record: DHTRecord) -> bool:
        return self.reason(record) == ""

    def reason(self, record: DHTRecord) -> str:
        """Why ``record`` is refused ('' if it is fine): for tests and logs."""
        kind = self._kinds.get(record.key)
        if kind is None:
            return "not one of this run's keys"
        limit = MAX_PLAN_BYTES if kind == "plan" else MAX_RECORD_BYTES
        if len(record.value) > limit:
            return f"{len(record.value)} bytes, more than {limit}"
        if record.expiration_time > get_dht_time() + MAX_TTL_S + SKEW_S:
            return f"asks to live {record.expiration_time - get_dht_time():.0f} s, more than {MAX_TTL_S:.0f} s"
        try:
            envelope = MSGPackSerializer.loads(record.value)
            subkey = MSGPackSerializer.loads(record.subkey) if record.subkey != self._regular else None
        except Exception:
            return "not msgpack"
        if not isinstance(envelope, dict):
            return "not a signed record"
        by, body, sig = envelope.get("by"), envelope.get("body"), envelope.get("sig")
        if not isinstance(by, str) or not isinstance(body, bytes) or not isinstance(sig, bytes):
            return "not a signed record"
        if kind in BY_COORDINATOR:
            if by != self.coordinator:
                return f"a {kind} record must be signed by the coordinator"
            if kind == "certs" and not isinstance(subkey, str):
                return "certificates are stored under the peer id"
            if kind != "certs" and subkey is not None:
                return f"a {kind} record has no subkey"
        elif not isinstance(subkey, str) or by != subkey:
            return f"a {kind} record must be signed by the peer its subkey names"
        if not verify(by, body, sig):
            return "bad signature"
        expires = _expires(body)
        if expires is None:
            return "no expiry in the signed body"
        if record.expiration_time > expires + SKEW_S:
            return "stored to live longer than its author signed for"
        return ""

    @property
    def priority(self) -> int:
        return 10

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, RunRecords) and other.coordinator == self.coordinator


def _expires(body: bytes) -> float | None:
    try:
        data: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    value = data.get("_expires") if isinstance(data, dict) else None
    return float(value) if isinstance(value, int | float) else None
