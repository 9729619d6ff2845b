"""Elasticity with real processes: a coordinator killed and restarted, and peers killed at random."""

from __future__ import annotations

import os
import random
import re
import signal
import socket

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def outer_steps_logged(swarm) -> int:  # type: ignore[no-untyped-def]
    """The highest outer step any peer's log reports as done (readable while the coordinator is down)."""
    best = 0
    for path in swarm.logs.glob("peer-*.log"):
        for m in re.finditer(r"outer step (\d+): ", path.read_text(errors="replace")):
            best = max(best, int(m.group(1)))
    return best


def test_coordinator_kill_and_restart_loses_no_outer_step(swarm) -> None:  # type: ignore[no-untyped-def]
    cfg = {"diloco.outer_steps": 10, "diloco.inner_steps": 10, "membership.min_peers": 3,
           "coordinator.dht_port": free_port(), "coordinator.checkpoint_every": 2}
    swarm.start_coordinator(cfg)
    for _ in range(3):
        swarm.start_peer()
    at_kill = swarm.wait_state(lambda s: s["run"]["outer_step"] >= 3, 240, "three outer steps")["run"]["outer_step"]
    os.killpg(swarm.coordinator.pid, signal.SIGKILL)
    swarm.coordinator.wait(timeout=30)
    # the peers go on without it, on the last plan
    swarm.wait_for(lambda: outer_steps_logged(swarm) >= at_kill + 2, 180, "two outer steps without a coordinator")
    swarm.start_coordinator(cfg)  # same journal, identity and DHT port
    state = swarm.wait_state(
        lambda s: s["run"]["finished"] and s["history"] and len(s["history"][-1]["state_hashes"]) == 3, 300,
        "the run to finish after the restart")
    steps = [h["step"] for h in state["history"]]
    assert steps == list(range(1, 11)), steps
    after = (swarm.logs / "coordinator.log").read_text().rsplit("resuming run", 1)[-1]
    assert "not admitted" not in after and "] admitted " not in after, after  # its admissions were journaled
    assert all(len(set(h["state_hashes"].values())) == 1 for h in state["history"] if h["state_hashes"])
    assert state["history"][-1]["eval_loss"] < state["history"][0]["eval_loss"]


def test_chaos_random_kills_during_a_pipelined_run(swarm) -> None:  # type: ignore[no-untyped-def]
    """2 stages x 2 replicas + 2 spares; SIGKILL a random peer three times, each time starting a new one."""
    rng = random.Random(7)
    swarm.start_coordinator({
        "pipeline.stages": 2, "pipeline.micro_batches": 2, "pipeline.pipe_timeout_s": 8.0, "model.n_layers": 2,
        "data.num_samples": 256, "membership.min_peers": 4, "diloco.outer_steps": 8, "diloco.inner_steps": 10,
        "sync.deadline_floor_s": 8.0, "links.placement": "sticky",
    })
    for _ in range(6):
        swarm.start_peer()
    for when in (2, 4, 6):
        state = swarm.wait_state(lambda s, w=when: s["run"]["outer_step"] >= w, 300, f"outer step {when}")
        members = {m["peer_id"] for m in state["round"]["members"]}
        names = [p["name"] for p in state["peers"] if p["id"] in members and p["state"] not in ("lost", "left")]
        victim = rng.choice(sorted(names))
        proc = swarm.peers[int(victim.split("-")[1])]
        # kill it at a random moment of the inner phase
        swarm.wait_for(lambda: rng.random() < 0.3, 5, "a random moment", poll=0.2)
        os.killpg(proc.pid, signal.SIGKILL)
        swarm.start_peer()
    state = swarm.wait_state(lambda s: s["run"]["finished"] and s["history"]
                             and s["history"][-1]["eval_loss"] is not None, 600, "all 8 outer steps")
    hist = state["history"]
    assert [h["step"] for h in hist] == list(range(1, 9))  # every committed step kept, none lost
    for h in hist:  # replicas of a stage agree after every step
        by_stage: dict[int, set[str]] = {}
        for pid, digest in h["state_hashes"].items():
            by_stage.setdefault(h["stages"][pid], set()).add(digest)
        assert all(len(v) == 1 for v in by_stage.values()), (h["step"], by_stage)
    evals = [h["eval_loss"] for h in hist if h["eval_loss"] is not None]
    assert evals[-1] < evals[0]
    assert all(b < a + 0.3 for a, b in zip(evals, evals[1:], strict=False)), f"the loss jumped: {evals}"
