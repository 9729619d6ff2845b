"""Grouped averaging in a real swarm: a coordinator and peer processes, groups of 2 regrouped every step."""

from __future__ import annotations

import math

import pytest
from swarm import alarming

from potluck.coordinator.rounds.groups import partition

pytestmark = pytest.mark.slow


def test_peers_in_groups_of_two_mix_a_joiner_in_and_stay_identical_inside_each_group(swarm) -> None:  # type: ignore[no-untyped-def]
    """3 peers, then a 4th: the groups change with the membership, so the joiner and the members it is grouped
    with fetch the state their new group starts from. Every step ends with one state per group (the
    groups of the step, from the members' replicas), different across groups, and no alarm in any log."""
    steps = 8
    swarm.start_coordinator({"diloco.outer_steps": steps, "diloco.inner_steps": 300, "membership.min_peers": 3,
                             "sync.group_size": 2, "data.eval_every": steps,
                             # (every member H steps: under a loaded suite a windowed member once fell a step behind
                             # its new group; tests/test_hetero_swarm.py tests windows)
                             "diloco.rounds": "fixed"})
    for _ in range(3):
        swarm.start_peer()
    swarm.wait_state(lambda s: s["round"] is not None, 120, "the first round")
    swarm.start_peer(name="late")
    state = swarm.wait_state(lambda s: s["run"]["finished"] and len(s["history"][-1]["state_hashes"]) == 4
                             and all(p["version"] == steps and p["eval_loss"] is not None for p in s["peers"]),
                             300, "the run to finish with the joiner and every member to evaluate its last state")
    hist = state["history"]
    assert [h["step"] for h in hist] == list(range(1, steps + 1)) and not state["failed_rounds"]
    joined = min(h["step"] for h in hist if h["members"] == 4)
    assert joined < steps - 1 and all(h["members"] == 4 for h in hist if h["step"] >= joined)
    for h in hist:
        groups = partition(h["members"], 2, h["step"])
        by_group: dict[int, set[str]] = {}
        for pid, digest in h["state_hashes"].items():
            by_group.setdefault(groups[h["tasklets"][pid][1]], set()).add(digest)
        assert [len(v) for v in by_group.values()] == [1, 1], (h["step"], by_group)
        assert len(set(h["state_hashes"].values())) == 2, f"both groups ended step {h['step']} with one state"
    start, floor = math.log(64), state["run"]["loss_floor"]
    finals = [p["eval_loss"] for p in state["peers"]]
    assert all(floor < f < floor + 0.4 * (start - floor) for f in finals), (finals, floor)
    # theta and momentum differences travel: about half what an fp32 all-reduce of theta alone would send
    sent, fp32 = sum(h["bytes"]["outer"] for h in hist), sum(h["bytes_fp32"]["outer"] for h in hist)
    assert 0.4 * fp32 < sent < 0.6 * fp32
    assert [p.wait(timeout=60) for p in swarm.peers] == [0, 0, 0, 0]
    assert alarming(swarm.logs) == []
