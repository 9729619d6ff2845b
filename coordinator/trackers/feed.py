"""The trackers' own thread: the coordinator's loop hands it each snapshot's new points and never waits for it.

:class:`Trackers` is what the coordinator holds. At its start it opens every tracker the config names
(:meth:`Trackers.start`, on the calling thread: a tracker that cannot start stops the coordinator's start with
:class:`~potluck.coordinator.trackers.backends.TrackerError`, the ones already opened closed again). Then, after
each status snapshot, the loop calls :meth:`Trackers.offer`: :func:`~potluck.coordinator.trackers.points.due`
picks the snapshot's new points (pure, a look at the newest history entries and events) and they go on a
bounded queue without blocking. A full queue drops the point and counts it (a tracker that cannot keep up, a
network that hangs, costs the run its tracker's points, never its loop), the way the journal's writer takes
saves off the loop (:class:`~potluck.coordinator.store.journal.JournalWriter`). The thread logs each point to
every tracker; a call that fails is logged (its first, then every ``SAY_EVERY``-th), counted, and the run and
the other trackers go on. :meth:`Trackers.close`, at the coordinator's stop, queues what the last snapshot
holds (the run's last step too), lets the thread log it and closes the trackers, waiting ``CLOSE_S`` at most.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from potluck.coordinator.trackers.backends import KINDS, Tracker, TrackerError
from potluck.coordinator.trackers.points import Cursor, Event, Step, config_values, due
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.runtime.log import get_logger

log = get_logger(__name__)

QUEUE = 1000  # points waiting for the thread at most (a step is one point, whatever the trackers)
SAY_EVERY = 100  # a tracker that keeps failing is said in the log at its first failure, then every this many
CLOSE_S = 5.0  # what the coordinator's stop waits for the trackers (its stop is cut short 8 s after a SIGTERM)


def tracker_dir(cfg: RunConfig) -> Path:
    """Where the trackers keep their local files: ``coordinator.tracker_dir``, else ``journal_dir/trackers``."""
    c = cfg.coordinator
    return Path(c.tracker_dir).expanduser() if c.tracker_dir else Path(c.journal_dir).expanduser() / "trackers"


class Trackers:
    """The run's trackers (none: every call does nothing), fed off the coordinator's loop."""

    def __init__(self, cfg: RunConfig, run_id: str, queue_size: int = QUEUE,
                 kinds: Mapping[str, Callable[[Path, str, str, str], Tracker]] = KINDS) -> None:
        c = cfg.coordinator
        folder = tracker_dir(cfg)
        self.trackers: list[Tracker] = [kinds[n](folder / n, c.tracker_project, c.tracker_run_name or run_id, run_id)
                                        for n in c.trackers]
        self.folder = folder
        self.config = config_values(cfg, run_id)
        self.cursor = Cursor()
        self.queue: queue.Queue[Step | Event | None] = queue.Queue(queue_size)
        self.dropped = 0  # points the full queue turned away
        self.logged = 0  # points the thread has handed to every tracker
        self.failed = {t.name: 0 for t in self.trackers}  # calls that raised, by tracker
        self._opened: list[Tracker] = []
        self._thread: threading.Thread | None = None

    def start(self, committed: int, epoch: int) -> None:
        """Open every tracker (here: a failure raises :class:`TrackerError` naming it) and start the thread; the
        steps up to ``committed`` (of ``epoch``) were the journal's: a tracker had them from the run before."""
        if not self.trackers:
            return
        self.cursor = Cursor(logged=committed, epoch=epoch)
        for t in self.trackers:
            try:
                t.open(self.config, committed)
            except Exception as err:  # (whatever the library raised: the run does not start, the reason is said)
                self._close_opened()
                raise TrackerError(f"the {t.name} tracker could not start: {type(err).__name__}: {err}") from err
            self._opened.append(t)
        self._thread = threading.Thread(target=self._run, name="trackers", daemon=True)
        self._thread.start()
        log.info("logging the run to %s (local files in %s)", ", ".join(t.name for t in self.trackers), self.folder)

    def offer(self, state: Mapping[str, Any], now: float) -> None:
        """The snapshot's points not logged yet, queued for the thread (never blocks: a full queue drops them)."""
        if self._thread is None:
            return
        self.cursor, points = due(state, self.cursor, now)
        for point in points:
            try:
                self.queue.put_nowait(point)
            except queue.Full:
                self.dropped += 1
                if self.dropped % SAY_EVERY == 1:
                    log.warning("trackers: %d point(s) dropped, the trackers cannot keep up (step %s)", self.dropped,
                                point.step)

    def close(self, state: Mapping[str, Any] | None, now: float, timeout: float = CLOSE_S) -> None:
        """Log what ``state`` (the last snapshot) holds that is not logged yet, then close every tracker."""
        if self._thread is None:
            self._close_opened()
            return
        points = due(state, self.cursor, now, final=True)[1] if state else []
        try:
            for point in [*points, None]:  # (None: the thread closes the trackers and ends)
                self.queue.put(point, timeout=timeout)
        except queue.Full:
            log.warning("trackers: the last points were not logged (the trackers did not take them in %.0f s)", timeout)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("trackers: still not closed after %.0f s; left behind", timeout)
        log.info("trackers: %d point(s) logged, %d dropped%s", self.logged, self.dropped,
                 "".join(f", {name}: {n} failed" for name, n in self.failed.items() if n))

    def _run(self) -> None:
        while (point := self.queue.get()) is not None:
            for t in self._opened:
                try:
                    t.step(point) if isinstance(point, Step) else t.event(point)
                except Exception as err:  # (a tracker's failure costs its point, never the run)
                    self.failed[t.name] += 1
                    if self.failed[t.name] % SAY_EVERY == 1:
                        log.warning("the %s tracker failed to log step %d (%d failure(s) so far): %s: %s", t.name,
                                    point.step, self.failed[t.name], type(err).__name__, err)
            self.logged += 1
        self._close_opened()

    def _close_opened(self) -> None:
        for t in self._opened:
            try:
                t.close()
            except Exception as err:
                log.warning("the %s tracker did not close cleanly: %s: %s", t.name, type(err).__name__, err)
        self._opened = []
