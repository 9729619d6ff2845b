"""Withholding has a cost: a contribution an owner neither receipts nor refuses for the round's reasons goes to the
shard's backup at once and is named in the contributor's report; an owner named so (or for results short of the
quorum) in several steps by several members past probation loses shard ownership for a while. Over real gRPC in one
process (members as in tests/test_allreduce.py) for the peer's half; values made here for the coordinator's."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch
from pydantic import ValidationError
from test_allreduce import Member, random_deltas, run_all

from potluck.coordinator.trust.integrity import COMPLAINT_STEPS, Integrity
from potluck.coordinator.trust.trust import Trust
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.identity import Identity
from potluck.protos.testkit import faults
from potluck.protos.testkit.faults import parse
from potluck.protos.wire.records import AuditReport, PeerRecord
from potluck.protos.wire.records import Member as PlanMember
from potluck.protos.wire.records import Round as PlanRound


@pytest.fixture
def members() -> Iterator[list[Member]]:
    ms = [Member() for _ in range(4)]
    yield ms
    for m in ms:
        m.close()


def test_a_refused_contribution_goes_to_the_backup_at_once_and_its_owner_is_named(members: list[Member]) -> None:
    """Shard 0's owner refuses every contribution (OVERLOADED) and averages its own alone. Each contributor names it
    (unreceipted) and sends its slice to the shard's backup as soon as it is refused; the owner's result names 1 of 4,
    short of the quorum, so the backup takes the shard over with what it already holds: nothing is lost, and every
    member applies the exact mean. The backup's own slice is not sent anywhere: it adds it when it takes over."""
    order = sorted(members, key=lambda m: m.id)
    order[0].ar.inbox.tamper = functools.partial(faults.tamper, pending=parse("owner.refuse@1:all"))
    backup, received = order[1], []
    handler = backup.push_contribution

    def counted(chunks):  # type: ignore[no-untyped-def]
        def seen():  # type: ignore[no-untyped-def]
            for i, c in enumerate(chunks):
                if i == 0:
                    received.append((c.header.sender, c.shard, c.attempt))
                yield c
        return handler(seen())

    backup.push_contribution = counted  # type: ignore[method-assign]
    deltas = random_deltas(members)
    out = run_all(members, deltas, wait_s=4)  # (the owner waits for what it refuses until its deadline)
    assert all(isinstance(v, tuple) for v in out.values()), out
    means = [out[m.id][0] for m in order]  # type: ignore[index]
    assert all(torch.equal(means[0], x) for x in means[1:]), "members disagree"
    exact = torch.stack(list(deltas.values())).mean(0)
    assert float((means[0] - exact).abs().max()) < 2 * 0.05 / 127, "a contribution was lost"
    stats = {m.id: out[m.id][1] for m in order}  # type: ignore[index]
    for m in order[1:]:
        assert [s for s, _ in stats[m.id].unreceipted] == [0], (m.id, stats[m.id].unreceipted)
        assert "OVERLOADED" in stats[m.id].unreceipted[0][1]
        assert stats[m.id].short == [0]
    assert stats[order[0].id].unreceipted == [], "the owner sent to itself: nothing to name"
    assert stats[backup.id].taken_over == [0]
    # each other member's slice of shard 0 reached the backup once: sent when refused, not again for the take-over
    again = sorted(sender for sender, shard, attempt in received if (shard, attempt) == (0, 1))
    assert again == sorted(m.id for m in order if m is not backup), received


def test_an_honest_step_names_nobody(members: list[Member]) -> None:
    out = run_all(members, random_deltas(members), wait_s=10)
    assert all(isinstance(v, tuple) and v[1].unreceipted == [] and v[1].short == [] for v in out.values()), out


# ---------------------------------------------------------------- the coordinator's half, on values made here

IDS = sorted(Identity.generate().peer_id for _ in range(4))
X = IDS[0]  # shard 0's owner, named


def rounds(steps: int) -> dict[int, PlanRound]:
    members = [PlanMember(peer_id=p, address=f"h:{i}", replica=i, owns=True) for i, p in enumerate(IDS)]
    return {s: PlanRound(step=s, members=members) for s in range(1, steps + 1)}


