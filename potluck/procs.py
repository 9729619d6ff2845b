"""Child processes that are ours to stop, on every exit path.

Each child starts in a session of its own, so its whole process group (the Python process, the
hivemind DHT process it forks and that one's ``p2pd`` daemon) can be killed at once. ``stop()``
asks every child to exit (SIGTERM), waits, then SIGKILLs each group that is left; it runs from ``__exit__`` and
an ``atexit`` hook, so neither an exception nor Ctrl+C leaves daemons behind (hivemind #382).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class ProcessGroup:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self._logs: list[IO[bytes]] = []
        atexit.register(self.stop)

    def spawn(
        self, args: Sequence[str], log_path: str | Path | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """Start ``args`` in a new session; output goes to ``log_path`` (or is inherited)."""
        out: IO[bytes] | None = None
        if log_path is not None:
            out = open(log_path, "ab")
            self._logs.append(out)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen(
            list(args), stdout=out, stderr=subprocess.STDOUT if out else None, env=full_env, start_new_session=True
        )
        self.procs.append(proc)
        return proc

    def spawn_potluck(self, args: Sequence[str], log_path: str | Path | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
        return self.spawn([sys.executable, "-m", "potluck", *args], log_path, env)

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
