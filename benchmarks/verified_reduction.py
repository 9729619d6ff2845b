"""What verified reduction costs and what it buys (issue 29), in one process over real gRPC on loopback.

``--members`` members (R, default 4) run the outer all-reduce of a ``--numel`` vector (int8, robust mean,
signed contributions and results committing to their inputs) for ``--steps`` steps; after each, every
shard is audited as the coordinator would have it with ``sync.audit_fraction = 1``: an auditor picked
among the other members fetches the shard's signed inputs from its owner (all but its own, which it
holds) and recomputes the result. Printed, per member and step (medians):

* ``allreduce_s`` (signing and commitments included) and the audits' ``audit_s`` (which peers run during
  the next inner phase, off the training loop's path; timed here alone, all shards at once), and
  ``time_ratio``: all-reduce + audit over the all-reduce (target <= 1.3);
* ``bytes_ratio``: all-reduce + audit bytes over the all-reduce's (target <= 1.5);
* the catch probability of a lying owner per step: measured over ``--draws`` draws of the coordinator's
  own audit picker (:class:`potluck.coordinator.trust.integrity.Integrity`) at ``--fraction``, against its
  analytic value (``fraction`` x the share of the liar's possible auditors that are honest), and, on the
  real path, the share of audited lies found (every one: the recomputation is exact).

* ``colluding_pair_caught_per_step``: a lying owner whose accomplice, if picked, audits it "ok": how often another
  member audits its shard in a step (``sync.audit_fraction = 1`` and the default ``sync.second_audit``), measured
  over ``--draws`` draws of the picker against its analytic value and against one auditor a shard;
* ``receipts``: the all-reduce with signed receipts (an owner signs for each contribution it keeps; a member
  checks its receipts against the results) against the same without them, two sets of members alternating
  steps in the same run at ``--receipts-numel`` values: ``time_ratio`` (target <= 1.05) and ``bytes_ratio``.

    python benchmarks/verified_reduction.py [--members 4] [--numel 4000000] [--steps 5] [--fraction 0.5]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import threading
import time
from collections.abc import Iterator

import torch

from potluck.compression.int8 import Int8BlockCodec
from potluck.coordinator.trust.integrity import Integrity
from potluck.coordinator.trust.trust import Trust
from potluck.peer.reduce.allreduce import AllReduce, MemberAddr, RoundInfo
from potluck.peer.reduce.audit import Auditor
from potluck.protos import potluck_pb2 as pb
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.identity import Identity
from potluck.protos.net.transport import PeerClient, PeerServer, Traffic
from potluck.protos.testkit import faults
from potluck.protos.wire.records import Audit, Member, Round

RUN, BLOCK, CHUNK = "bench-verified", 2048, 1 << 20


class Node:
    def __init__(self, numel: int, receipts: bool = True) -> None:
        self.identity = Identity.generate()
        self.id = self.identity.peer_id
        self.version = 0  # what a ping says this member holds: the step before the running one
        self.traffic = Traffic()
        self.client = PeerClient(self.traffic)
        self.ar = AllReduce(run_id=RUN, me=self.id, numel=numel, codec=Int8BlockCodec(BLOCK), client=self.client,
                            chunk_bytes=CHUNK, rpc_timeout=60.0,
                            ping=lambda pid, t: pb.PingReply(state="training", version=self.version),
                            sign=self.identity.sign, receipts=receipts)
        self.server = PeerServer(self, self.traffic, host="127.0.0.1", port=0)
        self.address = f"127.0.0.1:{self.server.port}"
        self.reports: list = []
        self.auditor = Auditor(RUN, self.id, self.client, Int8BlockCodec(BLOCK), CHUNK, 4.0, -0.1, self.ar.inbox.held_result,
                               lambda a, inputs: None, self.reports.append, self.ar.inbox.own_input)

    def push_contribution(self, chunks: Iterator[pb.ShardChunk]) -> pb.Ack:
        return self.ar.inbox.on_contribution(chunks)

    def push_result(self, chunks: Iterator[pb.ShardChunk]) -> pb.Ack:
        return self.ar.inbox.on_result(chunks)

    def fetch_result(self, request: pb.ResultRequest) -> Iterator[pb.ShardChunk]:
        return self.ar.inbox.on_fetch_result(request)

    def fetch_inputs(self, request: pb.InputsRequest) -> Iterator[pb.ShardChunk]:
        return self.ar.inbox.on_fetch_inputs(request)

    def sent(self, kind: str) -> int:
        return self.traffic.snapshot()[0].get(kind, 0)

    def both_ways(self, kind: str) -> int:
        """Bytes sent and received (the receipts ride on the acknowledgements a member receives)."""
        sent, received = self.traffic.snapshot()
        return sent.get(kind, 0) + received.get(kind, 0)

    def close(self) -> None:
        self.server.stop(0.1)
        self.auditor.close()
        self.ar.close()
        self.client.close()


def step(nodes: list[Node], k: int, numel: int) -> float:
    order = sorted(nodes, key=lambda n: n.id)
    members = tuple(MemberAddr(n.id, n.address) for n in order)
    gen = torch.Generator().manual_seed(k)
    common = torch.randn(numel, generator=gen) * 0.01
    base = f"base-{k}".ljust(32, "0")
    for n in nodes:
        n.ar.expect(k, base)
        n.version = k - 1
    errors: list[BaseException] = []

    def go(n: Node) -> None:
        try:
            n.ar.run(RoundInfo(step=k, members=members, me=n.id, base_hash=base),
                     common + 0.005 * torch.randn(numel, generator=torch.Generator().manual_seed(hash(n.id) % 1000 + k)),
                     wait_s=60)
        except BaseException as err:
            errors.append(err)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=go, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def audit_all(nodes: list[Node], k: int) -> float:
    """Every shard of step ``k`` audited by the next member in shard order, all at once (as during an inner phase)."""
    order = sorted(nodes, key=lambda n: n.id)
    for n in nodes:
        n.ar.expect(k + 1, "next".ljust(32, "0"))  # step k is kept for its audits
    t0 = time.perf_counter()
    for j, owner in enumerate(order):
        auditor = order[(j + 1) % len(order)]
        auditor.auditor.start([Audit(step=k, shard=j, owner=owner.id, auditor=auditor.id)], {owner.id: owner.address})
    for n in nodes:
        n.auditor.wait(120)
    return time.perf_counter() - t0


def receipts_cost(members: int, numel: int, steps: int) -> dict:
    """The all-reduce with signed receipts against the same without them, in the same run: two sets of ``members``
    nodes, their steps alternating (so both see the same box), each step's time and bytes (both ways) per member."""
    sets = {True: [Node(numel, receipts=True) for _ in range(members)],
            False: [Node(numel, receipts=False) for _ in range(members)]}
    times: dict[bool, list[float]] = {True: [], False: []}
    traffic: dict[bool, list[float]] = {True: [], False: []}
    try:
        for k in range(1, steps + 1):
            for on in ((True, False) if k % 2 else (False, True)):
                before = [n.both_ways("outer") for n in sets[on]]
                times[on].append(step(sets[on], k, numel))
                traffic[on].append(sum(n.both_ways("outer") - b for n, b in zip(sets[on], before, strict=True)) / members)
        receipted = sum(1 for n in sets[True] for j in range(members) if (c := n.ar.inbox.sent(j, 0)) is not None
                        and c.receipt)  # (of the last step: every contribution sent to another owner)
    finally:
        for n in sets[True] + sets[False]:
            n.close()
    with_s, without_s = (statistics.median(times[on][1:] or times[on]) for on in (True, False))
    with_b, without_b = (statistics.median(traffic[on]) for on in (True, False))
    return {"members": members, "numel": numel, "steps": steps, "with_s": round(with_s, 4),
            "without_s": round(without_s, 4), "time_ratio": round(with_s / without_s, 4), "target_time_ratio": 1.05,
            "bytes_per_member_with": round(with_b), "bytes_per_member_without": round(without_b),
            "bytes_ratio": round(with_b / without_b, 5), "receipted_last_step": receipted,
            "sent_last_step": members * (members - 1)}


