"""Signed receipts: an owner signs for every contribution it keeps, and a result that leaves a receipted one out is
a proof the contributor holds. Over real gRPC in one process (members as in tests/test_allreduce.py), and the
proof's rule on its own (potluck.compression.audit.omitted) with keys and digests made here."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch
from test_allreduce import BASE, BLOCK, RUN, Member, random_deltas, run_all

from potluck.compression.aggregate import contribution_digest, receipt_digest, result_digest
from potluck.compression.audit import ResultClaim, Round, Signed, Unverifiable, omitted
from potluck.compression.int8 import Int8BlockCodec
from potluck.compression.stream import tensor_digest
from potluck.coordinator.trust.verifier import Accusation, Verifier
from potluck.peer.reduce.shards import AllReduceStats
from potluck.protos import potluck_pb2 as pb
from potluck.protos.net.identity import Identity, verify
from potluck.protos.testkit import faults
from potluck.protos.testkit.faults import parse
from potluck.protos.wire.records import AuditReport


@pytest.fixture
def members() -> Iterator[list[Member]]:
    ms = [Member() for _ in range(4)]
    for m in ms:
        m.fetch_inputs = m.ar.inbox.on_fetch_inputs  # type: ignore[attr-defined]
    yield ms
    for m in ms:
        m.close()


def step(ms: list[Member], drop: str = "") -> tuple[list[Member], dict[str, AllReduceStats], dict[str, torch.Tensor]]:
    """All-reduce step 1 (shard 0's owner dropping what it receipted as told), then every member expects step 2
    (step 1 is kept). The members in shard order, each one's stats and each one's mean; the members agree, and
    unless an honest contributor was left out of an adopted result, their mean is every member's delta averaged (a
    result short of a quorum is taken over by its backup)."""
    order = sorted(ms, key=lambda m: m.id)
    if drop:
        order[0].ar.tamper = functools.partial(faults.tamper, pending=parse(f"owner.drop@1:{drop}"))
    deltas = random_deltas(ms)
    out = run_all(ms, deltas, wait_s=10)
    assert all(isinstance(v, tuple) for v in out.values()), out
    means = {pid: v[0] for pid, v in out.items()}  # type: ignore[index]
    first = next(iter(means.values()))
    assert all(torch.equal(first, x) for x in means.values()), "members disagree"
    if drop != "one":
        exact = torch.stack(list(deltas.values())).mean(0)
        assert float((first - exact).abs().max()) < 2 * 0.05 / 127, "a contribution was lost"
    for m in ms:
        m.ar.expect(2, "c" * 32)
    return order, {pid: v[1] for pid, v in out.items()}, means  # type: ignore[index]


def report_of(order: list[Member], shard: int = 0) -> AuditReport:
    return AuditReport(step=1, epoch=0, shard=shard, owner=order[shard].id, verdict="omitted")


def rule(order: list[Member], accuser: Member, shard: int = 0) -> tuple[str, str]:
    verifier = Verifier(accuser.client, RUN, Identity.generate().peer_id, Int8BlockCodec(BLOCK), 4096, 4.0, -0.1)
    try:
        holders = ((accuser.id, accuser.address), (order[shard].id, order[shard].address))
        ruling = verifier.rule(Accusation(report_of(order, shard), accuser.id, holders, 4))
        return ruling.verdict, ruling.detail
    finally:
        verifier.stop()


def test_every_contribution_kept_is_receipted_and_an_honest_step_leaves_nobody_out(members: list[Member]) -> None:
    order, stats, _ = step(members)
    assert all(s.omitted == [] and s.short == [] for s in stats.values())
    for k, m in enumerate(order):  # (the step moved on: what each sent, as the kept step holds it)
        for j, owner in enumerate(order):
            if j == k:
                continue
            mine = m.ar.inbox.own_input(1, 0, j, 0)
            assert mine is not None
            d = contribution_digest(RUN, 1, 0, j, 4, 0, BASE, m.id, mine.chunk_digests(), mine.samples)
            assert mine.receipt and verify(owner.id, receipt_digest(d), mine.receipt), (k, j)


@pytest.mark.parametrize("drop,left_out", [("others", 3), ("one", 1)])
def test_an_owner_that_leaves_out_what_it_receipted_is_proven_by_each_it_left_out(
        members: list[Member], drop: str, left_out: int) -> None:
    """Shard 0's owner receipts every contribution and averages only its own (or drops one honest contributor):
    its result is validly signed and its audit would pass (it names only what it averaged). Each contributor it
    left out finds it at once and holds the proof; the coordinator's check of that proof says lie; a contributor
    that was named, or one crying wolf over an honest shard, is found false."""
    order, stats, _ = step(members, drop)
    accusers = [m for m in order[1:] if stats[m.id].omitted]
    assert len(accusers) == left_out
    assert all(stats[m.id].omitted == [(0, 0, order[0].id)] for m in accusers)
    # averaging only its own, its result names 1 of the step's 4 contributors: short of the quorum (0.5), taken over
    # by shard 0's backup, so nothing is lost; leaving one out, it names 3 of 4: adopted, and only proven
    assert all(s.short == ([0] if drop == "others" else []) for s in stats.values()), {k: v.short for k, v in stats.items()}
    for accuser in accusers:
        verdict, detail = rule(order, accuser)
        assert verdict == "lie" and "receipted" in detail, detail
    for m in [m for m in order[1:] if m not in accusers]:  # (it named them: an accusation from them is false)
        assert cry_wolf(order, m, 0) == "false"
    assert cry_wolf(order, order[0], 2) == "false", "shard 2's owner is honest: it named order[0]'s contribution"
    assert rule(order, order[3], 1)[0] == "unverifiable", "an accuser that shows no receipt proves nothing"


def cry_wolf(order: list[Member], m: Member, shard: int) -> str:
    """``m`` accuses ``shard``'s owner, showing its own receipted contribution, which the result names."""
    mine = m.ar.inbox.own_input(1, 0, shard, 0)
    assert mine is not None and mine.receipt
    m.ar.inbox.keep_evidence(1, 0, shard, 0, {m.id: mine})
    verdict, detail = rule(order, m, shard)
    assert verdict != "false" or "names" in detail, detail
    return verdict


