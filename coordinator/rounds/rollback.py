"""How a round fails and what the run rolls back to, as values: pure functions over the state of
:class:`~potluck.coordinator.rounds.rounds.Rounds`, which applies what they return to it.

* A round **fails** (:func:`failure`) when some stage has no live member left (after a start-up grace:
  ``REGATHER`` times longer for a round journaled before a restart), when no member made visible progress for
  ``floor_s``, or, once step durations have been measured, when it is older than ``factor`` times their median
  (and at least ``floor_s``).
* The run then **rolls back** (:func:`decide_rollback`, a :class:`Rollback`) to the newest version every stage
  can still be had at (:func:`rollback_target`: a live peer's current or previous state, the newest
  checkpoint, or theta_0), in a new epoch. A step proven to hold a lie is **retracted** the same way, to a
  version before it (:func:`retracting`: the round that fails with it).

Nothing here holds or changes state: :class:`~potluck.coordinator.rounds.rounds.Rounds` owns all of it (its
rounds, canonical hashes, epoch, clocks and data cursor) and passes in what each answer is made of. Kept apart,
the decision is testable on its own and the one place that changes the run's state on a failure is
``Rounds._roll_back`` (it was a mixin once, re-declaring its host's attributes and writing them from here).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from potluck.coordinator.rounds.roundevents import Checkpoint, Event, Failed, Report, RolledBack, RoundOutcome
from potluck.protos.wire.records import Round

REGATHER = 3  # heartbeat timeouts for peers to gather again (after a restart: restore; a failure: ready_to_decide)


def failure(rnd: Round, reports: Sequence[Report], now: float, *, started: float, restored: bool,
            progress: Mapping[str, tuple[tuple, float]], grace_s: float, floor_s: float, factor: float,
            deadline_s: float | None) -> str:
    """Why ``rnd`` has failed by ``now``, or '' if it has not.

    ``started``: when it was decided (or restored from a journal: then ``restored``, and its members get ``REGATHER``
    times ``grace_s`` to show up, since their DHT nodes must find the coordinator's new one first). ``progress``:
    peer -> (its last progress signature, since when). ``deadline_s``: how long a round may take, None until step
    durations are measured (``factor`` is only named in the reason)."""
    age = now - started
    live = {r.peer_id for r in reports if r.live}
    if age >= grace_s * (REGATHER if restored else 1):  # (before, a member may just not have reported yet)
        for stage in range(rnd.stages):
            if not any(m.peer_id in live for m in rnd.stage_members(stage)):
                return f"stage {stage} lost all its members" if rnd.stages > 1 else "every member is gone"
    members = [m.peer_id for m in rnd.members if m.peer_id in live]
    last = max((progress[p][1] for p in members if p in progress), default=started)
    if now - max(last, started) >= floor_s:  # (progress made before the round began does not count for it)
        return f"no member made progress for {floor_s:.0f} s"
    if deadline_s is not None and age >= deadline_s:
        return f"not committed within {deadline_s:.0f} s ({factor:g}x the measured step time, at least the floor)"
    return ""


def on_line(r: Report, made_by: Round | None) -> bool:
    """``r``'s newest state is of the run's line: made in the epoch of ``made_by`` (the round that made its version,
    as ``Rounds.round_at`` finds it), or theta_0, or of a round no longer kept -- neither it nor the one before it is
    of an abandoned epoch. (With grouped averaging no hash is canonical: this is what tells a state to build on.)"""
    return r.version == 0 or made_by is None or r.epoch == made_by.epoch


def held(stage: int, version: int, reports: Sequence[Report], *, canonical: str, grouped: bool,
         round_at: Callable[[int], Round | None]) -> bool:
    """Some live member of ``stage`` holds ``version``: at its ``canonical`` hash (any, if unknown: '') or, with
    grouped averaging (``grouped``), at any hash of the run's line (:func:`on_line`, by ``round_at``)."""
    want = "" if grouped else canonical
    for r in reports:
        if not r.live or r.stage != stage:
            continue
        if grouped and not on_line(r, round_at(r.version)):
            continue
        for v, h in ((r.version, r.state_hash), (r.prev_version, r.prev_hash)):  # (a peer serves both)
            if v == version and h and (not want or h == want):
                return True
    return False


def rollback_target(reports: Sequence[Report], checkpoint: Checkpoint | None, *, committed: int, stages: int,
                    hashes: Mapping[int, Mapping[int, str]], grouped: bool, round_at: Callable[[int], Round | None],
                    ceiling: int | None = None) -> tuple[int, str]:
    """The newest version at or below ``committed`` (and ``ceiling``) that every one of ``stages`` can be had at,
    and from where: ``checkpoint``, live peers' ``reports`` (:func:`held`, against ``hashes``: stage -> version ->
    canonical hash), or theta_0 (version 0, which every peer builds from the run's seed)."""
    for v in range(committed if ceiling is None else min(ceiling, committed), 0, -1):
        if checkpoint is not None and checkpoint.version == v:
            return v, "checkpoint"
        if all(held(stage, v, reports, canonical=hashes.get(stage, {}).get(v, ""), grouped=grouped, round_at=round_at)
               for stage in range(stages)):
            return v, "live peers"
    return 0, "theta_0"


def retracting(step: int, committed: int, pending: Round | None, made_by: Round | None) -> Round | None:
    """The round that fails when step ``step`` is retracted (a proven lie): the one running now (``pending``), else
    the one that made ``step`` (``made_by``). A step not committed yet is retracted too: a contributor's proof of an
    omission comes with its report of the step, often before the slowest member's, so before the commit; the round
    running now (of ``committed + 1``, at or before ``step``) fails, and the run never takes the step. None when
    nothing can fail (no round running, and the step not committed)."""
    if step > committed:
        return pending if pending is not None and pending.step <= step else None
    return pending or made_by


@dataclass(frozen=True)
class Rollback:
    """A failed round and where the run goes back to: the decision, as a value, that ``Rounds`` applies to its own
    state (drops what came after ``target``, enters ``epoch``) and reports as :meth:`events`."""

    failed: Round
    reason: str
    from_step: int  # the committed step before
    target: int  # the version the run goes on from
    source: str  # where every stage can have it: "live peers", "checkpoint" or "theta_0"
    epoch: int  # the new epoch (one more than the failed round's run was in)
    checkpoint: Checkpoint | None  # the checkpoint, when it is of ``target``: its hashes become canonical, its cursor the data's

    @property
    def regather(self) -> frozenset[str]:
        """The failed round's members: a fresh start after the failure waits for them (``Rounds.ready_to_decide``)."""
        return frozenset(m.peer_id for m in self.failed.members)

    def events(self) -> list[Event]:
        """The round failed; and, if it undid committed steps, the run rolled back (a retry of the pending round
        from the committed step undoes nothing)."""
        out: list[Event] = [Failed(self.failed, self.reason)]
        if self.target < self.from_step:
            out.append(RolledBack(self.from_step, self.target, self.source, self.epoch))
        return out

    def outcome(self, t: float) -> RoundOutcome:
        """How the failed round ended, stamped ``t`` (wall clock: journaled and shown on the status page)."""
        return RoundOutcome(self.failed.step, self.failed.epoch, self.reason, len(self.failed.members), self.target, t)


def decide_rollback(rnd: Round, reason: str, reports: Sequence[Report], checkpoint: Checkpoint | None, *,
                    committed: int, epoch: int, stages: int, hashes: Mapping[int, Mapping[int, str]], grouped: bool,
                    round_at: Callable[[int], Round | None], ceiling: int | None = None) -> Rollback:
    """``rnd`` failed for ``reason``: where the run at ``committed`` in ``epoch`` goes back to
    (:func:`rollback_target`, at most to ``ceiling``), as a :class:`Rollback` to apply."""
    target, source = rollback_target(reports, checkpoint, committed=committed, stages=stages, hashes=hashes,
                                     grouped=grouped, round_at=round_at, ceiling=ceiling)
    kept = checkpoint if checkpoint is not None and checkpoint.version == target else None
    return Rollback(rnd, reason, committed, target, source, epoch + 1, kept)