def complaint(step: int, by: str, verdict: str = "unreceipted", owner: str = X, shard: int = 0) -> PeerRecord:
    return PeerRecord(peer_id=by, address="h", audits=[AuditReport(step=step, shard=shard, owner=owner,
                                                                   verdict=verdict)])  # type: ignore[arg-type]


def integrity(**sync: object) -> Integrity:
    cfg = RunConfig.model_validate({"sync": {"demote_after": 3, "demote_steps": 10, **sync}})
    return Integrity(cfg, Trust(0, founders=set(IDS)))


def test_an_owner_named_by_two_members_in_three_steps_loses_ownership_for_a_while() -> None:
    """One member naming the owner at every step demotes nobody (a bad link, or a liar); a second member's word in
    the third step does. The next rounds give the owner no shard (it still takes part), until ``sync.demote_steps``
    have passed; the journal keeps the demotion."""
    made = rounds(6)
    ig = integrity()
    events = []
    for step in (1, 2, 3):
        events += ig.complaints({IDS[1]: complaint(step, IDS[1])}, made.get)
    assert events == [] and not ig.trust.demoted, "one member alone demotes nobody"
    events += ig.complaints({IDS[2]: complaint(3, IDS[2], "short")}, made.get)
    assert [(k, p) for k, p, _ in events] == [("short", X), ("demoted", X)], events
    assert "owns no shard before step 14" in events[-1][2]
    assert ig.complaints({IDS[2]: complaint(3, IDS[2], "short")}, made.get) == [], "each said once"
    for step in (1, 2, 3):  # (records repeat their reports for a while: what it was demoted for counts once)
        assert ig.complaints({IDS[1]: complaint(step, IDS[1]), IDS[3]: complaint(step, IDS[3])}, made.get) == []
    members = [m.model_copy(update={"owns": False}) for m in made[1].members]
    owns = {m.peer_id: m.owns for m in ig.trust.assign_owners(members, step=5)}
    assert owns == {p: p != X for p in IDS}
    again = Trust.from_json(ig.trust.to_json(), 0)
    assert again.demoted == {X: 14}
    owns = {m.peer_id: m.owns for m in again.assign_owners(members, step=14)}
    assert owns == dict.fromkeys(IDS, True) and again.demoted == {}, "its time served, it owns again"


def test_complaints_nobody_can_weigh_count_for_nothing() -> None:
    """Not a member of that step, not past probation then, naming itself, naming a peer for a shard it does not own,
    a step the coordinator does not know: none counts; nor do complaints older than the window; demote_after 0
    demotes nobody."""
    made = rounds(40)
    stranger = Identity.generate().peer_id
    ig = integrity()
    for step in (1, 2, 3):
        for rec in (complaint(step, stranger), complaint(step, X), complaint(step, IDS[1], owner=IDS[2]),
                    complaint(step + 100, IDS[1])):
            assert ig.complaints({rec.peer_id: rec}, made.get) == []
    assert not ig.trust.demoted
    fresh = Integrity(RunConfig.model_validate({"sync": {"demote_after": 3}}), Trust(3, founders={X}))
    for step in (1, 2, 3):  # (the founders own while nobody is trusted: the others are on probation)
        for by in IDS[1:3]:
            assert fresh.complaints({by: complaint(step, by)}, made.get) == []
    assert not fresh.trust.demoted
    ig = integrity()
    for step, by in ((1, IDS[1]), (2, IDS[2]), (2 + COMPLAINT_STEPS, IDS[1])):
        ig.complaints({by: complaint(step, by)}, made.get)
    assert not ig.trust.demoted, "steps 1 and 2 fell out of the window"
    never = integrity(demote_after=0)
    for step in range(1, 10):
        for by in IDS[1:]:
            never.complaints({by: complaint(step, by)}, made.get)
    assert not never.trust.demoted