# ---------------------------------------------------------------- the rule, on values made here

def signed_round(owner: Identity, sender: Identity, *, name_it: bool = True, receipt_by: Identity | None = None,
                 samples: int = 8, handed: int = 8) -> tuple[Round, ResultClaim, str, Signed]:
    rnd = Round(RUN, 3, 1, 0, 2, "base", 4, {sender.peer_id: handed})
    chunk = pb.Tensor(name="shard0", payload=b"\x01\x02\x03\x04", numel=4)
    digests = [tensor_digest(chunk)]
    d = contribution_digest(RUN, 3, 1, 0, 2, 0, "base", sender.peer_id, digests, samples)
    contribution = Signed([chunk], sender.peer_id, sender.sign(d), digests, samples,
                          (receipt_by or owner).sign(receipt_digest(d)))
    other = Identity.generate()
    inputs = sorted([owner.peer_id, other.peer_id] + ([sender.peer_id] if name_it else []))
    input_digests = [d if p == sender.peer_id else bytes(32) for p in inputs]
    result_digests = [tensor_digest(chunk)]
    sig = owner.sign(result_digest(RUN, 3, 1, 0, 2, 0, "base", inputs, [], [], result_digests,
                                   zip(inputs, input_digests, strict=True), [1] * len(inputs)))
    claim = ResultClaim(0, inputs, [], [], inputs, input_digests, Signed([chunk], owner.peer_id, sig, result_digests),
                        [1] * len(inputs))
    return rnd, claim, sender.peer_id, contribution


def test_the_omission_rule() -> None:
    owner, sender = Identity.generate(), Identity.generate()
    assert omitted(*signed_round(owner, sender, name_it=False))[0] == "lie"
    assert omitted(*signed_round(owner, sender, name_it=True))[0] == "false", "named: no proof"
    verdict, why = omitted(*signed_round(owner, sender, name_it=False, receipt_by=Identity.generate()))
    assert verdict == "false" and "no receipt" in why, "a receipt by someone else proves nothing against the owner"
    verdict, why = omitted(*signed_round(owner, sender, name_it=False, samples=9, handed=8))
    # an over-claim is left out rightly, and saying so is no lie either: an honest sender that trained on an
    # earlier decision of the round claims what it trained, and the owner receipted before it knew the round
    assert verdict == "rightly" and "more than" in why
    assert omitted(*signed_round(owner, sender, name_it=False, samples=8, handed=8))[0] == "lie", "a claim of its share"
    rnd, claim, _, contribution = signed_round(owner, sender, name_it=False)
    with pytest.raises(Unverifiable):  # a result not signed by its signer
        omitted(rnd, ResultClaim(**{**vars(claim), "result": Signed(claim.result.chunks, owner.peer_id, b"x" * 64)}),
                sender.peer_id, contribution)
    with pytest.raises(Unverifiable):  # a contribution not signed by its sender
        omitted(rnd, claim, sender.peer_id, Signed(contribution.chunks, sender.peer_id, b"y" * 64,
                                                   contribution.digests, contribution.samples, contribution.receipt))


