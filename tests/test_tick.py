"""A long coordinator tick leaves what can wait to the next one (issue 30): at 1,000 peers a commit's tick judged
the step, folded every member's report of it, journaled it and built the status snapshot, 130-200 ms of CPU in
one tick, the tick's p99. The history's fold and the snapshot wait a tick (once), and come out the same."""

from __future__ import annotations

import json
import random
import time
from functools import partial

import pytest

from potluck.coordinator import health
from potluck.coordinator.health import MAX_WAITS, SNAPSHOT_SHARE, STALE_S, Health
from potluck.coordinator.rounds import history
from potluck.protos.wire.records import Member, PeerRecord, Round, StepReport


def test_a_long_tick_leaves_the_snapshot_to_the_next_one() -> None:
    """A commit wants the status snapshot at once; a long tick builds it on the next tick instead, unless the
    snapshot is 2 s old."""
    h = Health()
    assert h.snapshot_due(0.0, False, 0.2)
    h.snapshot_built(0.0)
    assert not h.snapshot_due(0.1, False, 0.2)
    assert not h.snapshot_due(0.3, True, 0.2, long=True)  # a commit in a long tick: owed ...
    assert h.snapshot_due(0.31, False, 0.2)  # ... and built on the next, short one
    h.snapshot_built(0.31)
    assert h.snapshot_due(0.31 + STALE_S, True, 0.2, long=True)  # too old to wait for a short tick


