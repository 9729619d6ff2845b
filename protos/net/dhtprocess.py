"""hivemind's DHT process as potluck runs it: tied to its parent, out of the terminal's signals, its command
pipe read whole, and its start counted (the ``dht.start`` fault point). A process killed while it held one
of hivemind's process-wide future locks leaves it taken; :func:`free_locks_of_the_dead` frees it.

Import it after :mod:`potluck.protos.net.swarm` has set hivemind's environment (swarm imports it).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
from typing import Any

from hivemind.dht import DHT
from hivemind.utils.mpfuture import MPFuture

from potluck.protos.runtime.log import get_logger
from potluck.protos.runtime.stopping import children_die_with_parent, die_with_parent
from potluck.protos.testkit.faults import fault

log = get_logger(__name__)


def _ignore_sigterm(signum: int, frame: object) -> None:
    """The DHT process's SIGTERM: ignored (caught, so ``p2pd`` still gets the default action after exec)."""


def _leave_foreground_group() -> None:
    """In ``p2pd``, between fork and exec: a process group of its own, out of the terminal's reach."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass


class _WholeMessages:
    """The DHT process's end of its command pipe, read one whole message at a time.

    uvloop watches the pipe, which makes it non-blocking, and hivemind reads a command as soon as any
    byte of it is there. Python's ``Connection`` writes a message of more than 16 KB as a header, then a
    body: a read between the two failed ("Resource temporarily unavailable"), the next took the body for
    a header, and the DHT process died ("Ran out of input") -- a plan of 4 rounds of 30 members was
    enough. Here a read blocks until its message is whole (the body follows its header at once)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def recv(self) -> Any:
        fd = self._conn.fileno()
        was = os.get_blocking(fd)
        os.set_blocking(fd, True)
        try:
            return self._conn.recv()
        finally:
            os.set_blocking(fd, was)

    def __getattr__(self, name: str) -> Any:  # poll, fileno, close: the connection's own
        return getattr(self._conn, name)


class DHTProcess(DHT):
    """hivemind's DHT process, tied to the process that starts it.

    It dies with its parent (SIGKILL on parent death), and so does its ``p2pd``. SIGINT (hivemind)
    and SIGTERM (here) leave it alone: a Ctrl+C or a SIGTERM to the whole process group reaches
    the parent too, which still needs the DHT to say goodbye and then stops it
    (:meth:`~potluck.protos.net.swarm.SwarmNode.shutdown`). ``p2pd`` cannot ignore SIGINT (Go installs its own handler), so it
    runs in a process group of its own: a Ctrl+C in the terminal used to close it under the DHT
    process, which logged p2pd's "use of closed network connection" error, lost the goodbye, and hung
    in its shutdown until it was killed.
    """

    started = 0  # DHT starts in this process so far: the step of its ``dht.start`` fault point

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.owner_pid = os.getpid()
        DHTProcess.started += 1
        self.start_number = DHTProcess.started
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        # what this process inherited (torch's, hivemind's and gRPC's modules, the parent's objects: 230,000
        # containers and more) is never walked by its collections: a walk writes each object's header, which
        # copies the page it lands on out of the memory shared with the parent, and takes 0.1-0.2 s of its loop
        gc.freeze()
        die_with_parent(signal.SIGKILL, self.owner_pid)
        children_die_with_parent(signal.SIGKILL)  # p2pd, started by uvloop's fork + exec
        os.register_at_fork(after_in_child=_leave_foreground_group)  # (the DHT process forks p2pd only)
        signal.signal(signal.SIGTERM, _ignore_sigterm)
        fault("dht.start", self.start_number)  # (in the DHT process: a hang here is a start that never ends)
        pipe: Any = self.__dict__["_inner_pipe"]  # (hivemind's own, set in DHT.__init__)
        self._inner_pipe = _WholeMessages(pipe)
        super().run()


def free_locks_of_the_dead() -> None:
    """Replace hivemind's process-wide future locks if a process we killed died holding one.

    Every process forked from this one shares ``MPFuture``'s locks; a DHT process killed while it
    held one (it had just handed this process its start-up error and was still in the lock's
    ``with``) left it taken for good, and the next DHT process hung in its first ``set_result``: a
    coordinator that started a new swarm after a failed rejoin never became ready. A live holder
    keeps such a lock for microseconds, so one not free within a second belongs to the dead.
    """
    for name in ("_update_lock", "_initialization_lock"):
        lock = getattr(MPFuture, name)
        if lock.acquire(timeout=1.0):
            lock.release()
        else:
            log.warning("a DHT process died holding hivemind's %s: replaced it (the next start would hang)", name)
            setattr(MPFuture, name, mp.Lock())


def dht_starts() -> int:
    """How many DHT processes this process has started (the step of the next one's ``dht.start`` is this + 1)."""
    return DHTProcess.started
