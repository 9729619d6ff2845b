"""The failures that used to stop a run forever, driven at exact steps in real processes.

Faults are injected at named points (``POTLUCK_FAULTS``, :mod:`potluck.protos.testkit.faults`), not by
polling for a random moment: every peer of a round dies half way through its inner steps, a backup
freezes right after reducing its shard, everything is killed and resumed with another stage count.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import defaultdict

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FLOOR_S = 20.0  # membership.round_timeout_floor_s in tests/swarm.py


def kill_at(point: str, step: int) -> dict[str, str]:
    return {"POTLUCK_FAULTS": f"{point}@{step}:kill"}


def wait_dead(swarm, procs, what: str, timeout: float = 180) -> None:  # type: ignore[no-untyped-def]
    swarm.wait_for(lambda: all(p.poll() is not None for p in procs), timeout, what)


def one_outcome_per_step(state: dict, steps: int) -> None:
    """Every step 1..steps exactly once in the history, and the replicas of each stage agree."""
    hist = state["history"]
    assert [h["step"] for h in hist] == list(range(1, steps + 1)), [h["step"] for h in hist]
    for h in hist:
        by_stage: dict[int, set[str]] = defaultdict(set)
        for pid, digest in h["state_hashes"].items():
            by_stage[h["stages"][pid]].add(digest)
        assert h["state_hashes"], f"step {h['step']} has no member's report"
        assert all(len(v) == 1 for v in by_stage.values()), (h["step"], dict(by_stage))


def finished(state: dict) -> bool:
    hist = state["history"]
    return state["run"]["finished"] and bool(hist) and hist[-1]["eval_loss"] is not None


@pytest.mark.parametrize("restart", [False, True], ids=["coordinator-alive", "full-restart"])
def test_every_member_of_the_pending_round_dies_and_new_peers_resume(swarm, restart: bool) -> None:  # type: ignore[no-untyped-def]
    cfg = {"diloco.outer_steps": 6, "diloco.inner_steps": 20, "membership.min_peers": 3,
           "coordinator.checkpoint_every": 1}
    swarm.start_coordinator(cfg)
    for _ in range(3):  # all three die entering step 4.s outer step: round 4 is decided, pending
        swarm.start_peer(env=kill_at("outer.start", 4))
    wait_dead(swarm, swarm.peers[:3], "the three peers to die in step 4")
    state = swarm.state()
    assert state["run"]["outer_step"] == 3 and state["round"]["step"] == 4
    if restart:  # and the coordinator too; its journal holds a pending round of dead peers
        os.killpg(swarm.coordinator.pid, signal.SIGKILL)
        swarm.coordinator.wait(timeout=30)
        swarm.start_coordinator(cfg)
    for _ in range(3):
        swarm.start_peer()
    joined = swarm.wait_state(lambda s: sum(p["state"] not in ("lost", "left") for p in s["peers"]) >= 3, 120,
                              "three new peers")
    t0 = time.monotonic()
    state = swarm.wait_state(lambda s: s["run"]["outer_step"] >= 4, 2 * FLOOR_S, "step 4 with the new peers")
    print(f"step 4 committed {time.monotonic() - t0:.1f} s after the new peers joined "
          f"(committed step was {joined['run']['outer_step']})")
    assert any(e["kind"] == "failed" for e in state["events"]), "the dead round was never failed"
    final = swarm.wait_state(finished, 180, "the run to finish")
    one_outcome_per_step(final, 6)
    assert final["history"][-1]["eval_loss"] < final["history"][0]["eval_loss"]


def test_a_frozen_backup_does_not_get_its_partner_dropped(swarm) -> None:  # type: ignore[no-untyped-def]
    """One member freezes (SIGSTOP, the whole process) right after reducing its own shard of step 3:
    the member whose backup it is must not hang handing it the result and get itself dropped."""
    swarm.start_coordinator({"diloco.outer_steps": 5, "membership.min_peers": 3, "sync.deadline_floor_s": 6.0})
    frozen = swarm.start_peer(env={"POTLUCK_FAULTS": "allreduce.reduced@3:stop"}, name="frozen")
    swarm.start_peer()
    swarm.start_peer()
    state = swarm.wait_state(lambda s: s["run"]["outer_step"] >= 3 and any(
        h["step"] == 3 and len(h["state_hashes"]) >= 2 for h in s["history"]), 180, "step 3 without the frozen peer")
    frozen_id = next(p["id"] for p in state["peers"] if p["name"] == "frozen")
    entry = next(h for h in state["history"] if h["step"] == 3)
    others = {pid for pid in entry["state_hashes"] if pid != frozen_id}
    assert len(others) == 2 and len({entry["state_hashes"][p] for p in others}) == 1, entry
    assert entry["dropped"] == [frozen_id], f"a healthy member was dropped: {entry['dropped']}"
    os.killpg(frozen.pid, signal.SIGCONT)  # it thaws, finds the run went on without it, and recovers
    final = swarm.wait_state(finished, 180, "the run to finish")
    one_outcome_per_step(final, 5)


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)], ids=["2-to-1-stages", "1-to-2-stages"])
def test_a_crash_then_a_resume_with_another_stage_count(swarm, before: int, after: int) -> None:  # type: ignore[no-untyped-def]
    common = {"model.n_layers": 2, "data.num_samples": 256, "pipeline.micro_batches": 2, "pipeline.pipe_timeout_s": 10.0,
              "coordinator.checkpoint_every": 2, "diloco.inner_steps": 8, "diloco.outer_steps": 8,
              "links.placement": "sticky"}
    swarm.start_coordinator({**common, "pipeline.stages": before, "membership.min_peers": 2 * before})
    # every peer dies in step 5: half way through its inner steps or, if a neighbour's death stalled its
    # pipeline before that, as it enters the outer step
    for _ in range(2 * before):
        swarm.start_peer(env={"POTLUCK_FAULTS": "inner.mid@5:kill,outer.start@5:kill"})
    wait_dead(swarm, swarm.peers, "every peer to die in step 5")
    os.killpg(swarm.coordinator.pid, signal.SIGKILL)
    swarm.coordinator.wait(timeout=30)
    swarm.start_coordinator({**common, "pipeline.stages": after, "membership.min_peers": 2 * after})
    for _ in range(2 * after):
        swarm.start_peer()
    final = swarm.wait_state(finished, 300, f"the run resumed with {after} stage(s) to finish")
    assert any(e["kind"] == "reshard" for e in final["events"])
    one_outcome_per_step(final, 8)
    assert all(h["loss"] is not None and h["loss"] == h["loss"] for h in final["history"][-3:])  # finite losses


def test_a_coordinator_whose_dht_process_stalls_loses_nobody(swarm) -> None:  # type: ignore[no-untyped-def]
    """The coordinator's DHT process freezes for 1.5 heartbeat timeouts in the middle of a run (SIGSTOP: what five
    peers joining at once did to it on 2 cores): it can read no heartbeat meanwhile, and that silence is its own,
    not the peers'. No peer is reported lost, no round fails, and the run ends with every step once."""
    swarm.start_coordinator({"membership.min_peers": 3, "diloco.outer_steps": 6})
    for _ in range(3):
        swarm.start_peer()
    swarm.wait_state(lambda s: s["run"]["outer_step"] >= 2, 180, "outer step 2")
    coordinator = swarm.coordinator.pid
    dht = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == coordinator
           and b"p2pd" not in _cmdline(int(p))]
    assert len(dht) == 1, dht
    os.kill(dht[0], signal.SIGSTOP)
    try:
        time.sleep(6.0)  # (the fault: 1.5 x membership.heartbeat_timeout_s of a frozen DHT process)
    finally:
        os.kill(dht[0], signal.SIGCONT)
    state = swarm.wait_state(lambda s: s["run"]["finished"] and len(s["history"]) == 6, 240, "the run to finish")
    assert not [e for e in state["events"] if e["kind"] in ("lost", "failed")], \
        [e["message"] for e in state["events"] if e["kind"] in ("lost", "failed")]
    one_outcome_per_step(state, 6)


