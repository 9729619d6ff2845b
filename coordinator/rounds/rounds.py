"""The round lifecycle: one explicit, pure state machine over the run's outer steps.

A *round* is the coordinator's decision of who runs outer step ``v`` on which tasklet, and from which
state (``base_hashes``: per stage, the hash of version ``v - 1``). Each round ends exactly once::

    decided --(every stage has a member at v)----------------------> committed
       |
       +--(a stage lost all its members, or the round went silent)--> failed --> rolled back

* **committed**: for every stage, some member of the round reports version ``v`` (or later: peers
  go on without the coordinator, on the last plan, while it is away) made in the round's epoch.
* **failed**: some stage has no live member left (after a start-up grace, so a restarted
  coordinator gives the peers of a journaled round time to show up), or no member made visible
  progress for ``floor_s`` (the round is *silent*), or, once step durations have been measured,
  the round is older than ``factor`` times their median (and at least ``floor_s``). Deadlines come
  from measured step times with a configurable floor (a fixed timeout cannot fit every network: one
  long enough for a slow home link leaves a fast cluster idle after a failure), never from a constant.
* **rolled back**: the run goes on from the newest version that every stage can still be had at:
  held by a live peer (its current state or the one before it, both served) or in the newest
  checkpoint; version 0 (theta_0, which every peer builds from the run's seed) always can. The
  *epoch* grows by one, so a member still holding a version of the failed epoch knows it must roll
  back, and its stragglers' messages are refused. (Whether a round failed, the round a retraction fails and
  where the run goes back to are decided, as values, by :mod:`potluck.coordinator.rounds.rollback`'s pure
  functions; :class:`Rounds` owns the state and applies the :class:`~potluck.coordinator.rounds.rollback.Rollback`
  they return to it, in ``_roll_back``.)

Nothing here does I/O or reads a clock of its own: the coordinator feeds it peer reports and the
time (``now``, monotonic seconds), and acts on the events it returns. That is what makes the
lifecycle testable step by step (``tests/test_rounds.py``), like a torchft ``Manager`` quorum.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from potluck.coordinator.rounds import groups, rollback
from potluck.coordinator.rounds.cursor import DataCursor
from potluck.coordinator.rounds.rollback import REGATHER, Rollback
from potluck.coordinator.rounds.roundevents import (
    Checkpoint,
    Committed,
    Event,
    Report,
    RoundOutcome,
)
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.wire.records import Audit, Member, Round

KEEP_ROUNDS = 16  # decided rounds kept (and failed rounds' outcomes)
KEEP_DURATIONS = 8
HEADROOM = 2.0  # a share holds this much more than its member's measured speed fits in the window (it may speed up,
# and a shared device's step times vary: a share too small for the window leaves the member idle; too big, to the pool)
GATHERED = 0.8  # a fresh start's pings start once this share of the peers it waits for is live (see settling)


@dataclass
class Rounds:
    """Committed step, decided rounds, canonical hashes and the epoch of a run."""

    stages: int
    floor_s: float = 60.0
    factor: float = 4.0
    settle_s: float = 1.0
    grace_s: float = 8.0
    group_size: int = 0  # sync.group_size: > 0 averages each stage in groups (members then hold several hashes)
    committed: int = 0
    epoch: int = 0
    rounds: dict[int, Round] = field(default_factory=dict)
    hashes: dict[int, dict[int, str]] = field(default_factory=dict)  # stage -> version -> hash
    outcomes: list[RoundOutcome] = field(default_factory=list)
    _started: dict[int, float] = field(default_factory=dict)  # step -> when decided (or restored)
    _restored: set[tuple[int, int]] = field(default_factory=set)  # (step, epoch) of journaled rounds, not decided here
    _committed_at: float | None = None
    _durations: deque = field(default_factory=lambda: deque(maxlen=KEEP_DURATIONS))
    _progress: dict[str, tuple[tuple, float]] = field(default_factory=dict)  # peer -> (signature, since)
    _fresh_start: bool = True  # no round is running after a failure (or ever): wait for min_peers
    _failed_at: float | None = None  # when the last round failed (the wait for min_peers after it is bounded)
    _regather: frozenset[str] = frozenset()  # the members of the round that failed last (the wait is for them)
    _short_since: float | None = None  # when a fresh start's pings first reached fewer than min_peers
    _voted: dict[str, tuple[Report, tuple]] = field(default_factory=dict)  # peer -> the report it last voted with
    _voted_in: tuple = ()  # the context of the last votes cast (see _learn_included)
    _shapes: dict[str, tuple] = field(default_factory=dict)  # peer -> what its hash and version were last (see _moved)
    _folded: tuple = ()  # the context the hashes and the step reached were last made in (see _context)
    _hashes_set: int = 0  # how often the hashes were set from outside the reports (restored, adopted, pruned)
    wall: Callable[[], float] = time.time  # wall-clock stamps for the journal (every decision uses ``now``)
    data: DataCursor = field(default_factory=lambda: DataCursor(per_replica=1))  # who trains on which samples
    batch: int = 1  # train.batch_size: a share holds whole batches
    inner_steps: int = 1  # H: the fastest member's inner steps make the window
    windows: bool = True  # diloco.rounds = "window": shares are sized by each member's measured speed

    @classmethod
    def for_run(cls, cfg: RunConfig) -> Rounds:
        m = cfg.membership
        return cls(stages=cfg.pipeline.stages, floor_s=m.round_timeout_floor_s, factor=m.round_timeout_factor,
                   grace_s=m.heartbeat_timeout_s, group_size=cfg.sync.group_size,
                   data=DataCursor(cfg.diloco.inner_steps * cfg.train.batch_size), batch=cfg.train.batch_size,
                   inner_steps=cfg.diloco.inner_steps, windows=cfg.diloco.rounds == "window")

    # ------------------------------------------------------------------ views

    @property
    def latest(self) -> Round | None:
        return self.rounds[max(self.rounds)] if self.rounds else None

    def pending(self) -> Round | None:
        """The decided round that has not ended: the one for ``committed + 1``."""
        latest = self.latest
        return latest if latest is not None and latest.step > self.committed else None

    def canonical(self, version: int, stage: int = 0) -> str:
        """The hash of ``version`` of ``stage`` every member must hold ('' if unknown: version 0, say). With
        grouped averaging each group holds its own: this is the one most members hold (checkpoints take it)."""
        return self.hashes.get(stage, {}).get(version, "")

    def round_at(self, step: int) -> Round | None:
        """The round that applied to ``step``: the latest decided at or before it (peers use the last plan)."""
        exact = self.rounds.get(step)  # (the usual case, asked thousands of times a tick at 1,000 peers)
        if exact is not None:
            return exact
        best = max((s for s in self.rounds if s <= step), default=None)
        return self.rounds[best] if best is not None else None

    def deadline_s(self) -> float | None:
        """Seconds a round may take before it fails, once step durations have been measured."""
        if not self._durations:
            return None
        return max(self.floor_s, self.factor * statistics.median(self._durations))

    # ------------------------------------------------------------------ inputs

    def restore(self, committed: int, epoch: int, rounds: Iterable[Round], hashes: dict[int, dict[int, str]],
                outcomes: Iterable[dict], now: float, cursors: dict | None = None) -> None:
        """Resume from a journal. A journaled pending round gets ``REGATHER`` times ``grace_s`` for its members to show
        up and a fresh deadline, from now or :meth:`resumed` (their DHT nodes must find the coordinator's new one)."""
        self.committed, self.epoch = committed, epoch
        self.data.restore(cursors, committed)
        self.rounds = {r.step: r for r in rounds}
        self.hashes, self._hashes_set = {s: dict(v) for s, v in hashes.items()}, self._hashes_set + 1
        self.outcomes = [RoundOutcome(**o) for o in outcomes]
        self._started = {step: now for step in self.rounds}
        self._restored = {(r.step, r.epoch) for r in self.rounds.values()}
        self._committed_at = now
        self._fresh_start = not self.rounds
        latest = max(self.rounds, default=None)
        for rnd in [r for r in self.rounds.values() if not r.shares and (r.step > committed or r.step == latest)]:
            # journaled before cursors: peers running ahead on it need its shares too
            shares, data_next, pool = self.data.assign(rnd.step - 1, [(m.peer_id, m.replica) for m in rnd.members
                                                                      if m.stage == 0])
            self.rounds[rnd.step] = rnd.model_copy(update={"shares": shares, "data_next": data_next, "pool": pool})

    def resumed(self, now: float) -> None:
        """The restarted coordinator serves from ``now``: the journaled rounds' clocks start here (a DHT that
        took seconds to start must not eat the members' grace)."""
        for step, _ in self._restored:
            if step in self._started:
                self._started[step] = now
        self._committed_at = now

    def observe(self, reports: Sequence[Report], now: float, checkpoint: Checkpoint | None = None,
                changed: Sequence[Report] | None = None) -> list[Event]:
        """Fold the peers' latest reports in: commits, canonical hashes, and failure of the pending round. ``changed``
        (given): the reports that changed since the last call (:meth:`PeerTable.take_changed`); what only a changed
        report can change -- a peer's progress, its data votes -- is looked for in those alone."""
        events: list[Event] = []
        self._note_progress(reports, now, changed)
        # the canonical hashes and the step reached depend on nothing but each report's version, stage, epoch, hash
        # and liveness and on the rounds: unless one of those changed, they are what the last tick made (at 1,000
        # peers most ticks bring heartbeats from the middle of a step, and both were a pass over every report)
        moved = self._moved(changed) or self._folded != self._context()
        if moved:
            self._learn_hashes(reports)
        self._learn_included(reports, changed)
        step = self._reached(reports) if moved else self.committed
        if step > self.committed:
            started = self._started.get(step)
            seconds = now - started if started is not None and step == self._latest_step() else None
            if seconds is not None:
                self._durations.append(seconds)
            since, self.committed, self._committed_at, self._fresh_start = self.committed, step, now, False
            self._learn_hashes(reports)
            self.data.commit(since, step, self.round_at)
            events.append(Committed(step, since, seconds))
        pending = self.pending()
        if pending is not None:
            reason = rollback.failure(pending, reports, now, started=self._started.setdefault(pending.step, now),
                                      restored=(pending.step, pending.epoch) in self._restored, progress=self._progress,
                                      grace_s=self.grace_s, floor_s=self.floor_s, factor=self.factor,
                                      deadline_s=self.deadline_s())
            if reason:
                events.extend(self._fail(pending, reason, reports, checkpoint, now))
        self._folded = self._context()
        if self.settling():  # (the next decision's data shares, made ready while the committed round settles)
            self.data.warm(self.committed, self.round_at(self.committed), self.epoch)
        return events

    def _latest_step(self) -> int:
        return max(self.rounds, default=0)

    def _context(self) -> tuple:
        latest = self.latest
        return self.committed, self.epoch, id(latest), latest.epoch if latest else -1, self._hashes_set

    def _moved(self, changed: Sequence[Report] | None) -> bool:
        """Did a report in ``changed`` (None: any report) change what the hashes and the step reached are made of?"""
        if changed is None:
            self._shapes.clear()
            return True
        moved = False
        for r in changed:
            shape = (r.version, r.stage, r.epoch, r.state_hash, r.live)
            if self._shapes.get(r.peer_id) != shape:
                self._shapes[r.peer_id], moved = shape, True
        return moved

    def _reached(self, reports: Sequence[Report]) -> int:
        """The highest version every stage of the latest round has reached in the current epoch.

        A member reports a version only once its stage's all-reduce produced it, so it is enough that
        at least half of a stage's live members (all of its members, if none is live) report it: one
        member claiming version 5000 moves nothing while its peers are at 7. It is above the round's
        step when peers went on without the coordinator (on the last plan, in the same epoch); a
        version made in an epoch since abandoned never counts.
        """
        latest = self.latest
        if latest is None:
            return self.committed
        by_id = {r.peer_id: r for r in reports}
        reached = []
        for stage in range(latest.stages):
            members = [m.peer_id for m in latest.stage_members(stage)]
            voters = [p for p in members if p in by_id and by_id[p].live] or members
            versions = sorted((by_id[p].version if p in by_id and by_id[p].stage == stage and by_id[p].epoch >= self.epoch
                               else -1 for p in voters), reverse=True)
            reached.append(versions[(len(versions) + 1) // 2 - 1])  # what at least half of them reached
        return max(self.committed, min(reached)) if min(reached) >= latest.step else self.committed

    def _learn_hashes(self, reports: Sequence[Report]) -> None:
        """Canonical hash of each (stage, version) up to the committed step: what most live members of
        the round that made it hold (a minority with another hash recovers the canonical one)."""
        votes: dict[tuple[int, int], list[str]] = {}  # (counted once per (stage, version), in the reports' order)
        made: dict[int, tuple[int, Collection[str]] | None] = {}  # version -> (epoch, members) of the round that made it
        committed = self.committed  # (every tick, of every report: 2.5 ms at 1,000 as it was written first)
        for r in reports:
            version = r.version
            if version > committed or version == 0 or not r.state_hash or not r.live:
                continue
            if version not in made:
                rnd = self.round_at(version)
                made[version] = (rnd.epoch, rnd.member_ids()) if rnd is not None else None
            if (by := made[version]) is None or r.epoch != by[0] or r.peer_id not in by[1]:
                continue
            if (hashes := votes.get((r.stage, version))) is None:
                hashes = votes[(r.stage, version)] = []
            hashes.append(r.state_hash)
        for (stage, version), hashes in votes.items():
            self.hashes.setdefault(stage, {})[version] = Counter(hashes).most_common(1)[0][0]

    def _learn_included(self, reports: Sequence[Report], changed: Sequence[Report] | None = None) -> None:
        """Which replicas' samples each coming version holds, as the stage-0 members of its round say
        (the round's own record says who is in stage 0, not the report). Of ``changed`` only, if given, when nothing
        else a vote depends on changed since the last call."""
        shared: dict[int, set[int]] = {}  # round step -> the replicas it gave a share (once per round, not per vote)
        context = (self.committed, self.epoch, self._latest_step())  # (what else a vote depends on)
        if len(self._voted) > 2 * len(reports) + 100:
            self._voted = {r.peer_id: self._voted[r.peer_id] for r in reports if r.peer_id in self._voted}
        if changed is not None and context == self._voted_in:
            reports = changed  # (every other report's votes are in, cast in this same context)
        self._voted_in = context
        for r in reports:
            if (last := self._voted.get(r.peer_id)) is not None and last[0] is r and last[1] == context:
                continue  # (its votes are in: at 1,000 peers, casting them all again every tick cost a tenth of it)
            self._voted[r.peer_id] = (r, context)
            for step, epoch, included, *samples in r.included:
                made_by = self.round_at(step)
                if made_by is None or not r.live or not self.committed < step <= self.committed + KEEP_ROUNDS:
                    continue
                cell = made_by.member(r.peer_id)
                if cell is not None and cell.stage == 0 and epoch == made_by.epoch == self.epoch:
                    known = shared.get(made_by.step)
                    if known is None:
                        known = shared[made_by.step] = {s.replica for s in made_by.shares}
                    worked = dict(zip(included, samples[0], strict=False)) if samples and len(samples[0]) == len(included) \
                        else {}
                    kept = [i for i in included if i in known]
                    self.data.vote(step, epoch, r.peer_id, kept, [worked.get(i, 0) for i in kept])

    def _note_progress(self, reports: Sequence[Report], now: float, changed: Sequence[Report] | None = None) -> None:
        if len(self._progress) > 2 * len(reports) + 100:  # (peers forgotten: with churn it grew without end)
            self._progress = {r.peer_id: self._progress[r.peer_id] for r in reports if r.peer_id in self._progress}
        for r in reports if changed is None else changed:  # (a report that did not change made no progress)
            old = self._progress.get(r.peer_id)
            if old is None or old[0] != r.progress:
                self._progress[r.peer_id] = (r.progress, now)

    # ------------------------------------------------------------------ failing (decided in rollback, applied here)

    def retract(self, step: int, reason: str, reports: Sequence[Report], checkpoint: Checkpoint | None,
                now: float) -> list[Event]:
        """Step ``step`` committed a proven lie (verified reduction): the run goes back to a version before it,
        whatever came after, and the round running now (if any) fails with it."""
        rnd = rollback.retracting(step, self.committed, self.pending(), self.round_at(step))
        return [] if rnd is None else self._fail(rnd, reason, reports, checkpoint, now, ceiling=step - 1)

    def rollback_target(self, reports: Sequence[Report], checkpoint: Checkpoint | None,
                        ceiling: int | None = None) -> tuple[int, str]:
        """The newest version at or below the committed one (and ``ceiling``) that every stage can be had at,
        and from where (:func:`~potluck.coordinator.rounds.rollback.rollback_target`, of this run's state)."""
        return rollback.rollback_target(reports, checkpoint, committed=self.committed, stages=self.stages,
                                        hashes=self.hashes, grouped=bool(self.group_size), round_at=self.round_at,
                                        ceiling=ceiling)

    def _fail(self, rnd: Round, reason: str, reports: Sequence[Report], checkpoint: Checkpoint | None,
              now: float, ceiling: int | None = None) -> list[Event]:
        """``rnd`` failed for ``reason``: decide where the run goes back to (no further than ``ceiling``) and go."""
        return self._roll_back(rollback.decide_rollback(
            rnd, reason, reports, checkpoint, committed=self.committed, epoch=self.epoch, stages=self.stages,
            hashes=self.hashes, grouped=bool(self.group_size), round_at=self.round_at, ceiling=ceiling), now)

    def _roll_back(self, rb: Rollback, now: float) -> list[Event]:
        """Apply ``rb`` to the run's state, the one place a failure changes it: the rounds and hashes past its target
        go (the checkpoint's, if it is of the target, become canonical), the data cursor goes back with them, a new
        epoch begins, and the next round is a fresh start that waits for the failed round's members."""
        target = rb.target
        for step in [s for s in self.rounds if s > target]:
            del self.rounds[step]
            self._started.pop(step, None)
        for by_version in self.hashes.values():
            for v in [v for v in by_version if v > target]:
                del by_version[v]
        if rb.checkpoint is not None:
            for stage, h in rb.checkpoint.hashes.items():
                self.hashes.setdefault(stage, {})[target] = h
        self.epoch, self.committed = rb.epoch, target
        self.data.roll_back(target, rb.checkpoint.cursor if rb.checkpoint is not None else None)
        self._committed_at, self._failed_at = now, now
        self._regather, self._fresh_start = rb.regather, True
        self.outcomes.append(rb.outcome(self.wall()))
        self.outcomes = self.outcomes[-KEEP_ROUNDS:]
        return rb.events()

    # ------------------------------------------------------------------ deciding

    def settled(self, now: float, grace_s: float | None = None, reports: Sequence[Report] = ()) -> bool:
        """Every live member of the committed round has reported it, or ``grace_s`` (default
        ``settle_s``) has passed since the commit."""
        grace_s = self.settle_s if grace_s is None else grace_s
        prev = self.rounds.get(self.committed)
        if prev is None:
            return True
        behind = {r.peer_id for r in reports if r.live and r.version < self.committed}
        waiting = [m.peer_id for m in prev.members if m.peer_id in behind]
        return not waiting or (self._committed_at is not None and now - self._committed_at >= grace_s)

    def ready_to_decide(self, live: int, min_peers: int, now: float, reports: Sequence[Report] = ()) -> bool:
        """Time to decide round ``committed + 1``? Never while one is running; a fresh start (the first
        round, or the first after a failure) waits for ``min_peers`` -- after a failure only until every member of
        the failed round is live again or gone for good (evicted, said goodbye), and ``REGATHER`` heartbeat timeouts
        at most, then goes on with whoever is live (an evicted liar or a peer gone for good must not stall the
        run); otherwise the committed round must have settled."""
        if self.pending() is not None or live < max(1, self.stages):
            return False
        if self._fresh_start:
            return live >= min_peers or self._regathered(now, reports)
        return self.settled(now, reports=reports)

    def settling(self, live: int = 0, min_peers: int = 0) -> bool:
        """Will the next round be due soon? The latest round committed, and the next is decided once its members have
        reported it (:meth:`settled`); or a fresh start has ``GATHERED`` of the ``min_peers`` it waits for (``live``).
        What that decision needs may start now (its pings: at 1,000 peers the first round's were 0.4-1.2 s, of the
        peers that had joined more than a few seconds before it was due)."""
        return self.pending() is None and (not self._fresh_start or live >= max(1.0, GATHERED * min_peers))

    def short_of(self, answered: int, live: int, min_peers: int, now: float) -> bool:
        """Wait on? A fresh start whose heartbeats show ``min_peers`` live but whose pings reached fewer (a busy
        peer missed one) waits for them, pinging again, for ``grace_s`` at most from the first short answer, then
        goes on with those that answered: a peer that heartbeats but cannot be reached must not stall the run."""
        if not self._fresh_start or answered >= min_peers or live < min_peers:
            self._short_since = None
            return False
        self._short_since = now if self._short_since is None else self._short_since
        return now - self._short_since < self.grace_s

    def _regathered(self, now: float, reports: Sequence[Report]) -> bool:
        if self._failed_at is None:
            return False  # (the first round of a run)
        if now - self._failed_at >= REGATHER * self.grace_s:
            return True
        back = {r.peer_id for r in reports if r.live or r.gone}
        return bool(self._regather) and self._regather <= back

    def decide(self, members: list[Member], now: float, decided_at: float = 0.0, reports: Sequence[Report] = (),
               audits: Sequence[Audit] = ()) -> Round:
        """Round ``committed + 1`` with these members (already placed on the grid, shard owners marked), in this
        epoch, carrying ``audits`` of the step before. With grouped averaging each stage's members are split
        into groups, each with the base state it starts from (:mod:`potluck.coordinator.rounds.groups`, from what
        ``reports`` say the members hold), and no stage-wide base hash is named: the groups of the step before
        hold different ones."""
        step = self.committed + 1
        hashes = [self.canonical(step - 1, s) if not self.group_size else "" for s in range(self.stages)]
        members, bases = groups.assign(members, step, self.group_size, self._holdings(reports, members))
        stage0 = [(m.peer_id, m.replica) for m in members if m.stage == 0]
        shares, data_next, pool = self.data.assign(self.committed, stage0, self.round_at(self.committed), self.epoch,
                                                   self._sizes(reports, {p for p, _ in stage0}))
        rnd = Round(step=step, members=sorted(members, key=lambda m: (m.stage, m.replica)), base_hash=hashes[0],
                    stages=self.stages, base_hashes=hashes if self.stages > 1 else [], epoch=self.epoch,
                    decided_at=decided_at, shares=shares, data_next=data_next, pool=pool, groups=bases,
                    audits=list(audits))
        self.rounds[step] = rnd
        self._started[step], self._short_since = now, None
        for old in sorted(self.rounds)[:-KEEP_ROUNDS]:
            del self.rounds[old]
        return rnd

    def _sizes(self, reports: Sequence[Report], stage0: Collection[str]) -> dict[str, int]:
        """Samples each stage-0 member's speed fits in a round's window (H steps of the fastest of them), with
        ``HEADROOM``, in whole batches, at most H batches (unmeasured members: H batches): the data it is handed."""
        speed = {r.peer_id: r.step_s for r in reports if r.peer_id in stage0 and r.step_s > 0}
        if not speed or not self.windows:  # (fixed rounds: every member trains H steps, on H batches)
            return {}
        window = self.inner_steps * min(speed.values())
        return {p: self.batch * max(1, min(self.inner_steps, math.ceil(HEADROOM * window / s))) for p, s in speed.items()}

    def _holdings(self, reports: Sequence[Report], members: Sequence[Member]) -> dict[str, list[groups.Holding]]:
        """The states each live member holds of the stage it is placed on (its newest and the one before),
        of the run's line: its newest made in the epoch of the round that made it (or version 0)."""
        stage = {m.peer_id: m.stage for m in members}
        out: dict[str, list[groups.Holding]] = {}
        for r in reports:
            if not r.live or stage.get(r.peer_id) != r.stage or not rollback.on_line(r, self.round_at(r.version)):
                continue
            out[r.peer_id] = [(r.version, r.state_hash)] + ([(r.prev_version, r.prev_hash)] if r.prev_version >= 0 else [])
        return out

    def reshard(self, stages: int, checkpoint: Checkpoint, now: float) -> None:
        """Resume with another number of stages from ``checkpoint`` (re-split into ``stages``): every
        hash of the old layout is dropped, the checkpoint's become canonical, and a new epoch begins."""
        self.stages = stages
        self.rounds.clear()
        self._started.clear()
        self.hashes, self._hashes_set = {s: {checkpoint.version: h} for s, h in checkpoint.hashes.items()}, self._hashes_set + 1
        self.committed, self._committed_at = checkpoint.version, now
        self.data.roll_back(checkpoint.version, checkpoint.cursor)
        self.epoch += 1
        self._fresh_start = True

    def adopt_checkpoint(self, checkpoint: Checkpoint) -> None:
        """A checkpoint written of this layout: its hashes are canonical where none is known yet."""
        self._hashes_set += 1
        for stage, h in checkpoint.hashes.items():
            self.hashes.setdefault(stage, {}).setdefault(checkpoint.version, h)

    def prune_hashes(self) -> None:
        """Keep the hashes a journal needs: the bases of the rounds kept, and the committed step's."""
        keep = {r.step - 1 for r in self.rounds.values()} | {self.committed}
        self._hashes_set += 1
        for by_version in self.hashes.values():
            for v in [v for v in by_version if v not in keep]:
                del by_version[v]