def test_a_snapshot_that_takes_long_to_build_is_built_as_much_less_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build of 30 ms (1,000 peers) comes at most every 0.6 s: building takes a twentieth of the loop at most."""
    clock = [100.0]
    monkeypatch.setattr(health.time, "monotonic", lambda: clock[0])
    h = Health()
    assert h.snapshot_due(0.0, False, 0.2)
    clock[0] += 0.03
    h.snapshot_built(0.0)
    assert SNAPSHOT_SHARE == 1 / 20
    assert not h.snapshot_due(0.59, False, 0.2)
    assert h.snapshot_due(0.61, False, 0.2)


def test_a_commits_fold_left_to_the_next_tick_makes_the_same_history() -> None:
    """Ticks of random records, some long: the folder leaves a commit's fold to the next tick (once: never two
    ticks running), with the records that changed meanwhile, and the history comes out as folding everything
    every tick makes it."""
    rng = random.Random(5)
    ids = [f"12D3KooW{c * 44}" for c in "abcdefgh"]
    rounds = {s: Round(step=s, members=[Member(peer_id=p, address="x:1", replica=i) for i, p in enumerate(ids)])
              for s in range(1, 12)}
    round_at = partial(lambda r, s: r.get(min(s, 11)), rounds)
    held: dict[str, PeerRecord] = {}
    whole: list[dict] = []
    part: list[dict] = []
    folder, deferred, health = history.Folder(), 0, Health()  # (its waits: long ticks, never two running)
    for tick in range(60):
        committed = tick // 6
        changed = []
        for pid in rng.sample(ids, 3):  # a few heartbeats a tick, each with its newest reports
            v = min(11, committed + rng.choice((0, 1)))
            rec = PeerRecord(peer_id=pid, address="x:1", seq=tick, version=v, recent=[
                StepReport(step=s, state_hash=f"h{s}", loss=2.0 + s / 10 + rng.random() / 100, outer_bytes=10)
                for s in range(max(1, v - 3), v + 1)])
            held[pid] = rec
            changed.append(rec)
        whole, _ = history.fold(whole, list(held.values()), round_at, committed, now=float(committed))
        before = len(part)
        began = -1e9 if rng.random() < 0.7 else time.thread_time()  # (a long tick, most of them)
        part, added = folder.fold(part, changed, round_at, committed, list(held.values()), partial(health.waits, began=began))
        deferred += committed > (part[-1]["step"] if part else 0)
        assert added == (len(part) > before)
        for h in part[-len(whole):]:
            h["t"] = next(w["t"] for w in whole if w["step"] == h["step"])  # (when it was added: a tick later)
    part, _ = folder.fold(part, [], round_at, committed, list(held.values()))  # (in case the last tick left one)
    folder.flush(part)  # (the totals the last ticks left to later)
    part[-1]["t"] = whole[-1]["t"]
    assert deferred and json.dumps(part, sort_keys=True) == json.dumps(whole, sort_keys=True)


def test_a_long_ticks_journal_write_waits_a_few_ticks_at_most() -> None:
    """A commit in a long tick is journaled on a later one (peers act on a commit without the journal; a
    coordinator that stops before the write learns the step again from their reports), at most ``MAX_WAITS``
    long ticks later, and at once in a short one."""
    import time

    h = Health()
    long_ago = time.thread_time() - 1.0  # (a tick that began a CPU second ago: long)
    assert [h.waits("journal", long_ago) for _ in range(MAX_WAITS + 1)] == [True] * MAX_WAITS + [False]
    assert h.waits("journal", long_ago) and h.waits("plan", long_ago)  # (counted per job, from 0 again)
    assert not h.waits("journal", time.thread_time())  # a short tick writes at once
    assert h.waits("journal", long_ago)  # (and the count starts over)


def test_a_long_ticks_new_plan_is_published_by_the_next_tick_never_later() -> None:
    """A tick that decided a round of 1,000 members has run long: sealing and storing the plan waits one tick
    (the caller is told, and starts that tick at once), never two; a short tick publishes at once."""
    from potluck.coordinator.swarm.publisher import Publisher
    from potluck.protos.net.identity import Identity
    from potluck.protos.wire.envelope import seal
    from potluck.protos.wire.records import Manifest
    me, stored = Identity.generate(), list[str]()

    class Node:
        def seal(self, record: object, ttl: float, raw: dict | None = None) -> dict:
            return seal(me, record, ttl, raw)  # type: ignore[arg-type]

        def sealed_size(self, value: dict, ttl: float) -> int:
            return len(value["body"])

        def publish_manifest(self, m: object, ttl: float, wait: bool = False) -> bool:
            return not stored.append("manifest")  # type: ignore[func-returns-value]

        def publish_plan(self, p: object, ttl: float, wait: bool = False, sealed: object = None) -> bool:
            return not stored.append("plan")  # type: ignore[func-returns-value]

        def publish_plan_head(self, h: object, ttl: float, wait: bool = False) -> bool:
            return not stored.append("head")  # type: ignore[func-returns-value]

    pub, health = Publisher(Node(), Manifest(run_id="r", coordinator=me.peer_id, config={}), set()), Health()  # type: ignore[arg-type]
    rounds = [Round(step=1, members=[Member(peer_id="p", address="x:1")])]
    long_tick = time.thread_time() - 1.0  # (a tick that began a CPU second ago)
    pub.new_plan()
    assert pub.publish(rounds, partial(health.waits, "plan", long_tick, 1)) is True and stored == []
    assert pub.publish(rounds, partial(health.waits, "plan", long_tick, 1)) is False  # the next one, long too: now
    assert stored == ["manifest", "plan", "head"]
    pub.new_plan()
    assert pub.publish(rounds, partial(health.waits, "plan", time.thread_time())) is False
    assert stored[3:] == ["manifest", "plan", "head"]
    # a decision's new plan makes the newest rounds' JSON at once (that tick), and its publish takes it as made
    more = [Round(step=s, members=[Member(peer_id="p", address="x:1")]) for s in range(2, 7)]
    pub.new_plan(more)
    made = pub._dumped._kept
    assert sorted(r.step for r, _ in made.values()) == [3, 4, 5, 6]
    assert pub.publish(more, partial(health.waits, "plan", time.thread_time())) is False and stored[6:] == ["manifest", "plan", "head"]
    assert all(pub._dumped._kept[k][1] is made[k][1] for k in made), "the JSON made with the new plan, not again"


def test_an_entrys_totals_are_made_again_once_a_second_while_reports_keep_coming(monkeypatch) -> None:
    """At 1,000 peers, the members' reports of a step arrive over many ticks, and making the entry's totals
    again from all of them on each was most of an ordinary tick's p99. They are made at once for a new entry,
    then at most every ``AGGREGATE_S`` while reports keep coming, and once they stop; a long tick leaves them
    to the next."""
    clock = [100.0]
    monkeypatch.setattr(history.time, "monotonic", lambda: clock[0])
    ids = [f"12D3KooW{c * 44}" for c in "abcd"]
    rnd = Round(step=1, members=[Member(peer_id=p, address="x:1", replica=i) for i, p in enumerate(ids)])

    def rec(i: int, loss: float) -> PeerRecord:
        return PeerRecord(peer_id=ids[i], address="x:1", version=1, recent=[StepReport(step=1, loss=loss)])

    folder, everyone = history.Folder(), [rec(0, 1.0)]
    never, always = (lambda what: False), (lambda what: what == "aggregate")
    h, added = folder.fold([], everyone, lambda s: rnd, 1, everyone, never)
    assert added and h[-1]["loss"] == 1.0 and not folder.dirty  # a new entry: its totals at once
    clock[0] += 0.2
    h, _ = folder.fold(h, [rec(1, 3.0)], lambda s: rnd, 1, everyone, never)
    assert h[-1]["loss"] == 1.0 and folder.dirty == {1}  # a report 0.2 s later: its totals wait
    clock[0] += 0.9
    h, _ = folder.fold(h, [rec(2, 5.0)], lambda s: rnd, 1, everyone, always)
    assert h[-1]["loss"] == 1.0  # due, but a long tick: still waiting
    h, _ = folder.fold(h, [rec(3, 7.0)], lambda s: rnd, 1, everyone, never)
    assert h[-1]["loss"] == 4.0 and not folder.dirty  # the next tick: made from all four
    clock[0] += 0.1
    h, _ = folder.fold(h, [rec(3, 11.0)], lambda s: rnd, 1, everyone, never)
    assert h[-1]["loss"] == 4.0  # a changed report 0.1 s after: waits ...
    clock[0] += 0.1
    h, _ = folder.fold(h, [rec(2, 9.0)], lambda s: rnd, 1, everyone, never)
    assert h[-1]["loss"] == 4.0 and folder.dirty == {1}  # ... while reports of the step keep coming ...
    h, _ = folder.fold(h, [], lambda s: rnd, 1, everyone, never)
    assert h[-1]["loss"] == 6.0 and not folder.dirty  # ... until a tick brings none


def test_an_entry_leaving_the_detail_window_gets_its_waiting_totals_first() -> None:
    """Only the newest ``KEEP_DETAIL`` entries keep their members' reports: one whose totals still wait for a
    report that came late has them made before the reports go."""
    ids = [f"12D3KooW{c * 44}" for c in "ab"]
    rounds = {s: Round(step=s, members=[Member(peer_id=p, address="x:1", replica=i) for i, p in enumerate(ids)])
              for s in range(1, history.KEEP_DETAIL + 3)}

    def rec(i: int, step: int, loss: float) -> PeerRecord:
        return PeerRecord(peer_id=ids[i], address="x:1", version=step, recent=[StepReport(step=step, loss=loss)])

    folder, h, first = history.Folder(), [], [rec(0, 1, 1.0)]
    h, _ = folder.fold(h, first, rounds.get, 1, first)
    h, _ = folder.fold(h, [rec(1, 1, 3.0)], rounds.get, 1, first)  # a late report of step 1: its totals wait
    assert h[0]["loss"] == 1.0 and folder.dirty == {1}
    h, _ = folder.fold(h, [], rounds.get, history.KEEP_DETAIL + 2, [])  # step 1 leaves the window
    assert "_peers" not in h[0] and h[0]["loss"] == 2.0 and not folder.dirty


def test_a_report_of_a_step_not_committed_yet_is_made_into_its_row_as_it_comes() -> None:
    """A commit's fold took every member's report of the step in one tick (10-50 ms at 1,000 members): a report
    of one of the next steps is made into its entry row when it comes, and the commit takes that row as it is,
    unless the report or the round changed since."""
    ids = [f"12D3KooW{c * 44}" for c in "ab"]
    rnd = Round(step=1, members=[Member(peer_id=p, address="x:1", replica=i) for i, p in enumerate(ids)])

    def rec(i: int, step: int, loss: float) -> PeerRecord:
        return PeerRecord(peer_id=ids[i], address="x:1", version=step, parameters=7,
                          recent=[StepReport(step=s, loss=loss) for s in range(1, step + 1)])

    folder, h = history.Folder(), []
    first = [rec(0, 1, 1.0), rec(1, 1, 1.0)]
    h, _ = folder.fold(h, first, lambda s: rnd, 1, first)
    now = [rec(0, 2, 2.0), rec(1, 2, 3.0)]
    h, added = folder.fold(h, now, lambda s: rnd, 1, now)  # step 2 reported, not committed yet
    assert not added and set(folder.early) == {(ids[0], 2), (ids[1], 2)}
    made = folder.early[(ids[0], 2)][3]
    assert made["loss"] == 2.0 and made["n"] == 2 and made["parameters"] == 7
    changed = [rec(1, 2, 5.0)]
    h, _ = folder.fold(h, changed, lambda s: rnd, 1, [now[0], changed[0]])  # a changed report: made again
    assert folder.early[(ids[1], 2)][3]["loss"] == 5.0
    h, added = folder.fold(h, [], lambda s: rnd, 2, [now[0], changed[0]])  # committed: the rows taken as made
    assert added and h[-1]["_peers"][ids[0]] is made and h[-1]["loss"] == 3.5 and not folder.early


def test_a_report_that_changed_where_no_total_looks_leaves_its_entrys_totals_alone() -> None:
    """A peer's older reports drop their ``included`` lists when it trains the next step (its record must stay
    small): at 1,000 members each such change made the step's totals again, once a second for a heartbeat's lag.
    Such a report leaves its entry clean; one whose loss changed does not."""
    ids = [f"12D3KooW{c * 44}" for c in "ab"]
    rnd = Round(step=1, members=[Member(peer_id=p, address="x:1", replica=i) for i, p in enumerate(ids)])

    def rec(i: int, loss: float, included: list[int]) -> PeerRecord:
        return PeerRecord(peer_id=ids[i], address="x:1", version=1,
                          recent=[StepReport(step=1, loss=loss, included=included, flags={ids[0]: [ids[1]]})])

    folder, everyone = history.Folder(), [rec(0, 1.0, [0, 1]), rec(1, 3.0, [0, 1])]
    h, _ = folder.fold([], everyone, lambda s: rnd, 1, everyone)
    row = h[-1]["_peers"][ids[0]]
    assert h[-1]["loss"] == 2.0 and not folder.dirty and "included" not in row and "flags" not in row
    h, _ = folder.fold(h, [rec(0, 1.0, [])], lambda s: rnd, 1, everyone)
    assert not folder.dirty and h[-1]["_peers"][ids[0]] is row, "the same row: nothing to make again"
    h, _ = folder.fold(h, [rec(0, 5.0, [])], lambda s: rnd, 1, everyone, lambda what: what == "aggregate")
    assert folder.dirty == {1} and h[-1]["_peers"][ids[0]]["loss"] == 5.0
