"""Grouped averaging (Moshpit SGD): the coordinator's groups and base states, and grouped outer steps
between real gRPC servers in one process, against an independent numpy simulation."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from potluck.compression.int8 import Int8BlockCodec
from potluck.compression.transfer import Snapshot
from potluck.coordinator.rounds.groups import assign, choose_base, group_count, partition
from potluck.coordinator.trust.integrity import Integrity
from potluck.coordinator.trust.trust import Trust
from potluck.peer.outer.diloco import outer_snapshot
from potluck.peer.outer.outer import outer_step
from potluck.peer.reduce.allreduce import AllReduce, MemberAddr, RoundInfo
from potluck.peer.reduce.audit import Auditor
from potluck.peer.tasklet import Tasklet
from potluck.protos import potluck_pb2 as pb
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.identity import Identity
from potluck.protos.net.transport import PeerClient, PeerServer, Traffic
from potluck.protos.wire.records import Audit, GroupBase, Member, Round

SIZES = [(n, g) for g in (2, 3, 4, 8) for n in range(1, 70)] + [(1000, 32), (1024, 32), (1024, 8)]


def test_groups_are_balanced_numbered_connected_and_repeat_every_other_step() -> None:
    for n, g in SIZES:
        _check_partitions(n, g)


def _check_partitions(n: int, g: int) -> None:
    k = group_count(n, g)
    for step in (1, 2, 3, 4):
        groups = partition(n, g, step)
        sizes = np.bincount(groups)
        assert len(groups) == n and len(sizes) == k and sizes.min() >= 1
        assert sizes.max() <= g and sizes.max() - sizes.min() <= 1, (n, g, step)
        assert groups == partition(n, g, step + 2), (n, g)  # the group's members all hold its result of 2 steps ago
    rows, diagonals = partition(n, g, 1), partition(n, g, 2)
    parent = list(range(2 * k))  # rows and diagonals sharing a member are linked: one component, or no mixing

    def find(x: int) -> int:
        while parent[x] != x:
            x = parent[x]
        return x

    for r, d in zip(rows, diagonals, strict=True):
        parent[find(r)] = find(k + d)
    assert len({find(x) for x in range(k)}) == 1, (n, g)


def test_grouping_off_is_one_group() -> None:
    assert partition(64, 0, 3) == [0] * 64 and partition(4, 8, 2) == [0] * 4


def moshpit_grid(x: np.ndarray, side: int, steps: int) -> np.ndarray:
    """Moshpit's 2-D grid, written independently: ``side x side`` members, averaged along rows on odd
    steps and along the grid's wrapped diagonals (a Latin square's transversals) on even ones."""
    grid = x.reshape(side, side).astype(np.float64)
    for step in range(1, steps + 1):
        if step % 2 == 1:
            grid = np.repeat(grid.mean(axis=1, keepdims=True), side, axis=1)
        else:
            shifted = np.stack([np.roll(grid[r], r) for r in range(side)])  # diagonal j lands in column j
            means = shifted.mean(axis=0)
            grid = np.stack([np.roll(np.broadcast_to(means, (side,)), -r) for r in range(side)])
    return grid.reshape(-1)


@pytest.mark.parametrize("side", [2, 3, 4, 8])
def test_mixing_matches_the_moshpit_grid_and_reaches_the_mean_in_two_steps(side: int) -> None:
    x = np.random.default_rng(side).normal(size=side * side)
    ours = x.copy()
    for step in range(1, 5):
        groups = np.array(partition(side * side, side, step))
        for j in np.unique(groups):
            ours[groups == j] = ours[groups == j].mean()
        np.testing.assert_allclose(ours, moshpit_grid(x, side, step), rtol=0, atol=1e-12)
    np.testing.assert_allclose(moshpit_grid(x, side, 2), np.full_like(x, x.mean()), atol=1e-12)


def test_base_is_what_most_of_the_group_holds_then_the_newest() -> None:
    holds = {"a": [(4, "x"), (3, "p")], "b": [(4, "y"), (3, "p")], "c": [(4, "x"), (3, "q")], "d": [(2, "old")]}
    assert choose_base(["a", "b"], holds, 5) == (3, "p")  # both hold p (as their previous state)
    assert choose_base(["a", "c"], holds, 5) == (4, "x")  # x and p... x by two, p by one
    assert choose_base(["a", "b", "c"], holds, 5) == (3, "p")  # a tie: the older, the one a peer expects
    assert choose_base(["d"], holds, 5) == (4, "")  # nothing recent: each member's own
    assert choose_base(["a"], {"a": [(4, "")]}, 5) == (4, "")


def test_assign_groups_every_stage_and_names_each_groups_base() -> None:
    cells = [Member(peer_id=f"s{s}r{r}", address="x:1", stage=s, replica=r) for s in range(2) for r in range(4)]
    holds = {m.peer_id: [(3, f"own{m.replica}"), (2, "common")] for m in cells}
    members, bases = assign(cells, 4, 2, holds)
    assert [m.group for m in members if m.stage == 1] == partition(4, 2, 4) == [0, 1, 1, 0]
    assert {(b.stage, b.group, b.version, b.hash) for b in bases} == {(s, g, 2, "common") for s in (0, 1) for g in (0, 1)}
    Round(step=4, members=members, groups=bases)  # a valid round
    assert assign(cells, 4, 0, holds) == (cells, [])


def _round(groups: list[int], bases: list[tuple[int, int]] | None) -> dict:
    members = [{"peer_id": f"p{i}", "address": "x:1", "replica": i, "group": g} for i, g in enumerate(groups)]
    named = [{"stage": s, "group": g, "version": 0, "hash": "h"} for s, g in (bases or [])]
    return {"step": 1, "members": members, "groups": named}


@pytest.mark.parametrize("groups,bases,match", [
    ([0, 2, 2], [(0, 0), (0, 2)], "groups must be numbered 0..k-1"),
    ([0, 1, 1], [(0, 0)], r"missing \[\(0, 1\)\]"),
    ([0, 1, 1], [(0, 0), (0, 1), (0, 2)], r"without members \[\(0, 2\)\]"),
    ([0, 1, 1], [(0, 0), (0, 1), (0, 1)], "twice"),
    ([0, 1, 1], None, "names no group's base"),
    ([0, 0, 0], [(0, 0), (1, 0)], "without members"),
])
def test_a_round_whose_groups_do_not_cover_its_members_is_refused(groups, bases, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError, match=match):
        Round.model_validate(_round(groups, bases))


def test_a_groups_base_must_come_before_its_step() -> None:
    data = _round([0, 1], [(0, 0), (0, 1)])
    data["groups"][1]["version"] = 1
    with pytest.raises(ValidationError, match="a version before step 1"):
        Round.model_validate(data)


# ----------------------------------------------------------------------------- grouped outer steps over gRPC

N, BLOCK, LR, MU = 3000, 256, 0.7, 0.9


class Peer:
    """One member: its own gRPC server and all-reduce over ``[theta, momentum]``, and its two newest states."""

    def __init__(self, theta0: torch.Tensor) -> None:
        self.identity = Identity.generate()
        self.id = self.identity.peer_id
        self.traffic = Traffic()
        self.client = PeerClient(self.traffic)
        self.addresses: dict[str, str] = {}
        self.version = 0
        self.ar = AllReduce(run_id="groups", me=self.id, numel=2 * N, codec=Int8BlockCodec(BLOCK), client=self.client,
                            chunk_bytes=4096, rpc_timeout=5.0, ping=self._ping, sign=self.identity.sign)
        self.server = PeerServer(self, self.traffic, host="127.0.0.1", port=0)
        self.address = f"127.0.0.1:{self.server.port}"
        self.states = [outer_snapshot(theta0.clone(), torch.zeros(N), 0)]  # newest last

    def _ping(self, peer_id: str, timeout: float) -> pb.PingReply:
        return self.client.ping(self.addresses[peer_id], pb.PingRequest(header=pb.Header(run_id="groups")), timeout)

    def ping(self, request: pb.PingRequest) -> pb.PingReply:
        return pb.PingReply(peer_id=self.id, state="syncing", version=self.version)

    def push_contribution(self, chunks):  # type: ignore[no-untyped-def]
        return self.ar.inbox.on_contribution(chunks)

    def push_result(self, chunks):  # type: ignore[no-untyped-def]
        return self.ar.inbox.on_result(chunks)

    def fetch_inputs(self, request: pb.InputsRequest):  # type: ignore[no-untyped-def]
        return self.ar.inbox.on_fetch_inputs(request)

    def holding(self) -> list[tuple[int, str]]:
        return [(s.version, s.hash) for s in self.states[-2:]]

    def base(self, hash_: str) -> Snapshot:
        return next(s for s in self.states[-2:] if s.hash == hash_)

    def close(self) -> None:
        self.server.stop(0.1)
        self.ar.close()
        self.client.close()


def _step(p: Peer, rnd: Round, rc: RunConfig, delta: np.ndarray) -> Snapshot | Exception:
    """``p``'s grouped outer step of ``rnd``, as a peer runs it: its group's members, from its group's base."""
    me = rnd.member(p.id)
    assert me is not None
    base = rnd.group_base(0, me.group)
    assert base is not None
    cells = rnd.group_members(0, me.group)
    info = RoundInfo(rnd.step, tuple(MemberAddr(m.peer_id, m.address) for m in cells), p.id, base.hash)
    p.ar.expect(rnd.step, base.hash)
    try:
        return outer_step(rc, p.ar, info, p.states[-1], torch.tensor(delta, dtype=torch.float32), 0.0, {},
                          p.base(base.hash)).snapshot
    except Exception as err:  # reported by the test
        return err


