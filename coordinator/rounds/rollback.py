"""How a round fails and what the run rolls back to: the part of :class:`~potluck.coordinator.rounds.rounds.Rounds` that
ends a round that cannot commit.

* A round **fails** when some stage has no live member left (after a start-up grace: ``REGATHER`` times longer
  for a round journaled before a restart), when no member made visible progress for ``floor_s``, or, once step
  durations have been measured, when it is older than ``factor`` times their median (and at least ``floor_s``).
* The run then **rolls back** to the newest version every stage can still be had at (a live peer's current or
  previous state, the newest checkpoint, or theta_0), in a new epoch. A step proven to hold a lie is
  **retracted** the same way, to a version before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from potluck.coordinator.rounds.roundevents import Checkpoint, Event, Failed, Report, RolledBack, RoundOutcome
from potluck.protos.wire.records import Round

if TYPE_CHECKING:
    from potluck.coordinator.rounds.cursor import DataCursor

KEEP_ROUNDS = 16  # decided rounds kept (and failed rounds' outcomes)
REGATHER = 3  # heartbeat timeouts for peers to gather again (after a restart: restore; a failure: ready_to_decide)


class RollingBack:
    """Failing and rolling back, for :class:`~potluck.coordinator.rounds.rounds.Rounds` (whose state it works on)."""

    # the round lifecycle's state, declared for the type checker (Rounds holds it: annotations alone make no attribute)
    stages: int
    floor_s: float
    factor: float
    grace_s: float
    group_size: int
    committed: int
    epoch: int
    rounds: dict[int, Round]
    hashes: dict[int, dict[int, str]]
    outcomes: list[RoundOutcome]
    data: DataCursor
    wall: Callable[[], float]
    _started: dict[int, float]
    _restored: set[tuple[int, int]]
    _progress: dict[str, tuple[tuple, float]]
    _committed_at: float | None
    _failed_at: float | None
    _regather: frozenset[str]
    _fresh_start: bool

    if TYPE_CHECKING:
        def pending(self) -> Round | None: ...
        def round_at(self, step: int) -> Round | None: ...
        def canonical(self, version: int, stage: int = 0) -> str: ...
        def deadline_s(self) -> float | None: ...

    def _failure(self, rnd: Round, reports: Sequence[Report], now: float) -> str:
        """Why ``rnd`` has failed by ``now``, or '' if it has not."""
        started = self._started.setdefault(rnd.step, now)
        age = now - started
        live = {r.peer_id for r in reports if r.live}
        if age >= self.grace_s * (REGATHER if (rnd.step, rnd.epoch) in self._restored else 1):
            for stage in range(rnd.stages):
                if not any(m.peer_id in live for m in rnd.stage_members(stage)):
                    return f"stage {stage} lost all its members" if rnd.stages > 1 else "every member is gone"
        members = [m.peer_id for m in rnd.members if m.peer_id in live]
        last = max((self._progress[p][1] for p in members if p in self._progress), default=started)
        if now - max(last, started) >= self.floor_s:
            return f"no member made progress for {self.floor_s:.0f} s"
        deadline = self.deadline_s()
        if deadline is not None and age >= deadline:
            return f"not committed within {deadline:.0f} s ({self.factor:g}x the measured step time, at least the floor)"
        return ""

    def retract(self, step: int, reason: str, reports: Sequence[Report], checkpoint: Checkpoint | None,
                now: float) -> list[Event]:
        """Step ``step`` committed a proven lie (verified reduction): the run goes back to a version before it,
        whatever came after, and the round running now (if any) fails with it."""
        rnd = self.pending() or self.rounds.get(step) or self.round_at(step)
        if rnd is None or step > self.committed:
            return []
        return self._fail(rnd, reason, reports, checkpoint, now, ceiling=step - 1)

    def _fail(self, rnd: Round, reason: str, reports: Sequence[Report], checkpoint: Checkpoint | None,
              now: float, ceiling: int | None = None) -> list[Event]:
        target, source = self.rollback_target(reports, checkpoint, ceiling)
        events: list[Event] = [Failed(rnd, reason)]
        before = self.committed
        for step in [s for s in self.rounds if s > target]:
            del self.rounds[step]
            self._started.pop(step, None)
        for by_version in self.hashes.values():
            for v in [v for v in by_version if v > target]:
                del by_version[v]
        if checkpoint is not None and checkpoint.version == target:
            for stage, h in checkpoint.hashes.items():
                self.hashes.setdefault(stage, {})[target] = h
        self.epoch += 1
        self.committed = target
        self.data.roll_back(target, checkpoint.cursor if checkpoint is not None and checkpoint.version == target else None)
        self._committed_at, self._failed_at = now, now
        self._regather = frozenset(m.peer_id for m in rnd.members)
        self._fresh_start = True
        self.outcomes.append(RoundOutcome(rnd.step, rnd.epoch, reason, len(rnd.members), target, self.wall()))
        self.outcomes = self.outcomes[-KEEP_ROUNDS:]
        if target < before:
            events.append(RolledBack(before, target, source, self.epoch))
        return events

    def rollback_target(self, reports: Sequence[Report], checkpoint: Checkpoint | None,
                        ceiling: int | None = None) -> tuple[int, str]:
        """The newest version at or below the committed one (and ``ceiling``) that every stage can be had at,
        and from where."""
        for v in range(self.committed if ceiling is None else min(ceiling, self.committed), 0, -1):
            if checkpoint is not None and checkpoint.version == v:
                return v, "checkpoint"
            if all(self._held(stage, v, reports) for stage in range(self.stages)):
                return v, "live peers"
        return 0, "theta_0"

    def _held(self, stage: int, version: int, reports: Sequence[Report]) -> bool:
        """Some live member of ``stage`` holds ``version``: at the canonical hash, or with grouped averaging
        at any hash of the run's line (its newest state made in the epoch of the round that made it)."""
        want = "" if self.group_size else self.canonical(version, stage)
        for r in reports:
            if not r.live or r.stage != stage:
                continue
            if self.group_size and not self._on_line(r):
                continue
            for v, h in ((r.version, r.state_hash), (r.prev_version, r.prev_hash)):
                if v == version and h and (not want or h == want):
                    return True
        return False

    def _on_line(self, r: Report) -> bool:
        """``r``'s newest state was made in the epoch of the round that made it (or is theta_0): neither
        it nor the one before it is of an abandoned epoch."""
        made_by = self.round_at(r.version)
        return r.version == 0 or made_by is None or r.epoch == made_by.epoch