# ---------------------------------------------------------------- an evicted owner's steps

def test_an_evicted_owners_unvouched_shards_are_audited_again_or_rolled_back() -> None:
    """When a peer is evicted, for whatever reason, the shards it owned in the kept steps that no picked auditor
    vouched for go to the coordinator's own audit; a ruling of "lie" proves it, "false" leaves the step, and
    "unverifiable" (gone with its inputs) takes the run back to before that step. Values only: a verifier that
    records what it is asked."""
    from potluck.coordinator.trust.integrity import Integrity
    from potluck.coordinator.trust.trust import Trust
    from potluck.coordinator.trust.verifier import Ruling
    from potluck.protos.config.runconfig import RunConfig
    from potluck.protos.wire.records import Audit, Member, PeerRecord
    from potluck.protos.wire.records import Round as PlanRound

    class Asked:
        def __init__(self) -> None:
            self.asked: list[Accusation] = []

        def want(self, acc: Accusation) -> bool:
            self.asked.append(acc)
            return True

    ids = [Identity.generate().peer_id for _ in range(3)]
    x = ids[0]
    members = [Member(peer_id=p, address=f"h:{i}", replica=i) for i, p in enumerate(ids)]
    rounds = {s: PlanRound(step=s, members=members) for s in (1, 2, 3)}
    shard_of_x = [m.peer_id for m in members].index(x)
    rounds[2] = rounds[2].model_copy(update={"audits": [Audit(step=1, shard=shard_of_x, owner=x, auditor=ids[1])]})
    asked = Asked()
    integrity = Integrity(RunConfig(), Trust(0), verifier=asked)  # type: ignore[arg-type]
    vouch = PeerRecord(peer_id=ids[1], address="h:1", audits=[AuditReport(step=1, shard=shard_of_x, owner=x,
                                                                          verdict="ok")])
    integrity.observe({ids[1]: vouch}, rounds.get)
    assert integrity.evicted(x, rounds.get, 3) == 2
    assert sorted(a.report.step for a in asked.asked) == [2, 3], "step 1 was vouched for by its picked auditor"
    assert all(a.auditor == "" and a.report.owner == x and a.holders[0][0] == x for a in asked.asked)
    assert integrity.evicted(x, rounds.get, 3) == 0, "asked once"
    by_step = {a.report.step: a for a in asked.asked}
    lie = integrity.verdict(Ruling(by_step[2], "lie", "not the average"))
    assert (lie.evict, lie.retract, lie.kind) == (x, 2, "proven")
    gone = integrity.verdict(Ruling(by_step[3], "unverifiable", "no holder served the evidence"))
    assert (gone.evict, gone.retract) == ("", 3) and "goes back to before step 3" in gone.message
    ok = integrity.verdict(Ruling(by_step[3], "false", "its result is the average"))
    assert (ok.evict, ok.retract) == ("", 0)


def test_a_member_claims_at_most_what_the_round_it_commits_under_hands_it() -> None:
    """A member that trained on an earlier decision of the round (a longer share) claims the share of the round it
    contributes under: its owner would refuse more, after receipting it if the contribution came first."""
    from potluck.peer.outer.outer import claimable
    from potluck.peer.reduce.allreduce import MemberAddr, RoundInfo

    info = RoundInfo(step=3, members=(MemberAddr("a", "x"), MemberAddr("b", "y")), me="b", base_hash="h",
                     handed=(80, 72))
    assert claimable(info, 80) == 72
    assert claimable(info, 64) == 64, "less work than the share: claimed as it is"
    assert claimable(RoundInfo(step=3, members=info.members, me="b", base_hash="h"), 80) == 80, "no shares: unchecked"