def test_a_stage_of_demoted_owners_still_has_owners() -> None:
    """Every eligible member demoted: the others own (on probation or not); every member demoted: the eligible."""
    members = [PlanMember(peer_id=p, address="h", replica=i) for i, p in enumerate(IDS)]
    trust = Trust(3, founders=set(IDS[:2]))
    for p in IDS[:2]:
        trust.demote(p, 20)
    assert {m.peer_id for m in trust.assign_owners(members, step=5) if m.owns} == set(IDS[2:])
    for p in IDS:
        trust.demote(p, 20)
    assert {m.peer_id for m in trust.assign_owners(members, step=5) if m.owns} == set(IDS[:2])


def test_the_first_founder_past_probation_does_not_own_every_shard_alone() -> None:
    """A run's founders own from its first step. The first of them credited with its probation's work (its reports
    came first) once became the only eligible one, the sole owner of its stage's all-reduce for a round: with one
    shard there is no quorum to fall short of, and an owner refusing every contribution averaged its own alone (the
    refusal swarm test, under load). Founders stay eligible beside whoever is trusted; a later key waits."""
    founders, late = IDS[:3], IDS[3]
    trust = Trust(3, work={founders[0]: [1, 2, 3]}, founders=set(founders))
    members = [PlanMember(peer_id=p, address="h", replica=i) for i, p in enumerate(IDS)]
    assert trust.eligible(members) == set(founders)
    assert {m.peer_id for m in trust.assign_owners(members) if m.owns} == set(founders)
    trust.work[late] = [4, 5, 6]
    assert trust.eligible(members) == set(IDS)


@pytest.mark.parametrize("bad", [{"demote_after": -1}, {"demote_after": 65}, {"demote_steps": 0},
                                 {"demote_after": "often"}])
def test_bad_demotion_settings_are_refused(bad: dict) -> None:
    with pytest.raises(ValidationError):
        RunConfig.model_validate({"sync": bad})


# ---------------------------------------------------------------- colluding auditors

class Rulings:
    """A verifier that rules as told (the proofs themselves are tested in tests/test_receipts.py)."""

    def __init__(self) -> None:
        self.ready: list = []

    def want(self, acc: object) -> bool:
        return True

    def results(self) -> list:
        out, self.ready = self.ready, []
        return out


@pytest.mark.parametrize("ok_first", [True, False])
def test_an_auditor_that_said_ok_to_a_proven_lie_is_evicted_with_its_owner(ok_first: bool) -> None:
    """Shard 0 of step 1 (owner X) is audited by A, which says ok, and by B, which says lie; the lie is proven. A
    recomputed (or said it did) a result from inputs fixed by their digests, deterministically: its ok is false, and
    it is evicted with X, whichever of its report and the proof comes first. An auditor that said ok to another,
    honest shard is not; nor is one that said ok to a shard proven only to leave a contribution out, nor one that
    said ok to another result of the same shard (an owner signing two may have shown it an honest one)."""
    from potluck.coordinator.trust.verifier import Accusation, Ruling
    from potluck.protos.wire.records import Audit

    a, b = IDS[1], IDS[2]
    made = rounds(2)
    made[2] = made[2].model_copy(update={"audits": [Audit(step=1, shard=0, owner=X, auditor=a),
                                                    Audit(step=1, shard=0, owner=X, auditor=b),
                                                    Audit(step=1, shard=1, owner=a, auditor=IDS[3])]})
    rulings = Rulings()
    ig = Integrity(RunConfig(), Trust(0, founders=set(IDS)), verifier=rulings)  # type: ignore[arg-type]

    def ok(by: str, shard: int, owner: str, result: str = "ab" * 64) -> None:
        ig.observe({by: PeerRecord(peer_id=by, address="h", audits=[AuditReport(step=1, shard=shard, owner=owner,
                                                                                verdict="ok", result=result)])}, made.get)

    lie = AuditReport(step=1, shard=0, owner=X, verdict="lie")
    ok(IDS[3], 1, a)
    if ok_first:
        ok(a, 0, X)
    rulings.ready = [Ruling(Accusation(lie, b, (), 4), "lie", "not the average", "ab" * 64)]
    verdicts = ig.verdicts()
    if not ok_first:
        assert [(v.evict, v.kind) for v in verdicts] == [(X, "proven")]
        ok(a, 0, X)
        verdicts += ig.verdicts()
    assert [(v.evict, v.kind) for v in verdicts] == [(X, "proven"), (a, "evicted")], verdicts
    assert "said ok" in verdicts[-1].message
    ok(a, 0, X)
    assert ig.verdicts() == [], "evicted once"
    omission = AuditReport(step=1, shard=1, owner=a, verdict="omitted")
    rulings.ready = [Ruling(Accusation(omission, b, (), 4), "lie", "left out what it receipted")]
    assert [(v.evict, v.kind) for v in ig.verdicts()] == [(a, "proven")], "IDS[3]'s ok was not false: it is not evicted"
    other = AuditReport(step=1, shard=2, owner=IDS[3], verdict="lie")
    made[2] = made[2].model_copy(update={"audits": [Audit(step=1, shard=2, owner=IDS[3], auditor=b)]})
    ok(b, 2, IDS[3], result="cd" * 64)
    rulings.ready = [Ruling(Accusation(other, X, (), 4), "lie", "not the average", "ab" * 64)]
    assert [(v.evict, v.kind) for v in ig.verdicts()] == [(IDS[3], "proven")], "b said ok to another result"


