"""The round lifecycle, step by step with an injected clock: decided -> committed | failed -> rolled back."""

from __future__ import annotations

from pathlib import Path

import pytest

from potluck.coordinator.placement.placement import members, sticky_placement
from potluck.coordinator.rounds.history import fold, roll_back
from potluck.coordinator.rounds.roundevents import Checkpoint, Committed, Failed, RolledBack
from potluck.coordinator.rounds.rounds import REGATHER, Rounds
from potluck.coordinator.swarm.membership import PeerTable
from potluck.coordinator.trust.admission import Gatekeeper
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.wire.records import PeerRecord, StepReport

TIMEOUT = 5.0


def rec(pid: str, version: int = 0, state: str = "waiting", h: str = "", seq: int = 1, stage: int = 0,
        epoch: int = 0, prev: tuple[int, str] = (-1, ""), inner: int = 0, recent: list[StepReport] | None = None,
        ) -> PeerRecord:
    return PeerRecord(peer_id=pid, address=f"{pid}:1", version=version, state=state, state_hash=h or f"h{version}",
                      seq=seq, stage=stage, epoch=epoch, prev_version=prev[0], prev_hash=prev[1], inner_step=inner,
                      recent=recent or [])


class Swarm:
    """A PeerTable and a Rounds driven together, the way the coordinator's tick drives them."""

    def __init__(self, stages: int = 1, floor_s: float = 30.0, min_peers: int = 1) -> None:
        self.table = PeerTable(TIMEOUT)
        self.rounds = Rounds(stages=stages, floor_s=floor_s, factor=4.0, settle_s=1.0, grace_s=TIMEOUT)
        self.min_peers, self.seq, self.now = min_peers, 1, 0.0
        self.checkpoint: Checkpoint | None = None

    def tick(self, now: float, *records: PeerRecord) -> list:
        self.now = now
        self.seq += 1
        self.table.update({r.peer_id: r.model_copy(update={"seq": self.seq}) for r in records}, now)
        return self.rounds.observe(self.table.reports(), now, self.checkpoint)

    def decide(self) -> object:
        live = self.table.live()
        assert self.rounds.ready_to_decide(len(live), self.min_peers, self.now, self.table.reports())
        s = self.rounds.stages
        ids = sorted(v.record.peer_id for v in live)
        prev = self.rounds.rounds.get(self.rounds.committed)
        before = {m.peer_id: (m.stage, m.replica) for m in prev.members} if prev else {}
        grid = sticky_placement(ids, s, len(ids) // s, before)
        return self.rounds.decide(members(grid, [v.record for v in live]), self.now, reports=self.table.reports())


def test_first_round_waits_for_min_peers_then_admits_all_sorted() -> None:
    s = Swarm(min_peers=2)
    s.tick(0, rec("b"))
    assert not s.rounds.ready_to_decide(1, 2, 0, s.table.reports())
    # (a fresh start's pings start once 4 in 5 of the peers it waits for are live: here, not with 1 of 2)
    assert not s.rounds.settling(1, 2) and not s.rounds.settling(3, 5) and s.rounds.settling(4, 5)
    s.tick(1, rec("a"), rec("b"))
    r = s.decide()
    assert [m.peer_id for m in r.members] == ["a", "b"] and r.step == 1 and r.epoch == 0
    assert s.rounds.pending() is r and not s.rounds.ready_to_decide(2, 2, 1, s.table.reports())


def test_commit_then_the_next_round_admits_joiners_and_drops_the_lost() -> None:
    s = Swarm()
    s.tick(0, rec("a"), rec("b"))
    assert not s.rounds.settling()  # (a first round: it waits for min_peers, not for a round to settle)
    s.decide()
    assert not s.rounds.settling()
    events = s.tick(2, rec("a", 1, "training", "good"), rec("c"))
    assert [type(e) for e in events] == [Committed] and s.rounds.committed == 1
    assert not s.rounds.ready_to_decide(3, 1, 2, s.table.reports())  # b has not reported v1, settle time not over
    assert s.rounds.settling()  # (the next decision's pings may start)
    s.tick(3.5)
    assert s.rounds.ready_to_decide(3, 1, 3.5, s.table.reports())
    s.tick(6)  # b silent for 6 s > timeout: lost
    r = s.decide()
    assert [m.peer_id for m in r.members] == ["a", "c"] and r.base_hash == "good"


def test_canonical_hash_is_the_majority_of_the_rounds_members() -> None:
    s = Swarm()
    s.tick(0, *(rec(p) for p in "abc"))
    s.decide()
    s.tick(1, rec("a", 1, h="good"), rec("b", 1, h="good"), rec("c", 1, h="bad"))
    assert s.rounds.canonical(1) == "good"


def test_goodbye_evicts_at_once() -> None:
    t = PeerTable(heartbeat_timeout_s=100)
    t.update({"a": rec("a")}, now=0)
    events = t.update({"a": rec("a", state="left", seq=2)}, now=1)
    assert ("left", "a") in events and t.live() == []


def test_an_evicted_peer_is_in_no_round_decided_after_its_eviction(tmp_path: Path) -> None:
    """Evicting a peer takes it out of the table at once, not at its last heartbeat's timeout: a round decided
    in between named it (a liar proven at step 1 was a member, and a shard owner, of the rerun of step 1)."""
    s = Swarm(min_peers=3)
    gate = Gatekeeper(RunConfig(), "run", "coordinator-id", tmp_path, [])
    gate.admission.on_revoke = s.table.evict
    now = run_to(s, 1)
    gate.admission.revoke("c")  # (its heartbeats stop reaching the table: the gate no longer passes them)
    assert sorted(v.record.peer_id for v in s.table.live()) == ["a", "b"]
    assert "c" not in {m.peer_id for m in s.decide().members}  # type: ignore[attr-defined]
    assert s.table.update({}, now=now + 1) == []  # and it is not reported lost later on top of evicted


def test_a_peer_that_said_goodbye_and_heartbeats_again_is_back() -> None:
    """A volunteer's Ctrl+C, then the same key again: the goodbye used to keep the id out for good."""
    t = PeerTable(heartbeat_timeout_s=100)
    t.update({"a": rec("a", seq=1)}, now=0)
    t.update({"a": rec("a", state="left", seq=2)}, now=1)
    assert t.update({"a": rec("a", state="joining", seq=3)}, now=2) == [("back", "a")]
    assert [v.record.peer_id for v in t.live()] == ["a"]
    # a DHT replica still holding the old goodbye (an older seq) does not send it away again
    assert t.update({"a": rec("a", state="left", seq=2)}, now=3) == [] and t.live()
    # nor a goodbye that is older than a lost peer's return
    t.update({}, now=200)
    assert t.update({"a": rec("a", state="training", seq=5)}, now=201) == [("back", "a")] and t.live()


def test_a_restart_whose_goodbye_was_never_read_is_back() -> None:
    """CI: SIGTERM, then the same key again within a tick: the new process's first heartbeat replaced the
    goodbye in the DHT before the coordinator read it. A record from a later process is a restart all the same;
    a later record of the same process is not."""
    t = PeerTable(heartbeat_timeout_s=100)
    t.update({"a": rec("a", seq=1).model_copy(update={"started_at": 10.0})}, now=0)
    assert t.update({"a": rec("a", seq=2).model_copy(update={"started_at": 10.0})}, now=1) == []
    assert t.update({"a": rec("a", seq=3).model_copy(update={"started_at": 50.0})}, now=2) == [("back", "a")]
    assert [v.record.peer_id for v in t.live()] == ["a"]


def test_members_that_finished_the_last_step_commit_it_and_are_not_a_lost_stage() -> None:
    """Seen in the chaos test: a stage's members finished the run's last step (state ``finished``, still
    serving it) while one joiner of the other stage was behind; the round was failed as "stage 0 lost all
    its members" and the whole run rolled back to theta_0."""
    s = Swarm(stages=2)
    s.tick(0, *(rec(p) for p in "abcd"))
    r = s.decide()
    stage = {p: r.member(p).stage for p in "abcd"}
    late = next(p for p in "abcd" if stage[p] == 1)
    done = [rec(p, 1, "finished", "h1", stage=stage[p], prev=(0, "h0"), seq=0) for p in "abcd" if p != late]
    events = s.tick(2, *done, rec(late, 0, "training", "h0", stage=1))
    assert [type(e) for e in events] == [Committed] and s.rounds.committed == 1
    assert {v.record.peer_id for v in s.table.live()} == {late}  # (finished peers are not in the next round)
    # once they stop heartbeating they count no more, and are not reported lost
    later = s.table.update({late: rec(late, 1, "training", "h1", stage=1, seq=99)}, 2 + 2 * TIMEOUT)
    assert later == [] and [x.peer_id for x in s.table.reports() if x.live] == [late]


def run_to(s: Swarm, step: int, ids: str = "abc", t0: float = 0.0) -> float:
    """Decide and commit steps 1..step with these peers; returns the clock."""
    now = t0
    s.tick(now, *(rec(p, s.rounds.committed, "waiting") for p in ids))
    while s.rounds.committed < step:
        s.decide()
        now += 2
        v = s.rounds.committed + 1
        s.tick(now, *(rec(p, v, "training", f"h{v}", prev=(v - 1, f"h{v - 1}")) for p in ids))
        now += 2
        s.tick(now, *(rec(p, v, "training", f"h{v}", prev=(v - 1, f"h{v - 1}")) for p in ids))
    return now


def test_every_member_of_the_pending_round_dies_so_it_fails_and_the_run_resumes_from_the_checkpoint() -> None:
    s = Swarm(min_peers=3)
    now = run_to(s, 3)
    s.checkpoint = Checkpoint(2, {0: "h2"})
    s.decide()  # round 4 decided ...
    assert s.tick(now + 1) == []  # ... and all three members die: their records stop, nothing changes yet
    events = s.tick(now + TIMEOUT + 1.5)  # lost: the round fails at once
    failed = next(e for e in events if isinstance(e, Failed))
    assert failed.round.step == 4 and "every member is gone" in failed.reason
    back = next(e for e in events if isinstance(e, RolledBack))
    assert (back.from_step, back.to_version, back.source, back.epoch) == (3, 2, "checkpoint", 1)
    assert s.rounds.committed == 2 and s.rounds.pending() is None and s.rounds.epoch == 1
    # new peers: a fresh start waits for min_peers again, then round 3 runs in the new epoch from the checkpoint
    s.tick(now + 20, rec("d"), rec("e"))
    assert not s.rounds.ready_to_decide(2, 3, now + 20, s.table.reports())
    s.tick(now + 21, rec("d"), rec("e"), rec("f"))
    r = s.decide()
    assert (r.step, r.epoch, r.base_hash) == (3, 1, "h2")
    assert [o.step for o in s.rounds.outcomes] == [4]


def test_after_a_failure_the_run_waits_for_min_peers_a_bounded_time_then_goes_on_with_whoever_is_live() -> None:
    """A member that went silent (maybe for good) leaves fewer live peers than ``min_peers``: the run waits
    ``REGATHER`` heartbeat timeouts for it or others to come, then goes on with the peers it has (it used to wait
    forever). The first round of a run waits for ``min_peers`` without a bound: that is the operator's ask."""
    s = Swarm(min_peers=3)
    assert not s.rounds.ready_to_decide(2, 3, 10_000.0)  # never a first round with fewer
    now = run_to(s, 3)
    s.decide()
    lie = s.rounds.retract(2, "a proven lie", s.table.reports(), None, now + 0.5)  # (the coordinator's check)
    assert [type(e) for e in lie][:1] == [Failed] and s.rounds.committed == 0  # (nobody holds v1: theta_0)
    for t in (now + TIMEOUT + 1, now + 0.5 + REGATHER * TIMEOUT - 0.5):
        s.tick(t, *(rec(p, 0, "waiting") for p in "ab"))  # c went silent: maybe it comes back
        assert not s.rounds.ready_to_decide(2, 3, t, s.table.reports()), t
    t = now + 0.5 + REGATHER * TIMEOUT
    s.tick(t, *(rec(p, 0, "waiting") for p in "ab"))
    r = s.decide()
    assert (r.step, r.epoch, sorted(m.peer_id for m in r.members)) == (1, 1, ["a", "b"])


def test_a_first_round_whose_pings_reach_fewer_than_min_peers_waits_for_them_a_bounded_time() -> None:
    """16 peers heartbeat and ``min_peers`` is 16, but one misses the decision's ping (busy): the round waits and
    pings again, so the run starts with the 16 asked for (it started with 15); a peer that heartbeats but is never
    reachable holds the start for one heartbeat timeout, not for ever."""
    s = Swarm(min_peers=4)
    s.tick(0.0, *(rec(p, 0, "waiting") for p in "abcd"))
    assert s.rounds.ready_to_decide(4, 4, 0.0, s.table.reports())
    assert s.rounds.short_of(3, 4, 4, 10.0) and s.rounds.short_of(3, 4, 4, 10.0 + TIMEOUT - 0.1)  # ping again
    assert not s.rounds.short_of(4, 4, 4, 12.0)  # all four answered: decide now
    assert s.rounds.short_of(3, 4, 4, 13.0)  # (a new wait: it starts again from here)
    assert not s.rounds.short_of(3, 4, 4, 13.0 + TIMEOUT)  # d never answers: go on with those that did
    assert not s.rounds.short_of(2, 3, 4, 20.0)  # fewer live than min_peers (a regather's go-on): nothing to wait for
    run_to(s, 1, ids="abcd", t0=20.0)
    assert s.rounds.committed == 1 and not s.rounds.short_of(1, 4, 4, 60.0)  # after a commit: no fresh start


def test_after_a_failure_the_run_goes_on_at_once_when_every_member_of_the_failed_round_is_back_or_gone_for_good() -> None:
    """The bounded wait is for members of the failed round that may still come back: once each is live again,
    evicted or said goodbye, nothing is left to wait for (a proven liar's eviction cost every run 3 heartbeat
    timeouts). One that only went silent is still waited for."""
    s = Swarm(min_peers=4)
    now = run_to(s, 3, ids="abcd")
    s.decide()
    s.rounds.retract(2, "a proven lie", s.table.reports(), None, now + 0.5)
    t = now + TIMEOUT + 1
    s.tick(t, *(rec(p, 0, "waiting") for p in "abc"))  # d went silent: maybe back soon
    assert not s.rounds.ready_to_decide(3, 4, t, s.table.reports())
    s.table.evict("d")  # no: d was the liar
    assert s.rounds.ready_to_decide(3, 4, t, s.table.reports())
    r = s.decide()
    assert (r.step, r.epoch, sorted(m.peer_id for m in r.members)) == (1, 1, ["a", "b", "c"])
    assert s.table.peers["d"].live is False and s.table.peers["d"].report().gone
    s.tick(t + 1, *(rec(p, 0, "waiting") for p in "abc"), rec("d", 0, "left"))
    assert s.table.peers["d"].report().gone  # (a goodbye is gone for good, too)


def test_a_journaled_pending_round_of_peers_that_never_come_back_fails_after_a_restart() -> None:
    s = Swarm()
    run_to(s, 3)
    s.decide()
    journal = (s.rounds.committed, s.rounds.epoch, list(s.rounds.rounds.values()), s.rounds.hashes, [])
    restarted = Swarm()
    restarted.rounds.restore(*journal, now=100.0)
    restarted.rounds.resumed(107.0)  # its DHT took 7 s to start: the members' grace counts from here
    assert restarted.rounds.pending() is not None and restarted.rounds.pending().step == 4
    grace = REGATHER * TIMEOUT  # (their DHT nodes must find the coordinator's new one first)
    assert restarted.tick(107.0 + grace - 1, rec("x")) == []  # its members may still show up
    events = restarted.tick(107.0 + grace + 0.5, rec("x"))
    assert any(isinstance(e, Failed) for e in events)
    # nobody holds v3 and there is no checkpoint: every peer can rebuild theta_0
    back = next(e for e in events if isinstance(e, RolledBack))
    assert (back.to_version, back.source) == (0, "theta_0") and restarted.rounds.committed == 0


def test_a_live_peer_holding_the_committed_state_means_a_retry_without_rollback() -> None:
    s = Swarm()
    now = run_to(s, 3, ids="ab")
    s.decide()
    # a stays (not a member of the new attempt's failure cause), b dies; round 4 goes silent
    events = s.tick(now + 1, rec("a", 3, "syncing", "h3", prev=(2, "h2")))
    assert events == []
    events = s.tick(now + 40, rec("a", 3, "syncing", "h3", prev=(2, "h2")))
    assert [type(e) for e in events] == [Failed] and "no member made progress" in events[0].reason
    assert s.rounds.committed == 3 and s.rounds.epoch == 1
    r = s.decide()
    assert (r.step, r.epoch, [m.peer_id for m in r.members]) == (4, 1, ["a"])


def test_rollback_finds_a_step_held_as_some_peers_previous_state() -> None:
    s = Swarm(stages=2)
    for p, st in (("a", 0), ("b", 1)):
        s.table.update({p: rec(p, stage=st)}, 0)
    s.rounds.hashes = {0: {3: "s0v3"}, 1: {3: "s1v3"}}
    s.rounds.committed = 3
    # stage 0's member committed v4 and still serves v3; stage 1's holds v3
    reports = [rec("a", 4, h="s0v4", stage=0, prev=(3, "s0v3")), rec("b", 3, h="s1v3", stage=1, prev=(2, "x"))]
    s.table.update({r.peer_id: r.model_copy(update={"seq": 9}) for r in reports}, 1)
    assert s.rounds.rollback_target(s.table.reports(), None) == (3, "live peers")
    # the stage 1 holder is lost: only the checkpoint (or theta_0) has both stages
    s.table.update({}, 100)
    s.table.update({"a": reports[0].model_copy(update={"seq": 10})}, 100)
    assert s.rounds.rollback_target(s.table.reports(), None) == (0, "theta_0")
    assert s.rounds.rollback_target(s.table.reports(), Checkpoint(2, {0: "c0", 1: "c1"})) == (2, "checkpoint")


def test_deadline_comes_from_measured_steps_with_a_floor() -> None:
    s = Swarm(floor_s=10.0)
    now = run_to(s, 3)  # each step takes 2 s from decision to commit
    assert s.rounds.deadline_s() == 10.0  # 4 x 2 s is below the floor
    s.rounds.floor_s = 1.0
    assert s.rounds.deadline_s() == pytest.approx(8.0)
    s.decide()
    busy = [rec(p, 3, "training", "h3", inner=i) for i, p in enumerate("abc")]
    assert s.tick(now + 7, *busy) == []
    events = s.tick(now + 8.5, *(r.model_copy(update={"inner_step": 9}) for r in busy))  # busy, but far too slow
    assert any(isinstance(e, Failed) and "within 8 s" in e.reason for e in events)


def test_a_stale_epochs_report_never_commits_the_new_round() -> None:
    s = Swarm()
    now = run_to(s, 3, ids="a")
    s.decide()
    s.tick(now + 40, rec("a", 3, "waiting", "h3"))  # silent: fails, epoch 1, round 4 decided again
    assert s.rounds.epoch == 1
    s.decide()
    # a straggler of the failed epoch reports v4: not the new round's result
    assert s.tick(now + 41, rec("a", 4, "training", "old", epoch=0)) == []
    assert s.rounds.committed == 3
    events = s.tick(now + 42, rec("a", 4, "training", "new", epoch=1))
    assert isinstance(events[0], Committed) and s.rounds.canonical(4) == "new"


def test_steps_committed_on_the_last_plan_while_the_coordinator_was_away() -> None:
    s = Swarm()
    now = run_to(s, 2, ids="ab")
    s.decide()
    events = s.tick(now + 30, rec("a", 6, "training", "h6"), rec("b", 6, "training", "h6"))
    assert [(e.step, e.since) for e in events] == [(6, 2)] and s.rounds.canonical(6) == "h6"


def test_one_member_claiming_version_5000_moves_nothing() -> None:
    """Nothing a peer says about itself is trusted alone: at least half of a stage's live members must
    report a version for it to count, and only the round's members vote on its hash."""
    s = Swarm()
    now = run_to(s, 2)
    s.decide()
    assert s.tick(now + 1, rec("a", 5000, "training", "evil"), rec("b", 2, "training", "h2"),
                  rec("c", 2, "training", "h2")) == []
    assert s.rounds.committed == 2
    events = s.tick(now + 2, rec("a", 5000, "training", "evil"), rec("b", 3, "training", "h3"),
                    rec("c", 3, "training", "h3"))
    assert [(e.step, e.since) for e in events] == [(3, 2)] and s.rounds.canonical(3) == "h3"


def test_reshard_replaces_every_hash_of_the_old_layout() -> None:
    s = Swarm(stages=2)
    s.rounds.hashes = {0: {4: "two-stage-s0"}, 1: {4: "two-stage-s1"}}
    s.rounds.committed, s.rounds.epoch = 5, 3
    s.rounds.reshard(1, Checkpoint(4, {0: "one-stage"}), now=0)
    assert s.rounds.hashes == {0: {4: "one-stage"}} and s.rounds.committed == 4 and s.rounds.epoch == 4
    assert s.rounds.stages == 1 and s.rounds.pending() is None


# ----------------------------------------------------------------------------- the history, one outcome per step


def report(step: int, h: str, loss: float, epoch: int = 0, **kw: object) -> StepReport:
    return StepReport(step=step, epoch=epoch, state_hash=h, loss=loss, outer_s=0.5, outer_bytes=100, **kw)


def test_history_folds_members_reports_idempotently_and_fills_steps_seen_late() -> None:
    s = Swarm()
    run_to(s, 3, ids="ab")
    recs = [rec("a", 3, recent=[report(v, f"h{v}", 2.0 - v / 10) for v in (1, 2, 3)]),
            rec("b", 3, recent=[report(v, f"h{v}", 2.0 - v / 10, eval_loss=1.5 if v == 3 else None) for v in (2, 3)])]
    hist, added = fold([], recs, s.rounds.round_at, s.rounds.committed, now=1.0)
    again, added_again = fold(hist, recs, s.rounds.round_at, s.rounds.committed, now=2.0)
    assert added and not added_again and again == hist
    assert [h["step"] for h in hist] == [1, 2, 3]
    assert hist[0]["state_hashes"] == {"a": "h1"} and hist[2]["state_hashes"] == {"a": "h3", "b": "h3"}
    assert hist[2]["eval_loss"] == 1.5 and hist[2]["bytes"]["outer"] == 200 and hist[2]["loss"] == pytest.approx(1.7)


def test_a_rolled_back_step_leaves_the_history_and_its_rerun_takes_its_place() -> None:
    s = Swarm()
    run_to(s, 3, ids="a")
    hist, _ = fold([], [rec("a", 3, recent=[report(v, f"old{v}", 1.0) for v in (1, 2, 3)])], s.rounds.round_at, 3)
    kept, undone = roll_back(hist, 1)
    assert [h["step"] for h in kept] == [1] and [(h["step"], h["rolled_back"]) for h in undone] == [(2, True), (3, True)]
    s.rounds.committed, s.rounds.epoch = 1, 1
    for step in (2, 3):
        s.rounds.rounds.pop(step, None)
    s.tick(100, rec("a", 1, h="old1"))
    s.decide()
    s.tick(101, rec("a", 2, h="new2", epoch=1, recent=[report(2, "new2", 0.9, epoch=1)]))
    stale = rec("a", 2, h="new2", epoch=1, recent=[report(2, "old2", 1.0, epoch=0), report(2, "new2", 0.9, epoch=1)])
    hist, _ = fold(kept, [stale], s.rounds.round_at, s.rounds.committed)
    assert [h["step"] for h in hist] == [1, 2] and hist[1]["state_hashes"] == {"a": "new2"} and hist[1]["epoch"] == 1


def test_grouped_rounds_name_each_groups_base_and_no_stage_hash() -> None:
    """sync.group_size: the members of a step hold their groups' different results; the next round names,
    per group, the state its members all hold (their common result of two steps before), not one hash."""
    s = Swarm()
    s.rounds.group_size = 2
    ids = "abcd"
    s.tick(0, *(rec(p, 0, h="t0") for p in ids))
    r1 = s.decide()
    assert [m.group for m in r1.members] == [0, 0, 1, 1] and r1.base_hash == ""
    assert [(g.group, g.version, g.hash) for g in r1.groups] == [(0, 0, "t0"), (1, 0, "t0")]
    row = {"a": "r0", "b": "r0", "c": "r1", "d": "r1"}  # each group's result of step 1
    events = s.tick(2, *(rec(p, 1, "training", row[p], prev=(0, "t0")) for p in ids))
    assert [type(e) for e in events] == [Committed] and s.rounds.canonical(1) in ("r0", "r1")
    s.tick(4, *(rec(p, 1, "training", row[p], prev=(0, "t0")) for p in ids))
    r2 = s.decide()
    assert [m.group for m in r2.members] == [0, 1, 1, 0]  # diagonals: one member of each row
    assert [(g.version, g.hash) for g in r2.groups] == [(0, "t0"), (0, "t0")]
    diag = {"a": "d0", "d": "d0", "b": "d1", "c": "d1"}
    s.tick(6, *(rec(p, 2, "training", diag[p], prev=(1, row[p])) for p in ids))
    s.tick(8, *(rec(p, 2, "training", diag[p], prev=(1, row[p])) for p in ids))
    r3 = s.decide()
    assert [(g.version, g.hash) for g in r3.groups] == [(1, "r0"), (1, "r1")]  # rows again: their step-1 results
    # the round fails with only c left, whose group's v2 is not the hash most members held: the run goes on
    # from it (any group's state is the run's), not back to theta_0
    events = s.tick(100, rec("c", 2, "syncing", "d1", prev=(1, "r1")))
    assert [type(e) for e in events] == [Failed] and s.rounds.committed == 2
    s.rounds.hashes[0].update({2: "d0", 1: "r0"})  # (what most members held, as a restarted journal says)
    assert s.rounds.rollback_target(s.table.reports(), None) == (2, "live peers")
    s.rounds.group_size = 0  # (one group: d1 is a member's diverged state, and nobody holds d0)
    assert s.rounds.rollback_target(s.table.reports(), None) == (0, "theta_0")


def test_grouped_data_votes_count_within_the_replicas_group() -> None:
    """A grouped version holds only its group's replicas: each member votes for those, and the others'
    samples must not go back to the pool for lack of their votes."""
    s = Swarm()
    s.rounds.group_size = 2
    s.tick(0, *(rec(p, 0, h="t0") for p in "abcd"))
    r = s.decide()
    group = {m.peer_id: m.group for m in r.members}
    mine = {p: tuple(m.replica for m in r.members if m.group == group[p]) for p in "abcd"}
    for p in "abcd":
        s.rounds.data.vote(1, 0, p, mine[p])
    assert s.rounds.data.included(r, 1, s.rounds.round_at) == {0, 1, 2, 3}
    s.rounds.data.vote(1, 0, "a", ())  # a says its own group's replica 1 is not in; b still says it is: a tie keeps
    assert s.rounds.data.included(r, 1, s.rounds.round_at) == {0, 1, 2, 3}
    s.rounds.data.vote(1, 0, "b", (1,))
    assert s.rounds.data.included(r, 1, s.rounds.round_at) == {1, 2, 3}
