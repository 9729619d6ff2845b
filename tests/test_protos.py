"""Contracts: generated protobuf code is fresh, records are signed and checked, ids carry their key."""

from __future__ import annotations

import json
import time

import pytest

from potluck.protos import generate
from potluck.protos.net.identity import (
    Identity,
    IdentityError,
    b58decode,
    b58encode,
    public_key_from_peer_id,
    verify,
)
from potluck.protos.wire.envelope import ENVELOPE_VERSION, RecordError, seal, unseal
from potluck.protos.wire.records import Manifest, Member, PeerRecord, Plan, Round


def test_generated_code_is_up_to_date() -> None:
    stale = generate.stale_files()
    assert stale == [], f"run `python -m potluck.protos.generate`: {stale} differ from the .proto files"


def test_peer_id_embeds_the_public_key() -> None:
    ident = Identity.generate()
    assert ident.peer_id.startswith("12D3KooW")
    assert public_key_from_peer_id(ident.peer_id) == ident.public_bytes
    sig = ident.sign(b"hello")
    assert verify(ident.peer_id, b"hello", sig)
    assert not verify(ident.peer_id, b"hellO", sig)
    assert not verify(Identity.generate().peer_id, b"hello", sig)


def test_base58_round_trip_and_bad_ids() -> None:
    for data in (b"", b"\0\0abc", bytes(range(40))):
        assert b58decode(b58encode(data)) == data
    with pytest.raises(IdentityError):
        public_key_from_peer_id("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")  # an RSA-style id
    with pytest.raises(IdentityError):
        b58decode("0OIl")


def test_identity_file_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "id.key"
    a = Identity.load_or_create(path)
    b = Identity.load_or_create(path)
    assert a.peer_id == b.peer_id
    path.chmod(0o600)
    path.write_bytes(b"garbage")
    with pytest.raises(IdentityError):
        Identity.load_or_create(path)


def manifest(ident: Identity, **kw) -> Manifest:  # type: ignore[no-untyped-def]
    return Manifest(run_id="r", coordinator=ident.peer_id, config={}, seq=kw.pop("seq", 5), **kw)


def test_signed_record_round_trip() -> None:
    ident = Identity.generate()
    value = seal(ident, manifest(ident), 60)
    assert unseal(Manifest, value, author=ident.peer_id).run_id == "r"


def test_forged_record_is_refused() -> None:
    coordinator, mallory = Identity.generate(), Identity.generate()
    forged = seal(mallory, manifest(coordinator), 60)
    with pytest.raises(RecordError, match="must come from"):
        unseal(Manifest, forged, author=coordinator.peer_id)
    tampered = seal(coordinator, manifest(coordinator), 60)
    body = json.loads(tampered["body"])
    body["finished"] = True
    tampered["body"] = json.dumps(body).encode()
    with pytest.raises(RecordError, match="bad signature"):
        unseal(Manifest, tampered, author=coordinator.peer_id)
    stolen = dict(seal(mallory, manifest(coordinator), 60), by=coordinator.peer_id)
    with pytest.raises(RecordError, match="bad signature"):
        unseal(Manifest, stolen, author=coordinator.peer_id)


def test_expired_and_undated_records_are_refused() -> None:
    """The signed body carries its expiry: a genuine old record replayed later is refused."""
    ident = Identity.generate()
    old = seal(ident, manifest(ident), -3600)
    with pytest.raises(RecordError, match="expired"):
        unseal(Manifest, old, author=ident.peer_id)
    body = json.dumps(manifest(ident).model_dump(mode="json")).encode()  # no _expires
    undated = {"v": ENVELOPE_VERSION, "by": ident.peer_id, "body": body, "sig": ident.sign(body)}
    with pytest.raises(RecordError, match="expir"):
        unseal(Manifest, undated, author=ident.peer_id)


def test_stale_and_future_records_are_refused() -> None:
    ident = Identity.generate()
    with pytest.raises(RecordError, match="stale"):
        unseal(Manifest, seal(ident, manifest(ident, seq=3), 60), author=ident.peer_id, min_seq=4)
    rec = PeerRecord(peer_id=ident.peer_id, address="h:1", ts=time.time() + 3600)
    with pytest.raises(RecordError, match="future"):
        unseal(PeerRecord, seal(ident, rec, 60), author=ident.peer_id)


@pytest.mark.parametrize(
    "value,match",
    [
        ("a string", "not a signed record"),
        ({"v": 99}, "envelope version"),
        ({"v": ENVELOPE_VERSION, "by": "x"}, "lacks"),
    ],
)
def test_malformed_envelopes(value, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RecordError, match=match):
        unseal(Manifest, value, author="x")


def test_malformed_body_and_tolerant_parsing() -> None:
    ident = Identity.generate()

    def sealed(body: bytes) -> dict:
        return {"v": ENVELOPE_VERSION, "by": ident.peer_id, "body": body, "sig": ident.sign(body)}

    later = time.time() + 60
    with pytest.raises(RecordError, match="not JSON"):
        unseal(Manifest, sealed(b"{nope"), author=ident.peer_id)
    with pytest.raises(RecordError, match="malformed Manifest"):
        unseal(Manifest, sealed(json.dumps({"run_id": "r", "_expires": later}).encode()), author=ident.peer_id)
    newer = {"run_id": "r", "coordinator": ident.peer_id, "config": {}, "a_field_from_the_future": [1, 2],
             "_expires": later}
    assert unseal(Manifest, sealed(json.dumps(newer).encode()), author=ident.peer_id).run_id == "r"


@pytest.mark.parametrize("kinds,match", [
    ({"outer": -1}, "greater than or equal to 0"),
    ({"x" * 33: 1}, "at most 32 characters"),
    ({f"k{i}": 1 for i in range(17)}, "at most 16 items"),
    ({"x" * 128: 1}, "at most 32 characters"),  # (4x the bounds each guards)
    ({f"k{i}": 1 for i in range(64)}, "at most 16 items"),
])
def test_a_heartbeat_with_a_bad_peak_second_breakdown_is_refused(kinds, match) -> None:  # type: ignore[no-untyped-def]
    """A peer's peak second by kind (issue 48) is bytes: never negative, a few short names."""
    ident = Identity.generate()
    rec = PeerRecord(peer_id=ident.peer_id, address="h:1", peak_send_kinds={"outer": 5, "audit": 7})
    body = json.loads(seal(ident, rec, 60)["body"])
    assert body["peak_send_kinds"] == {"outer": 5, "audit": 7}
    body["peak_send_kinds"] = kinds
    raw = json.dumps(body).encode()
    with pytest.raises(RecordError, match="malformed PeerRecord") as err:
        unseal(PeerRecord, {"v": ENVELOPE_VERSION, "by": ident.peer_id, "body": raw, "sig": ident.sign(raw)},
               author=ident.peer_id)
    assert match in str(err.value.__cause__ or err.value)


def test_plan_round_for_picks_latest_at_or_before() -> None:
    m = [Member(peer_id="a", address="x:1")]
    plan = Plan(seq=1, rounds=[Round(step=3, members=m), Round(step=5, members=m)])
    assert plan.round_for(2) is None
    assert plan.round_for(4).step == 3  # type: ignore[union-attr]
    assert plan.round_for(9).step == 5  # type: ignore[union-attr]
