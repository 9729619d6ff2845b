"""Streaming outer steps (``sync.fragments = 4``) in a real swarm: members stay bit-identical step after step
while each step sends about a quarter of the bytes, a member killed between a fragment's syncs does not stall
the others, and a run resumed from a checkpoint taken between fragment syncs goes on identical among its
members."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from test_lifecycle import finished, kill_at, one_outcome_per_step, wait_dead
from test_swarm import hashes_agree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SLOW = {"POTLUCK_FAULTS": "inner.step@*:slow=2"}  # an honest peer at half speed


def per_member_outer_bytes(state: dict) -> float:
    """The mean outer bytes a member sent per step."""
    hist = state["history"]
    return sum(h["bytes"]["outer"] / max(len(h["state_hashes"]), 1) for h in hist) / len(hist)


def run(swarm, overrides: dict, steps: int, journal: str) -> dict:  # type: ignore[no-untyped-def]
    swarm.start_coordinator({"diloco.outer_steps": steps, "membership.min_peers": 3, **overrides}, journal=journal)
    swarm.start_peer(env=SLOW, name="slow")
    for _ in range(2):
        swarm.start_peer()
    state = swarm.wait_state(lambda s: s["run"]["finished"] and s["history"] and len(s["history"][-1]["state_hashes"]) == 3,
                             300, f"{steps} outer steps")
    swarm.procs.stop()
    swarm.peers.clear()
    return state


def evals_agree(swarm, members: int) -> None:  # type: ignore[no-untyped-def]
    """Every member logged the same eval loss for each version it evaluated: that of theta_global, which they share,
    not of the values each trains on (a streaming member's own fragments, an overlapped one's next phase)."""
    by_version: dict[int, set[str]] = {}
    for i in range(members):
        for v, loss in re.findall(r"eval loss of v(\d+): ([0-9.]+)", (swarm.logs / f"peer-{i}.log").read_text()):
            by_version.setdefault(int(v), set()).add(loss)
    assert by_version and all(len(losses) == 1 for losses in by_version.values()), by_version


def test_four_fragments_stay_identical_and_send_a_quarter_a_step(swarm) -> None:  # type: ignore[no-untyped-def]
    whole = run(swarm, {"diloco.inner_steps": 8}, steps=3, journal="whole")
    for i in range(3):  # (the streamed run's peers log under the same names)
        (swarm.logs / f"peer-{i}.log").rename(swarm.logs / f"whole-peer-{i}.log")
    streamed = run(swarm, {"diloco.inner_steps": 2, "sync.fragments": 4}, steps=8, journal="streamed")
    hist = streamed["history"]
    assert [h["step"] for h in hist] == list(range(1, 9))
    assert all(len(h["state_hashes"]) == 3 for h in hist)
    assert hashes_agree(streamed) == [], "members held different parameters after an outer step"
    ratio = per_member_outer_bytes(streamed) / per_member_outer_bytes(whole)
    print(f"outer bytes per member per step, F = 4 / F = 1: {ratio:.3f}")
    assert 0.15 < ratio < 0.35, ratio
    assert hist[-1]["eval_loss"] is None or hist[-1]["eval_loss"] == hist[-1]["eval_loss"]  # (finite if measured)
    evals_agree(swarm, 3)


def test_a_member_killed_mid_fragment_does_not_stall_the_others(swarm) -> None:  # type: ignore[no-untyped-def]
    """tests/test_swarm.py's SIGKILL half way through step 2's inner steps, with fragments = 4: step 2 (fragment
    1) commits without the dead peer, at once, and the run finishes identical among the two left."""
    floor_s, step = 20.0, 2
    swarm.start_coordinator({"diloco.outer_steps": step + 3, "diloco.inner_steps": 200, "membership.min_peers": 3,
                             "sync.deadline_floor_s": floor_s, "sync.fragments": 4})
    victim = swarm.start_peer(name="victim", env={"POTLUCK_FAULTS": f"inner.mid@{step}:kill"})
    for _ in range(2):
        swarm.start_peer()
    victim.wait(timeout=180)
    assert victim.returncode == -9
    state = swarm.wait_state(lambda s: s["run"]["outer_step"] >= step, 120, f"outer step {step} without the dead peer")
    entry = next(h for h in state["history"] if h["step"] == step)
    assert entry["members"] == 3
    assert entry["outer_s"] is not None and entry["outer_s"] < floor_s / 2, entry["outer_s"]
    final = swarm.wait_state(lambda s: s["run"]["finished"] and len(s["history"][-1]["state_hashes"]) == 2,
                             180, "the run to finish with two peers")
    assert hashes_agree(final) == []
    assert [h["members"] for h in final["history"] if h["step"] > step] == [2, 2, 2]


def test_a_run_resumed_between_fragment_syncs_goes_on_identical(swarm) -> None:  # type: ignore[no-untyped-def]
    """Checkpoints every step; every peer dies entering step 3's outer step (fragments 0 and 1 synced, 2 and 3
    not) and the coordinator is killed too. Restarted from its journal and checkpoint, with new peers: they
    start from the checkpointed v2 (its hash is the one the members of step 2 reported), step 3 syncs
    fragment 2, and every step of the run has one state among its members."""
    cfg = {"diloco.outer_steps": 6, "diloco.inner_steps": 5, "membership.min_peers": 2,
           "coordinator.checkpoint_every": 1, "sync.fragments": 4}
    swarm.start_coordinator(cfg)
    for _ in range(2):
        swarm.start_peer(env=kill_at("outer.start", 3))
    wait_dead(swarm, swarm.peers[:2], "both peers to die in step 3")
    before = swarm.wait_state(lambda s: any(e["kind"] == "checkpoint" and "v2 " in e["message"] for e in s["events"]),
                              60, "the checkpoint of v2")
    assert before["run"]["outer_step"] == 2
    v2 = set(next(h for h in before["history"] if h["step"] == 2)["state_hashes"].values())
    assert len(v2) == 1
    os.killpg(swarm.coordinator.pid, signal.SIGKILL)
    swarm.coordinator.wait(timeout=30)
    swarm.start_coordinator(cfg)
    t0 = time.monotonic()
    for _ in range(2):
        swarm.start_peer()
    final = swarm.wait_state(finished, 240, "the resumed run to finish")
    print(f"resumed run finished {time.monotonic() - t0:.1f} s after the restart")
    one_outcome_per_step(final, 6)
    hist = {h["step"]: h for h in final["history"]}
    assert set(hist[2]["state_hashes"].values()) == v2  # the checkpoint the new peers started from
    assert not set(hist[3]["state_hashes"]) & set(next(h for h in before["history"] if h["step"] == 2)["state_hashes"])


def test_a_lying_owner_of_a_fragments_shard_is_proven_and_evicted(swarm) -> None:  # type: ignore[no-untyped-def]
    """tests/test_verified_swarm.py's lying owner with fragments = 2: the audit recomputes a shard of the
    fragment's all-reduce (its size from the result held, not the model's), the coordinator's verifier agrees,
    the owner is evicted and the run rolled back to before step 1; the honest three finish identical."""
    from test_verified_swarm import run as verified_run

    attacked = verified_run(swarm, 4, "owner.mean@*:shift=0.5", {"sync.fragments": 2}, slow="inner.step@*:slow=2")
    proven = [e for e in attacked["events"] if e["kind"] == "proven"]
    assert proven and "step 1" in proven[0]["message"], [e for e in attacked["events"] if e["kind"] in ("audit", "proven")]
    liar_id = proven[0]["peer"]
    assert any(e["kind"] == "rollback" and "to v0" in e["message"] for e in attacked["events"])
    assert not [e for e in attacked["events"] if e["kind"] in ("proven", "evicted") and e["peer"] != liar_id]
    assert all(liar_id not in h["state_hashes"] for h in attacked["history"])
    assert hashes_agree(attacked) == []


def test_overlapped_fragments_stay_identical(swarm) -> None:  # type: ignore[no-untyped-def]
    """diloco.overlap with fragments = 4: each step's all-reduce of one fragment runs while the next phase
    trains, and lands on that fragment only, mixed with the local values (``sync.fragment_alpha`` 0.5: only the
    local copies mix); every step's members hold one state and the run finishes."""
    swarm.start_coordinator({"diloco.outer_steps": 8, "diloco.inner_steps": 3, "membership.min_peers": 2,
                             "diloco.overlap": True, "sync.fragments": 4, "sync.fragment_alpha": 0.5})
    swarm.start_peer(env=SLOW, name="slow")
    swarm.start_peer()
    final = swarm.wait_state(lambda s: s["run"]["finished"] and s["history"] and len(s["history"][-1]["state_hashes"]) == 2,
                             240, "the overlapped run to finish")
    assert [h["step"] for h in final["history"]] == list(range(1, 9))
    assert hashes_agree(final) == []
    evals_agree(swarm, 2)
