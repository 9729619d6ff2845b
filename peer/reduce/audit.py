"""An auditor's work: recompute a shard of an earlier step from the contributions its owner signed for.

The coordinator picks auditors after a step has committed (``Round.audits`` of the next round), so no
owner knows, when it signs its result, whether or by whom it will be checked. A peer picked runs its
audits on a thread of its own during the next inner phase:

1. the owner's signed result is the one this peer received as a member of that round (kept by
   :class:`~potluck.peer.reduce.allreduce.AllReduce` for one step after it);
2. the contributions come from the owner (``FetchInputs``), each signed by its sender;
3. :func:`potluck.compression.audit.check` says whether the result is what they make.

A lie is reported in the peer's record (``audits``, verdict ``lie``) and the evidence is kept, so the
coordinator can fetch it and check it for itself before it evicts anyone. An owner that does not
show its inputs is reported as ``unserved``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import grpc

from potluck.compression.audit import ResultClaim, Round, Signed, Unverifiable, check, decode_streams
from potluck.compression.int8 import Codec
from potluck.protos import potluck_pb2 as pb
from potluck.protos.net.transport import PeerClient
from potluck.protos.runtime.log import get_logger, short_id
from potluck.protos.testkit.faults import tamper
from potluck.protos.wire.records import Audit, AuditReport, Plan
from potluck.protos.wire.refusals import rpc_reason

log = get_logger(__name__)


class PlanSource(Protocol):
    def wait_plan(self, predicate: Callable[[Plan | None], bool], timeout: float) -> Plan | None: ...


@dataclass(frozen=True)
class HeldResult:
    """A shard's result as a member received it, with the round facts an audit needs."""

    claim: ResultClaim
    round: Round


class Auditor:
    """Runs this peer's audits one at a time, off the training loop; their reports go to ``report``."""

    def __init__(self, run_id: str, me: str, client: PeerClient, codec: Codec, chunk_bytes: int, clip_factor: float,
                 reject_below: float | None, held: Callable[[int, int, int], HeldResult | None],
                 keep: Callable[[Audit, dict[str, Signed]], None], report: Callable[[AuditReport], None],
                 own: Callable[[int, int, int, int], Signed | None] = lambda *a: None, timeout_s: float = 60.0) -> None:
        self.run_id, self.me, self.client, self.codec, self.chunk_bytes = run_id, me, client, codec, chunk_bytes
        self.clip_factor, self.reject_below, self.timeout_s = clip_factor, reject_below, timeout_s
        self.held, self.keep, self.report, self.own = held, keep, report, own
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="audit")
        self._lock = threading.Lock()
        self._pending: list[Future] = []
        self._started: set[tuple[int, int, int, int, int]] = set()
        self._lies: list[str] = []  # owners this peer's audits found lying, not yet ruled on

    def start(self, audits: list[Audit], addresses: dict[str, str]) -> None:
        """Run the audits picked for this peer (each once, however many rounds name it)."""
        with self._lock:
            for a in audits:
                key = (a.step, a.epoch, a.stage, a.group, a.shard)
                if a.auditor != self.me or key in self._started:
                    continue
                self._started.add(key)
                self._pending.append(self._pool.submit(self._run, a, addresses.get(a.owner, "")))

    def start_for(self, plan: Plan | None, step: int, addresses: dict[str, str]) -> None:
        """The audits the coordinator's rounds up to ``step`` give this peer (a round can reach a peer that runs
        ahead on the last plan after its step has passed: its audits still run, while the results are kept)."""
        for rnd in plan.rounds if plan is not None else []:
            if rnd.step <= step:
                self.start(rnd.audits, addresses)

    def lied(self, timeout: float) -> bool:
        """Did an audit of the step before (waited for at most ``timeout`` s) find its owner lying?"""
        self._lies += [r.owner for r in self.wait(timeout) if r.verdict == "lie"]
        return bool(self._lies)

    def await_ruling(self, heartbeat: PlanSource, step: int, timeout: float) -> None:
        """After a lie: commit nothing on it (the caller skips this step's outer step) and wait, bounded, for the
        coordinator to rule: the liar evicted (and the run rolled back to before its step), or this peer (its
        accusation did not check out). Then the follower acts on the plan as always."""
        owners, self._lies = set(self._lies), []
        log.warning("step %d builds on a result proven false by %s; committing nothing, waiting for the coordinator",
                    step, ", ".join(map(short_id, sorted(owners))))
        heartbeat.wait_plan(lambda p: p is not None and bool((owners | {self.me}) & set(p.revoked)), timeout=timeout)

    def wait(self, timeout: float) -> list[AuditReport]:
        """Wait (at most ``timeout`` s) for the audits under way; the reports of those that ended."""
        with self._lock:
            pending, self._pending = self._pending, []
        out, deadline = [], time.monotonic() + timeout
        for fut in pending:
            try:
                out.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except TimeoutError:  # still running: put back, it reports when it ends (_audit catches its own errors)
                with self._lock:
                    self._pending.append(fut)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, a: Audit, address: str) -> AuditReport:
        try:
            report = self.audit(a, address)
        except Exception as err:  # an audit that breaks is not a verdict on the owner
            log.warning("audit of shard %d of step %d failed: %s", a.shard, a.step, err)
            report = AuditReport(**a.model_dump(exclude={"auditor"}), verdict="unserved",
                                 reason=f"the audit failed here: {err}"[:500])
        report = report.model_copy(update={"t": time.time()})
        (log.warning if report.verdict != "ok" else log.info)(
            "audit of shard %d of step %d (owner %s): %s%s", a.shard, a.step, short_id(a.owner), report.verdict,
            f": {report.reason}" if report.reason else "")
        self.report(report)
        return report

    def audit(self, a: Audit, address: str) -> AuditReport:
        def verdict(v: str, reason: str = "") -> AuditReport:
            return AuditReport(**a.model_dump(exclude={"auditor"}), verdict=v, reason=reason[:500])  # type: ignore[arg-type]

        held = self.held(a.step, a.epoch, a.shard)
        if held is None:
            return verdict("unserved", "this peer does not hold the result it was asked to audit")
        if not address:
            return verdict("unserved", "the owner's address is unknown")
        mine = self.own(a.step, a.epoch, a.shard, held.claim.attempt)  # (what this peer sent: not fetched again)
        request = pb.InputsRequest(header=pb.Header(run_id=self.run_id, sender=self.me, step=a.step, epoch=a.epoch),
                                   shard=a.shard, num_shards=held.round.num_shards, attempt=held.claim.attempt,
                                   skip=[self.me] if mine is not None else [])
        try:
            inputs = decode_streams(list(self.client.fetch_inputs(address, request, self.timeout_s, peer=a.owner)))
            if mine is not None:
                inputs[self.me] = mine
        except grpc.RpcError as err:
            return verdict("unserved", f"the owner did not show its inputs: {rpc_reason(err)}")
        except Unverifiable as err:
            return verdict("unserved", f"the owner showed inputs that prove nothing: {err}")
        try:
            lie = check(held.round, held.claim, inputs, self.codec, self.chunk_bytes, self.clip_factor,
                        self.reject_below)
        except Unverifiable as err:
            return verdict("unserved", str(err))
        if not lie or tamper("audit.verdict", a.step, False) is True:  # (an auditor colluding with the owner: tests)
            return verdict("ok").model_copy(update={"result": held.claim.result.signature.hex()})
        self.keep(a, inputs)  # the evidence, for the coordinator to fetch and check for itself
        return verdict("lie", lie)
