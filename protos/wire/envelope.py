"""The signed envelope every DHT value travels in, and the base of every record type.

A value is ``{"v": 2, "by": <author id>, "body": <json>, "sig": ...}``. A reader accepts it only if the
signature matches the author's key (inside the author's peer id, see :mod:`potluck.protos.net.identity`),
the author is the one it must be, the signed expiry (``_expires``) has not passed, and the record is not
older than one already seen from that author (``seq``); anything else is a :class:`RecordError` saying why.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from potluck.protos.net.identity import Identity, verify

ENVELOPE_VERSION = 2
MAX_CLOCK_SKEW_S = 300.0


class RecordError(ValueError):
    """A DHT value that is malformed, forged, or older than one already accepted."""


class Record(BaseModel):
    """The base of every record type: unknown fields are ignored (a newer writer does not crash an older reader)."""

    model_config = ConfigDict(extra="ignore")


_R = TypeVar("_R", bound=Record)


def seal(identity: Identity, record: BaseModel | dict[str, Any], ttl: float, raw: dict[str, str] | None = None,
         ) -> dict[str, Any]:
    """Sign a record (or its ``model_dump(mode="json")``, made already) for the DHT; it is refused everywhere
    ``ttl`` seconds from now. ``raw``: fields already in their :func:`canonical` JSON (a plan's rounds)."""
    data = {**(record if isinstance(record, dict) else record.model_dump(mode="json")), "_expires": time.time() + ttl}
    body = canonical(data, raw)
    return {"v": ENVELOPE_VERSION, "by": identity.peer_id, "body": body, "sig": identity.sign(body)}


def canonical(data: dict[str, Any], raw: dict[str, str] | None = None) -> bytes:
    """The JSON a record's body is signed as: keys sorted, no spaces. ``raw`` holds top-level fields already in
    this form, spliced in as they are: the same bytes as dumping them with the rest (a plan of 1,000 members is
    700 KB of JSON, and only its newest round is new at each publish)."""
    dump = functools.partial(json.dumps, sort_keys=True, separators=(",", ":"))
    if not raw:
        return dump(data).encode()
    parts = {**{k: dump(v) for k, v in data.items() if k not in raw}, **raw}
    return ("{" + ",".join(f"{json.dumps(k)}:{parts[k]}" for k in sorted(parts)) + "}").encode()


def unseal(model: type[_R], value: Any, *, author: str, min_seq: int = 0) -> _R:
    """Check and parse a DHT value; raises RecordError saying why it was refused.

    ``author`` is the peer id that must have signed it; ``min_seq`` the newest ``seq`` already
    accepted from that author (an older one is stale and refused).
    """
    return parse(model, opened(value, author=author, what=model.__name__), min_seq)


def opened(value: Any, *, author: str, what: str = "record") -> dict[str, Any]:
    """The signed body of a DHT value, checked (envelope, author, signature, expiry) and decoded, not yet parsed
    (:func:`parse` does that): the half of :func:`unseal` that needs no record type, so it can run in another
    process than the parsing (the coordinator's DHT process opens its peers' heartbeats)."""
    if not isinstance(value, dict):
        raise RecordError(f"not a signed record (got {type(value).__name__})")
    if value.get("v") != ENVELOPE_VERSION:
        raise RecordError(f"unsupported record envelope version {value.get('v')!r}")
    by, body, sig = value.get("by"), value.get("body"), value.get("sig")
    if not isinstance(body, bytes) or not isinstance(sig, bytes) or not isinstance(by, str):
        raise RecordError("record envelope lacks by/body/sig")
    if by != author:
        raise RecordError(f"record signed by {by[-6:]} but must come from {author[-6:]}")
    if not verify(author, body, sig):
        raise RecordError(f"bad signature on a record claiming to come from {author[-6:]}")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RecordError(f"record body is not JSON: {err}") from None
    expires = data.get("_expires") if isinstance(data, dict) else None
    if not isinstance(expires, int | float) or expires < time.time() - MAX_CLOCK_SKEW_S:
        raise RecordError(f"{what} has expired (or carries no signed expiry)")
    return data


def parse(model: type[_R], data: dict[str, Any], min_seq: int = 0) -> _R:
    """A record of type ``model`` from a body :func:`opened` checked; raises RecordError saying why not."""
    try:
        record = model.model_validate(data)
    except ValidationError as err:
        raise RecordError(f"malformed {model.__name__}: {err.errors()[0]['msg']} at {err.errors()[0]['loc']}") from None
    seq = getattr(record, "seq", 0)
    if seq < min_seq:
        raise RecordError(f"stale {model.__name__} (seq {seq} < {min_seq} already seen)")
    ts = getattr(record, "ts", 0.0)
    if ts and ts > time.time() + MAX_CLOCK_SKEW_S:
        raise RecordError(f"{model.__name__} is dated {ts - time.time():.0f} s in the future")
    return record


def next_seq() -> int:
    """A sequence number that grows across restarts of the same author (wall-clock microseconds)."""
    return time.time_ns() // 1000