def test_an_omission_of_an_over_claim_evicts_nobody() -> None:
    """A contributor that trained on an earlier decision of the round claims more samples than the round its owner
    and the coordinator hold hands it; the owner receipted it before it knew the round, then left it out. The
    contributor's complaint is true, and the omission was right: nobody is evicted (a run under churn once evicted
    the honest contributor here). A complaint the evidence proves false still evicts its maker."""
    from potluck.coordinator.trust.verifier import Accusation, Ruling

    rulings = Rulings()
    ig = Integrity(RunConfig(), Trust(0, founders=set(IDS)), verifier=rulings)  # type: ignore[arg-type]
    said = AuditReport(step=1, shard=0, owner=X, verdict="omitted")
    rulings.ready = [Ruling(Accusation(said, IDS[1], (), 4), "rightly", "claims 80 samples, more than the 72")]
    verdicts = ig.verdicts()
    assert [(v.evict, v.kind, v.retract) for v in verdicts] == [("", "audit", 0)], verdicts
    assert "rightly" in verdicts[0].message and "nobody is evicted" in verdicts[0].message
    rulings.ready = [Ruling(Accusation(said, IDS[2], (), 4), "false", "its result names it")]
    assert [(v.evict, v.kind) for v in ig.verdicts()] == [(IDS[2], "evicted")]


def test_what_complaints_keep_stays_bounded_at_four_times_its_limits() -> None:
    """At 4x each limit: one member naming the owner at every step of 4 x COMPLAINT_STEPS steps keeps at most a
    window's steps (and demotes nobody: one accuser); short results of 4 x the kept number are said once each while
    at most 4 x MAX_AUDITS are remembered; a record carrying 4 x the 16 audit reports a record may hold is refused."""
    from potluck.coordinator.trust.integrity import MAX_AUDITS

    steps = 4 * COMPLAINT_STEPS
    made = rounds(steps)
    ig = integrity()
    for step in range(1, steps + 1):
        ig.complaints({IDS[1]: complaint(step, IDS[1])}, made.get)
        assert len(ig._named[X]) <= COMPLAINT_STEPS + 1
    assert not ig.trust.demoted
    many = 4 * 4 * MAX_AUDITS
    made = {s: PlanRound(step=s, members=[PlanMember(peer_id=p, address=f"h:{i}", replica=i, owns=True)
                                          for i, p in enumerate(IDS)]) for s in range(1, many + 1)}
    shorts = integrity(demote_after=0)
    said = 0
    for step in range(1, many + 1):
        said += len(shorts.complaints({IDS[1]: complaint(step, IDS[1], "short")}, made.get))
        assert len(shorts._said_short) <= 4 * MAX_AUDITS
    assert said == many, "each short result said once"
    with pytest.raises(ValidationError):
        PeerRecord(peer_id=IDS[1], address="h", audits=[AuditReport(step=s, shard=0, owner=X, verdict="short")
                                                        for s in range(1, 4 * 16 + 1)])  # type: ignore[arg-type]
