"""The run's sample order and the coordinator's data cursor: no sample repeats or goes missing in an epoch.

The order is a keyed Feistel permutation per epoch (golden tests against its scalar reference and
against being a bijection). The cursor is driven through the real round lifecycle (``Rounds`` and a
``PeerTable``, as the coordinator's tick drives them) for 200 rounds of random joins, leaves, deaths
in the middle of a round, stalled replicas, re-plans, peers running ahead while the coordinator is
away, failed rounds with rollbacks and a coordinator restart from its journal; the samples the run's
final model was trained on are then counted position by position.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pytest

from potluck.coordinator.placement.placement import members, sticky_placement
from potluck.coordinator.rounds.cursor import Cursor, DataCursor, merge
from potluck.coordinator.rounds.roundevents import Checkpoint, Failed
from potluck.coordinator.rounds.rounds import Rounds
from potluck.coordinator.store.journal import JournalState
from potluck.coordinator.swarm.membership import PeerTable
from potluck.data import DataError
from potluck.data.order import permute, permute_one, sample_ids
from potluck.peer.training.data import SpanSampler
from potluck.protos.wire.records import MAX_POSITION, MAX_SHARE, Member, PeerRecord, Round, Share, StepReport

# ---------------------------------------------------------------------- the order


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 100, 1000, 4097, 65536, 100_003])
def test_each_epoch_is_a_permutation_equal_to_the_scalar_reference(n: int) -> None:
    for epoch in (0, 1, 7):
        p = permute(np.arange(n), n, seed=42, epoch=epoch)
        assert np.array_equal(np.sort(p), np.arange(n))
        for i in sorted({0, n // 3, n // 2, n - 1}):
            assert p[i] == permute_one(i, n, 42, epoch)


def test_epochs_and_seeds_give_other_orders_and_positions_cross_epochs() -> None:
    n = 1000
    a, b, c = (permute(np.arange(n), n, s, e) for s, e in ((0, 0), (0, 1), (1, 0)))
    assert (a != b).mean() > 0.9 and (a != c).mean() > 0.9
    ids = sample_ids([(n - 3, n + 3)], n, seed=0)
    assert list(ids[:3]) == list(a[-3:]) and list(ids[3:]) == list(b[:3])
    assert sorted(sample_ids([(0, 400), (400, n)], n, 0)) == list(range(n))
    with pytest.raises(DataError):
        permute(np.array([n]), n, 0, 0)


def test_a_span_sampler_reads_its_spans_in_batches() -> None:
    s = SpanSampler([(10, 14), (30, 34)], 1000, seed=3, count=8)
    got = s.next_ids(4) + s.next_ids(4)
    assert got == list(sample_ids([(10, 14), (30, 34)], 1000, 3))
    with pytest.raises(DataError, match="used up"):
        s.next_ids(1)
    with pytest.raises(DataError, match="needs 8"):
        SpanSampler([(0, 4)], 1000, 3, count=8)


# ---------------------------------------------------------------------- the cursor's arithmetic


def test_take_serves_the_pool_first_then_the_frontier() -> None:
    c = Cursor(100, ((10, 13), (50, 52)))
    spans, nxt = c.take([4, 4])
    assert spans == [[(10, 13), (50, 51)], [(51, 52), (100, 103)]] and nxt == 103
    after = c.without([s for mine in spans for s in mine])
    assert after == Cursor(103, ())
    assert after.with_back(spans[1]) == Cursor(103, ((51, 52), (100, 103)))
    assert c.free((10, 13)) and c.free((100, 200)) and not c.free((9, 11)) and not c.free((52, 53))
    assert merge([(5, 7), (1, 3), (3, 4), (6, 9), (9, 9)]) == [(1, 4), (5, 9)]
    crumbs = Cursor(10_000, tuple((2 * i, 2 * i + 1) for i in range(1000)))  # a pool in 1,000 pieces
    spans, nxt = crumbs.take([100, 100])
    assert all(len(mine) <= 32 for mine in spans) and sum(b - a for mine in spans for a, b in mine) == 200
    assert [Share(replica=i, count=100, spans=mine) for i, mine in enumerate(spans)] and nxt > 10_000
    assert Cursor.from_json(json.loads(json.dumps(c.to_json()))) == c
    data = DataCursor(4, at={0: Cursor(), 5: Cursor(40), 6: Cursor(48, ((0, 4),))})
    data.roll_back(5, None)
    assert data.at == {0: Cursor(), 5: Cursor(40)}  # the kept cursor of the version gone back to
    data.roll_back(3, Cursor(24))
    assert data.at == {0: Cursor(), 3: Cursor(24)}  # not kept: the checkpoint's
    data.roll_back(0, None)
    assert data.at == {0: Cursor()}  # theta_0: nothing trained yet


def test_a_vote_counts_only_from_the_rounds_stage_0_and_only_for_the_coming_steps() -> None:
    """A stage-1 member cannot say which replicas' samples a version holds, a vote for a step far ahead
    is not kept, and a version far ahead folds in bounded time."""
    from potluck.coordinator.rounds.roundevents import Report
    from potluck.coordinator.rounds.rounds import KEEP_ROUNDS
    from potluck.protos.wire.records import Member

    r = Rounds(stages=2, data=DataCursor(4))
    rnd = r.decide([Member(peer_id=p, address="a:1", stage=s, replica=0) for p, s in (("a", 0), ("b", 1))], 0.0)
    assert rnd.shares[0].spans == [(0, 4)]
    liar = Report("b", 1, 0, "", included=((1, 0, ()),))  # stage 1 says replica 0 is not in v1
    far = Report("a", 0, 0, "", included=((1 + KEEP_ROUNDS + 1, 0, ()), (1, 0, (0, 7))))
    r.observe([liar, far], 1.0)
    assert r.data._votes == {(1, 0): {"a": ((0, 0),)}}  # replica 7 is not in the round either (0: its whole share)
    r.data.commit(0, 10**9, r.round_at)  # a member claiming version 10**9: the fold stays bounded
    assert max(r.data.at) == 10**9 and len(r.data.at) <= 70


def test_shares_are_validated_and_later_steps_read_on_from_data_next() -> None:
    rnd = Round(step=5, members=[], data_next=40, shares=[Share(replica=0, count=4, spans=[(0, 2), (20, 22)]),
                                                          Share(replica=1, count=4, spans=[(36, 40)])])
    assert rnd.data_spans(5, 1) == [(36, 40)] and rnd.data_spans(6, 0) == [(40, 44)]
    assert rnd.data_spans(7, 1) == [(52, 56)] and rnd.data_spans(4, 0) == [] and rnd.data_spans(5, 9) == []
    with pytest.raises(ValueError, match="not count"):
        Share(replica=0, count=5, spans=[(0, 4)])
    with pytest.raises(ValueError, match="start"):
        Share(replica=0, count=0, spans=[(4, 0)])
    with pytest.raises(ValueError, match="stop <="):
        Share(replica=0, count=2**70, spans=[(0, 2**70)])
    with pytest.raises(DataError, match="needs 8"):  # refused before any id is made
        SpanSampler([(0, 4)], 10**12, 0, count=8)
    later = Round(step=1, members=[], data_next=100, pool=[(10, 13), (50, 52)],
                  shares=[Share(replica=0, count=4, spans=[(0, 4)]), Share(replica=1, count=4, spans=[(4, 8)])])
    assert later.data_spans(2, 0) == [(10, 13), (50, 51)] and later.data_spans(2, 1) == [(51, 52), (100, 103)]
    assert later.data_spans(3, 0) == [(103, 107)]
    with pytest.raises(ValueError, match="pool"):
        Round(step=1, members=[], data_next=10, pool=[(5, 20)])


# ---------------------------------------------------------------------- 200 rounds of a hostile swarm

N = 211  # training samples: an epoch is 211 positions
COUNT = 6  # samples a replica trains per outer step at most (inner_steps x batch_size)
BATCH = 2
TIMEOUT = 5.0


@dataclass
class Sim:
    """Peers that train what the coordinator's rounds tell them, and a model whose samples are counted."""

    rng: random.Random
    stages: int
    windows: bool = False  # peers of different speeds: each trains the first batches of its share that fit the window
    rounds: Rounds = field(init=False)
    table: PeerTable = field(init=False)
    now: float = 0.0
    seq: int = 0
    alive: dict[str, dict] = field(default_factory=dict)  # peer -> {version, hash, epoch, prev, stage, recent}
    trained: dict[str, Counter] = field(default_factory=lambda: {"root": Counter()})  # state hash -> positions
    checkpoint: Checkpoint | None = None
    ckpt_trained: dict[int, str] = field(default_factory=dict)
    next_id: int = 0
    stats: Counter = field(default_factory=Counter)
    plan_held: Round | None = None

    def __post_init__(self) -> None:
        self.rounds = self.fresh_rounds()
        self.table = PeerTable(TIMEOUT)

    def fresh_rounds(self) -> Rounds:
        return Rounds(stages=self.stages, floor_s=12.0, factor=4.0, settle_s=1.0, grace_s=TIMEOUT,
                      data=DataCursor(COUNT), batch=BATCH, inner_steps=COUNT // BATCH)

    # -------------------------------------------------------------- peers

    def join(self) -> None:
        pid = f"p{self.next_id:03d}"
        self.next_id += 1
        self.alive[pid] = {"version": 0, "hash": "root", "epoch": 0, "prev": (-1, ""), "stage": 0, "recent": [],
                           "step_s": self.rng.choice([1.0, 2.0, 3.0]) if self.windows else 0.0}

    def record(self, pid: str) -> PeerRecord:
        p = self.alive[pid]
        self.seq += 1
        return PeerRecord(peer_id=pid, address=f"{pid}:1", state="training", version=p["version"], state_hash=p["hash"],
                          epoch=p["epoch"], prev_version=p["prev"][0], prev_hash=p["prev"][1], stage=p["stage"],
                          seq=self.seq, inner_step=self.seq, recent=p["recent"][-16:], step_s=p["step_s"])

    def tick(self, dt: float = 1.0) -> list:
        self.now += dt
        self.table.update({pid: self.record(pid) for pid in self.alive}, self.now)
        events = self.rounds.observe(self.table.reports(), self.now, self.checkpoint)
        self.stats.update(type(e).__name__ for e in events)
        return events

    # -------------------------------------------------------------- the coordinator's side

    def restart_coordinator(self) -> None:
        """The coordinator process dies and comes back from its journal (serialised as it is on disk)."""
        r = self.rounds
        state = JournalState(run_id="r", config={}, created_at=0.0, committed=r.committed, epoch=r.epoch,
                             rounds=list(r.rounds.values()), hashes=r.hashes, cursors=r.data.to_json(),
                             outcomes=[vars(o) for o in r.outcomes])
        state = JournalState.model_validate_json(state.model_dump_json())
        self.rounds, self.table = self.fresh_rounds(), PeerTable(TIMEOUT)
        self.rounds.restore(state.committed, state.epoch, state.rounds, state.hashes, state.outcomes, self.now,
                            state.cursors)
        self.stats["restart"] += 1

    def decide(self) -> Round | None:
        for _ in range(40):
            live = self.table.live()
            if self.rounds.ready_to_decide(len(live), 1, self.now, self.table.reports()):
                ids = sorted(v.record.peer_id for v in live)
                replicas = len(ids) // self.stages
                if replicas == 0:
                    return None
                prev = self.rounds.rounds.get(self.rounds.committed)
                before = {m.peer_id: (m.stage, m.replica) for m in prev.members} if prev else {}
                grid = sticky_placement(ids, self.stages, replicas, before)
                self.plan_held = self.rounds.round_at(self.rounds.committed)  # what peers hold while it is decided
                return self.rounds.decide(members(grid, [v.record for v in live]), self.now, reports=self.table.reports())
            self.tick()
        return None

    # -------------------------------------------------------------- a round as the peers live it

    def base_of(self, version: int) -> str:
        if version == 0:
            return "root"
        want = self.rounds.canonical(version)
        assert want in self.trained, f"no state {want!r} of v{version}"
        return want

    def run(self, rnd: Round, extra_steps: int = 0) -> None:
        """Members recover the round's base, train, die at random; survivors commit what their stages averaged."""
        base = self.base_of(rnd.step - 1)
        for m in rnd.members:  # recovery: every member starts from the canonical state of step - 1
            if m.peer_id in self.alive:
                p = self.alive[m.peer_id]
                if (p["version"], p["hash"]) != (rnd.step - 1, base):
                    p.update(version=rnd.step - 1, hash=base, epoch=rnd.epoch, prev=(-1, ""))
                p["stage"] = m.stage
        if extra_steps == 0 and self.rng.random() < 0.04:  # every member of the round dies in the middle of it
            for m in rnd.members:
                self.alive.pop(m.peer_id, None)
            self.stats["wipe"] += 1
        for step in range(rnd.step, rnd.step + 1 + extra_steps):
            for m in rnd.members:  # deaths in the middle of the step
                if m.peer_id in self.alive and self.rng.random() < (0.07 if extra_steps == 0 else 0.0):
                    del self.alive[m.peer_id]
                    self.stats["death"] += 1
            complete = sorted(k for k in {m.replica for m in rnd.members}
                              if all(c.peer_id in self.alive for c in rnd.members if c.replica == k))
            stalled = self.rng.random() < 0.05 and len(complete) > 1  # a replica's pipeline stalls: no contribution
            if stalled:
                complete.pop(self.rng.randrange(len(complete)))
                self.stats["stall"] += 1
            if not complete:
                return  # every stage's all-reduce has nothing to average: the round fails
            before = self.trained[base]
            after = before.copy()
            held = self.plan_held
            worked = []
            for k in complete:
                spans = rnd.data_spans(step, k)
                if self.windows:  # the first batches of its share that fit the round's window, in order
                    first_member = next(m for m in rnd.members if m.replica == k and m.stage == 0)
                    fits = BATCH * max(1, min(COUNT // BATCH, round(COUNT // BATCH / self.alive[first_member.peer_id]["step_s"]
                                                                    if first_member.peer_id in self.alive else 1)))
                    fits = min(fits, sum(b - a for a, b in spans))
                    if self.rng.random() < 0.2:  # it ran short: fewer batches than its share holds
                        fits = BATCH * self.rng.randint(1, max(1, fits // BATCH))
                    worked.append(fits)
                    self.stats["partial"] += fits < sum(b - a for a, b in spans)
                    spans = [(a, b) for a, b in spans]
                    left, read = fits, []
                    for a, b in spans:
                        take = min(left, b - a)
                        if take > 0:
                            read.append((a, a + take))
                        left -= take
                    spans_trained = read
                else:
                    spans_trained = spans
                first = next(m for m in rnd.members if m.replica == k and m.stage == 0)
                old = held.member(first.peer_id) if held is not None and held.epoch == rnd.epoch else None
                if step == rnd.step and old is not None and old.stage == 0:
                    # one stage: this member started the step at once, on the plan it held, and read the same
                    early = held.data_spans(step, old.replica)
                    assert early == spans, f"step {step}: {first.peer_id} would read {early} early, {spans} on time"
                    self.stats["read ahead"] += 1
                for a, b in spans_trained:
                    after.update(range(a, b))
            new = hashlib.sha256(json.dumps(sorted(after.items())).encode()).hexdigest()[:16]
            self.trained[new] = after
            for m in rnd.members:
                if m.peer_id in self.alive:
                    p = self.alive[m.peer_id]
                    p.update(version=step, hash=new, epoch=rnd.epoch, prev=(step - 1, base))
                    p["recent"] = [*p["recent"], StepReport(step=step, epoch=rnd.epoch, stage=m.stage,
                                                            replica=m.replica, included=complete, samples=worked)]
            base = new
            if self.windows and self.rng.random() < 0.1:  # a device slows down or speeds up
                pid = self.rng.choice(sorted(self.alive))
                self.alive[pid]["step_s"] = self.rng.choice([1.0, 2.0, 3.0])
                self.stats["speed change"] += 1

    def settle(self) -> None:
        """Ticks until the round in flight committed or failed (and rolled back)."""
        for _ in range(60):
            if self.rounds.pending() is None:
                return
            events = self.tick()
            if any(isinstance(e, Failed) for e in events):
                self.stats["failed round"] += 1
                return

    def write_checkpoint(self) -> None:
        v = self.rounds.committed
        if v and self.rounds.data.cursor(v) is not None:
            self.checkpoint = Checkpoint(v, {s: self.rounds.canonical(v, s) for s in range(self.stages)},
                                         self.rounds.data.cursor(v))


@pytest.mark.parametrize("stages,seed,windows", [(1, 0, False), (2, 1, False), (1, 2, False), (1, 3, True),
                                                 (2, 4, True)])
def test_200_rounds_of_churn_never_repeat_or_skip_a_sample(stages: int, seed: int, windows: bool) -> None:
    """With ``windows``, peers of three speeds (changing at random) each train the first batches of their share that
    fit the round's window, some fewer, and are handed shares by their speed: what they leave goes back."""
    sim = Sim(random.Random(seed), stages, windows)
    for _ in range(4 * stages):
        sim.join()
    sim.tick()
    decided = 0
    while decided < 200:
        r = sim.rng.random()
        if r < 0.25 or len(sim.alive) < 2 * stages:
            sim.join()
            sim.stats["join"] += 1
        elif r < 0.35 and len(sim.alive) > stages:
            del sim.alive[sim.rng.choice(sorted(sim.alive))]  # leaves between rounds
            sim.stats["leave"] += 1
        if decided == 120:
            sim.restart_coordinator()
        if sim.rng.random() < 0.1:
            sim.write_checkpoint()
        sim.tick()
        rnd = sim.decide()
        if rnd is None:
            continue
        decided += 1
        sim.stats["sized"] += any(s.next for s in rnd.shares)
        away = 2 if sim.rng.random() < 0.05 else 0  # the coordinator is away: peers go on with the same plan
        sim.run(rnd, extra_steps=away)
        sim.stats["ran ahead"] += away
        sim.settle()

    for _ in range(30):  # let the last round end
        if sim.rounds.pending() is None:
            break
        sim.tick()
    r = sim.rounds
    final = sim.trained[sim.base_of(r.committed)]
    cursor = r.data.cursor(r.committed)
    assert cursor is not None
    repeats = {p: n for p, n in final.items() if n > 1}
    pool = {p for a, b in cursor.pool for p in range(a, b)}
    skipped = [p for p in range(cursor.frontier) if final[p] == 0 and p not in pool]
    assert not repeats, f"{len(repeats)} positions trained more than once"
    assert not skipped, f"{len(skipped)} positions neither trained nor back in the pool: {skipped[:10]}"
    assert not pool & set(final), "a position in the pool was already trained"
    assert r.data.repeats == 0
    assert len(pool) <= 3 * COUNT * len(sim.alive) + COUNT * 8, "handed-back samples are not re-issued promptly"
    epochs = cursor.frontier / N
    # the churn really happened, and the run got somewhere
    assert sim.stats["death"] > 10 and sim.stats["failed round"] >= 2 and sim.stats["restart"] == 1, sim.stats
    assert sim.stats["RolledBack"] >= 1, sim.stats
    assert sim.stats["ran ahead"] > 0 and r.committed > 100 and epochs > 2, (sim.stats, r.committed, epochs)
    assert sim.stats["read ahead"] > 100, sim.stats
    if windows:  # shares sized by speed, and partial phases, really happened
        assert sim.stats["speed change"] > 5 and sim.stats["partial"] > 100 and sim.stats["sized"] > 50, sim.stats
    per_epoch = Counter(sample_ids([(p, p + 1) for p in sorted(final)], N, 0).tolist())
    assert max(per_epoch.values()) <= epochs + 1  # a sample id at most once per epoch


def test_free_looks_only_at_the_pool_spans_that_can_overlap_and_says_what_a_pass_over_all_says() -> None:
    """A commit at 1,000 replicas asks ``free`` of every share; over a sorted pool it looks at the spans near the
    one asked about (a pass over the whole pool per share was 0.1 s of one tick). Against the pass over all
    (numpy), on random pools, spans and frontiers; an unsorted pool (made by hand) is still answered right."""
    rng = np.random.default_rng(3)

    def by_numpy(c: Cursor, a: int, b: int) -> bool:
        if a >= c.frontier:
            return True
        free = np.zeros(c.frontier + 1, dtype=bool)
        for x, y in c.pool:
            free[x:y] = True
        return b >= a and bool(free[a:min(b, c.frontier)].all())

    for _ in range(300):
        frontier = int(rng.integers(30, 400))
        cuts = np.sort(rng.choice(np.arange(frontier + 1), size=2 * int(rng.integers(0, 12)), replace=False))
        pool = tuple((int(x), int(y)) for x, y in cuts.reshape(-1, 2) if x < y)
        for c in (Cursor(frontier, pool), Cursor(frontier, pool[::-1])):
            for _ in range(20):
                a = int(rng.integers(0, frontier + 20))
                b = a + int(rng.integers(-2, 60))
                assert c.free((a, b)) == by_numpy(c, a, b), (c, a, b)


@pytest.mark.parametrize("replica,count,spans", [
    (0, 5, [(0, 3), (10, 12)]), (3, 0, []),  # good
    (0, 4, [(0, 3)]), (0, 3, [(3, 0)]), (-1, 3, [(0, 3)]), (0, 65, [(2 * i, 2 * i + 1) for i in range(65)]),
    (0, 256, [(2 * i, 2 * i + 1) for i in range(256)]),  # (4x MAX_SHARE_SPANS)
    (0, 1, [(MAX_POSITION, MAX_POSITION + 1)]), (0, MAX_SHARE + 1, [(0, MAX_SHARE + 1)]),
])
def test_a_share_the_cursor_makes_is_held_to_the_rules_of_a_share_read_from_a_plan(replica, count, spans) -> None:  # type: ignore[no-untyped-def]
    """Share.made skips pydantic's validation (5 ms a decision at 1,000 replicas), not its rules: what Share refuses,
    made refuses; what Share takes, made makes the same."""
    try:
        want = Share(replica=replica, count=count, spans=spans)
    except ValueError:
        with pytest.raises(ValueError):
            Share.made(replica, count, spans)
        return
    got = Share.made(replica, count, spans)
    assert got == want and got.model_dump(mode="json") == want.model_dump(mode="json")


def test_a_cursor_less_spans_and_a_plans_later_reads_match_a_position_by_position_reference() -> None:
    """``Cursor.without`` (one pass over pool and spans) and ``Round.data_spans`` past the round's step (a bisect
    into the plan's reads) against sets of positions, on random fragmented pools."""
    rng = random.Random(7)

    def spans_of(n: int, hi: int) -> list[tuple[int, int]]:
        return [(a, a + rng.randint(0, 6)) for a in (rng.randrange(hi) for _ in range(n))]

    def positions(spans: Iterable[tuple[int, int]]) -> set[int]:
        return {p for a, b in spans for p in range(a, b)}

    for _ in range(300):
        frontier = rng.randint(0, 120)
        cur = Cursor(frontier, tuple(merge(s for s in spans_of(rng.randint(0, 12), 120) if s[1] <= frontier)))
        cuts = spans_of(rng.randint(0, 10), 140)
        got = cur.without(cuts)
        end = max([frontier, *(b for a, b in cuts if b > a)])
        free = (positions(cur.pool) | positions([(frontier, end)])) - positions(cuts)
        assert got.frontier == end and positions(got.pool) == {p for p in free if p < end}, (cur, cuts, got)
        assert list(got.pool) == merge(got.pool)
    for _ in range(200):
        pool = merge(spans_of(rng.randint(0, 8), 60))
        counts = [rng.randint(0, 9) for _ in range(rng.randint(1, 6))]
        shares, at = [], 0
        for r, c in enumerate(counts):
            shares.append(Share(replica=r, count=c, spans=[(1000 + at, 1000 + at + c)]))
            at += c
        data_next = max([60, *(b for _, b in pool)])
        rnd = Round(step=4, members=[], shares=shares, pool=pool, data_next=data_next)
        reads = [p for a, b in pool for p in range(a, b)] + list(range(data_next, data_next + 200))
        for step in (5, 6, 7):
            for r, c in enumerate(counts):
                start = (step - 5) * sum(counts) + sum(counts[:r])
                assert [p for a, b in rnd.data_spans(step, r) for p in range(a, b)] == reads[start:start + c]


def test_votes_counted_once_per_say_match_a_count_voter_by_voter() -> None:
    """The same say (most voters of a step list the same replicas) is kept as one object and counted once, with its
    number of voters; what a step holds is what counting each voter's say one by one finds, per averaging group."""
    rng = random.Random(11)
    n = 60
    rnd = Round.model_construct(  # (three averaging groups; their base states play no part here)
        step=3, members=[Member(peer_id=f"p{i}", address="x:1", replica=i, group=i % 3) for i in range(n)],
        shares=[Share(replica=i, count=1, spans=[(i, i + 1)]) for i in range(n)])
    data = DataCursor(1)
    says = [tuple(range(n)), tuple(r for r in range(n) if r % 7), tuple(r for r in range(n) if r % 2)]
    voted = {}
    for i in range(n):
        say = list(rng.choice(says)) if rng.random() < 0.8 else rng.sample(range(n), rng.randrange(n))
        data.vote(3, 0, f"p{i}", say)
        voted[f"p{i}"] = set(say)
    distinct = {tuple(sorted(v)) for v in voted.values()}
    assert len({id(v) for v in data._votes[(3, 0)].values()}) == len(distinct) < n // 2  # (the same say: one object)
    group_of = {f"p{i}": i % 3 for i in range(n)}
    expect = {r for r in range(n) if 2 * sum(r in voted[p] for p in voted if group_of[p] == r % 3)
              >= sum(1 for p in voted if group_of[p] == r % 3)}
    assert data.included(rnd, 3, lambda v: rnd if v == 3 else None) == expect
    for _ in range(4 * (2 * n + 16)):  # a voter changing its say at every heartbeat, 4x the bound: a bounded few
        data.vote(3, 0, "p0", rng.sample(range(n), 5))
    assert len(data._says[(3, 0)]) <= 2 * n + 16
