"""Roles and proofs: who may own a shard, who audits which, what an accusation is worth.

Admission (:mod:`potluck.coordinator.trust.admission`) decides who takes part; this room decides what an
admitted peer is trusted with, and acts on proof that it abused it:

* **Owners.** A round's members own shards only once past probation (:mod:`potluck.coordinator.trust.trust`);
  the others contribute and gather. Set on each :class:`~potluck.protos.wire.records.Member` of a round.
* **Audits.** When a round is decided, each shard result of the step committed just before is picked
  for an audit with probability ``sync.audit_fraction``, its auditor drawn at random among the eligible
  members that hold that result (members of that round, not its owner). Owners signed their results
  before the draw, so none knows whether or by whom it will be checked.
* **Groups.** With grouped averaging (``sync.group_size``) each group of a stage runs a verified
  all-reduce of its own: its shards are numbered within it, owned by its members past probation (all of
  them while none is), and audited by another of its members, the only peers that hold its results.
* **Accusations.** An auditor that finds a lie says so in its record; the :class:`~potluck.coordinator.
  verifier.Verifier` checks the evidence itself. A proven lie evicts the owner and takes the run back to
  before that step; a false accusation evicts the auditor; the page shows both.
* **Complaints.** What a member cannot prove, it says: an owner that neither receipted its contribution nor
  refused it for the round's reasons (``unreceipted``), or whose result fell short of the quorum (``short``).
  An owner named so in ``sync.demote_after`` of the last :data:`COMPLAINT_STEPS` steps, by at least two members
  past probation, loses shard ownership for ``sync.demote_steps`` steps: withholding costs every step a take-over,
  and one member with a bad link to it (or one liar) cannot demote it alone.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from potluck.compression.int8 import make_codec
from potluck.coordinator.rounds.roundevents import Report
from potluck.coordinator.rounds.rounds import KEEP_ROUNDS, Rounds
from potluck.coordinator.trust.trust import Trust
from potluck.coordinator.trust.verifier import Accusation, Ruling, Verifier
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.transport import PeerClient
from potluck.protos.runtime.log import short_id
from potluck.protos.wire.records import (
    MAX_AUDITS,
    MAX_OWNERS,
    Audit,
    AuditReport,
    Member,
    PeerRecord,
    Round,
    ShardOf,
)

COMPLAINT_STEPS = 16  # complaints against an owner count over this many steps


@dataclass(frozen=True)
class Verdict:
    """What the coordinator does with a ruling: evict ``evict`` (if any), take back ``retract`` (a step, 0:
    none), and say ``message``."""

    evict: str
    retract: int
    message: str
    kind: str  # the event's kind: "proven" (a lie, its owner evicted), "evicted" (a false accuser), "audit"
    warn: bool = True  # worth a warning in the log (an audit that found nothing wrong is not)


@dataclass
class Integrity:
    cfg: RunConfig
    trust: Trust
    verifier: Verifier | None = None
    rng: random.Random = field(default_factory=random.SystemRandom)
    _reported: set[tuple] = field(default_factory=set)
    _final: set[tuple[int, ...]] = field(default_factory=set)  # the coordinator's own audits, unruled
    _assigned: dict[tuple[int, ...], Audit] = field(default_factory=dict)  # audits in decided rounds
    _picked: set[tuple] = field(default_factory=set)  # (*shard, owner, auditor) of every audit of a decided round
    _answered: set[tuple[int, ...]] = field(default_factory=set)  # ... whose auditor reported
    _vouched: dict[tuple[int, ...], set[str]] = field(default_factory=dict)  # shard -> picked auditors that said ok
    _oks: set[tuple] = field(default_factory=set)  # ok reports seen (each looked at once)
    _rechecks: set[tuple[int, ...]] = field(default_factory=set)  # an evicted owner's shards, audited by the coordinator
    _lies: dict[tuple[int, ...], tuple[str, str]] = field(default_factory=dict)  # shard -> (owner, the result proven)
    _oks_of: dict[tuple[int, ...], dict[str, str]] = field(default_factory=dict)  # shard -> picked auditor -> result
    _colluders: list[Verdict] = field(default_factory=list)  # auditors that said ok to a proven lie, to evict
    _named: dict[str, dict[int, set[str]]] = field(default_factory=dict)  # owner -> step -> members complaining
    _said_short: set[tuple] = field(default_factory=set)  # short results the page was told of
    _cleared: dict[str, int] = field(default_factory=dict)  # owner -> newest step of the complaints it was demoted for

    @classmethod
    def for_run(cls, cfg: RunConfig, client: PeerClient, run_id: str, me: str, trust_json: dict | None) -> Integrity:
        s = cfg.sync
        verifier = Verifier(client, run_id, me, make_codec(s.codec, s.block_size), s.chunk_bytes, s.clip_factor,
                            s.reject_below)
        return cls(cfg, Trust.from_json(trust_json, cfg.admission.probation_steps), verifier)

    # ------------------------------------------------------------------ deciding a round

    def roles(self, members: list[Member], rounds: Rounds) -> tuple[list[Member], list[Audit]]:
        """The members of the next round with their shard ownership set, and the audits it carries."""
        members = self.trust.assign_owners(members, None if rounds.group_size else MAX_OWNERS, self.rng.random,
                                           step=rounds.committed + 1)
        audits = self.audits(rounds.rounds.get(rounds.committed), members)
        self._assigned.update({shard_key(a): a for a in audits})
        self._picked.update((*shard_key(a), a.owner, a.auditor) for a in audits)
        return members, audits

    def audits(self, made: Round | None, members: Sequence[Member]) -> list[Audit]:
        """Audits of the shards of ``made`` (the round that produced the committed version)."""
        fraction = self.cfg.sync.audit_fraction
        if made is None or fraction <= 0:
            return []
        next_ids = {m.peer_id for m in members}
        out = []
        for stage, group, cells in groups_of(made):
            owners = made.shard_owners(stage, group)
            # who holds the result: its group in that round; who will be around to check it: of the next one
            pool = sorted(p for p in self.trust.eligible(cells) if p in next_ids)  # (sorted once, not per shard)
            for shard, owner in enumerate(owners):
                if self.rng.random() >= fraction:
                    continue
                at = bisect.bisect_left(pool, owner)
                mine = at < len(pool) and pool[at] == owner  # the candidates are the pool without the owner
                if len(pool) > mine:
                    i = self.rng.randrange(len(pool) - mine)  # (draws as rng.choice of the candidates would)
                    first = pool[i + 1 if mine and i >= at else i]
                    out.append(Audit(step=made.step, epoch=made.epoch, stage=stage, group=group, shard=shard,
                                     owner=owner, auditor=first))
                    second = self.cfg.sync.second_audit  # (drawn only when asked for: the draws are otherwise as before)
                    if second > 0 and len(pool) - mine >= 2 and self.rng.random() < second:  # (a colluder's lie)
                        others = [p for p in pool if p not in (owner, first)]
                        out.append(Audit(step=made.step, epoch=made.epoch, stage=stage, group=group, shard=shard,
                                         owner=owner, auditor=others[self.rng.randrange(len(others))]))
        if len(out) > MAX_AUDITS:  # (a round carries at most that many: past it, a random subset of the shards)
            out = sorted(self.rng.sample(out, MAX_AUDITS), key=lambda a: (a.stage, a.shard))
        return out

    # ------------------------------------------------------------------ what auditors report

    def observe(self, records: dict[str, PeerRecord], round_at: Callable[[int], Round | None]) -> list[tuple[str, str]]:
        """Reports of the auditors that were picked: a lie goes to the verifier; events as (peer, message). Each report
        is acted on once, so ``records`` need only be those that changed since the last call (the coordinator gives
        its table's: at 1,000 peers a pass over every record was 1 ms of every tick)."""
        events: list[tuple[str, str]] = []
        for rec in records.values():
            for r in rec.audits:
                if r.verdict in ("unreceipted", "short"):  # (complaints: :meth:`complaints`)
                    continue
                if r.verdict == "omitted":  # (any contributor may hold such a proof: no pick needed; not an audit)
                    if (made := round_at(r.step)) is not None and (e := self._omission(r, rec.peer_id, made)):
                        events.append(e)
                    continue
                self._answered.add(shard_key(r))
                key = (*shard_key(r), r.owner, rec.peer_id, r.verdict)
                if r.verdict == "ok" and key not in self._oks:
                    self._oks.add(key)
                    if self._was_picked(r, rec.peer_id, round_at):
                        self._vouched.setdefault(shard_key(r), set()).add(rec.peer_id)
                        self._oks_of.setdefault(shard_key(r), {})[rec.peer_id] = r.result
                        if shard_key(r) in self._lies:  # (its ok came after the lie was proven)
                            self._colluders += self._vouchers(shard_key(r))
                if key in self._reported or r.verdict == "ok":
                    continue
                self._reported.add(key)
                made = round_at(r.step)
                if not self._was_picked(r, rec.peer_id, round_at) or made is None:
                    continue  # nobody asked it: an accusation nobody can weigh is not acted on
                if r.verdict == "unserved":
                    events.append((r.owner, f"did not show the inputs of its shard {r.shard} of step {r.step} to "
                                            f"its auditor {short_id(rec.peer_id)}: {r.reason}"))
                    continue
                others = [m for m in made.group_members(r.stage, r.group) if m.peer_id != rec.peer_id]
                holders = [(rec.peer_id, rec.address)] + [(m.peer_id, m.address) for m in others]
                shards = len(made.shard_owners(r.stage, r.group))
                handed = tuple(made.handed(r.step, r.stage, r.group).items())
                if self.verifier is not None and self.verifier.want(Accusation(r, rec.peer_id, tuple(holders), shards,
                                                                               handed)):
                    events.append((r.owner, f"{short_id(rec.peer_id)}, auditing shard {r.shard} of step {r.step}, "
                                            f"says its result is false ({r.reason}); checking the evidence"))
        return events

    def complaints(self, records: dict[str, PeerRecord], round_at: Callable[[int], Round | None]
                   ) -> list[tuple[str, str, str]]:
        """The complaints in ``records`` (``unreceipted``, ``short``), each counted once per step and member: from a
        member of that step's group, past probation then, against the owner of the shard it names. A short result is
        said on the page once; an owner named in ``sync.demote_after`` of the last :data:`COMPLAINT_STEPS` steps by two
        or more members is demoted (:meth:`~potluck.coordinator.trust.trust.Trust.demote`). Events as (kind, peer,
        message)."""
        out: list[tuple[str, str, str]] = []
        for rec in records.values():
            for r in rec.audits:
                if r.verdict not in ("unreceipted", "short") or (made := round_at(r.step)) is None:
                    continue
                cells, owners = made.group_members(r.stage, r.group), made.shard_owners(r.stage, r.group)
                if (r.shard >= len(owners) or owners[r.shard] != r.owner or r.owner == rec.peer_id
                        or r.step <= self._cleared.get(r.owner, 0)  # (what it was demoted for, repeated in records)
                        or rec.peer_id not in self.trust.eligible(cells, before=r.step)):
                    continue  # (nobody can weigh it: not a member then, not trusted then, or not that shard's owner)
                if r.verdict == "short" and (key := (*shard_key(r), r.owner)) not in self._said_short:
                    self._said_short.add(key)
                    out.append(("short", r.owner, f"its result of shard {r.shard} of step {r.step} named too few of "
                                                  f"the step's contributors (sync.quorum {self.cfg.sync.quorum:g}): not "
                                                  "adopted; its backup took the shard over"))
                    for old in sorted(self._said_short)[:-4 * MAX_AUDITS]:
                        self._said_short.discard(old)
                self._named.setdefault(r.owner, {}).setdefault(r.step, set()).add(rec.peer_id)
                if (e := self._demote(r.owner)) is not None:
                    out.append(e)
        return out

    def _demote(self, owner: str) -> tuple[str, str, str] | None:
        """``owner`` demoted if the complaints against it are enough (:meth:`complaints`): the event."""
        after, by_step = self.cfg.sync.demote_after, self._named[owner]
        newest = max(by_step)
        for s in [s for s in by_step if s <= newest - COMPLAINT_STEPS]:
            del by_step[s]
        accusers = set().union(*by_step.values())
        if after <= 0 or len(by_step) < after or len(accusers) < 2:
            return None
        del self._named[owner]
        self._cleared[owner] = newest
        until = newest + 1 + self.cfg.sync.demote_steps
        self.trust.demote(owner, until)
        return ("demoted", owner, f"{len(accusers)} members said it withheld (contributions it did not receipt, or "
                                  f"results short of the quorum) in {len(by_step)} of the last {COMPLAINT_STEPS} steps: "
                                  f"it owns no shard before step {until} (it still trains and contributes)")

    def _was_picked(self, r: AuditReport, auditor: str, round_at: Callable[[int], Round | None]) -> bool:
        """Was ``auditor`` picked to audit the shard ``r`` names? As a round this coordinator decided said (a rollback
        may have replaced the round that carried the audit since), or the round of the step after as kept."""
        if (*shard_key(r), r.owner, auditor) in self._picked:
            return True
        nxt = round_at(r.step + 1)
        return nxt is not None and any((*shard_key(a), a.owner, a.auditor) == (*shard_key(r), r.owner, auditor)
                                       for a in nxt.audits)

    def _omission(self, r: AuditReport, accuser: str, made: Round) -> tuple[str, str] | None:
        """A contributor says ``r.owner`` receipted its contribution and left it out of its signed result: to the
        verifier if both were members of that group and ``r.owner`` could sign that shard's result (its owner, or
        after a take-over any owner of the group); the event, or None when nobody can weigh it."""
        cells = made.group_members(r.stage, r.group)
        ids, owners = {m.peer_id for m in cells}, made.shard_owners(r.stage, r.group)
        if accuser not in ids or r.shard >= len(owners) or (owners[r.shard] != r.owner if r.attempt == 0
                                                              else r.owner not in owners):
            return None
        holders = [(m.peer_id, m.address) for m in sorted(cells, key=lambda m: m.peer_id != accuser)]  # (accuser first)
        handed = tuple(made.handed(r.step, r.stage, r.group).items())
        if self.verifier is None or not self.verifier.want(Accusation(r, accuser, tuple(holders), len(owners), handed)):
            return None
        return r.owner, (f"{short_id(accuser)} says it receipted its contribution to shard {r.shard} of step {r.step} "
                         "and left it out of its signed result; checking the proof")

    def evicted(self, peer_id: str, round_at: Callable[[int], Round | None], committed: int) -> int:
        """``peer_id`` was evicted (for whatever reason): the shards it owned in the kept steps that no picked auditor
        vouched for are audited again, by the coordinator itself; one that cannot be (its owner gone with its inputs)
        is rolled back (:meth:`verdict`), so damage done before the eviction does not stay in the model. Returns how
        many it audits."""
        if self.verifier is None:
            return 0
        asked = 0
        for step in range(max(1, committed - KEEP_ROUNDS + 1), committed + 1):
            if (rnd := round_at(step)) is None or rnd.step != step:
                continue
            for stage, group, cells in groups_of(rnd):
                owners = rnd.shard_owners(stage, group)
                for shard, owner in enumerate(owners):
                    key = (step, rnd.epoch, stage, group, shard)
                    if owner != peer_id or self._vouched.get(key, set()) - {peer_id} or key in self._rechecks:
                        continue
                    self._rechecks.add(key)
                    holders = tuple((m.peer_id, m.address) for m in sorted(cells, key=lambda m: m.peer_id != owner))
                    report = AuditReport(step=step, epoch=rnd.epoch, stage=stage, group=group, shard=shard, owner=owner,
                                         verdict="lie")
                    asked += self.verifier.want(Accusation(report, "", holders, len(owners),
                                                           tuple(rnd.handed(step, stage, group).items())))
        return asked

    def verdicts(self) -> list[Verdict]:
        """The verdicts of the rulings made since the last call, and after each proven lie the eviction of every picked
        auditor that said ok to it (:meth:`_vouchers`)."""
        out = []
        for ruling in self.verifier.results() if self.verifier is not None else []:
            v = self.verdict(ruling)
            out.append(v)
            if v.kind == "proven" and ruling.accusation.report.verdict != "omitted":
                key = shard_key(ruling.accusation.report)
                self._lies[key] = (v.evict, ruling.result)
                out += self._vouchers(key)
        out += self._colluders
        self._colluders = []
        return out

    def _vouchers(self, key: tuple[int, ...]) -> list[Verdict]:
        """Evictions of the picked auditors that said ok to the shard result ``key``, which is proven a lie: to that very
        result, by its signature (an owner that signs two results may have shown an honest auditor the other).
        Recomputing from the inputs its owner signed for is deterministic, and the inputs shown must be those the result
        names by digest, so an honest auditor cannot say ok to it: it colluded with the owner (or did not audit at
        all). Each is evicted once."""
        (owner, proven), oks = self._lies[key], self._oks_of.pop(key, {})
        step, shard = key[0], key[-1]
        return [Verdict(p, 0, f"evicted: it audited shard {shard} of step {step} and said ok; that result is proven "
                              f"false (its owner {short_id(owner)} evicted for it)", "evicted")
                for p, result in sorted(oks.items()) if p != owner and proven and result == proven]

    def judge(self, revoke: Callable[[str], None], retract: Callable[[int, str], list],
              event: Callable[[str, str, str, bool], None]) -> list:
        """Carry out the rulings made since the last call: evict whom each names (``revoke``: admission's), say
        so (``event``), and take back the step a proven lie made (``retract``); the rounds' events of that."""
        out: list = []
        for v in self.verdicts():
            event(v.kind, self.evict(v, revoke), v.message, v.warn)
            if v.retract:
                out += retract(v.retract, v.message)
        return out

    def verdict(self, ruling: Ruling) -> Verdict:
        r, auditor = ruling.accusation.report, ruling.accusation.auditor
        where = f"shard {r.shard} of step {r.step}"
        self._final.discard(shard_key(r))
        if not auditor and shard_key(r) in self._rechecks:  # an evicted owner's shard, audited again
            if ruling.verdict == "lie":
                return Verdict(r.owner, r.step, f"proven after its eviction: its signed result of {where} is not the "
                                                f"average of its signed inputs ({ruling.detail}); the run goes back to "
                                                f"before step {r.step}", "proven")
            if ruling.verdict == "false":
                return Verdict("", 0, f"{where}, owned by the evicted {short_id(r.owner)}: audited by the coordinator: ok",
                               "audit", warn=False)
            return Verdict("", r.step, f"{where}, owned by the evicted {short_id(r.owner)}, could not be audited "
                                       f"({ruling.detail}): the run goes back to before step {r.step}", "audit")
        if not auditor and ruling.verdict != "lie":  # the coordinator's own audit
            return Verdict("", 0, f"{where} audited by the coordinator: "
                                  f"{'ok' if ruling.verdict == 'false' else ruling.detail}", "audit",
                           warn=ruling.verdict != "false")
        if r.verdict == "omitted":
            if ruling.verdict == "lie":
                return Verdict(r.owner, r.step, f"proven: {ruling.detail} ({where}); evicted, and the run goes back to "
                                                f"before step {r.step}", "proven")
            if ruling.verdict == "false":
                return Verdict(auditor, 0, f"evicted: it said {short_id(r.owner)} left its contribution out of {where}, "
                                           f"and it did not ({ruling.detail})", "evicted")
            if ruling.verdict == "rightly":
                return Verdict("", 0, f"{short_id(auditor)} says {short_id(r.owner)} left its contribution out of "
                                      f"{where}, and it did, rightly ({ruling.detail}); nobody is evicted", "audit")
            return Verdict("", 0, f"could not check {short_id(auditor)}'s proof against {short_id(r.owner)} ({where}): "
                                  f"{ruling.detail}", "audit")
        if ruling.verdict == "lie":
            return Verdict(r.owner, r.step, f"proven: its signed result of {where} is not the average of the signed "
                                            f"contributions it names ({ruling.detail}); evicted, and the run goes "
                                            f"back to before step {r.step}", "proven")
        if ruling.verdict == "false":
            return Verdict(auditor, 0, f"evicted: it said {short_id(r.owner)}'s result of {where} was false, and it "
                                       f"is not ({ruling.detail})", "evicted")
        return Verdict("", 0, f"could not check {short_id(auditor)}'s accusation against {short_id(r.owner)} ({where}): "
                              f"{ruling.detail}", "audit")

    def audited_to_the_end(self, round_at: Callable[[int], Round | None], committed: int) -> bool:
        """Before the run ends, every audit is done: the last step has no next round to carry its audits, and a
        peer that ran ahead on the last plan may have finished before it saw its audit of the step before.
        The coordinator audits those shards itself (the last step's each with the usual probability), and the
        run ends once they are ruled on."""
        if self.cfg.sync.audit_fraction <= 0 or self.verifier is None:
            return True
        made = round_at(committed)
        if made is not None and made.step == committed and (made.step, made.epoch, -1, -1, -1) not in self._answered:
            self._answered.add((made.step, made.epoch, -1, -1, -1))  # (the last step: drawn once)
            for stage, group, _ in groups_of(made):
                for shard, owner in enumerate(made.shard_owners(stage, group)):
                    if self.rng.random() < self.cfg.sync.audit_fraction:
                        a = Audit(step=made.step, epoch=made.epoch, stage=stage, group=group, shard=shard,
                                  owner=owner, auditor="")
                        self._assigned[shard_key(a)] = a
        for key, a in list(self._assigned.items()):
            if key in self._answered or (rnd := round_at(a.step)) is None or rnd.epoch != a.epoch:
                continue
            self._answered.add(key)
            cells = rnd.group_members(a.stage, a.group)
            holders = tuple((m.peer_id, m.address) for m in sorted(cells, key=lambda m: m.peer_id != a.owner))
            report = AuditReport(step=a.step, epoch=a.epoch, stage=a.stage, group=a.group, shard=a.shard,
                                 owner=a.owner, verdict="lie")
            if self.verifier.want(Accusation(report, "", holders, len(rnd.shard_owners(a.stage, a.group)),
                                             tuple(rnd.handed(a.step, a.stage, a.group).items()))):
                self._final.add(key)
        return not self._final

    # ------------------------------------------------------------------ bookkeeping

    def committed(self, rnd: Round | None, step: int, reports: Iterable[Report]) -> None:
        self.trust.committed(rnd, step, reports)
        cut = step - KEEP_ROUNDS - 1  # (the rounds before are gone: an audit of them can be weighed no more; kept, the
        self._reported = {k for k in self._reported if k[0] >= cut}  # audits seen grew by each shard audited in the run)
        self._answered = {k for k in self._answered if k[0] >= cut}
        self._assigned = {k: a for k, a in self._assigned.items() if k[0] >= cut}
        self._picked = {k for k in self._picked if k[0] >= cut}
        self._vouched = {k: v for k, v in self._vouched.items() if k[0] >= cut}
        self._lies = {k: v for k, v in self._lies.items() if k[0] >= cut}
        self._oks_of = {k: v for k, v in self._oks_of.items() if k[0] >= cut}
        self._oks = {k for k in self._oks if k[0] >= cut}
        self._rechecks = {k for k in self._rechecks if k[0] >= cut}

    def rolled_back(self, to_version: int) -> None:
        self.trust.rolled_back(to_version)

    def evict(self, verdict: Verdict, revoke: Callable[[str], None]) -> str:
        """Carry out a verdict's eviction (``revoke``: admission's); the peer evicted, '' if none."""
        if verdict.evict:
            revoke(verdict.evict)
            self.trust.forget(verdict.evict)
        return verdict.evict

    def stop(self) -> None:
        if self.verifier is not None:
            self.verifier.stop()


def shard_key(s: ShardOf) -> tuple[int, int, int, int, int]:
    """What names one shard result of a run: step, epoch, stage, group, shard."""
    return s.step, s.epoch, s.stage, s.group, s.shard


def groups_of(rnd: Round) -> list[tuple[int, int, list[Member]]]:
    """Each averaging group of ``rnd`` as (stage, group, its members in shard order)."""
    return [(stage, group, cells) for stage in range(rnd.stages) for group, cells in rnd.stage_groups(stage).items()]