def test_grouped_steps_match_numpy_and_stay_bit_identical_inside_each_group() -> None:
    """4 members in groups of 2 for 3 outer steps (rows, diagonals, rows) through the coordinator's grouping
    and bases and the peers' grouped outer step over real gRPC, int8 both ways. Against a float64 numpy
    simulation of the same thing (each group averages its members' own Nesterov outer steps): equal to the
    codec's error, bit-identical inside a group, different across groups, and the bases the
    coordinator names are the groups' common states of two steps before."""
    rng = np.random.default_rng(0)
    theta0 = rng.normal(0, 0.02, N)
    rc = apply_overrides(RunConfig(), {"sync.group_size": 2, "sync.block_size": BLOCK})
    peers = [Peer(torch.tensor(theta0, dtype=torch.float32)) for _ in range(4)]
    sim_theta, sim_m = np.tile(theta0, (4, 1)), np.zeros((4, N))
    bases_seen = []
    try:
        for p in peers:
            p.addresses = {q.id: q.address for q in peers}
        for step in (1, 2, 3):
            common = rng.normal(0, 0.01, N)
            deltas = common + rng.normal(0, 0.005, (4, N))  # replicas trained the same model: a shared direction
            groups = partition(4, 2, step)
            members = [Member(peer_id=p.id, address=p.address, replica=i) for i, p in enumerate(peers)]
            placed, bases = assign(members, step, 2, {p.id: p.holding() for p in peers})
            rnd = Round(step=step, members=placed, groups=bases)
            bases_seen.append(sorted({(b.version, b.hash) for b in bases}))
            with ThreadPoolExecutor(4) as pool:  # every member at once, as peers are
                out = list(pool.map(_step, peers, [rnd] * 4, [rc] * 4, list(deltas)))
            assert all(isinstance(out[i], Snapshot) for i in range(4)), out
            for i, p in enumerate(peers):
                p.states.append(out[i])  # type: ignore[arg-type]
                p.version = step
            # numpy: each member's own Nesterov step, then its group's mean state and momentum
            new_m = MU * sim_m + deltas
            proposal = sim_theta - LR * (deltas + MU * new_m)
            for j in set(groups):
                idx = [i for i, g in enumerate(groups) if g == j]
                sim_theta[idx], sim_m[idx] = proposal[idx].mean(0), new_m[idx].mean(0)
            for i, p in enumerate(peers):
                got = p.states[-1].tensors
                moved = np.linalg.norm(sim_theta[i] - theta0)
                assert np.linalg.norm(got["theta"].numpy() - sim_theta[i]) < 0.01 * moved, f"theta of {i} at {step}"
                assert np.linalg.norm(got["momentum"].numpy() - sim_m[i]) < 0.01 * np.linalg.norm(sim_m[i])
            for i in range(4):
                for k in range(4):
                    same = peers[i].states[-1].hash == peers[k].states[-1].hash
                    assert same == (groups[i] == groups[k]), (step, i, k)
        h = [[s.hash for s in p.states] for p in peers]
        assert bases_seen[0] == [(0, h[0][0])]  # every member starts at theta_0
        assert bases_seen[1] == [(0, h[0][0])]  # the diagonals' members last shared theta_0
        assert bases_seen[2] == sorted({(1, h[0][1]), (1, h[2][1])})  # rows again: each row's result of step 1
        for p in peers:
            p.ar.expect(4, p.states[-1].hash)  # step 3 is kept for its audits
        audit_each_group(peers, rnd)
    finally:
        for p in peers:
            p.close()


