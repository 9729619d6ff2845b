"""The interpreter's cycle collector on a loop's own schedule, not in the middle of its work.

CPython's full (generation 2) collection walks every container object the process holds. A
coordinator holds about 230,000 of them before its first tick (torch, hivemind, gRPC and their
modules), and at 1,000 peers as many again of records, rounds and reports; none of them garbage. A
full pass cost 150-250 ms of CPU on a 2-core box: at 300 peers it landed every few seconds in
whichever tick happened to allocate, and it was the whole of that tick's p99
(``benchmarks/swarm_scale.py``). So a long-running loop:

* ``settle()`` once it has started: collects, then freezes what survived (``gc.freeze``: a frozen object
  is never walked again; it is still freed the usual way when nothing refers to it) and takes full
  collections off the automatic schedule; the young generations still collect as usual, in a few ms;
* ``collect()`` between two iterations when ``due`` (every ``every_s``): a full pass over what is not
  frozen (what survived since the last one), then freezes it too;
* once every ``whole_every_s`` that pass unfreezes everything first, so a cycle that became garbage
  after it was frozen lives that long at most (at 1,000 peers the passes found 67,000-121,000 such objects
  in 3.5 minutes: cycles do become garbage);
* after each, the C allocator's free pages go back to the OS (:func:`trim`), unless the process holds them
  (``give_back=False``: a peer, see :func:`hold`).

Two policies for the C allocator itself, set once at start: a coordinator's memory comes and goes with bursts,
so it gives back what it frees (:func:`tame`); a peer's big buffers come back every step, so it keeps what it
frees (:func:`hold`).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

NEVER = 1 << 30  # a generation-2 threshold that automatic collection never reaches


@dataclass
class Heap:
    every_s: float = 30.0  # a full collection of what is not frozen at most this often
    give_back: bool = True  # after each, the C allocator's free pages go back to the OS (False: see hold)
    whole_every_s: float = 600.0  # ... and of everything, this often
    frozen: int = 0  # objects frozen now
    collections: int = 0
    last_s: float = 0.0  # CPU seconds the last full collection took
    max_s: float = 0.0
    freed: int = 0  # unreachable objects found by the full collections, in all
    trimmed: int = 0  # times the C allocator gave memory back (see trim)
    _next: float = float("inf")  # (until settled, the interpreter's own schedule)
    _next_whole: float = float("inf")

    def settle(self, now: float) -> None:
        gc.collect()
        gc.freeze()
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, NEVER)
        self.frozen, self._next, self._next_whole = gc.get_freeze_count(), now + self.every_s, now + self.whole_every_s

    def due(self, now: float) -> bool:
        return now >= self._next

    def collect(self, now: float) -> float:
        """One full collection (of what is not frozen; of everything when the whole pass is due); its CPU seconds."""
        c0 = time.thread_time()
        if now >= self._next_whole:
            gc.unfreeze()
            self._next_whole = now + self.whole_every_s
        self.freed += gc.collect()
        gc.freeze()
        if self.give_back:
            self.trimmed += trim()
        self.last_s, self.frozen = time.thread_time() - c0, gc.get_freeze_count()
        self.max_s, self.collections, self._next = max(self.max_s, self.last_s), self.collections + 1, now + self.every_s
        return self.last_s

    def section(self) -> dict[str, float | int]:
        return {"frozen": self.frozen, "every_s": self.every_s, "whole_every_s": self.whole_every_s,
                "collections": self.collections, "last_s": self.last_s, "max_s": self.max_s, "freed": self.freed,
                "trimmed": self.trimmed}


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -3, -4, -8
ARENAS = 2  # malloc arenas for the whole process (glibc's default: 8 per core)
MMAP_FROM = 256 * 1024  # an allocation this big gets pages of its own, unmapped when it is freed
TRIM_FROM = 1024 * 1024  # free memory at the heap's top past this goes back to the OS at once


def tame() -> bool:
    """Keep the C allocator's footprint near what the process holds (call it before threads start; False where
    there is no glibc). glibc's defaults suit short jobs: each thread that allocates gets an arena of its own (up
    to 8 per core), and each freed big block raises the size from which blocks get pages of their own, up to
    32 MB. A coordinator at 1,000 peers frees a plan (560 KB), a snapshot (430 KB) and DHT answers every few
    seconds from the loop, gRPC's and the status server's threads: its main heap and 7 thread arenas held
    ~600 MB that its Python objects (~160 MB, tracemalloc) did not use. Fixed thresholds keep big blocks out
    of the heaps, and two arenas are shared by all threads."""
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    return all(mallopt(k, v) == 1 for k, v in ((M_ARENA_MAX, ARENAS), (M_MMAP_THRESHOLD, MMAP_FROM),
                                               (M_TRIM_THRESHOLD, TRIM_FROM)))


HELD_TOP = (1 << 31) - 1  # (mallopt takes an int) free memory at the heap's top past this still goes back


def hold() -> bool:
    """Keep what the C allocator frees for the next allocation instead of giving it back to the OS (call it
    before threads start; False where there is no glibc). A peer's big buffers come back every step: the
    all-reduce's decoded contributions, sums and result vectors (tens of MB each at 20M values), the inner
    step's activations and gradients. With glibc's defaults each buffer over its mmap threshold gets pages of
    its own, unmapped when it is freed, so every step faults all of them in again (and zeroes them), and thread
    arenas give back their tops. ``benchmarks/allreduce_vs_hivemind.py``'s members took about 21,000 page faults
    a round each that way (11-40 held); on a VM whose host takes back the pages the guest frees (free page
    reporting) a page touched again costs a host fault, about 8 ms a MB there. Here every block comes from one
    heap (one arena, no mmap of its own), and a freed one waits there for the next. The price: the resident set
    stays at its peak between steps, and one heap fragments more, so the peak can be higher (two real peers of a
    20M-parameter model: within 6 %; the benchmark's members, whose off-clock work allocates more: up to 1.3x)."""
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    return all(mallopt(k, v) == 1 for k, v in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, HELD_TOP)))


