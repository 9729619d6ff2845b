"""Every DHT node of a run refuses records that are not the run's, not signed by their author,
too big, or stored to live too long: with two real hivemind nodes, as an attacker would try it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from potluck.peer.swarm.heartbeat import Heartbeat
from potluck.peer.swarm.joining import await_manifest
from potluck.protos.net.dhtguard import MAX_RECORD_BYTES, RunRecords, run_key
from potluck.protos.net.identity import Identity
from potluck.protos.net.swarm import DHTTimeout, SwarmNode
from potluck.protos.wire.envelope import ENVELOPE_VERSION, seal
from potluck.protos.wire.records import Manifest, PeerRecord
from potluck.protos.wire.states import PeerState

COORD, PEER, MALLORY = Identity.generate(), Identity.generate(), Identity.generate()


def record(kind: str, value: object, subkey: str | None = None, ttl: float = 60.0) -> DHTRecord:
    return DHTRecord(DHTID.generate(source=run_key(COORD.peer_id, kind)).to_bytes(), MSGPackSerializer.dumps(subkey),
                     MSGPackSerializer.dumps(value), get_dht_time() + ttl)


def beat(who: Identity, ttl: float = 60.0) -> dict:
    return seal(who, PeerRecord(peer_id=who.peer_id, address="127.0.0.1:1", seq=time.time_ns()), ttl)


def huge(who: Identity) -> dict:
    """A well-signed record far over the size cap (field caps stop honest code from making one)."""
    body = json.dumps({"peer_id": who.peer_id, "address": "x", "_expires": time.time() + 60,
                       "padding": "x" * MAX_RECORD_BYTES}).encode()
    return {"v": ENVELOPE_VERSION, "by": who.peer_id, "body": body, "sig": who.sign(body)}


@pytest.mark.parametrize("case,reason", [
    ("fine", ""),
    ("forged", "must be signed by the peer its subkey names"),
    ("unsigned", "not a signed record"),
    ("tampered", "bad signature"),
    ("too-long-lived", "more than 300 s"),
    ("outlives-its-signature", "longer than its author signed for"),
    ("too-big", "more than"),
    ("not-a-run-key", "not one of this run's keys"),
    ("manifest-by-a-peer", "must be signed by the coordinator"),
])
def test_the_validator_says_why(case: str, reason: str) -> None:
    v = RunRecords(COORD.peer_id)
    r = {
        "fine": lambda: record("peers", beat(PEER), PEER.peer_id),
        "forged": lambda: record("peers", beat(MALLORY), PEER.peer_id),
        "unsigned": lambda: record("peers", {"hello": 1}, PEER.peer_id),
        "tampered": lambda: record("peers", {**beat(PEER), "body": beat(MALLORY)["body"]}, PEER.peer_id),
        "too-long-lived": lambda: record("peers", beat(PEER, ttl=3600), PEER.peer_id, ttl=3600),
        "outlives-its-signature": lambda: record("peers", beat(PEER, ttl=10), PEER.peer_id, ttl=200),
        "too-big": lambda: record("peers", huge(PEER), PEER.peer_id),
        "not-a-run-key": lambda: DHTRecord(DHTID.generate(source="potluck/manifest").to_bytes(),
                                           MSGPackSerializer.dumps(None), b"junk", get_dht_time() + 60),
        "manifest-by-a-peer": lambda: record("manifest", seal(PEER, Manifest(run_id="r", coordinator=COORD.peer_id,
                                                                             config={}), 60)),
    }[case]()
    got = v.reason(r)
    assert (got == "") if not reason else (reason in got), got


def test_real_nodes_keep_the_victims_heartbeat_and_drop_the_forgeries() -> None:
    a = SwarmNode(COORD, coordinator=COORD.peer_id, host="127.0.0.1")
    b = SwarmNode(PEER, coordinator=COORD.peer_id, initial_peers=a.maddrs, host="127.0.0.1")
    try:
        assert b.publish_peer(PeerRecord(peer_id=PEER.peer_id, address="127.0.0.1:1", seq=time.time_ns()), ttl=10)
        key, far = run_key(COORD.peer_id, "peers"), get_dht_time() + 3600
        # a forged heartbeat under the victim's subkey, with a later expiry that would have won
        assert not a.dht.store(key, beat(MALLORY), expiration_time=far, subkey=PEER.peer_id)
        # the victim's own genuine record, replayed to live an hour
        assert not a.dht.store(key, beat(PEER, ttl=10), expiration_time=far, subkey=PEER.peer_id)
        # junk under the manifest key (a new peer used to need 28 s to get past it)
        assert not a.dht.store(run_key(COORD.peer_id, "manifest"), "junk", expiration_time=get_dht_time() + 60)
        records, refused = a.get_peers()
        assert list(records) == [PEER.peer_id] and not refused
        assert a.publish_manifest(Manifest(run_id="r", coordinator=COORD.peer_id, config={}, seq=1), ttl=60)
        t0 = time.monotonic()
        assert b.get_manifest() is not None and time.monotonic() - t0 < 5
        # a record asking to live longer than every node accepts is a clear error at its author
        with pytest.raises(ValueError, match="asks to live 301 s; records live"):
            b.publish_peer(PeerRecord(peer_id=PEER.peer_id, address="127.0.0.1:1", seq=time.time_ns()), ttl=301)
    finally:
        b.shutdown()
        a.shutdown()


@pytest.mark.slow
def test_a_frozen_dht_process_is_a_clear_timeout_not_a_hang() -> None:
    """A DHT process that stops answering (SIGSTOP: a wedged p2pd or a swapped-out child) must not take
    the caller with it: every call says so within ``call_timeout_s``, and works again once it answers."""
    node = SwarmNode(COORD, coordinator=COORD.peer_id, host="127.0.0.1")
    node.call_timeout_s = 1.0
    manifest = Manifest(run_id="r", coordinator=COORD.peer_id, config={}, seq=1)
    try:
        assert node.publish_manifest(manifest, ttl=60)
        os.kill(node.dht.pid, signal.SIGSTOP)
        try:
            for call in (lambda: node.get_manifest(), lambda: node.publish_manifest(manifest, ttl=60), node.get_peers):
                t0 = time.monotonic()
                with pytest.raises(DHTTimeout, match="no answer from the DHT process within 1 s"):
                    call()
                assert time.monotonic() - t0 < 3.0
        finally:
            os.kill(node.dht.pid, signal.SIGCONT)
        node.call_timeout_s = 15.0
        found = node.get_manifest()  # (the answers to the calls that timed out are dropped, not mixed in)
        assert found is not None and found.run_id == "r"
    finally:
        node.shutdown()


def test_a_goodbye_right_after_a_heartbeat_reaches_the_coordinator() -> None:
    """A stored record wins by its expiry: a goodbye that asked for a shorter life than the heartbeat just
    before it was refused, so the coordinator saw the peer as lost 8 s later, without the last step reports
    the goodbye carries (a run's final eval loss went missing this way)."""
    a = SwarmNode(COORD, coordinator=COORD.peer_id, host="127.0.0.1")
    b = SwarmNode(PEER, coordinator=COORD.peer_id, initial_peers=a.maddrs, host="127.0.0.1")
    manifest = Manifest(run_id="r", coordinator=COORD.peer_id, config={}, seq=1)
    training = PeerRecord(peer_id=PEER.peer_id, address="127.0.0.1:1", state="training", seq=time.time_ns())
    beat = Heartbeat(b, manifest, lambda: training, heartbeat_s=2.0, ttl_s=8.0)
    try:
        beat.start()
        deadline = time.monotonic() + 20
        while PEER.peer_id not in a.get_peers()[0]:
            assert time.monotonic() < deadline, "the heartbeat never reached the coordinator's node"
            time.sleep(0.1)
        beat.poke()  # one more heartbeat, then the goodbye at once
        beat.stop(goodbye=training.model_copy(update={"state": PeerState.FINISHED, "seq": time.time_ns()}))
        records, refused = a.get_peers()
        assert not refused and records[PEER.peer_id].state == "finished"
    finally:
        b.shutdown()
        a.shutdown()


def test_joining_rides_out_a_dht_timeout() -> None:
    """A DHT call that times out while a peer joins is asked again until the join's own deadline, not a crash."""
    manifest = Manifest(run_id="r", coordinator=COORD.peer_id, config={}, seq=1)

    class Slow:
        calls = 0

        def get_manifest(self) -> Manifest:
            self.calls += 1
            if self.calls == 1:
                raise DHTTimeout("reading the manifest records: no answer from the DHT process within 15 s")
            return manifest

    node = Slow()
    assert await_manifest(node, COORD.peer_id, 10.0, threading.Event()) is manifest  # type: ignore[arg-type]
    assert node.calls == 2