def audit_each_group(peers: list[Peer], rnd: Round) -> None:
    """Verified reduction per group: each group's shards (numbered within it) are audited by another member of
    the group, from the inputs their owner signed, and pass; a member of another group holds none of them."""
    by_id = {p.id: p for p in peers}
    for group, cells in rnd.stage_groups(0).items():
        for shard, owner in enumerate(rnd.shard_owners(0, group)):
            auditor = by_id[next(m.peer_id for m in cells if m.peer_id != owner)]
            stranger = by_id[next(m.peer_id for m in rnd.members if m.group != group)]
            a = Audit(step=rnd.step, stage=0, group=group, shard=shard, owner=owner, auditor=auditor.id)
            for who, verdict in ((auditor, "ok"), (stranger, "unserved")):
                checker = Auditor("groups", who.id, who.client, Int8BlockCodec(BLOCK), 4096, 4.0, -0.1,
                                  who.ar.inbox.held_result, lambda a, inputs: None, lambda r: None, who.ar.inbox.own_input)
                report = checker.audit(a, by_id[owner].address)
                assert (report.verdict, report.group, report.shard) == (verdict, group, shard), report


def test_owners_and_auditors_of_a_shard_come_from_its_group() -> None:
    """The coordinator's half of verified reduction with groups: a group's shards are owned by its members
    past probation (all of them while none is), and each audit's auditor is another eligible member of the
    owner's group (the only peers that hold the result), named with the group."""
    rc = apply_overrides(RunConfig(), {"sync.group_size": 3, "sync.audit_fraction": 1.0})
    trust = Trust(probation_steps=1, work={"p0": [1], "p4": [1], "p5": [1]})
    owned = trust.assign_owners([Member(peer_id=f"p{r}", address="x:1", replica=r) for r in range(9)])
    members, bases = assign(owned, 3, 3, {})
    made = Round(step=3, members=members, groups=bases)  # rows: p0-p2, p3-p5, p6-p8
    assert [made.shard_owners(0, g) for g in range(3)] == [["p0"], ["p4", "p5"], ["p6", "p7", "p8"]]
    audits = Integrity(rc, trust, rng=random.Random(0)).audits(made, members)
    # group 0's one trusted member cannot audit itself: no audit there, as in a stage with one trusted member
    assert sorted((a.group, a.shard, a.owner) for a in audits) == [
        (1, 0, "p4"), (1, 1, "p5"), (2, 0, "p6"), (2, 1, "p7"), (2, 2, "p8")]
    for a in audits:
        owner, auditor = made.member(a.owner), made.member(a.auditor)
        assert owner is not None and auditor is not None and a.auditor != a.owner
        assert owner.group == auditor.group == a.group
        assert a.group != 1 or a.auditor in {"p4", "p5"}  # trusted members audit where there are some


