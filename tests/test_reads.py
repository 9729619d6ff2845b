"""How the coordinator reads its peers' heartbeats (issue 30): its DHT process opens each changed record (checks its
envelope, author, signature and expiry) off the coordinator's loop, and silence is measured on the clock of the
reads. ``tests/test_scale.py`` reads them through real DHT nodes."""

from __future__ import annotations

from hivemind.utils import MSGPackSerializer

from potluck.coordinator.swarm.membership import PeerTable
from potluck.protos.net.feed import open_record
from potluck.protos.net.identity import Identity
from potluck.protos.wire.envelope import seal
from potluck.protos.wire.records import PeerRecord


def test_the_dht_process_opens_a_record_or_says_why_not() -> None:
    """The coordinator's DHT process checks each changed heartbeat's envelope, author, signature and expiry (off
    the coordinator's loop); a record it refuses reaches the reader as the reason only."""
    who, other = Identity.generate(), Identity.generate()
    good = seal(who, PeerRecord(peer_id=who.peer_id, address="x:1", seq=1), 60)
    assert open_record(MSGPackSerializer.dumps(good), who.peer_id, "PeerRecord").data["seq"] == 1
    cases = {"signed by": (good, other.peer_id), "has expired": (seal(who, PeerRecord(peer_id=who.peer_id,
             address="x:1"), -900), who.peer_id), "bad signature": ({**good, "sig": b"x" * 64}, who.peer_id),
             "not a signed record": (b"\x93junk", who.peer_id)}
    for reason, (value, author) in cases.items():
        raw = value if isinstance(value, bytes) else MSGPackSerializer.dumps(value)
        got = open_record(raw, author, "PeerRecord")
        assert got.data is None and reason in got.refused, (reason, got)


def test_given_the_records_type_the_dht_process_parses_it_too_and_refuses_a_malformed_one() -> None:
    """The coordinator's reads name the record's type: its DHT process parses each changed record as well, so the
    coordinator's loop only unpickles it; a body that is signed but not a valid record is refused there, with the
    reason, as the loop's own parse refused it."""
    who = Identity.generate()
    good = seal(who, PeerRecord(peer_id=who.peer_id, address="x:1", seq=1), 60)
    got = open_record(MSGPackSerializer.dumps(good), who.peer_id, PeerRecord)
    assert isinstance(got.record, PeerRecord) and got.record.seq == 1 and got.data is None and not got.refused
    bad = seal(who, {**PeerRecord(peer_id=who.peer_id, address="x:1").model_dump(mode="json"), "seq": "many"}, 60)
    got = open_record(MSGPackSerializer.dumps(bad), who.peer_id, PeerRecord)
    assert got.record is None and got.refused.startswith("malformed PeerRecord") and "seq" in got.refused, got
    late = seal(who, PeerRecord(peer_id=who.peer_id, address="x:1"), -900)
    assert "PeerRecord has expired" in open_record(MSGPackSerializer.dumps(late), who.peer_id, PeerRecord).refused


def test_a_stalled_read_of_the_heartbeats_makes_nobody_lost_and_a_silent_peer_still_is() -> None:
    """Found when the tests began starting peers from a fork server: five peers starting at once swamped the
    coordinator's DHT process, its reads of the heartbeats went unanswered for 4 s, and it declared all three
    training peers lost and failed their round. Silence is measured on the clock of the reads: time in which
    no read was answered is no peer's."""
    a, b = (f"12D3KooW{c * 44}" for c in "ab")

    def rec(pid: str, seq: int) -> PeerRecord:
        return PeerRecord(peer_id=pid, address="127.0.0.1:1", seq=seq)

    table = PeerTable(heartbeat_timeout_s=4.0)
    held = {a: rec(a, 1), b: rec(b, 1)}
    assert sorted(table.update(held, now=0.0, read_at=0.0)) == [("joined", a), ("joined", b)]
    for t in (1.0, 3.0, 5.0, 7.0):  # the loop ticks on; the read begun at 0 s is not answered
        assert table.update(held, now=t, read_at=0.0) == []
    held[a] = rec(a, 2)  # answered at last: a's newest heartbeat is in, b's not yet
    assert table.update(held, now=7.2, read_at=7.1) == [] and all(v.live for v in table.peers.values())
    events, t = [], 7.1
    while t < 13.0:  # reads answered every 0.2 s again: b stays silent, and is lost 4 s on
        t += 0.2
        held[a] = rec(a, held[a].seq + 1)
        events += [(round(t, 1), e) for e in table.update(held, now=t + 0.05, read_at=t)]
    assert [e for _, e in events] == [("lost", b)] and 11.1 < events[0][0] < 11.5, events
    plain = PeerTable(heartbeat_timeout_s=4.0)  # a caller without reads' times: silence is time, as before
    plain.update({b: rec(b, 1)}, now=0.0)
    assert plain.update({b: rec(b, 1)}, now=4.5) == [("lost", b)]


def test_a_body_with_fields_spliced_in_is_the_bytes_of_one_dumped_whole() -> None:
    """A plan's rounds are kept as canonical JSON from one publish to the next and spliced into the new plan's
    body; what is signed must be the bytes of dumping it all at once (peers verify exactly those)."""
    import json
    import random

    from potluck.protos.wire.envelope import canonical

    rng = random.Random(4)
    for _ in range(50):
        data = {k: rng.choice([rng.random(), rng.randrange(-9, 9), "é\"x", None, [1, {"b": 2, "a": [3.5]}],
                               {"z": 1, "y": {"é": True}}]) for k in rng.sample(["_expires", "rounds", "seq", "ts",
                                                                                "revoked", "a", "ab", "B"], 5)}
        raw = {k: canonical(v if isinstance(v, dict) else {"v": v}).decode() for k, v in data.items() if rng.random() < 0.5}
        whole = {k: (json.loads(raw[k]) if k in raw else v) for k, v in data.items()}
        assert canonical(data, raw) == json.dumps(whole, sort_keys=True, separators=(",", ":")).encode()
