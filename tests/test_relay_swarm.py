"""NAT traversal in a real swarm: a peer that accepts no connections trains through the coordinator's relay."""

from __future__ import annotations

import pytest
from test_swarm import hashes_agree

from potluck.protos.net.relay import VIA

pytestmark = pytest.mark.slow


def test_a_peer_without_inbound_reachability_contributes_every_step(swarm) -> None:  # type: ignore[no-untyped-def]
    # (fixed rounds: phases of 15 steps of ~3 ms are shorter than the relayed peer's start skew, and the window rule
    # then took it for too slow; windows are not what this test is about)
    swarm.start_coordinator({"diloco.outer_steps": 5, "diloco.inner_steps": 15, "membership.min_peers": 3,
                             "diloco.rounds": "fixed"})
    swarm.start_peer()
    swarm.start_peer()
    # listens on no port at all (its DHT node a client only): every call to it crosses the coordinator
    swarm.start_peer("--relay", "--dht-client", name="natted")
    state = swarm.wait_state(lambda s: s["run"]["finished"] and s["history"]
                             and len(s["history"][-1]["state_hashes"]) == 3, 240, "the run to finish")
    natted = next(p for p in state["peers"] if p["name"] == "natted")
    assert VIA in natted["address"] and natted["relayed"], natted["address"]
    assert natted["bytes_sent"].get("relay", 0) > 0 and natted["bytes_received"].get("relay", 0) > 0
    assert not any(p["relayed"] for p in state["peers"] if p["name"] != "natted")
    hist = state["history"]
    assert [h["step"] for h in hist] == list(range(1, 6))
    assert all(natted["id"] in h["state_hashes"] for h in hist), "the relayed peer missed a step"
    assert all(h["members"] == 3 and h["contributors"] == 3 for h in hist), hist
    assert hashes_agree(state) == []
    for proc in swarm.peers:
        proc.wait(timeout=60)
        assert proc.returncode == 0
