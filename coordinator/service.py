"""The coordinator's side of the wire: what its PeerService answers, and the pings it sends.

The coordinator is not on the data path. It answers Ping and serves its checkpoint to recovering
peers (through the :class:`~potluck.coordinator.checkpointer.Checkpointer`); the all-reduce and
pipeline RPCs are refused as ``UNSUPPORTED``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import grpc

from potluck.coordinator.checkpointer import Checkpointer
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


def answers(client: PeerClient, run_id: str, me: str, rec: PeerRecord) -> bool:
    """Does the process that published ``rec`` still answer at its address, as a peer of this run?"""
    request = pb.PingRequest(header=pb.Header(run_id=run_id, sender=me), sent_at=time.time())
    try:
        reply = client.ping(rec.address, request, PING_TIMEOUT_S, peer=rec.peer_id)
    except grpc.RpcError:
        return False
    return reply.peer_id == rec.peer_id and reply.state not in SAID_GOODBYE


def reachable(client: PeerClient, run_id: str, me: str, records: Iterable[PeerRecord]) -> list[PeerRecord]:
    """The peers that answer a ping, all pinged at once: a live record of a dead process should not enter a round.
    (32 threads pinged 1,000 peers in turn: with churn, waves of 2 s timeouts made a decision take 6 s.)"""
    records = list(records)
    request = pb.PingRequest(header=pb.Header(run_id=run_id, sender=me), sent_at=time.time())
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
    at most ``primed_s`` ago. With churn, nearly all a decision had left to ping were such newcomers, and
    waiting for them was most of its time (0.16 s of a median decision at 1,000 peers, on a machine of its
    own; a second for the first round after a join burst). Only the next decision: a member killed later,
    whose record then stops short of the committed step, is pinged again like before (a test killing one
    mid-step caught a round decided with it, its join-time answer taken as fresh)."""

    def __init__(self, client: PeerClient, run_id: str, me: str, max_age_s: float = 10.0,
                 done: Callable[[], None] = lambda: None, primed_s: float = PRIMED_S) -> None:
        self.client, self.run_id, self.me, self.max_age_s, self.primed_s = client, run_id, me, max_age_s, primed_s
        self.done = done  # told when the answers are in (the coordinator's loop wakes to decide at once)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._answer: tuple[list[PeerRecord], float, float, set[str]] | None = None  # (reachable, began, ended, asked)
        self._queue: dict[str, PeerRecord] = {}  # newcomers not pinged yet (by peer id: the newest record)
        self._primer: threading.Thread | None = None
        self._answered: dict[str, tuple[str, float]] = {}  # peer id -> (the address that answered, when it did)
        self._taken = -float("inf")  # when a decision last took its answers: a primed answer before it is spent

    def poll(self, records: Iterable[PeerRecord], proven: Callable[[], Collection[str]] = frozenset, due: bool = True,
             ) -> tuple[list[PeerRecord], float] | None:
        """``proven()``: peers whose own reports just showed them at work (they averaged or fetched the committed
        step, and heartbeat): they are not pinged again, nor are peers whose answer to :meth:`prime`'s ping came
        after the last decision took its answers, within ``primed_s``, at the address they still announce. With no
        one left to ping, the answer is at once. Asked only when pings start (not on every tick they run).

        Not ``due`` (the decision is not due yet: the round just committed, its members still report it), the pings
        start and their answer is kept for the decision, not taken: at 1,000 peers the newcomers' pings were most
        of a decision's time, and the committed round's settling is time enough for them (up to ``settle_s``)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return None
            answer, now = self._answer, time.monotonic()
            if answer is not None and now - answer[2] <= self.max_age_s and not due:
                return None  # (kept for the decision: asked on every tick while the round settles, it looks at no peer)
            records = list(records)
            if answer is not None and now - answer[2] <= self.max_age_s:
                here = {r.peer_id: r for r in records}  # (a proven liar answered the pings that began before its proof)
                late = [r for r in records if r.peer_id not in answer[3]]  # (live since the pings began: in if at work
                known = set(proven()) if late else set()  # or their own first answer is fresh, else in the next round)
                late = [r for r in late if r.peer_id in known or self._fresh(r, now)]
                self._answer, self._taken = None, now
                return [here[r.peer_id] for r in answer[0] if r.peer_id in here] + late, answer[1]
            self._answer = None
            known = set(proven()) | {r.peer_id for r in records if self._fresh(r, now)}
            if all(r.peer_id in known for r in records):
                if due:
                    self._taken = now
                    return records, now
                return None  # (nobody to ping: the decision finds the same)
            self._thread = threading.Thread(target=self._ping, args=(records, known, now), name="pinger", daemon=True)
            self._thread.start()
            return None

    def prime(self, rec: PeerRecord) -> None:
        """Ping ``rec``'s peer soon, off the loop (it just joined or came back): the next decision need not."""
        with self._lock:
            self._queue[rec.peer_id] = rec
            if self._primer is None or not self._primer.is_alive():
                self._primer = threading.Thread(target=self._prime, name="pinger-primer", daemon=True)
                self._primer.start()

    def _fresh(self, rec: PeerRecord, now: float) -> bool:
        seen = self._answered.get(rec.peer_id)
        return seen is not None and seen[0] == rec.address and self._taken < seen[1] and now - seen[1] <= self.primed_s

    def _prime(self) -> None:
        while True:
            with self._lock:
                batch, self._queue = list(self._queue.values()), {}
                if not batch:
                    self._primer = None
                    return
            try:
                ok = reachable(self.client, self.run_id, self.me, batch)
            except Exception:  # (a bug here must not stop the primer: the decision pings them itself)
                ok = []
            now = time.monotonic()
            with self._lock:
                for r in ok:
                    self._answered[r.peer_id] = (r.address, now)
                if len(self._answered) > 64:  # (stale answers go: they prove nothing)
                    self._answered = {p: a for p, a in self._answered.items() if now - a[1] <= self.primed_s}

    def _ping(self, records: list[PeerRecord], proven: set[str], began: float) -> None:
        try:
            ok = {r.peer_id for r in reachable(self.client, self.run_id, self.me, [r for r in records if r.peer_id not in proven])}
        except Exception:  # (a bug here must not stop decisions: nobody answered, ask again)
            ok = set()
        with self._lock:
            self._answer = ([r for r in records if r.peer_id in ok or r.peer_id in proven], began, time.monotonic(),
                            {r.peer_id for r in records})
        self.done()
