"""The coordinator's tick looks at what changed, not at everything (issue 30): at 1,000 peers and as many gone,
each pass over every peer's report was a millisecond or more of every tick. These drive the same random swarm
through two round lifecycles, one told which reports changed and one looking at all of them (the way it always
could), and hold the first to every decision, commit, failure, hash, progress and data vote of the second; a third
makes a decision's data shares only when it decides, not while the round before settles."""

from __future__ import annotations

import random

import pytest

from potluck.coordinator.placement.placement import members, sticky_placement
from potluck.coordinator.rounds.roundevents import Checkpoint
from potluck.coordinator.rounds.rounds import Rounds
from potluck.coordinator.swarm.membership import PeerTable
from potluck.protos.wire.records import PeerRecord, StepReport


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_rounds_told_what_changed_keep_the_state_of_rounds_that_look_at_every_report(seed: int) -> None:
    """16 peers over 300 ticks: some heartbeat, some fall silent, some leave and come back, members finish their
    step at random times and vote which replicas' samples it holds (some of them lying), rounds fail and roll
    back, and the table forgets the longest gone. Both lifecycles see the same reports and decide the same rounds."""
    rng = random.Random(seed)
    table = PeerTable(heartbeat_timeout_s=6.0, keep_gone=4)
    told, full, cold = (Rounds(stages=1, floor_s=20.0, settle_s=1.0, grace_s=6.0) for _ in range(3))
    cold.data.warm = lambda *args: None  # type: ignore[method-assign]  # (its shares made only when it decides)
    ids = [f"p{i:02d}" for i in range(16)]
    state = {p: {"version": 0, "epoch": 0, "hash": "", "recent": [], "seq": 0, "inner": 0} for p in ids}
    away: dict[str, int] = {}  # peer -> the tick it heartbeats again
    checked = {"commits": 0, "failures": 0, "votes": 0, "decisions": 0, "calm": 0}
    for tick in range(300):
        now = float(tick)
        pending = full.pending()
        batch = {}
        for p in ids:
            if away.get(p, -1) > tick:
                continue
            s = state[p]
            if rng.random() < 0.005:
                away[p] = tick + rng.randrange(1, 15)  # (falls silent: lost after the timeout, and back)
                continue
            if pending is not None and (m := pending.member(p)) is not None \
                    and (s["version"], s["epoch"]) != (pending.step, pending.epoch) and rng.random() < 0.15:  # finishes the step: its new version, and the replicas it holds
                held = [sh.replica for sh in pending.shares if rng.random() < 0.9]
                s.update(version=pending.step, epoch=pending.epoch, hash=f"h{pending.step}-{rng.random() < 0.1}")
                s["recent"] = (s["recent"] + [StepReport(step=pending.step, epoch=pending.epoch, stage=m.stage,
                                                         replica=m.replica, included=held)])[-16:]
            elif rng.random() < 0.03 and s["version"]:  # recovers its version's canonical state (same version)
                s["hash"] = full.canonical(s["version"]) or "h-recovered"
            if rng.random() < 0.5:  # heartbeats (not every peer on every tick: most records stay the same objects)
                s["seq"] += 1
                s["inner"] += rng.random() < 0.7
                batch[p] = PeerRecord(peer_id=p, address=f"{p}:1", seq=s["seq"], version=s["version"],
                                      epoch=s["epoch"], state_hash=s["hash"], inner_step=s["inner"],
                                      state="left" if rng.random() < 0.01 else "training", recent=list(s["recent"]))
        table.update(batch, now=now)
        reports = table.reports()
        if tick % 13 == 6:  # (the coordinator's journal writes prune the hashes; a checkpoint's are adopted)
            for r in (told, full, cold):
                r.prune_hashes()
        if tick % 29 == 11 and full.committed:
            for r in (told, full, cold):
                r.adopt_checkpoint(Checkpoint(full.committed, {0: f"ckpt{tick}"}))
        folded = told._folded
        events = [told.observe(reports, now, changed=table.take_changed()), full.observe(reports, now),
                  cold.observe(reports, now)]
        checked["calm"] += folded == told._folded  # (nothing the hashes are made of moved: they were not made again)
        assert [repr(e) for e in events[0]] == [repr(e) for e in events[1]] == [repr(e) for e in events[2]], tick
        assert (told.committed, told.epoch, told.hashes) == (full.committed, full.epoch, full.hashes), tick
        assert told._progress == full._progress and told.data._votes == full.data._votes, tick
        checked["commits"] += sum(type(e).__name__ == "Committed" for e in events[1])
        checked["failures"] += sum(type(e).__name__ == "Failed" for e in events[1])
        checked["votes"] = max(checked["votes"], sum(len(v) for v in full.data._votes.values()))
        live = table.live()
        if full.ready_to_decide(len(live), 4, now, reports):
            assert told.ready_to_decide(len(live), 4, now, reports)
            peers = sorted(v.record.peer_id for v in live)
            prev = full.rounds.get(full.committed)
            grid = sticky_placement(peers, 1, len(peers), {m.peer_id: (m.stage, m.replica) for m in prev.members}
                                    if prev else {})
            cells = members(grid, [v.record for v in live])
            made = [r.decide(cells, now, reports=reports) for r in (told, full, cold)]
            assert made[0] == made[1] == made[2], tick  # (cold: the same data shares, made when it decided)
            checked["decisions"] += 1
            if checked["decisions"] % 10 == 5:  # every member of the round goes quiet before it reports: it fails
                away |= {m.peer_id: tick + 12 for m in made[1].members}
    assert min(checked.values()) > 0, checked  # (it decided, committed, failed and counted votes)


def test_a_hash_changed_at_the_same_version_is_seen_by_rounds_told_what_changed() -> None:
    """A member that recovers another state of the version it holds changes no version, only its hash: that can move
    the canonical hash (here two of three members end up holding ``y``), and a lifecycle told what changed sees it."""
    table, told, full = PeerTable(heartbeat_timeout_s=60.0), Rounds(stages=1), Rounds(stages=1)
    ids = ["a", "b", "c"]

    def beat(pid: str, seq: int, version: int, h: str) -> PeerRecord:
        return PeerRecord(peer_id=pid, address=f"{pid}:1", seq=seq, version=version, state_hash=h, state="training")

    table.update({p: beat(p, 1, 0, "") for p in ids}, now=0.0)
    reports = table.reports()
    for r in (told, full):
        r.observe(reports, 0.0, changed=table.take_changed() if r is told else None)
        r.decide(members(sticky_placement(ids, 1, 3, {}), [v.record for v in table.live()]), 0.0, reports=reports)
    for seq, now, hashes in ((2, 1.0, "xxy"), (3, 2.0, "xxy"), (4, 3.0, "xyy")):
        table.update({p: beat(p, seq, 1, h) for p, h in zip(ids, hashes, strict=True)}, now=now)
        reports = table.reports()
        changed = table.take_changed()
        told.observe(reports, now, changed=changed)
        full.observe(reports, now)
        assert told.canonical(1) == full.canonical(1) == {"xxy": "x", "xyy": "y"}[hashes], (now, told.canonical(1))
