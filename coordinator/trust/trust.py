"""Fresh keys earn trust: who may own a shard, audit one, or count in an eviction.

In an open run anyone is admitted, and a key costs nothing (or the proof of work of
``admission.pow_bits``). A newly admitted peer trains and contributes from its first round, but the
roles that could steer the run -- averaging a shard every member applies, auditing another owner,
voting a peer out -- wait until it has done ``admission.probation_steps`` outer steps of verified
work: steps that committed with it as a member, holding the committed state. A crowd of fresh keys
therefore joins as contributors, whose updates robust aggregation bounds, and can neither own a shard
nor outvote the stage's trusted peers during probation.

A run starts with nobody past probation: its *founders* (the members of its first round) own shards
and audit until someone is trusted, and earn trust by the same rule; a key that joins later waits out
its probation whatever the founders' count (else a crowd joining early would own shards at once). A
stage with neither (every founder gone) lets all its members own shards: there is no one else.

Pure bookkeeping: the coordinator feeds it committed rounds and the peers' reports, and journals it.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from potluck.coordinator.rounds.roundevents import Report
from potluck.protos.wire.records import Member, Round

KEEP_STEPS = 64  # steps of work remembered per peer (only a count up to probation_steps matters)


@dataclass
class Trust:
    probation_steps: int = 3
    work: dict[str, list[int]] = field(default_factory=dict)  # peer -> committed steps it made as a member
    founders: set[str] = field(default_factory=set)  # the members of the run's first round
    demoted: dict[str, int] = field(default_factory=dict)  # peer -> the step until which it owns no shard
    _moved: set[str] = field(default_factory=set, compare=False, repr=False)  # whose trust as of a step changed

    def committed(self, rnd: Round | None, step: int, reports: Iterable[Report]) -> None:
        """Step ``step`` committed in ``rnd``: its members that hold a version of it (or later) did the work."""
        if rnd is None:
            return
        members = {m.peer_id for m in rnd.members}
        for r in reports:
            if r.peer_id in members and r.version >= step and r.epoch >= rnd.epoch:
                steps = self.work.setdefault(r.peer_id, [])
                if step not in steps:
                    at = bisect.bisect(steps, step)
                    steps.insert(at, step)  # (kept in order: trusted() reads the probation-th step)
                    del steps[:-KEEP_STEPS]  # (what this drops moves that step 60 steps back: no verdict changes)
                    if at < self.probation_steps:
                        self._moved.add(r.peer_id)

    def rolled_back(self, to_version: int) -> None:
        """Steps undone by a rollback were not verified work after all."""
        for peer, steps in self.work.items():
            kept = [s for s in steps if s <= to_version]
            if kept[:self.probation_steps] != steps[:self.probation_steps]:
                self._moved.add(peer)
            steps[:] = kept

    def forget(self, peer_id: str) -> None:
        """An evicted peer starts over, should it ever be let back in (and is a founder no more)."""
        self.work.pop(peer_id, None)
        self.founders.discard(peer_id)
        self._moved.add(peer_id)

    def moved(self) -> set[str]:
        """The peers whose trust as of some step changed since the last call (crossed probation, lost work to a
        rollback, forgotten): the coordinator judges their groups' eviction votes again."""
        out, self._moved = self._moved, set()
        return out

    def trusted(self, peer_id: str, before: int | None = None) -> bool:
        """Past probation (``before`` a step: by the work it committed before that step)."""
        steps, p = self.work.get(peer_id, ()), self.probation_steps
        return len(steps) >= p and (before is None or p == 0 or steps[p - 1] < before)  # (a tick asks it per member)

    def eligible(self, members: Sequence[Member], before: int | None = None) -> set[str]:
        """Of one stage's members, those who may own a shard and audit: the trusted ones and the run's founders
        among them (owners from the run's first step: were they eligible only while nobody was trusted, the first
        founder past probation would own every shard alone until the others' reports came, and a sole owner has no
        quorum to fall short of); with neither, all of them. ``before``: as trust stood when that step ran (what a
        member reports of a step counts only if it was past probation then: trust earned later does not reach back
        to the steps it reported while still on probation)."""
        out = {m.peer_id for m in members if self.trusted(m.peer_id, before) or m.peer_id in self.founders}
        return out or {m.peer_id for m in members}

    def demote(self, peer_id: str, until: int) -> None:
        """``peer_id`` owns no shard in the rounds of steps before ``until`` (several members said it withheld: it
        left their contributions unreceipted, or its results short of a quorum). It still trains and contributes."""
        self.demoted[peer_id] = max(until, self.demoted.get(peer_id, 0))

    def assign_owners(self, members: Sequence[Member], cap: int | None = None,
                      draw: Callable[[], float] = random.random, step: int | None = None) -> list[Member]:
        """``members`` with ``owns`` set: per stage, its eligible members own its shards (the first round's
        members are the run's founders), but for those demoted (:meth:`demote`) as of ``step``, unless that leaves
        none; ``cap``: at most that many per stage, those with the most verified work,
        ties drawn by ``draw`` (a peer id is cheap to grind: never its order) (a stage averaged as one group of
        1,000: each member reports every owner's outcome in each heartbeat, which must fit a DHT record; the
        others contribute to every shard and gather every result, as on probation)."""
        if not self.founders and not self.work:
            self.founders = {m.peer_id for m in members}
        if step is not None:
            self.demoted = {p: until for p, until in self.demoted.items() if until > step}
        out = []
        for stage in sorted({m.stage for m in members}):
            cells = [m for m in members if m.stage == stage]
            owners = self.eligible(cells)
            # (if that leaves none: the others, probation or not, before a demoted one)
            owners = (owners - set(self.demoted)) or ({m.peer_id for m in cells} - set(self.demoted)) or owners
            if cap is not None and len(owners) > cap:
                owners = set(sorted(owners, key=lambda p: (-len(self.work.get(p, ())), draw()))[:cap])
            out += [m if m.owns == (m.peer_id in owners) else m.model_copy(update={"owns": m.peer_id in owners})
                    for m in cells]  # (copied only where it changes: 1,000 copies were 5 ms of a decision)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"probation_steps": self.probation_steps, "work": {p: list(s) for p, s in self.work.items()},
                "founders": sorted(self.founders), "demoted": dict(self.demoted)}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None, probation_steps: int) -> Trust:
        work = {str(p): sorted(int(s) for s in steps) for p, steps in ((data or {}).get("work") or {}).items()}
        demoted = {str(p): int(u) for p, u in ((data or {}).get("demoted") or {}).items()}
        return cls(probation_steps, work, {str(p) for p in (data or {}).get("founders") or []}, demoted)
