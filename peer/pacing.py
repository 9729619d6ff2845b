"""Paced sends: an overlapped outer step's bytes spread over the inner phase it overlaps (``sync.pace``).

A volunteer's uplink is shared with everything else at home. Streaming outer steps cut each step's bytes by the
number of fragments, but sent as fast as the link takes them, each fragment is still a burst at line rate. When the
outer step overlaps the next inner phase (``diloco.overlap``), nothing waits for its result until that phase ends,
so its sends can be spread out: :class:`Pacer` gives the round's streams (the contributions and, as an owner, the
results) one shared rate, ``bytes / (sync.pace x the measured inner phase)``, as a virtual clock: each chunk goes
at the time the ones before it, at that rate, allow (never earlier), and no chunk is held back once the rate allows
it. Measured (``benchmarks/wan_throughput.py``, docs/benchmarks.md), a peer's peak second fell less than the rate
says (0.377x -> 0.358x of F = 1's at 2.1M parameters): what is not paced (a result's copy to its backup) and whole
messages still land in one second.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Protocol, TypeVar


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

    def take(self, nbytes: int) -> None:
        """Wait for ``nbytes``' turn."""
        wait = self.slot(nbytes) - self.clock()
        if wait > 0:
            self.waited_s += wait
            self.stopping.wait(wait)


S = TypeVar("S", bound=Sized)


def paced(chunks: Iterator[S], pacer: Pacer | None) -> Iterator[S]:
    """``chunks``, each sent when ``pacer`` allows (all at once without one)."""
    for chunk in chunks:
        if pacer is not None:
            pacer.take(chunk.ByteSize())
        yield chunk