def test_a_grouped_step_bases_on_the_groups_state_not_the_members_own() -> None:
    """outer_step refuses a base that is not the round's (a member must never add its group's mean to a
    state the others do not hold)."""
    snap = outer_snapshot(torch.zeros(N), torch.zeros(N), 0)
    other = outer_snapshot(torch.ones(N), torch.zeros(N), 0)
    info = RoundInfo(1, (MemberAddr("me", "x:1"),), "me", snap.hash)
    rc = apply_overrides(RunConfig(), {"sync.group_size": 2})
    with pytest.raises(ValueError, match="is not the round's"):
        outer_step(rc, None, info, snap, torch.zeros(N), 0.0, {}, other)  # type: ignore[arg-type]


def test_group_bases_travel_in_the_round_record() -> None:
    r = Round(step=3, members=[Member(peer_id="a", address="x:1", group=0), Member(peer_id="b", address="y:1",
                                                                                 replica=1, group=1)],
              groups=[GroupBase(stage=0, group=0, version=1, hash="h1"), GroupBase(stage=0, group=1, version=2, hash="")])
    back = Round.model_validate_json(r.model_dump_json())
    assert back == r and back.group_base(0, 1) == GroupBase(stage=0, group=1, version=2, hash="")
    assert [m.peer_id for m in back.group_members(0, 1)] == ["b"]
    old = Round.model_validate({"step": 1, "members": [{"peer_id": "a", "address": "x:1"}]})  # an older writer's
    assert old.members[0].group == 0 and old.groups == [] and old.group_base(0, 0) is None


