"""Eviction votes judged incrementally give the verdicts of judging everything, in every layout of a round.

The coordinator judges a step's eviction votes again only where a report changed: the averaging groups whose
members' reports of that step changed (or every group, when a round, an admission or an eviction changed). Each
group's verdicts come from its own members' reports, so this is exact; these tests hold it to that against a
gatekeeper made to judge every report of every step at every tick (the old way).
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_admission import RUN, _Node, asking

from potluck.coordinator.trust.admission import Gatekeeper
from potluck.coordinator.trust.evictions import RECENT_STEPS
from potluck.coordinator.trust.trust import Trust
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.wire.records import GroupBase, Member, PeerRecord, Round, StepReport


@pytest.mark.parametrize("stages,group_size,trusting", [(1, 0, False), (2, 3, False), (1, 2, False), (1, 0, True),
                                                        (2, 3, True)])
def test_judging_only_the_groups_whose_reports_changed_gives_the_verdicts_of_judging_everything(
        tmp_path: Path, stages: int, group_size: int, trusting: bool) -> None:
    """Three gatekeepers see the same 40 ticks of random reports (flags from owners and from liars, a reporter that
    names another stage than its own, records replaced, dropped and back, rounds decided anew, members moved
    between groups, peers admitted late and evicted): one incremental, one made to judge every step every tick, and
    one told which records changed or went (the coordinator's reader tells it: it looks at no other record). They
    flag, and evict, the same peers at every tick."""
    rng = random.Random(7 + stages + group_size + 3 * trusting)
    cfg = apply_overrides(RunConfig(), {"admission.evict_after": 3})
    asks = [asking() for _ in range(12)]
    ids = sorted(pid for pid, _, _ in asks)
    late = set(ids[6:8])  # (admitted at tick 9: their reports start counting then)
    node = _Node({pid: req for pid, _, req in asks if pid not in late})
    gates = [Gatekeeper(cfg, RUN, "coordinator-id", tmp_path / name, []) for name in ("incremental", "full", "told")]
    trust = Trust(probation_steps=2, founders=set(ids[:2]))  # (trusting: reporters past probation only, who cross
    moved: list[str] = []
    if trusting:  # it as steps commit, and fall back behind it in a rollback)
        for g in gates:
            g.evictions.trusted = trust.eligible
        gates[0].evictions.trust_moved = gates[2].evictions.trust_moved = lambda: moved  # (what moved this tick)
    per_stage = len(ids) // stages

    def a_round(step: int) -> Round:
        order = rng.sample(ids, len(ids)) if group_size else ids  # (groups change from step to step)
        members = [Member(peer_id=p, address="x:1", stage=i // per_stage, replica=i % per_stage, owns=i % 3 == 0,
                          group=(i % per_stage) // group_size if group_size else 0) for i, p in enumerate(order)]
        members.sort(key=lambda m: (m.stage, m.replica))
        groups = sorted({(m.stage, m.group) for m in members})
        return Round(step=step, members=members, stages=stages,
                     groups=[GroupBase(stage=s, group=g, version=step - 1) for s, g in groups] if group_size else [])

    rounds: dict[int, Round] = {}

    def round_at(step: int) -> Round | None:  # (as the coordinator's: past the newest step, the newest round)
        return rounds.get(step) if step <= max(rounds) else rounds[max(rounds)]

    recent: dict[str, list[StepReport]] = {p: [] for p in ids}
    records: dict[str, PeerRecord] = {}
    for tick in range(40):
        step = 1 + tick // 2
        rounds.setdefault(step, a_round(step))
        for pid in rng.sample(ids, 5):  # some report this step, some flags honest, some not
            cohort = [m.peer_id for m in rounds[step].cohort(pid)]
            flags = {o: [ids[4]] * (rng.random() < 0.7) + rng.sample(cohort, rng.choice((0, 0, 1))) for o in cohort}
            flags = {} if rng.random() < 0.2 else flags  # (a report with no owner's list: nothing to count)
            stage = rounds[step].member(pid).stage if pid != ids[5] else rng.randrange(stages)  # (one says any stage)
            recent[pid] = (recent[pid] + [StepReport(step=step, stage=stage, flags=flags)])[-RECENT_STEPS:]
        if tick == 9:
            node.requests.update({pid: req for pid, _, req in asks if pid in late})
        if trusting and tick % 2 == 1:  # (a commit, seen late at times: some of its members did the step's work)
            made = max(1, step - rng.choice((0, 2, 3)))
            done = [SimpleNamespace(peer_id=p, version=made, epoch=0) for p in rng.sample(ids, 6)]
            trust.committed(rounds[made], made, done)  # type: ignore[arg-type]
        if trusting and tick == 25:
            trust.rolled_back(step - 4)
        if tick % 7 == 3:
            rounds[step] = a_round(step)  # the newest round decided anew (after a failure): all is judged again
        before, records = records, {p: records[p] if p in records and records[p].recent == r else  # (kept: no change)
                                    PeerRecord(peer_id=p, address="x:1", recent=list(r), seq=tick) for p, r in recent.items()
                                    if not (tick % 5 == 2 and p == ids[1])}  # one record missing now and then
        told = {p for p in before.keys() | records.keys() if before.get(p) is not records.get(p)}
        assert len(told) < len(ids) or tick == 0, "most records are the same objects as the tick before"
        moved[:] = trust.moved() if trusting else []
        full = gates[1].evictions  # (the old way: all)
        full._seen, full._by_step, full._flaggers, full._rounds = {}, {}, {}, {}
        got = [g.tick(node, records, round_at)[1] for g in gates[:2]] + [gates[2].tick(node, records, round_at,
                                                                                      changed=told.copy)[1]]
        for g, events in zip(gates[1:], got[1:], strict=True):
            assert [e for e in got[0] if e[0] == "evicted"] == [e for e in events if e[0] == "evicted"], tick
            assert gates[0].evictions._flagged == g.evictions._flagged, tick
    assert any(any(v.values()) for v in gates[0].evictions._flagged.values())  # (votes were cast: the test judged something)
