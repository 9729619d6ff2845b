"""The coordinator's side of the wire: what its PeerService answers, and the pings it sends.

The coordinator is not on the data path. It answers Ping and serves its checkpoint to recovering
peers (through the :class:`~potluck.coordinator.store.checkpointer.Checkpointer`); the all-reduce and
pipeline RPCs are refused as ``UNSUPPORTED``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from potluck.coordinator.store.checkpointer import Checkpointer
from potluck.coordinator.swarm import pings
from potluck.coordinator.swarm.pings import PING_TIMEOUT_S
from potluck.protos import potluck_pb2 as pb
from potluck.protos.net.transport import PeerClient
from potluck.protos.wire.records import PeerRecord
from potluck.protos.wire.refusals import Rejected
from potluck.protos.wire.states import SAID_GOODBYE

# The coordinator calls a peer at its admission, and again only at a decision that finds it not at work (or to
# fetch a checkpoint or audit): an idle TLS connection holds about 120 KB, so at 1,000 peers one kept open to
# each was 120 MB of its memory. Past this long without a call, a connection closes (the channel stays, and
# connects again for the next call; a call in flight, however long, keeps it open).
IDLE_CONNECTION_S = 60.0

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


@dataclass(frozen=True)
class Snapshot:
    """What a :class:`Pinger` holds, copied (for a test or a status page to look at without its lock)."""

    state: pings.PingerState
    heard: dict[str, pings.Heard]  # the newcomers' answers held (see pings.pruned)
    priming: frozenset[str]  # newcomers whose first ping is queued or in flight


class Pinger:
    """The pings of :mod:`~potluck.coordinator.swarm.pings`, carried out off the coordinator's loop: what to do is
    decided there (a pure state machine, :class:`~potluck.coordinator.swarm.pings.PingerState`); this class holds
    the state under a lock and runs the pings on threads of its own, so the loop never stops for them.

    - :meth:`poll` (the loop, for a round's decision): :func:`pings.poll`'s :class:`~pings.Answer` or
      :class:`~pings.Waiting`; a :class:`~pings.PingAll` it asks for runs on a thread of its own, :func:`reachable`
      (all at once), and wakes the loop (``done``) when its answers are in;
    - :meth:`prime` (the peer table, when a peer first shows up or comes back) and :class:`~pings.Prime`: the
      newcomer is queued for the primer thread, which pings each with ``client.ping_each`` and books each answer
      as it comes (:class:`~pings.Heard`: at a join burst, batches of 150 waited 0.8 s for their slowest)."""

    def __init__(self, client: PeerClient, run_id: str, me: str, max_age_s: float = 10.0,
                 done: Callable[[], None] = lambda: None, primed_s: float = pings.PRIMED_S) -> None:
        self.client, self.run_id, self.me = client, run_id, me
        self.done = done  # told when the answers are in (the coordinator's loop wakes to decide at once)
        self._lock = threading.Lock()  # (the loop's polls, the ping thread's and the primer's answers)
        self._state = pings.PingerState(pings.PingRules(max_age_s=max_age_s, primed_s=primed_s))
        self._heard: dict[str, pings.Heard] = {}  # peer id -> its answer to its first ping
        self._queue: dict[str, PeerRecord] = {}  # newcomers not pinged yet (by peer id: the newest record)
        self._priming: set[str] = set()  # queued for the primer, or its pings in flight
        self._primer: threading.Thread | None = None

    def poll(self, records: Iterable[PeerRecord], proven: Callable[[], Collection[str]] = frozenset, due: bool = True,
             short: Callable[[int], bool] = lambda answered: False) -> pings.Polled:
        """See :func:`pings.poll` (``proven``, ``due``, ``short``): an Answer, or why the decision waits."""
        records = list(records)
        with self._lock:
            self._state, polled, actions = pings.poll(self._state, records, time.monotonic(), self._heard,
                                                      self._priming, proven, due, short)
            for action in actions:
                match action:
                    case pings.PingAll(todo):
                        threading.Thread(target=self._ping, args=(todo,), name="pinger", daemon=True).start()
                    case pings.Prime(todo):
                        for rec in todo:
                            self._enqueue(rec)
        return polled

    def prime(self, rec: PeerRecord) -> None:
        """Ping ``rec``'s peer soon, off the loop (it just joined or came back): the next decision need not."""
        with self._lock:
            self._enqueue(rec)

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(self._state, dict(self._heard), frozenset(self._priming))

    def _ping(self, todo: tuple[PeerRecord, ...]) -> None:
        """A decision's pings (its own thread): all at once, then the loop is woken to decide."""
        try:
            ok = {r.peer_id for r in reachable(self.client, self.run_id, self.me, todo)}
        except Exception:  # (a bug here must not stop decisions: nobody answered, ask again)
            ok = set()
        with self._lock:
            self._state = pings.pinged(self._state, {r.peer_id for r in todo}, ok, time.monotonic())
        self.done()

    def _enqueue(self, rec: PeerRecord) -> None:
        self._queue[rec.peer_id] = rec
        self._priming.add(rec.peer_id)
        if self._primer is None or not self._primer.is_alive():
            self._primer = threading.Thread(target=self._prime, name="pinger-primer", daemon=True)
            self._primer.start()

    def _prime(self) -> None:
        """The primer (its own thread): the queued newcomers' first pings, each answer booked as it comes."""
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
                                      pings.PING_TIMEOUT_S, answered)
            except Exception:  # (a bug here must not stop the primer: the decision pings them itself)
                for pid in where:
                    self._primed(pid, where[pid], False)

    def _primed(self, pid: str, address: str, ok: bool) -> None:
        now = time.monotonic()
        with self._lock:
            self._heard[pid] = pings.Heard(address if ok else "", now)
            if pid not in self._queue:  # (asked again meanwhile: still on its way)
                self._priming.discard(pid)
            if (cut := pings.pruned(self._state, self._heard, now)) is not None:
                self._state, self._heard = cut
            self._state, wake = pings.wakes(self._state, now)
        if wake:
            self.done()  # (a fresh start waits for its min_peers: a newcomer's answer may be the one)