@pytest.mark.parametrize("round_step,expected", [(9, "named"), (5, "h7"), (6, "h8")])
def test_a_step_on_an_older_round_starts_from_the_state_its_groups_share(round_step: int, expected: str) -> None:
    """Step 9 runs on the last round known: its own (the base it names), or, the coordinator away, an older
    one whose groups the step two before had too (same parity: the state before the held one, v7), or that
    this member has just averaged with (the held one, v8)."""
    held = [SimpleNamespace(version=v, hash=f"h{v}") for v in (8, 7)]
    rnd = Round(step=round_step, members=[Member(peer_id="me", address="x:1")],
                groups=[GroupBase(stage=0, group=0, version=round_step - 1, hash="named")])
    tasklet = SimpleNamespace(tools=SimpleNamespace(me="me", rc=apply_overrides(RunConfig(), {"sync.group_size": 2})),
                              stage=0, states=SimpleNamespace(current=held[0], server=SimpleNamespace(previous=held[1])))
    assert Tasklet.base_hash(tasklet, rnd, 9) == expected  # type: ignore[arg-type]


def test_a_stage_averaged_as_one_group_has_at_most_max_owners_owners_and_their_reports_fit_a_record() -> None:
    """Each member reports every owner's outcome in each heartbeat (StepReport.flags), and a heartbeat must fit a DHT
    record: a stage of 300 averaged as one group (sync.group_size 0) had 300 owners, and every member's record failed
    validation after the step. Its owners are now the MAX_OWNERS with the most verified work, ties drawn at random
    (the lowest peer ids would be a prize to grind keys for); the others contribute and gather, as on probation.
    With groups, every eligible member of a group owns in it (a group holds at most MAX_OWNERS)."""
    import time

    from hivemind.utils import MSGPackSerializer

    from potluck.coordinator.rounds.rounds import Rounds
    from potluck.peer.swarm.telemetry import KEEP_STEPS
    from potluck.protos.net.dhtguard import MAX_RECORD_BYTES
    from potluck.protos.net.identity import Identity
    from potluck.protos.wire.envelope import seal
    from potluck.protos.wire.records import MAX_OWNERS, PeerRecord, StepReport

    work = {f"p{r:03d}": list(range(1, 2 + r % 5)) for r in range(300)}  # (60 peers with the most: 5 steps)
    stage = [Member(peer_id=p, address="x:1", replica=r) for r, p in enumerate(sorted(work))]
    rc = apply_overrides(RunConfig(), {"sync.audit_fraction": 0.0})
    whole, _ = Integrity(rc, Trust(probation_steps=1, work=work), rng=random.Random(1)).roles(stage, Rounds(stages=1))
    owners = [m.peer_id for m in whole if m.owns]
    assert len(owners) == MAX_OWNERS and all(len(work[p]) == 5 for p in owners)  # (the most work first)
    assert owners != sorted(p for p in work if len(work[p]) == 5)[:MAX_OWNERS]  # (not the lowest ids)
    grouped, _ = Integrity(rc, Trust(probation_steps=1, work=work)).roles(stage, Rounds(stages=1, group_size=4))
    assert all(m.owns for m in grouped)
    me, ids = Identity.generate(), [Identity.generate().peer_id for _ in range(MAX_OWNERS + 2)]
    reports = [StepReport(step=s, stage=0, replica=5, state_hash="h" * 64, loss=2.5, eval_loss=2.6, outer_s=3.2,
                          outer_bytes=10**7, members=MAX_OWNERS, contributors=MAX_OWNERS, dropped=ids[:2],
                          clipped=ids[:2], included=list(range(MAX_OWNERS)), pipe={"activations": 10**8},
                          flags={o: ids[-1:] for o in ids[:MAX_OWNERS]}, t=time.time()) for s in range(KEEP_STEPS)]
    kinds = {f"{k:032d}": 10**12 for k in range(16)}  # (the peak second's kinds at their bounds too)
    record = PeerRecord(peer_id=me.peer_id, address="203.0.113.7:40000", recent=reports, seq=1, peak_send_kinds=kinds)
    assert len(MSGPackSerializer.dumps(seal(me, record, 60))) < 0.6 * MAX_RECORD_BYTES  # (every owner naming one)