def catch_probability(members: int, fraction: float, draws: int) -> tuple[float, float]:
    """How often the coordinator's picker audits a lying owner's shard in a step (by an honest member)."""
    cfg = apply_overrides(RunConfig(), {"sync.audit_fraction": fraction})
    integrity = Integrity(cfg, Trust(0))
    ids = [f"12D3KooWpeer{i}" for i in range(members)]
    made = Round(step=1, members=[Member(peer_id=p, address="-", replica=i) for i, p in enumerate(ids)])
    liar = ids[0]
    caught = sum(any(a.owner == liar for a in integrity.audits(made, made.members)) for _ in range(draws))
    return caught / draws, fraction  # every possible auditor of the liar's shard is honest here


def colluders_caught(members: int, fraction: float, second: float, draws: int) -> dict:
    """How often a lying owner whose accomplice says "ok" to whatever it audits is caught in a step: an audit of its
    shard by anyone but the accomplice. Analytic: ``fraction x (1 - (1 - second) / (members - 1))`` (the accomplice
    is the first auditor with probability 1 / (members - 1); then a second auditor, drawn with probability
    ``second``, is honest)."""
    cfg = apply_overrides(RunConfig(), {"sync.audit_fraction": fraction, "sync.second_audit": second})
    integrity = Integrity(cfg, Trust(0))
    ids = [f"12D3KooWpeer{i}" for i in range(members)]
    made = Round(step=1, members=[Member(peer_id=p, address="-", replica=i) for i, p in enumerate(ids)])
    liar, accomplice = ids[0], ids[1]
    caught = sum(any(a.owner == liar and a.auditor != accomplice for a in integrity.audits(made, made.members))
                 for _ in range(draws))
    return {"fraction": fraction, "second_audit": second, "measured": round(caught / draws, 4),
            "analytic": round(fraction * (1 - (1 - second) / (members - 1)), 4),
            "without_second_audits": round(fraction * (1 - 1 / (members - 1)), 4), "draws": draws}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--numel", type=int, default=4_000_000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--draws", type=int, default=20000)
    ap.add_argument("--receipts-numel", type=int, default=20_000_000, help="the vector of the receipts comparison")
    ap.add_argument("--receipts-steps", type=int, default=12, help="steps of each set in the receipts comparison")
    args = ap.parse_args()
    torch.set_num_threads(1)
    nodes = [Node(args.numel) for _ in range(args.members)]
    try:
        ar_s, audit_s, ar_bytes, audit_bytes = [], [], [], []
        for k in range(1, args.steps + 1):
            before = [n.sent("outer") for n in nodes]
            ar_s.append(step(nodes, k, args.numel))
            ar_bytes.append(sum(n.sent("outer") - b for n, b in zip(nodes, before, strict=True)) / len(nodes))
            before = [n.sent("audit") + n.sent("outer") for n in nodes]
            audit_s.append(audit_all(nodes, k))
            audit_bytes.append(sum(n.sent("audit") + n.sent("outer") - b for n, b in zip(nodes, before, strict=True))
                               / len(nodes))
        reports = [r for n in nodes for r in n.reports]
        honest_ok = sum(r.verdict == "ok" for r in reports) / max(1, len(reports))
        # the real path's detection of an audited lie: one member shifts its mean, every shard audited
        liar = sorted(nodes, key=lambda n: n.id)[0]
        liar.ar.tamper = functools.partial(faults.tamper, pending=faults.parse("owner.mean@*:shift=0.5"))
        for n in nodes:
            n.reports.clear()
        step(nodes, args.steps + 1, args.numel)
        audit_all(nodes, args.steps + 1)
        lies = [r for n in nodes for r in n.reports if r.owner == liar.id]
        found = sum(r.verdict == "lie" for r in lies) / max(1, len(lies))
    finally:
        for n in nodes:
            n.close()
    measured, analytic = catch_probability(args.members, args.fraction, args.draws)
    receipts = receipts_cost(args.members, args.receipts_numel, args.receipts_steps)
    pair = colluders_caught(args.members, 1.0, RunConfig().sync.second_audit, args.draws)
    a, v = statistics.median(ar_s[1:] or ar_s), statistics.median(audit_s[1:] or audit_s)
    b, ab = statistics.median(ar_bytes), statistics.median(audit_bytes)
    print(json.dumps({
        "benchmark": "verified_reduction", "members": args.members, "numel": args.numel, "steps": args.steps,
        "allreduce_s": round(a, 4), "audit_s": round(v, 4), "time_ratio": round((a + v) / a, 3),
        "target_time_ratio": 1.3,
        "allreduce_bytes_per_member": round(b), "audit_bytes_per_member": round(ab),
        "bytes_ratio": round((b + ab) / b, 3), "target_bytes_ratio": 1.5,
        "honest_audits_passed": honest_ok, "audited_lies_found": found,
        "catch_probability_per_step": {"fraction": args.fraction, "measured": round(measured, 4),
                                       "analytic": analytic, "draws": args.draws},
        "receipts": receipts, "colluding_pair_caught_per_step": pair,
    }))


if __name__ == "__main__":
    main()