def trim() -> int:
    """Give the C allocator's free pages back to the OS (glibc's ``malloc_trim``; 1 if it released any, 0 if
    not, or where there is no such call). gRPC's connections and TLS buffers and the larger Python objects live
    in that heap, and glibc keeps what a burst freed mapped for good: the coordinator's join burst of 1,000
    peers (a TLS connection each, about 120 KB) set its memory for the rest of the run."""
    release = _libc("malloc_trim")
    return int(release(0)) if release is not None else 0


MADV_PAGEOUT = 21  # madvise: reclaim these pages now (Linux 5.4 and newer)


def shed() -> int:
    """Give back the pages of the shared libraries that the process's imports touched and it has not used since;
    the bytes its RSS dropped (0 where the kernel cannot). Call it once the imports are done and before any fork:
    the kernel leaves pages that another process maps too. What the process runs later comes back from the page
    cache on first touch (nothing is written: these pages are the libraries' own, never changed).

    torch's CUDA build maps cuBLAS, NVRTC, nvJitLink, cuDNN and its own CUDA library when imported, GPU or not,
    and its loading touches ~380 MB of their pages (~50 MB with the CPU build). A coordinator never runs CUDA,
    yet those pages were 0.4 of its 1 GB RSS at 1,000 peers, and the OOM killer counts them."""
    madvise = _libc("madvise")
    if madvise is None or not os.path.exists("/proc/self/maps"):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    before = resident()
    with open("/proc/self/maps") as maps:
        spans = [line.split(maxsplit=5) for line in maps]
    for fields in spans:  # (the libraries' code and read-only data: a writable page may hold the process's changes)
        if len(fields) == 6 and ".so" in fields[5] and "w" not in fields[1]:
            begin, end = (int(x, 16) for x in fields[0].split("-"))
            madvise(begin, end - begin, MADV_PAGEOUT)
    return max(0, before - resident())


def resident() -> int:
    """This process's resident set, bytes (0 where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@functools.cache
def _libc(name: str) -> CFuncPtr | None:
    """A C library call (glibc's ``malloc_trim``, ``mallopt``), looked up once (each lookup makes a library
    object whose cycles a collection would find as garbage); None where the C library has no such call."""
    try:
        return getattr(ctypes.CDLL(None), name)  # type: ignore[no-any-return]
    except (AttributeError, OSError):
        return None
