"""Paced sends: an overlapped outer step's bytes spread over the inner phase it overlaps (``sync.pace``).

A volunteer's uplink is shared with everything else at home. Streaming outer steps cut each step's bytes by the
number of fragments, but sent as fast as the link takes them, each fragment is still a burst at line rate. When the
outer step overlaps the next inner phase (``diloco.overlap``), nothing waits for its result until that phase ends,
so its sends can be spread out: :class:`Pacer` gives the round's streams (the contributions and, as an owner, the
results) one shared rate, ``bytes / (sync.pace x the measured inner phase)``, as a virtual clock: each chunk goes
at the time the ones before it, at that rate, allow (never earlier), and no chunk is held back once the rate allows
it. An owner's result goes to its backup first (:meth:`~potluck.peer.reduce.allreduce.AllReduce._distribute`), paced too,
with that transfer's timeout stretched by what the pace makes it take (:meth:`Pacer.eta`): unpaced, the backup's
copy was the burst left in a paced step's peak second (in a group of two, the whole result). The rate budgets the
evidence auditors fetch from an owner too (:func:`round_bytes`). Measured (``benchmarks/wan_throughput.py``,
docs/benchmarks.md): F = 4 at pace 0.85, a peer's peak second 0.315x F = 1's, at 0.70x its tokens/s; at 0.45,
0.315-0.340x at 0.77-0.80x, where F = 4 unpaced ran 0.85-0.90x (a paced step still lands after the next phase ends
now and then), so pacing is off by default.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Protocol, TypeVar

PACE_CHUNK_S = 0.05  # a paced contribution's message holds this many seconds of the rate
MIN_PACED_CHUNK = 4096  # bytes: smaller messages would cost more in headers than pacing saves


class Sized(Protocol):
    def ByteSize(self) -> int: ...  # noqa: N802 (protobuf's name)


class Pacer:
    """``rate`` bytes a second over all the streams that :meth:`take` from it; ``stopping`` ends every wait."""

    def __init__(self, rate: float, stopping: threading.Event, clock=time.monotonic) -> None:  # type: ignore[no-untyped-def]
        if not rate > 0:
            raise ValueError(f"a pacer needs a positive rate, got {rate}")
        self.rate, self.stopping, self.clock = rate, stopping, clock
        self._lock = threading.Lock()
        self._next = 0.0  # when the next chunk may go (the virtual clock)
        self.waited_s = 0.0  # seconds the sends were held back, in all

    def slot(self, nbytes: int) -> float:
        """Book ``nbytes``: returns when they may go (now, or the time the bytes before them take at the rate)."""
        with self._lock:
            now = self.clock()
            start = max(now, self._next)
            self._next = start + nbytes / self.rate
            return start

    def eta(self, nbytes: int) -> float:
        """Seconds from now until ``nbytes`` booked now would be through: the bytes booked before them, then theirs."""
        with self._lock:
            return max(0.0, self._next - self.clock()) + nbytes / self.rate

    def take(self, nbytes: int) -> None:
        """Wait for ``nbytes``' turn."""
        wait = self.slot(nbytes) - self.clock()
        if wait > 0:
            self.waited_s += wait
            self.stopping.wait(wait)


def pace_seconds(pace: float, phases: Iterable[float], rpc_timeout_s: float) -> float:
    """Over how long an overlapped step spreads its sends: ``pace`` x the median of the recent inner ``phases``
    (one cut short by its window would make a burst of the step it ends), at most half the RPC timeout (a
    stream paced past it would be cut off); 0 without phases or a pace."""
    phases = list(phases)
    if not pace or not phases:
        return 0.0
    return min(pace * statistics.median(phases), 0.5 * rpc_timeout_s)


def round_bytes(numel: int, members: int, shards: int, bytes_per_element: float, owns: bool,
                evidence_share: float) -> float:
    """What one member sends for a paced round, about: its slices of the shards the other owners hold, and, as an
    owner, its shard's result to each of the other members and the evidence auditors fetch from it ``evidence_share``
    times a step (``sync.audit_fraction`` x (1 + ``sync.second_audit``)): its shard's inputs from every member but
    the auditor, who has its own (:class:`~potluck.peer.reduce.audit.Auditor`). That evidence goes on the same clock
    during the next phase, beside the next round's sends; left out of the budget, it put each round further behind
    the last (a paced step at 0.85 of a phase took 4.4-9.1 s of a 3.8 s one). Until 2026-12-04 this counted the whole
    vector as each audit's evidence and every member as an owner: 13 % over among four, under in a stage with more
    members than owners."""
    if shards < 1 or members < 1:
        return 0.0
    shard = numel * bytes_per_element / shards
    slices = (shards - (1 if owns else 0)) * shard
    return slices + ((members - 1) * shard * (1 + evidence_share) if owns else 0.0)


class Pacing:
    """One peer's pacing of its outer steps, the one owner of its state: the clock (kept from round to round,
    so the evidence served to auditors between rounds shares it), the round's use of it, and the size of a paced
    contribution's messages."""

    def __init__(self, stopping: threading.Event, chunk_bytes: int) -> None:
        self.stopping, self.chunk_bytes = stopping, chunk_bytes
        self.clock: Pacer | None = None  # None until a round is paced
        self.round: Pacer | None = None  # the clock while a paced round runs, else None (its sends go at once)
        self._waited_before = 0.0

    def begin(self, nbytes: float, pace_s: float) -> None:
        """A round that sends about ``nbytes`` begins: paced over ``pace_s`` seconds, or not at all (0)."""
        self.round = None
        if pace_s > 0 and nbytes > 0:
            rate = nbytes / pace_s
            if self.clock is None:
                self.clock = Pacer(rate, self.stopping)
            self.clock.rate = rate
            self.round, self._waited_before = self.clock, self.clock.waited_s

    def contribution_chunk(self) -> int:
        """Payload bytes of a contribution's message this round: ``chunk_bytes``, or PACE_CHUNK_S of the rate."""
        if self.round is None:
            return self.chunk_bytes
        return max(MIN_PACED_CHUNK, min(self.chunk_bytes, int(self.round.rate * PACE_CHUNK_S)))

    def held_back(self) -> tuple[float, float]:
        """``(seconds the round's sends were held back, all streams summed; its rate)``, (0, 0) unpaced."""
        if self.round is None:
            return 0.0, 0.0
        return self.round.waited_s - self._waited_before, self.round.rate

    def end(self) -> None:
        self.round = None


S = TypeVar("S", bound=Sized)


def paced(chunks: Iterator[S], pacer: Pacer | None) -> Iterator[S]:
    """``chunks``, each sent when ``pacer`` allows (all at once without one)."""
    for chunk in chunks:
        if pacer is not None:
            pacer.take(chunk.ByteSize())
        yield chunk
