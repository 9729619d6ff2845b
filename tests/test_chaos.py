"""Chaos: a seeded schedule of faults at named points over a 20-step run, and the run still ends well.

Each fault hits an exact point of an exact outer step (``POTLUCK_FAULTS``, see
:mod:`potluck.protos.testkit.faults`): a peer killed half way through its inner steps, a peer frozen right
after reducing its shard (and thawed two steps later), the coordinator killed right after it saw a
step committed (and restarted once the peers went on without it), and every peer killed as it enters
an outer step (new peers take over). The run must finish with every step in its history exactly
once, the replicas agreeing after every step, and the eval loss never far above the last
checkpoint's (``MARGIN``: a rollback goes to a checkpoint or a live peer's state, never to scratch).
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
from dataclasses import dataclass, field

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS, PEERS, SEED = 20, 3, 20261123
CONFIG = {"diloco.outer_steps": STEPS, "diloco.inner_steps": 10, "membership.min_peers": PEERS,
          "coordinator.checkpoint_every": 2, "sync.deadline_floor_s": 6.0}
MARGIN = 0.3  # how far above the last checkpoint's eval loss a step may come out (see the test)
BY_HAND: list[int] = []  # bystanders of a kill-all, killed by the test itself
POINTS = {"kill": "inner.mid", "stop": "allreduce.reduced", "kill-all": "outer.start"}


@dataclass
class ChaosPlan:
    """Which fault hits which peer slot (or the coordinator) at which step."""

    faults: list[tuple[int, str, int]] = field(default_factory=list)  # (step, kind, slot)

    @classmethod
    def seeded(cls, seed: int) -> ChaosPlan:
        rng = random.Random(seed)
        kinds = ["kill", "stop", "coordinator", "kill-all", *rng.choices(["kill", "stop", "coordinator"], k=2)]
        rng.shuffle(kinds)
        steps = sorted(rng.sample(range(3, STEPS - 2, 2), len(kinds)))
        return cls([(step, kind, rng.randrange(PEERS)) for step, kind in zip(steps, kinds, strict=True)])

    def env(self, slot: int | None, after: int) -> dict[str, str]:
        """The faults a process started now must carry: its slot's (or the coordinator's) later ones."""
        entries = [f"{'coordinator.committed' if kind == 'coordinator' else POINTS[kind]}@{step}+:"
                   f"{'stop' if kind == 'stop' else 'kill'}"
                   for step, kind, s in self.faults if step > after and (
                       kind == "coordinator" if slot is None else kind == "kill-all" or (kind != "coordinator" and s == slot))]
        return {"POTLUCK_FAULTS": ",".join(entries)} if entries else {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def logged_step(swarm) -> int:  # type: ignore[no-untyped-def]
    """The highest outer step any peer logged as done (readable while the coordinator is down)."""
    best = 0
    for path in swarm.logs.glob("peer-*.log"):
        for m in re.finditer(r"outer step (\d+): ", path.read_text(errors="replace")):
            best = max(best, int(m.group(1)))
    return best


def test_a_seeded_fault_schedule_over_twenty_steps(swarm) -> None:  # type: ignore[no-untyped-def]
    plan = ChaosPlan.seeded(SEED)
    BY_HAND.clear()
    print("fault schedule:", plan.faults)
    cfg = {**CONFIG, "coordinator.dht_port": free_port()}
    swarm.start_coordinator(cfg, env=plan.env(None, 0))
    slots = {slot: swarm.start_peer(env=plan.env(slot, 0)) for slot in range(PEERS)}
    for step, kind, slot in plan.faults:
        if kind == "coordinator":
            swarm.wait_for(lambda: swarm.coordinator.poll() is not None, 300, f"the coordinator to die at step {step}")
            swarm.wait_for(lambda s=step: logged_step(swarm) >= s + 1, 300, "the peers to go on without it")
            swarm.start_coordinator(cfg, env=plan.env(None, step))
            continue
        victims = list(slots) if kind == "kill-all" else [slot]
        swarm.wait_for(lambda v=victims, k=kind: all(_hit(swarm, slots[x], k) for x in v) or (
            k == "kill-all" and _kill_bystanders(swarm, [slots[x] for x in v])), 300, f"{kind} at step {step}")
        if kind == "stop":
            swarm.wait_state(lambda s, t=step: s["run"]["outer_step"] >= t + 1, 300, "a step without the frozen peer")
            os.killpg(slots[slot].pid, signal.SIGCONT)  # it thaws two steps behind and must recover
            continue
        for x in victims:
            slots[x] = swarm.start_peer(env=plan.env(x, step))
    state = swarm.wait_state(lambda s: s["run"]["finished"] and s["history"] and s["history"][-1]["eval_loss"]
                             is not None, 600, "the run to finish")
    hist = state["history"]
    assert [h["step"] for h in hist] == list(range(1, STEPS + 1)), "a committed step was lost or repeated"
    for h in hist:
        assert h["state_hashes"] and len(set(h["state_hashes"].values())) == 1, (h["step"], h["state_hashes"])
    evals = {h["step"]: h["eval_loss"] for h in hist if h["eval_loss"] is not None}
    every = CONFIG["coordinator.checkpoint_every"]
    by_step = {h["step"]: h for h in hist}
    for step, loss in evals.items():
        ckpt = max((s for s in evals if s % every == 0 and s < step), default=None)
        if ckpt is not None:
            # A rollback to scratch costs about 2.0 here (v1's eval is 4.0, the run ends near 2.0). One step
            # of a chaotic round -- an owner frozen after reducing its shard, its shard taken over, a fresh
            # joiner among the members -- once came out 0.14 above the checkpoint before it (CI, stop 55;
            # the runs after it went on down): a worse step, not a rollback.
            assert loss < evals[ckpt] + MARGIN, (
                f"eval loss {loss:.3f} at step {step} above checkpoint v{ckpt}'s {evals[ckpt]:.3f}: "
                f"{ {k: by_step[step].get(k) for k in ('members', 'contributors', 'dropped', 'rejected', 'loss')} }")
    fired = sum(path.read_text(errors="replace").count("fault injected at") for path in swarm.logs.glob("*.log"))
    planned = sum(PEERS if kind == "kill-all" else 1 for _, kind, _ in plan.faults) - len(BY_HAND)
    assert fired >= planned, f"only {fired} of {planned} planned faults hit"


def _hit(swarm, proc, kind: str) -> bool:  # type: ignore[no-untyped-def]
    """Has the fault hit this peer: dead (kill), or frozen (its log says so)?"""
    if kind != "stop":
        return proc.poll() is not None
    index = swarm.peers.index(proc)
    return "fault injected at allreduce.reduced" in swarm.tail(f"peer-{index}", 200)


def _kill_bystanders(swarm, procs) -> bool:  # type: ignore[no-untyped-def]
    """Kill-all hits the members of the round as they enter the outer step; a replacement that joined
    too late to be one of them waits for a round that needs more peers than are left, so once the
    members are dead, kill it too (by hand: it never reaches the fault's point)."""
    alive = [p for p in procs if p.poll() is None]
    if not alive or len(alive) == len(procs):
        return False
    states = {p["name"]: p["state"] for p in swarm.state()["peers"]}
    if any(states.get(f"peer-{swarm.peers.index(p)}") not in ("waiting", None) for p in alive):
        return False
    for p in alive:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        BY_HAND.append(p.pid)
    return True
