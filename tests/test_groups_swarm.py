"""Grouped averaging in a real swarm: coordinator and 4 peer processes, groups of 2 regrouped every step."""

from __future__ import annotations

import math

import pytest
from swarm import alarming

from potluck.coordinator.groups import partition

pytestmark = pytest.mark.slow


def test_four_peers_in_groups_of_two_mix_and_stay_identical_inside_each_group(swarm) -> None:  # type: ignore[no-untyped-def]
    steps = 6
    swarm.start_coordinator({"diloco.outer_steps": steps, "membership.min_peers": 4, "sync.group_size": 2,
                             "data.eval_every": steps})
    for _ in range(4):
        swarm.start_peer()
    state = swarm.wait_state(lambda s: s["run"]["finished"] and len(s["history"][-1]["state_hashes"]) == 4
                             and all(p["version"] == steps and p["eval_loss"] is not None for p in s["peers"]),
                             300, "the run to finish and every member to evaluate its last state")
    hist = state["history"]
    assert [h["step"] for h in hist] == list(range(1, steps + 1)) and all(h["members"] == 4 for h in hist)
    for h in hist:  # one hash per group (the groups of the step, from the members' replicas), two groups apart
        groups = partition(4, 2, h["step"])
        by_group: dict[int, set[str]] = {}
        for pid, digest in h["state_hashes"].items():
            by_group.setdefault(groups[h["tasklets"][pid][1]], set()).add(digest)
        assert sorted(len(v) for v in by_group.values()) == [1, 1], h["step"]
        assert len(set(h["state_hashes"].values())) == 2, "the two groups ended the step with the same state"
    rnd = state["round"]
    assert sorted(m["group"] for m in rnd["members"]) == [0, 0, 1, 1] and len(rnd["groups"]) == 2
    start, floor = math.log(64), state["run"]["loss_floor"]
    finals = [p["eval_loss"] for p in state["peers"]]
    assert all(floor < f < floor + 0.5 * (start - floor) for f in finals), (finals, floor)
    # theta and momentum differences travel: about half what an fp32 all-reduce of theta alone would send
    sent, fp32 = sum(h["bytes"]["outer"] for h in hist), sum(h["bytes_fp32"]["outer"] for h in hist)
    assert 0.4 * fp32 < sent < 0.6 * fp32
    assert [p.wait(timeout=60) for p in swarm.peers] == [0, 0, 0, 0]
    assert alarming(swarm.logs) == []
