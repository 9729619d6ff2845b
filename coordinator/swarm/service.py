"""The coordinator's side of the wire: what its PeerService answers, and the pings it sends.

The coordinator is not on the data path. It answers Ping and serves its checkpoint to recovering
peers (through the :class:`~potluck.coordinator.store.checkpointer.Checkpointer`); the all-reduce and
pipeline RPCs are refused as ``UNSUPPORTED``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import grpc

from potluck.coordinator.store.checkpointer import Checkpointer
from potluck.protos import potluck_pb2 as pb
from potluck.protos.net.transport import PeerClient
from potluck.protos.wire.records import PeerRecord
from potluck.protos.wire.refusals import Rejected
from potluck.protos.wire.states import SAID_GOODBYE

PING_TIMEOUT_S = 2.0
# The coordinator calls a peer at its admission, and again only at a decision that finds it not at work (or to
# fetch a checkpoint or audit): an idle TLS connection holds about 120 KB, so at 1,000 peers one kept open to
# each was 120 MB of its memory. Past this long without a call, a connection closes (the channel stays, and
# connects again for the next call; a call in flight, however long, keeps it open).
IDLE_CONNECTION_S = 60.0
# A newcomer's answer to the ping when it showed up stands in for the decision's own ping this long (and only
# for the next decision): the decision's own pings were as old as they took, a second or two.
PRIMED_S = 3.0
# A fresh start waiting for its min_peers' answers is woken by a newcomer's answer at most this often (each answer
# woke it at first: 23 ticks in the 0.35 s the last 86 answers of a 1,000-peer join burst took).
WAKE_S = 0.05
# While a round settles, the proofs of the peers not pinged are looked at again this often, and those that lapsed
# (a member whose heartbeat went stale) pinged: once due, at 1,000 peers on 2 cores, 20-100 such pings were
# 0.05-0.3 s of a decision.
RECHECK_S = 1.0


class CoordinatorService:
    def __init__(self, me: str, committed: Callable[[], int], checkpointer: Checkpointer) -> None:
        self.me, self.committed, self.checkpointer = me, committed, checkpointer

    def ping(self, request: pb.PingRequest) -> pb.PingReply:
        return pb.PingReply(peer_id=self.me, state="coordinator", version=self.committed(), sent_at=request.sent_at)

    def get_state_info(self, request: pb.StateInfoRequest) -> pb.StateInfo:
        return self.checkpointer.get_state_info(request)

    def fetch_state(self, request: pb.StateRequest) -> Iterator[pb.StateChunk]:
        return self.checkpointer.fetch_state(request)

    def _unsupported(self, *_: Any) -> Any:
        raise Rejected(pb.UNSUPPORTED, "the coordinator takes no part in the all-reduce or the pipeline")

    push_contribution = push_result = fetch_result = fetch_inputs = push_pipe = _unsupported


def ping_request(run_id: str, me: str) -> pb.PingRequest:
    return pb.PingRequest(header=pb.Header(run_id=run_id, sender=me), sent_at=time.time())


def answers(client: PeerClient, run_id: str, me: str, rec: PeerRecord) -> bool:
    """Does the process that published ``rec`` still answer at its address, as a peer of this run?"""
    request = ping_request(run_id, me)
    try:
        reply = client.ping(rec.address, request, PING_TIMEOUT_S, peer=rec.peer_id)
    except grpc.RpcError:
        return False
    return reply.peer_id == rec.peer_id and reply.state not in SAID_GOODBYE


def reachable(client: PeerClient, run_id: str, me: str, records: Iterable[PeerRecord]) -> list[PeerRecord]:
    """The peers that answer a ping, all pinged at once: a live record of a dead process should not enter a round.
    (32 threads pinged 1,000 peers in turn: with churn, waves of 2 s timeouts made a decision take 6 s.)"""
    records = list(records)
    request = ping_request(run_id, me)
    answered = client.ping_all([(r.address, r.peer_id) for r in records], request, PING_TIMEOUT_S)
    return [r for r, ok in zip(records, answered, strict=True) if ok]


class Pinger:
    """:func:`reachable`, off the coordinator's loop: a round's decision needs every live peer pinged (a
    thousand of them, some over new TLS connections, take seconds), and the loop must not stop for it.

    :meth:`poll` starts pinging the peers it is given and returns None until the answers are in, then
    the peers that answered and when the pings began (a decision's cost counts from there); answers
    older than ``max_age_s`` are not used, the peers are pinged again. Only peers it is still given are in
    an answer: one evicted (or gone) while the pings ran is in no round decided after that.

    :meth:`prime` pings a peer when it first shows up (or comes back), off the loop too: the next decision
    takes that answer without a ping of its own if it came after the decision before took its answers, and
    at most ``primed_s`` before the pings it keeps began (or after). With churn, nearly all a decision had left to
    ping were such newcomers, and waiting for them was most of its time (0.16 s of a median decision at 1,000
    peers, on a machine of its own; a second for the first round after a join burst). Only the next decision: a
    member killed later, whose record then stops short of the committed step, is pinged again like before (a
    test killing one mid-step caught a round decided with it, its join-time answer taken as fresh)."""

    def __init__(self, client: PeerClient, run_id: str, me: str, max_age_s: float = 10.0,
                 done: Callable[[], None] = lambda: None, primed_s: float = PRIMED_S) -> None:
        self.client, self.run_id, self.me, self.max_age_s, self.primed_s = client, run_id, me, max_age_s, primed_s
        self.done = done  # told when the answers are in (the coordinator's loop wakes to decide at once)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._answer: tuple[set[str], set[str], float, float] | None = None  # (answered, asked, began, ended)
        self._queue: dict[str, PeerRecord] = {}  # newcomers not pinged yet (by peer id: the newest record)
        self._primer: threading.Thread | None = None
        self._priming: set[str] = set()  # queued for the primer, or its pings in flight
        self._answered: dict[str, tuple[str, float]] = {}  # peer id -> (the address that answered, "" if none; when)
        self._again: dict[str, float] = {}  # peer id -> when a short answer had it pinged again
        self._proven: set[str] | None = None  # proven() when the kept answer was first offered (asked once)
        self._short = False  # a fresh start waits on newcomers' answers (they wake the loop, see WAKE_S)
        self._prune_at = 64  # (answers held past this many: the stale ones go)
        self._woke = -float("inf")  # when an answer last woke the loop
        self._checked = -float("inf")  # when the proofs were last looked at while a round settled
        self._taken = -float("inf")  # when a decision last took its answers: a primed answer before it is spent

    def poll(self, records: Iterable[PeerRecord], proven: Callable[[], Collection[str]] = frozenset, due: bool = True,
             short: Callable[[int], bool] = lambda answered: False) -> tuple[list[PeerRecord], float] | None:
        """``proven()``: peers whose own reports just showed them at work (they averaged or fetched the committed
        step, and heartbeat): they are not pinged again, nor are peers whose answer to :meth:`prime`'s ping came
        after the last decision took its answers, within ``primed_s`` of the pings' start, at the address they still
        announce, nor peers whose :meth:`prime` ping is on its way. With no one left to ping, the answer is at once.

        Not ``due`` (the decision is not due yet: the round just committed, its members still report it), the pings
        start and their answer is kept for the decision, not taken: at 1,000 peers the newcomers' pings were most
        of a decision's time, and the committed round's settling is time enough for them (up to ``settle_s``).
        Once due, who is in is looked at again: a peer proven then but not now is pinged by the decision (a member
        killed while the round settled); a newcomer since is in on its own first answer, else in the next round.

        ``short(answered)``: wait on (a fresh start short of ``min_peers``)? The answer is kept, not taken, and the
        peers it lacks are pinged again (each once in ``PING_TIMEOUT_S``); each newcomer is in once its own first
        answer is. (Taken and pinged anew, a short answer of the first round after 1,000 joins cost 1.2 s more.)"""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return None
            answer, now = self._answer, time.monotonic()
            if answer is not None and now - answer[3] > self.max_age_s:
                answer = self._answer = None
            if answer is not None and not due:
                if now - self._checked >= RECHECK_S and (records := list(records)):  # (else it looks at no peer)
                    self._checked = now  # (proofs that lapse while the round settles: pinged now, not once due)
                    if unasked := self._sort(records, set(proven()))[2]:
                        self._start(unasked)
                return None  # (kept for the decision)
            records = list(records)
            if answer is None:
                self._answer, self._again, self._proven, self._short = (set(), set(), now, now), {}, None, False
                known = set(proven()) | {r.peer_id for r in records if self._fresh(r, now - self.primed_s)}
                if todo := [r for r in records if r.peer_id not in known and r.peer_id not in self._priming]:
                    self._start(todo)
                    return None
                if not due:
                    return None
            return self._offer(records, proven, now, short)

    def _offer(self, records: list[PeerRecord], proven: Callable[[], Collection[str]], now: float,
               short: Callable[[int], bool]) -> tuple[list[PeerRecord], float] | None:
        if self._proven is None:  # (asked once: proofs that lapse while the decision's own pings run cost no more)
            self._proven = set(proven())
        there, missing, unasked = self._sort(records, self._proven)
        if unasked:
            self._start(unasked)
            return None
        if short(len(there)) and missing:
            for r in missing:  # (busy when pinged, or joined since: their own pings, not everyone's again)
                if r.peer_id not in self._priming and now - self._again.get(r.peer_id, -float("inf")) > PING_TIMEOUT_S:
                    self._again[r.peer_id] = now
                    self._enqueue(r)
            self._short = True
            return None
        assert self._answer is not None
        began = self._answer[2]
        self._answer, self._taken, self._again, self._proven, self._short = None, now, {}, None, False
        return there, began

    def _sort(self, records: list[PeerRecord], at_work: set[str]) -> tuple[list[PeerRecord], list[PeerRecord], list[PeerRecord]]:
        """``records`` by the kept answer: in (answered, at work, or a fresh first answer), missing (pinged, by
        the decision or at its join, with no answer), and not asked (proven when the pings began, not now)."""
        assert self._answer is not None
        ok, asked, began, _ = self._answer
        since = began - self.primed_s
        there, missing, unasked = list[PeerRecord](), list[PeerRecord](), list[PeerRecord]()
        for r in records:
            pid = r.peer_id
            if pid in ok or pid in at_work or self._fresh(r, since):
                there.append(r)
            elif pid in asked or pid in self._priming or self._tried(pid, since):
                missing.append(r)
            else:
                unasked.append(r)
        return there, missing, unasked

    def _start(self, todo: list[PeerRecord]) -> None:
        self._thread = threading.Thread(target=self._ping, args=(todo,), name="pinger", daemon=True)
        self._thread.start()

    def prime(self, rec: PeerRecord) -> None:
        """Ping ``rec``'s peer soon, off the loop (it just joined or came back): the next decision need not."""
        with self._lock:
            self._enqueue(rec)

    def _enqueue(self, rec: PeerRecord) -> None:
        self._queue[rec.peer_id] = rec
        self._priming.add(rec.peer_id)
        if self._primer is None or not self._primer.is_alive():
            self._primer = threading.Thread(target=self._prime, name="pinger-primer", daemon=True)
            self._primer.start()

    def _fresh(self, rec: PeerRecord, since: float) -> bool:
        return self._tried(rec.peer_id, since) and self._answered[rec.peer_id][0] == rec.address

    def _tried(self, pid: str, since: float) -> bool:
        seen = self._answered.get(pid)
        return seen is not None and seen[1] > self._taken and seen[1] >= since

    def _prime(self) -> None:
        while True:
            with self._lock:
                batch, self._queue = list(self._queue.values()), {}
                if not batch:
                    self._primer = None
                    return
            where = {r.peer_id: r.address for r in batch}

            def answered(peer: str, ok: bool, at: dict[str, str] = where) -> None:
                self._primed(peer, at[peer], ok)

            try:  # (each answer as it comes: at a join burst, batches of 150 waited 0.8 s for their slowest)
                self.client.ping_each([(a, p) for p, a in where.items()], ping_request(self.run_id, self.me),
                                      PING_TIMEOUT_S, answered)
            except Exception:  # (a bug here must not stop the primer: the decision pings them itself)
                for pid in where:
                    self._primed(pid, where[pid], False)

    def _primed(self, pid: str, address: str, ok: bool) -> None:
        now = time.monotonic()
        with self._lock:
            self._answered[pid] = (address if ok else "", now)
            if pid not in self._queue:  # (asked again meanwhile: still on its way)
                self._priming.discard(pid)
            if len(self._answered) > self._prune_at:  # (spent or stale answers go: they prove nothing)
                keep = max(self._taken, now - self.primed_s - self.max_age_s - PING_TIMEOUT_S)
                self._answered = {p: a for p, a in self._answered.items() if a[1] > keep}
                self._prune_at = max(64, 2 * len(self._answered))  # (each answer comes alone: not a pass each)
            wake = self._short and now - self._woke >= WAKE_S
            self._woke = now if wake else self._woke
        if wake:
            self.done()  # (a fresh start waits for its min_peers: a newcomer's answer may be the one)

    def _ping(self, todo: list[PeerRecord]) -> None:
        try:
            ok = {r.peer_id for r in reachable(self.client, self.run_id, self.me, todo)}
        except Exception:  # (a bug here must not stop decisions: nobody answered, ask again)
            ok = set()
        with self._lock:
            if self._answer is not None:
                answered, asked, began, ended = self._answer  # (its age: that of its first pings, however many after)
                self._answer = (answered | ok, asked | {r.peer_id for r in todo}, began, ended if asked else time.monotonic())
        self.done()
