"""The checkpoint uploader in a process of its own, so that its sends and read-back hashing never share the
coordinator's interpreter lock.

Run inside the coordinator's process, the :class:`~potluck.coordinator.store.offbox.Uploader`'s thread and fsspec's
event-loop thread took the lock in turns with the coordinator's loop: its tick p99 rose 2-3x while a 600 MB
checkpoint went out (``benchmarks/checkpoint_upload.py``). :class:`UploadProcess` runs the same uploader in a
spawned child (a fresh interpreter: nothing of the coordinator's threads or sockets in it), tied to the coordinator
(it dies with it), at a lower CPU priority (``NICE``: on a cheap box the loop comes first), and speaks to it over
a pipe:

* the coordinator sends ``("offer", n)`` after the n-th checkpoint write, and ``("stop",)``;
* the child answers ``("state", n, owed, failing, news)`` whenever one of them changes: the last offer it took, whether
  a pass is owed, the store's error (None while it works), and the changes between failing and working since the
  last answer (the page's events).

Its methods are the uploader's, so :class:`~potluck.coordinator.store.checkpointer.Checkpointer` uses either: a
pass is pending while an offer is not answered yet or the child says one is owed (and the store is not failing).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from pathlib import Path
from typing import Any

from potluck.coordinator.store.offbox import BACKOFF_S, PART_BYTES, open_store
from potluck.protos.runtime.log import get_logger

log = get_logger(__name__)

POLL_S = 0.2  # how often the child looks at its uploader's state between messages
NICE = 10  # the child's CPU priority below the coordinator's


class UploadProcess:
    """An :class:`~potluck.coordinator.store.offbox.Uploader` of the checkpoints in ``directory`` (kept ``keep``) to
    ``url``, with the roster of ``journal_dir``, run in a child process (module docstring)."""

    def __init__(self, url: str, directory: Path, keep: int, journal_dir: Path | None = None,
                 part_bytes: int = PART_BYTES, backoff_s: tuple[float, float] = BACKOFF_S) -> None:
        self.remote = open_store(url, part_bytes)  # (this side's: the start's probe of the bucket)
        self.failing: str | None = None
        self._args = (url, str(directory), keep, str(journal_dir) if journal_dir is not None else "", part_bytes,
                      backoff_s)
        self._lock = threading.Lock()
        self._offered = self._taken = 0
        self._owed = True
        self._news: list[tuple[str, bool]] = []
        self._conn: Any = None
        self._proc: Any = None
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=serve, args=(child, os.getpid(), *self._args), name="checkpoint-upload",
                                 daemon=True)
        self._proc.start()
        child.close()
        self._reader = threading.Thread(target=self._read, name="checkpoint-upload-answers", daemon=True)
        self._reader.start()
        self.offer()  # (what is kept locally and not in the store yet, from before a restart)

    def stop(self, timeout: float = 5.0) -> None:
        if self._proc is None:
            return
        try:
            self._conn.send(("stop",))
        except (OSError, ValueError):
            pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout)
        if self._reader is not None:
            self._reader.join(timeout)

    def offer(self) -> None:
        """A checkpoint was written (or pruned): a pass is owed. Never waits."""
        with self._lock:
            self._offered += 1
            n = self._offered
        try:
            self._conn.send(("offer", n))
        except (OSError, ValueError):  # (the child is gone: alive() says so to whoever asks)
            pass

    def pending(self) -> bool:
        """Whether a pass is owed and the store is not failing (a failing store never holds the run's end)."""
        with self._lock:
            owed = self._taken < self._offered or self._owed
            return owed and self.failing is None and self.alive()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def news(self) -> list[tuple[str, bool]]:
        """(message, is a warning) of each change between failing and working since the last call."""
        with self._lock:
            out, self._news = self._news, []
        return out

    def _read(self) -> None:
        while True:
            try:
                kind, *rest = self._conn.recv()
            except (EOFError, OSError):
                if self._proc is not None and self._proc.exitcode not in (0, None):
                    log.warning("the checkpoint uploader's process ended with exit code %s; checkpoints stay on this "
                                "disk only until the coordinator is restarted", self._proc.exitcode)
                return
            if kind == "state":
                taken, owed, failing, news = rest
                with self._lock:
                    self._taken, self._owed, self.failing = taken, owed, failing
                    self._news += news


def serve(conn: Any, parent: int, url: str, directory: str, keep: int, journal_dir: str, part_bytes: int,
          backoff_s: tuple[float, float]) -> None:
    """The child: an uploader, its offers from the pipe, its state back whenever it changes."""
    from functools import partial

    from potluck.coordinator.store.checkpoint import CheckpointStore
    from potluck.coordinator.store.offbox import Uploader, roster_of
    from potluck.protos.runtime.log import set_context
    from potluck.protos.runtime.stopping import die_with_parent

    die_with_parent(signal.SIGKILL, parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a Ctrl+C reaches the coordinator, which stops this child)
    try:
        os.nice(NICE)  # background work: on a small box the coordinator's loop comes first
    except OSError:
        pass
    set_context(role="upload")
    uploader = Uploader(open_store(url, part_bytes), CheckpointStore(Path(directory), keep=keep), keep,
                        backoff_s=backoff_s, roster=partial(roster_of, Path(journal_dir)) if journal_dir else None)
    uploader.start()
    taken, said = 0, None
    try:
        while True:
            if conn.poll(POLL_S):
                message = conn.recv()
                if message[0] == "stop":
                    return
                taken = max(taken, message[1])
                uploader.offer()
            state = (taken, uploader.pending(), uploader.failing)
            news = uploader.news()
            if state != said or news:
                conn.send(("state", *state, news))
                said = state
    except (EOFError, OSError):  # the coordinator is gone
        return
    finally:
        uploader.stop()