def _parent(pid: int) -> int:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _cmdline(pid: int) -> bytes:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""


def frozen(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0] == b"T"


def test_a_round_is_journaled_before_it_is_published_and_a_freeze_there_loses_nothing(swarm) -> None:  # type: ignore[no-untyped-def]
    """The coordinator decides a round in one tick, and journals it and puts it on the plan in the next, at once (a
    decision of 1,000 members and its journal write made its heaviest ticks): frozen right after round 2 is
    journaled, before the plan that holds it is published, its journal holds round 2, and thawed, the run goes on."""
    cfg = {"diloco.outer_steps": 3, "membership.min_peers": 2}
    swarm.start_coordinator(cfg, env={"POTLUCK_FAULTS": "coordinator.decided@2:stop"})
    for _ in range(2):
        swarm.start_peer()
    pid = swarm.coordinator.pid
    swarm.wait_for(lambda: frozen(pid), 300, "the coordinator to freeze once round 2 is journaled")
    journal = json.loads((swarm.workdir / "journal" / "journal.json").read_text())
    assert 2 in [r["step"] for r in journal["rounds"]], [r["step"] for r in journal["rounds"]]
    os.killpg(pid, signal.SIGCONT)  # (its DHT process and p2pd froze with it: its process group)
    swarm.wait_for(lambda: swarm.state()["run"]["outer_step"] >= 3, 300, "the run to commit step 3 after the thaw")
