"""Verified reduction over real gRPC in one process: an auditor recomputes an owner's shard from the
signed contributions it averaged; every kind of lie is found, an honest owner passes, and the
coordinator's own check rules the same way (a false accusation is the accuser's lie)."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
from test_allreduce import BLOCK, RUN, Member, random_deltas, run_all

from potluck.compression.audit import Signed, Unverifiable, check
from potluck.compression.int8 import Int8BlockCodec
from potluck.coordinator.trust.verifier import Accusation, Verifier
from potluck.peer.reduce.audit import Auditor
from potluck.protos.net.identity import Identity
from potluck.protos.testkit import faults
from potluck.protos.testkit.faults import parse
from potluck.protos.wire.records import Audit, AuditReport

CLIP, REJECT = 4.0, -0.1


@pytest.fixture
def members() -> Iterator[list[Member]]:
    ms = [Member() for _ in range(4)]
    for m in ms:
        m.fetch_inputs = m.ar.inbox.on_fetch_inputs  # type: ignore[attr-defined]
    yield ms
    for m in ms:
        m.close()


def step_then_next(ms: list[Member], tamper: str = "") -> list[Member]:
    """All-reduce step 1 (the owner of shard 0 tampering as told, the others honest), then every member expects
    step 2 (step 1 is kept for its audit). Returns the members in shard order."""
    order = sorted(ms, key=lambda m: m.id)
    if tamper:
        point = "owner.flags" if tamper == "flag" else "owner.mean"
        order[0].ar.tamper = functools.partial(faults.tamper, pending=parse(f"{point}@1:{tamper}"))
    out = run_all(ms, random_deltas(ms), wait_s=10)
    assert all(isinstance(v, tuple) for v in out.values()), out
    for m in ms:
        m.ar.expect(2, "c" * 32)
    return order


def auditor_of(m: Member, reports: list[AuditReport]) -> Auditor:
    return Auditor(RUN, m.id, m.client, Int8BlockCodec(BLOCK), 4096, CLIP, REJECT, m.ar.inbox.held_result,
                   lambda a, inputs: m.ar.inbox.keep_evidence(a.step, a.epoch, a.shard, a.attempt, inputs), reports.append,
                   m.ar.inbox.own_input)


def audit(order: list[Member], shard: int, by: int) -> AuditReport:
    owner, auditor = order[shard], order[by]
    a = Audit(step=1, epoch=0, stage=0, shard=shard, owner=owner.id, auditor=auditor.id)
    return auditor_of(auditor, []).audit(a, owner.address)


def proven(order: list[Member], says: str, handed: tuple[tuple[str, int], ...] = ()) -> tuple[AuditReport, Verifier]:
    """Shard 0's owner is found lying by its auditor (``says`` in the reason) and by the coordinator's own check of
    the auditor's evidence, while shard 2's honest owner passes; the verifier, for more rulings (stop it)."""
    report = audit(order, 0, 1)
    assert report.verdict == "lie" and says in report.reason, report
    assert audit(order, 2, 3).verdict == "ok"
    auditor, owner = order[1], order[0]
    verifier = Verifier(auditor.client, RUN, Identity.generate().peer_id, Int8BlockCodec(BLOCK), 4096, CLIP, REJECT)
    acc = Accusation(report, auditor.id, ((auditor.id, auditor.address), (owner.id, owner.address)), 4, handed)
    ruling = verifier.rule(acc)
    if ruling.verdict != "lie" or says not in ruling.detail:
        verifier.stop()
        raise AssertionError(ruling)
    return report, verifier


def test_an_honest_owner_passes_its_audit(members: list[Member]) -> None:
    order = step_then_next(members)
    for shard in range(4):
        report = audit(order, shard, (shard + 1) % 4)
        assert report.verdict == "ok", report


@pytest.mark.parametrize("tamper,says", [
    ("shift=0.5", "not the average"), ("scale=3", "not the average"), ("flip", "not the average"),
    ("spike", "not the average"), ("flag", "as clipped"),
])
def test_every_lie_of_an_owner_is_found_and_the_coordinator_agrees(members: list[Member], tamper: str,
                                                                    says: str) -> None:
    """The owner of shard 0 shifts, scales, flips or spikes its mean, or names honest contributors as clipped
    over an honest mean. Its signed result still passes every member's checks (it is its own, validly signed):
    only the recomputation from the signed inputs finds it; the coordinator's check from the auditor's evidence
    finds the same, and the shards of honest owners pass."""
    order = step_then_next(members, tamper)
    report, verifier = proven(order, says)
    auditor = order[1]
    try:
        honest = report.model_copy(update={"shard": 2, "owner": order[2].id})
        ruling = verifier.rule(Accusation(honest, auditor.id, ((order[2].id, order[2].address),), 4))
        assert ruling.verdict == "false", ruling  # crying wolf over an honest shard is the accuser's lie
    finally:
        verifier.stop()


def test_inputs_that_are_not_their_senders_prove_nothing(members: list[Member]) -> None:
    """An owner (or a holder) that shows a contribution under another sender's name, or altered after it was
    signed, proves nothing against anyone: the check says so instead of blaming the owner."""
    order = step_then_next(members)
    held = order[1].ar.inbox.held_result(1, 0, 0)
    assert held is not None
    from potluck.compression.audit import decode_streams
    from potluck.protos import potluck_pb2 as pb

    req = pb.InputsRequest(header=pb.Header(run_id=RUN, sender=order[1].id, step=1), shard=0, num_shards=4)
    inputs = decode_streams(list(order[1].client.fetch_inputs(order[0].address, req, 10, peer=order[0].id)))
    sender = sorted(inputs)[1]
    forged = dict(inputs)
    chunk = forged[sender].chunks[0]
    altered = type(chunk)()
    altered.CopyFrom(chunk)
    altered.payload = bytes(len(chunk.payload))
    forged[sender] = Signed([altered, *forged[sender].chunks[1:]], sender, forged[sender].signature)
    with pytest.raises(Unverifiable, match="not signed by it"):
        check(held.round, held.claim, forged, Int8BlockCodec(BLOCK), 4096, CLIP, REJECT)
    assert check(held.round, held.claim, inputs, Int8BlockCodec(BLOCK), 4096, CLIP, REJECT) == ""


def weighted_step(ms: list[Member], owner_fault: str = "", greedy: bool = False) -> list[Member]:
    """Step 1 with members of different work (160, 40, 80, 120 samples of shares of 160): the owner of shard 0
    tampering as told (``owner.weight``: it weighs its own contribution up in its average but signs the honest
    weights), or, ``greedy``, claiming 1,000 samples itself (the others refuse it; only its own shard takes it)."""
    from potluck.peer.reduce.allreduce import MemberAddr, RoundInfo

    order = sorted(ms, key=lambda m: m.id)
    samples = dict(zip([m.id for m in order], [160, 40, 80, 120], strict=True))
    handed = tuple(160 for _ in order)
    if owner_fault:
        order[0].ar.tamper = functools.partial(faults.tamper, pending=parse(f"owner.weight@1:{owner_fault}"))
    if greedy:
        samples[order[0].id] = 1000
    deltas = random_deltas(ms)
    out: dict[str, object] = {}

    def go(m: Member) -> None:
        m.addresses = {o.id: o.address for o in ms}
        info = RoundInfo(step=1, members=tuple(MemberAddr(o.id, o.address) for o in order), me=m.id,
                         base_hash=order[0].ar.inbox.expecting()[1], handed=handed)
        try:
            out[m.id] = m.ar.run(info, deltas[m.id], wait_s=2.5, grace_s=1.0, samples=samples[m.id])
        except Exception as err:
            out[m.id] = err

    import threading

    threads = [threading.Thread(target=go, args=(m,)) for m in ms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(v, tuple) for v in out.values()), out
    for m in ms:
        m.ar.expect(2, "c" * 32)
    return order


@pytest.mark.parametrize("how,says", [("mis-weigh", "not the average"), ("overclaim", "claim of 1000 samples")])
def test_an_owner_that_weighs_wrong_is_proven(members: list[Member], how: str, says: str) -> None:
    """Weights are signed by each contributor and recomputed by the auditor: an owner that gives its own contribution
    ten times its signed weight, or averages its own claim of more samples than its replica was handed (every other
    owner refused it), is proven a liar, by its auditor and by the coordinator's own check; honest owners pass."""
    order = weighted_step(members, "scale=10" if how == "mis-weigh" else "", greedy=how == "overclaim")
    _, verifier = proven(order, says, handed=tuple((m.id, 160) for m in order))
    verifier.stop()


def test_an_honest_owner_of_weighed_contributions_passes(members: list[Member]) -> None:
    order = weighted_step(members)
    assert all(audit(order, shard, (shard + 1) % 4).verdict == "ok" for shard in range(4))
