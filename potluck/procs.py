"""Child processes that are ours to stop, on every exit path.

Each child starts in a session of its own, so its whole process group (the Python process and the
hivemind DHT process it forks) can be killed at once; that one's ``p2pd`` daemon, in a group of its
own (out of reach of a terminal's Ctrl+C), dies with it by its parent-death signal. ``stop()``
asks every child to exit (SIGTERM), waits, then SIGKILLs each group that is left; it runs from ``__exit__`` and
an ``atexit`` hook, so neither an exception nor Ctrl+C leaves daemons behind (hivemind #382).

Neither runs when this process is SIGKILLed, so each child also gets SIGTERM from the kernel when
its parent dies (Linux's parent-death signal): it stops politely, and its own watchdog
(:mod:`potluck.protos.runtime.stopping`) makes sure it is gone within its grace period.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from potluck.forkserver import DISABLE_ENV, ForkServer
from potluck.protos.runtime.stopping import DIE_WITH_ENV


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """Does any process of group ``pgid`` still run? Zombies waiting to be reaped do not count."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _child_env(env: dict[str, str] | None) -> dict[str, str]:
    """A child's environment: this process's, unbuffered output, and ``env`` over them."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}


_fork_server: ForkServer | None = None


def fork_server() -> ForkServer | None:
    """This process's fork server (:mod:`potluck.forkserver`), started on first use, stopped at exit; None
    off the main thread before it runs (its parent-death signal comes when the thread that started it ends)."""
    global _fork_server
    if _fork_server is not None and _fork_server.proc.poll() == 3:
        return None  # (CUDA came up in its imports: no forks in this process)
    if _fork_server is None or _fork_server.proc.poll() is not None:
        if threading.current_thread() is not threading.main_thread():
            return None
        _fork_server = ForkServer()
        atexit.register(_fork_server.stop)
    return _fork_server


class ProcessGroup:
    """``fork``: start potluck processes that log to a file from this process's fork server (their imports
    are paid once; see :mod:`potluck.forkserver`), unless ``POTLUCK_FORKSERVER=0``."""

    def __init__(self, fork: bool = False) -> None:
        self.fork = fork and os.environ.get(DISABLE_ENV, "1") != "0"
        self.procs: list[subprocess.Popen] = []
        self._logs: list[IO[bytes]] = []
        atexit.register(self.stop)

    def spawn(
        self, args: Sequence[str], log_path: str | Path | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """Start ``args`` in a new session; output goes to ``log_path`` (or is inherited).

        A potluck child gets SIGTERM when the thread that calls this ends (spawn from the main
        thread): it asks the kernel for that itself, first thing (``POTLUCK_DIE_WITH``), rather than
        in a ``preexec_fn``, which would fork this process with its gRPC threads and run their
        at-fork handlers in the child.
        """
        out: IO[bytes] | None = None
        if log_path is not None:
            out = open(log_path, "ab")
            self._logs.append(out)
        full_env = {**_child_env(env), DIE_WITH_ENV: str(os.getpid()), **(env or {})}
        proc = subprocess.Popen(
            list(args), stdout=out, stderr=subprocess.STDOUT if out else None, env=full_env, start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def spawn_potluck(self, args: Sequence[str], log_path: str | Path | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Run the installed ``potluck`` package: ``-P`` keeps a ``./potluck`` folder in the working
        directory (a clone's root, seen from its parent) from shadowing it."""
        if self.fork and log_path is not None and (server := fork_server()) is not None:
            try:
                proc = server.spawn(list(args), log_path, _child_env(env))
            except OSError as err:  # no fork server here (it could not start, or CUDA came up in it): no forks
                print(f"potluck: {err}; starting fresh interpreters instead", file=sys.stderr)
                self.fork = False
            else:
                self.procs.append(proc)
                return proc
        return self.spawn([sys.executable, "-P", "-m", "potluck", *args], log_path, env)

    def kill(self, proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        """Signal one child's whole group (SIGKILL by default: a crash, not a goodbye)."""
        _killpg(proc.pid, sig)
        if sig == signal.SIGKILL:
            proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every child, wait up to ``timeout`` for its whole group to go, then SIGKILL the rest.

        Only the group leader gets SIGTERM, so it can shut its DHT process and ``p2pd`` down in order;
        whatever is still in the group after ``timeout`` is killed.
        """
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            while time.monotonic() < deadline and (p.poll() is None or group_alive(p.pid)):
                time.sleep(0.05)
        for p in self.procs:
            if p.poll() is None or group_alive(p.pid):
                _killpg(p.pid, signal.SIGKILL)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for f in self._logs:
            f.close()
        self._logs.clear()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
