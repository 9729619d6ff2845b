"""Evicting a peer whose updates the owners that averaged them clipped or left out, in most of its recent steps.

Each owner signs whom it clipped or left out, and every member reports each owner's list as it received it
(``StepReport.flags``). Who is flagged in a step is judged from those reports alone, group by group, and only the
groups whose reports changed since the last tick are judged again (see :meth:`Evictions.judge`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING

from potluck.protos.wire.records import Member, PeerRecord, Round, StepReport

if TYPE_CHECKING:
    from potluck.coordinator.trust.admission import Admission

RECENT_STEPS = 5


class Evictions:
    """The admission room's verdicts: which peers most owners of their groups flagged in which steps, and whom
    that evicts (``evict_after`` of its last ``RECENT_STEPS`` steps)."""

    def __init__(self, admission: Admission, evict_after: int) -> None:
        self.admission, self.evict_after = admission, evict_after
        self._flagged: dict[str, dict[int, bool]] = {}  # peer -> step -> clipped or rejected by most owners
        self._seen: dict[str, PeerRecord] = {}  # the records judge last saw, and their reports by step:
        self._by_step: dict[int, dict[str, StepReport]] = {}  # step -> reporter -> its report of that step
        self._flaggers: dict[int, set[str]] = {}  # step -> the reporters whose report of it carries owners' lists
        self._rounds: dict[int, Round | None] = {}  # step -> the round it was last judged under
        self._revoked = -1  # the evictions it judged under
        self._admitted: set[str] = set()  # the peers admitted when it last judged
        # of a stage's members, those whose reports count (past probation; all of them while none is)
        self.trusted: Callable[[Sequence[Member], int], set[str]] = lambda cells, step: {m.peer_id for m in cells}
        self.trust_moved: Callable[[], Collection[str]] = tuple  # peers whose trust changed since last asked

    def judge(self, records: dict[str, PeerRecord], round_at: Callable[[int], Round | None],
              changed: Collection[str] | None = None) -> list[tuple[str, str]]:
        """The peers evicted now (and why), judged from ``records``' reports. Each owner signs whom it clipped or left
        out, and every member reports each owner's list as it received it (``StepReport.flags``). A peer counts as flagged in a step only when most of the *owners* it
        averaged with (its stage's; its group's, with ``sync.group_size``) flagged it, each owner's list as most
        trusted reporters of that group give it, and only as far as the owner's own record says the same: owners
        are counted, not the members that repeat them, so one owner's false flags are never a majority (and an
        audit of its shard proves them false); reporters on probation (a crowd of fresh keys) do not count, and
        once past it, a crowd of reporters still cannot put words in an honest owner's mouth (it used to: 8
        fresh keys past a 2-step probation got the 3 honest peers evicted at a run's end). Flagged too often:
        evicted. ``changed`` (given): the peers whose record changed or went since the last call, the only ones looked
        at (else every record is)."""
        dirty: dict[int, set[str] | None] = dict(self._index(records, changed))
        rounds = {step: round_at(step) for step in self._by_step}  # (a step whose round is new, decided anew after
        for step, rnd in rounds.items():  # a rollback, or first judged: all of its groups; a decision changes one)
            if self._rounds.get(step) is not rnd:
                dirty[step] = None
        self._rounds = rounds
        admitted = set(self.admission.admitted)  # (at 1,000 peers with churn, someone is admitted every second)
        for pid in admitted ^ self._admitted:  # whose reports start or stop counting: their groups are judged again
            _mark(dirty, pid, [r.step for r in getattr(self._seen.get(pid), "recent", ())])
        self._admitted = admitted
        for pid in self.trust_moved():  # (a group's trusted reporters changed: in every step it may be a member of)
            _mark(dirty, pid, self._by_step)
        if len(self.admission.revoked) != self._revoked:
            dirty = dict.fromkeys(self._by_step)  # (an eviction: every verdict may change)
        self._revoked = len(self.admission.revoked)
        touched: set[str] = set()  # (at 1,000 peers, judging every report of every record five times a second was
        for step in sorted(dirty):  # a third of the coordinator's tick: only the groups whose reports changed are)
            touched |= self._judge_step(step, self._by_step.get(step, {}), round_at, dirty[step])
        out = []
        for pid in sorted(touched):
            steps = self._flagged[pid]
            for old in sorted(steps)[:-4 * RECENT_STEPS]:
                del steps[old]
            recent = [steps[s] for s in sorted(steps)[-RECENT_STEPS:]]
            if sum(recent) >= self.evict_after and pid not in self.admission.revoked:
                self.admission.revoke(pid)
                out.append((pid, f"evicted: most owners of its stage clipped or left out its update "
                                 f"in {sum(recent)} of its last {len(recent)} outer steps"))
        return out

    def _index(self, records: dict[str, PeerRecord], changed: Collection[str] | None = None) -> dict[int, set[str]]:
        """Keep ``_by_step`` (step -> reporter -> its report of that step, from the records now held) up to date
        with ``records`` (those of ``changed``, if given: at 1,000 peers a pass over every record was a tenth of an
        ordinary tick); the steps whose reports changed, and whose."""
        dirty: dict[int, set[str]] = {}
        gone = [p for p in self._seen if p not in records] if changed is None else [
            p for p in changed if p not in records and p in self._seen]
        for pid in gone:
            self._put(pid, {r.step: None for r in self._seen.pop(pid).recent}, dirty)
        for pid, rec in records.items() if changed is None else ((p, records[p]) for p in changed if p in records):
            old, self._seen[pid] = self._seen.get(pid), rec
            if old is not rec and (old is None or [r.__dict__ for r in old.recent] != [r.__dict__ for r in rec.recent]):
                new: dict[int, StepReport | None] = {r.step: r for r in rec.recent}  # one report per reporter and step
                was = {r.step: r for r in old.recent} if old is not None else {}  # (a heartbeat's new report: one step)
                self._put(pid, {step: new.get(step) for step in new.keys() | was.keys()
                                if not _same(new.get(step), was.get(step))}, dirty)
        return dirty

    def _put(self, pid: str, reports: dict[int, StepReport | None], dirty: dict[int, set[str]]) -> None:
        """``pid``'s report of each of these steps is now this one (None: it has none); noted in ``dirty``."""
        for step, report in reports.items():
            dirty.setdefault(step, set()).add(pid)
            if report is not None:
                self._by_step.setdefault(step, {})[pid] = report
            elif (held := self._by_step.get(step)) is not None:
                held.pop(pid, None)
                if not held:
                    del self._by_step[step]
            if report is not None and report.flags:
                self._flaggers.setdefault(step, set()).add(pid)
            elif (flaggers := self._flaggers.get(step)) is not None:
                flaggers.discard(pid)
                if not flaggers:
                    del self._flaggers[step]

    def _judge_step(self, step: int, reports: dict[str, StepReport], round_at: Callable[[int], Round | None],
               changed: set[str] | None = None) -> set[str]:
        """Step ``step``'s verdicts from its reports (see :meth:`judge`); the peers whose verdicts it added to.
        ``changed``: only these reporters' reports changed since the step was last judged, so only the averaging
        groups they are members of are judged again (each group's verdicts come from its members' reports alone;
        at 1,000 peers in groups of 4, a tick's 40 new reports are 160 reports to judge, not 1,000), and of their
        other members only those whose reports carry owners' lists: a report without one adds nothing but its
        reporter's part in the step, marked when it came (one group of 1,000 was 1,000 reports again a tick)."""
        rnd = round_at(step)
        if changed is not None and rnd is not None:
            groups = {m.group for pid in changed if (m := rnd.member(pid)) is not None}  # (in any stage: a report
            flaggers = self._flaggers.get(step, set())  # names its stage itself)
            again = changed | {pid for pid in flaggers if (m := rnd.member(pid)) is not None and m.group in groups}
            reports = {pid: r for pid, r in reports.items() if pid in again}  # (in the same order: the same verdicts)
        claims: dict[tuple[int, int], dict[str, Counter[tuple[str, ...]]]] = {}  # (stage, group) -> owner -> lists
        trusted: dict[tuple[int, int], set[str]] = {}  # (stage, group) -> its trusted reporters
        own: dict[tuple[int, int, str], set[str]] = {}  # (stage, group, owner) -> whom it says it flagged
        added: set[str] = set()
        for pid, report in reports.items():
            if not self.admission.is_admitted(pid):
                continue
            if step not in (verdicts := self._flagged.setdefault(pid, {})):
                verdicts[step] = False  # it took part
                added.add(pid)
            if not report.flags or rnd is None or (member := rnd.member(pid)) is None:
                continue  # (no owner's list, or not a member of that round: nothing more it reports counts)
            key = (report.stage, member.group)
            own[(*key, pid)] = set(report.flags.get(pid, ()))
            if key not in trusted:  # (once per group and step: per record, 1,000 peers made it seconds)
                trusted[key] = self.trusted(rnd.group_members(*key), step)  # that group, as trust stood then (not
                # the first reporter's own: one naming another stage than its own made the verdicts hang on order)
            if pid not in trusted[key]:
                continue
            by_owner = claims.setdefault(key, {})
            for owner, named in report.flags.items():
                by_owner.setdefault(owner, Counter())[tuple(sorted(set(named)))] += 1
        for (stage, group), by_owner in claims.items():
            assert rnd is not None  # (claims come only from members of the round)
            cells, owners = {m.peer_id for m in rnd.group_members(stage, group)}, rnd.shard_owners(stage, group)
            counts: Counter[str] = Counter()
            for owner, versions in by_owner.items():
                if owner in owners:  # (what the owner itself says it did, in its own signed record, bounds it)
                    counts.update(_as_most_say(versions) & own.get((stage, group, owner), set()))
            for pid, n in counts.items():  # (a flagged owner's own shard does not vote on it)
                if pid in cells and 2 * n > len(set(owners) - {pid}):
                    self._flagged.setdefault(pid, {})[step] = True
                    added.add(pid)
        return added


def _mark(dirty: dict[int, set[str] | None], pid: str, steps: Iterable[int]) -> None:
    """``pid``'s groups are to be judged again in these steps (a step judged whole already stays so)."""
    for step in steps:
        if (mark := dirty.setdefault(step, set())) is not None:
            mark.add(pid)


def _as_most_say(versions: Counter[tuple[str, ...]]) -> set[str]:
    """An owner's list as most reporters give it; on a tie, only whom every tied version names (whatever order the
    reports came in: the first to arrive used to win a tie, so one coordinator's verdict hung on arrival order)."""
    top = max(versions.values())
    return set.intersection(*(set(v) for v, n in versions.items() if n == top))


def _same(a: StepReport | None, b: StepReport | None) -> bool:
    """The same report (its fields compared as they are: a model's == costs several times more, per report of every
    record that changed, every tick)."""
    return a is b or (a is not None and b is not None and a.__dict__ == b.__dict__)
