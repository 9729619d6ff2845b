"""Stopping a potluck process: politely on the first signal, for sure within a bound.

The first SIGINT/SIGTERM sets the process's ``stopping`` event, so its loops leave at the next
check and shut their servers and DHT node down in order. A watchdog makes sure that happens within
``grace_s``: past it, or on a second signal, every process below this one is killed and this one
exits at once. Should even the watchdog thread not get to run (the interpreter wedged in C code),
an interval timer lets the kernel end the process half a second later, and the parent-death signals
(:func:`die_with_parent`) take its children along.

Processes below us are found through ``/proc`` and killed ones are reaped here, not left to init
(a process with stop handlers is a "child subreaper": orphans below it are re-parented to it). That
is Linux; elsewhere only the children ``multiprocessing`` knows of are killed, and no parent-death
signal is set.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import NoReturn

from potluck.protos.runtime.log import get_logger

log = get_logger(__name__)

DEFAULT_GRACE_S = 8.0
DIE_WITH_ENV = "POTLUCK_DIE_WITH"  # a launcher's pid: its child asks for a parent-death signal at start
BACKSTOP_S = 0.5  # after the watchdog's deadline, SIGALRM (default action) ends the process
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


def _load_prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, resolved once here: a forked child must not load libraries."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn


_prctl = _load_prctl()


def stop_each(stops: Iterable[Callable[[], object] | None], who: str) -> None:
    """Call each of ``stops`` (a falsy one: nothing to stop there), whatever the ones before did: a part that does
    not stop cleanly is said in the log (``who``: "stopping the coordinator"), and the rest are still stopped."""
    for stop in stops:
        if not stop:
            continue
        try:
            stop()
        except Exception as err:  # everything else must still be stopped
            log.warning("%s: one part did not stop cleanly (%s); stopping the rest", who, err)


def install_stop_handlers(stopping: threading.Event, *, grace_s: float = DEFAULT_GRACE_S) -> None:
    """SIGINT/SIGTERM set ``stopping``; the process is gone ``grace_s`` later whatever it is doing.

    A second signal means "now": descendants are killed and the process exits with 128 + signal.
    Call from the main thread (Python delivers signals there).
    """
    signalled = threading.Event()  # not ``stopping``: a process that stops on its own may still get a first signal

    def handler(signum: int, frame: object) -> None:
        if signalled.is_set():
            log.warning("second signal %d: stopping now", signum)
            hard_exit(128 + signum)
        signalled.set()
        log.info("received signal %d: stopping (at most %.0f s)", signum, grace_s)
        stopping.set()
        watchdog = threading.Timer(grace_s, _overdue, args=(signum, grace_s))
        watchdog.daemon = True
        watchdog.start()
        if hasattr(signal, "setitimer"):
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.setitimer(signal.ITIMER_REAL, grace_s + BACKSTOP_S)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    _child_subreaper(True)  # orphans below us (a p2pd whose DHT process died) are ours to reap, not init's


def exit_process(code: int) -> NoReturn:
    """Leave as the interpreter does at exit (wait for the non-daemon threads, run the ``atexit`` handlers, flush
    stdout and stderr), less the teardown that follows: an entry point's last call once its process has stopped,
    and how the fork server's children end (:mod:`potluck.forkserver`).

    That teardown gives the OS back nothing it would not take anyway, but its garbage collections over torch's
    object graph take a second or more (several on a loaded machine; time the watchdog cannot cut short, since
    daemon threads no longer run by then), and it ends with the extensions' own exit checks: nanobind's (Triton's)
    reports, in some 30 lines, every object of theirs still alive. (Freezing the objects at exit instead, to skip
    those collections, kept all of them alive: that report was what a peer printed after Ctrl+C.)
    """
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # (a closed or broken stream: nothing more can be said there)
                stream.flush()
    finally:
        os._exit(code)


def _overdue(signum: int, grace_s: float) -> None:
    log.warning("did not stop within %.0f s: killing what is left; where each thread was:", grace_s)
    faulthandler.dump_traceback(all_threads=True)  # to stderr: what to fix so the next stop is orderly
    hard_exit(128 + signum)


def hard_exit(code: int) -> None:
    """Kill every descendant of this process, then leave without running exit handlers."""
    try:
        kill_tree(os.getpid(), reap_own=True)
        while os.waitpid(-1, os.WNOHANG)[0]:  # children that had exited already
            pass
    except ChildProcessError:
        pass
    finally:
        os._exit(code)


def die_with_parent(sig: int, parent_pid: int) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux; False elsewhere).

    Meant for a freshly forked child (a ``preexec_fn``, an at-fork hook): it only calls an already
    loaded libc function. The setting survives ``exec``; the kernel sends the signal when the
    *thread* that forked us ends, so fork from a thread that lives as long as its process. If the
    parent is already gone (it died before this call), the process exits at once.
    """
    if _prctl is None or _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent_pid:
        os._exit(128 + int(sig))
    return True


def die_with_launcher() -> None:
    """Called first thing by potluck's entry point: if a launcher (``potluck demo``, the tests' process
    group) set ``POTLUCK_DIE_WITH`` to its pid, get SIGTERM when it dies (and exit now if it already has)."""
    launcher = os.environ.pop(DIE_WITH_ENV, "")
    if launcher.isdigit():
        die_with_parent(signal.SIGTERM, int(launcher))


_fork_parent = 0
_binding: list[int] = []  # the signal forked children get, once children_die_with_parent() ran


def _remember_fork_parent() -> None:
    global _fork_parent
    _fork_parent = os.getpid()


def children_die_with_parent(sig: int = signal.SIGKILL) -> None:
    """From now on every process forked here (or below, by forked children) gets ``sig`` when its parent dies.

    Works for ``multiprocessing`` forks and for children that ``exec`` (uvloop's and ``subprocess``'s
    with a ``preexec_fn`` call the at-fork hooks between fork and exec; the setting survives exec).
    Cannot be undone; a second call does nothing.
    """
    if _binding or _prctl is None:
        return
    _binding.append(int(sig))
    os.register_at_fork(before=_remember_fork_parent, after_in_child=lambda: die_with_parent(sig, _fork_parent))


def _parents() -> dict[int, int]:
    """Parent pid of every live (not zombie) process; {} without ``/proc``."""
    out: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] != b"Z":
            out[int(entry)] = int(fields[1])
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, parents before their children ([] without ``/proc``)."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    out: list[int] = []
    frontier = [pid]
    while frontier:
        frontier = [c for p in frontier for c in children.get(p, ()) if c not in out]
        out += frontier
    return out


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_tree(pid: int, *, include_root: bool = False, reap_own: bool = False, reap_s: float = 0.5) -> list[int]:
    """SIGKILL every process below ``pid`` (and ``pid`` itself with ``include_root``); returns them.

    The tree is frozen with SIGSTOP first, so nothing in it forks meanwhile, and nothing is
    re-parented to init (out of our sight) because its parent died before we saw it. The killed
    grandchildren are then re-parented to this process (a "child subreaper" meanwhile) and reaped
    here within ``reap_s``, rather than left as zombies for init, which may be slow to reap them or
    not reap at all (a container's PID 1). Our own children are reaped too with ``reap_own``;
    otherwise they are left to whoever started them (``multiprocessing``, ``subprocess``).
    """
    me = os.getpid()
    if not os.path.isdir("/proc"):
        pids = ([pid] if include_root else []) + (
            [p.pid for p in multiprocessing.active_children() if p.pid] if pid == me else [])
        _signal_all(pids, signal.SIGKILL)
        return pids
    frozen: list[int] = [pid] if include_root and pid != me else []
    _signal_all(frozen, signal.SIGSTOP)
    for _ in range(5):
        new = [p for p in descendants(pid) if p not in frozen]
        if not new:
            break
        _signal_all(new, signal.SIGSTOP)
        frozen += new
    parents = _parents()
    was_subreaper = _child_subreaper(True)
    try:
        _signal_all(frozen, signal.SIGKILL)
        if was_subreaper is not None:
            _reap([p for p in frozen if reap_own or parents.get(p) != me], reap_s)
    finally:
        if was_subreaper is False:
            _child_subreaper(False)
    return frozen


def _child_subreaper(on: bool) -> bool | None:
    """Make this process (or stop it being) the one orphans below it are re-parented to; returns
    whether it was one before (None: not supported)."""
    if _prctl is None:
        return None
    before = ctypes.c_int(0)
    if _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.addressof(before), 0, 0, 0) != 0:
        return None
    if _prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        return None
    return bool(before.value)


def _reap(pids: list[int], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    pending = list(pids)
    while pending and time.monotonic() < deadline:
        for p in list(pending):
            try:
                if os.waitpid(p, os.WNOHANG)[0]:
                    pending.remove(p)
            except ChildProcessError:  # not re-parented to us yet, or already reaped
                if not os.path.exists(f"/proc/{p}"):
                    pending.remove(p)
        if pending:
            time.sleep(0.005)
