"""One-step-delayed (overlapped) outer steps in a real swarm: the all-reduce of step k runs while the
inner steps of k + 1 train, and every member still commits the same theta_global at every step."""

from __future__ import annotations

import math

import pytest
from test_swarm import hashes_agree

pytestmark = pytest.mark.slow


def test_overlapped_outer_steps_stay_identical_and_train(swarm) -> None:  # type: ignore[no-untyped-def]
    swarm.start_coordinator({"diloco.outer_steps": 6, "diloco.inner_steps": 15, "membership.min_peers": 3,
                             "diloco.overlap": True, "diloco.rounds": "fixed"})  # (phases of ~50 ms: shorter than the
    # members' start skew under load, which the window rule took for a peer too slow; windows are not tested here)
    for _ in range(3):
        swarm.start_peer()
    state = swarm.wait_state(  # (and every peer to say goodbye: it does once the coordinator confirmed the end)
        lambda s: s["run"]["finished"] and s["history"] and s["history"][-1]["eval_loss"] is not None
        and len(s["history"][-1]["state_hashes"]) == 3 and sum(p["state"] == "finished" for p in s["peers"]) == 3,
        240, "the overlapped run to finish",
    )
    hist = state["history"]
    assert [h["step"] for h in hist] == list(range(1, 7))
    assert all(h["members"] == 3 and len(h["state_hashes"]) == 3 for h in hist)
    assert hashes_agree(state) == [], "members held different parameters after an outer step"
    start, floor = math.log(64), state["run"]["loss_floor"]
    final = hist[-1]["eval_loss"]
    assert final < floor + 0.5 * (start - floor), f"eval loss {final:.3f} (start {start:.3f}, floor {floor:.3f})"
    peers = [p for p in state["peers"] if p["state"] == "finished"]
    print({p["name"]: (p["compute_s"], p["sync_s"], p["hidden_s"]) for p in peers})
    # each step's all-reduce ran while the next inner phase trained (all but the last, which nothing follows)
    assert len(peers) == 3 and all(p["hidden_s"] > 0 for p in peers), peers
    for proc in swarm.peers:
        proc.wait(timeout=60)
        assert proc.returncode == 0


def test_a_member_killed_while_its_step_is_in_flight(swarm) -> None:  # type: ignore[no-untyped-def]
    """The victim dies right after it started the all-reduce of step 3 on its thread (its training loop is
    already in step 4): the others finish step 3 without it and the run ends identical."""
    swarm.start_coordinator({"diloco.outer_steps": 6, "diloco.inner_steps": 15, "membership.min_peers": 3,
                             "diloco.overlap": True, "diloco.rounds": "fixed"})  # (phases of ~50 ms: shorter than the
    # members' start skew under load, which the window rule took for a peer too slow; windows are not tested here)
    swarm.start_peer()
    swarm.start_peer()
    victim = swarm.start_peer(name="victim", env={"POTLUCK_FAULTS": "outer.start@3:kill"})
    final = swarm.wait_state(lambda s: s["run"]["finished"] and s["history"]
                             and len(s["history"][-1]["state_hashes"]) == 2, 240, "the run to finish without the victim")
    victim.wait(timeout=30)
    assert victim.returncode == -9
    assert [h["step"] for h in final["history"]] == list(range(1, 7))
    assert hashes_agree(final) == []
    assert all(h["members"] == 2 for h in final["history"] if h["step"] > 4)
