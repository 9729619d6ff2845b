"""Inner-step progress a volunteer can read: where the inner phase is, how fast, and when it ends.

An outer step starts with H inner AdamW steps: minutes without a word in the logs otherwise.
:class:`ProgressReporter` shows them in one of two ways:

* ``bar``: one line on stderr, redrawn in place (at most every ``BAR_EVERY_S``) and wiped before
  any log line is written, so the two never share a line::

      outer 12 | inner 120/500 [##--------] ETA 0:41  loss 3.412  18.2k tok/s

* ``lines``: a log line at most every ``POTLUCK_PROGRESS_S`` seconds (default 15) plus one at the
  end of each inner phase, for output that goes to a file (the demo's peers, CI), which a redrawn
  line would flood::

      inner step 120/500, loss 3.412, 18.2k tokens/s, ETA 0:41

``auto`` draws the bar only when stderr is the terminal this process is the foreground job of: a
child started in a session of its own (the demo's peers with ``--verbose``) writes to a terminal
that is not its own, where several bars would fight over one line. Nothing is shown when the log
level hides INFO (``POTLUCK_LOG=WARNING``).

Speeds are the mean of the last ``WINDOW`` step times, leaving out the process's first step, which
pays for warm-up (allocation, torch's lazy imports); the ETA is that mean times the steps left.
After ``ESTIMATE_AFTER`` such steps the reporter logs once what a whole inner phase costs on this
device (in every mode, ``off`` included), so a volunteer learns early what to expect of the run.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from potluck.protos.runtime.log import get_logger

log = get_logger(__name__)

MODES = ("auto", "bar", "lines", "off")
LINES_EVERY_S = 15.0  # default gap between two progress log lines (POTLUCK_PROGRESS_S overrides it)
BAR_EVERY_S = 0.1  # the bar is redrawn at most this often: a fast inner step must not pay for a terminal write
WINDOW = 20  # step times the speed is averaged over
ESTIMATE_AFTER = 3  # steps after the warm-up one before the one-time speed estimate
BAR_CELLS = 10
_LOGGERS = ("potluck", "hivemind", "")  # whose handlers wipe the bar before writing


def lines_every_s() -> float:
    """Seconds between progress log lines: ``POTLUCK_PROGRESS_S``, or ``LINES_EVERY_S``."""
    try:
        value = float(os.environ.get("POTLUCK_PROGRESS_S") or LINES_EVERY_S)
    except ValueError:
        return LINES_EVERY_S
    return value if math.isfinite(value) and value >= 0 else LINES_EVERY_S


def fmt_clock(seconds: float) -> str:
    """An ETA as a clock reads: ``0:41``, ``12:03``, ``1:02:03``."""
    s = max(0, round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def fmt_duration(seconds: float) -> str:
    """A duration in the unit a person would say it in: ``0.012 s``, ``1.4 s``, ``41 s``, ``3.2 min``, ``1.5 h``."""
    if seconds < 10:
        return f"{seconds:.2g} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def fmt_rate(per_s: float) -> str:
    """``812``, ``18.2k``, ``1.35M``."""
    if per_s >= 1e6:
        return f"{per_s / 1e6:.3g}M"
    if per_s >= 1e3:
        return f"{per_s / 1e3:.3g}k"
    return f"{per_s:.3g}"


@dataclass(frozen=True)
class ProgressSnapshot:
    """Where an inner phase stands after a step."""

    done: int  # inner steps done in this phase
    total: int  # H
    loss: float | None
    seconds_per_step: float
    tokens_per_step: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.seconds_per_step if self.seconds_per_step > 0 else 0.0

    @property
    def eta_s(self) -> float:
        """Seconds until the phase's last inner step is done."""
        return max(0, self.total - self.done) * self.seconds_per_step

    def loss_text(self) -> str:
        return f"{self.loss:.3f}" if self.loss is not None and math.isfinite(self.loss) else "-"


def describe(s: ProgressSnapshot) -> str:
    """The log line of a phase in progress."""
    return (f"inner step {s.done}/{s.total}, loss {s.loss_text()}, {fmt_rate(s.tokens_per_s)} tokens/s, "
            f"ETA {fmt_clock(s.eta_s)}")


def describe_end(s: ProgressSnapshot, seconds: float) -> str:
    """The log line of a finished phase."""
    return (f"inner phase done: {s.done}/{s.total} steps in {fmt_duration(seconds)}, loss {s.loss_text()}, "
            f"{fmt_rate(s.tokens_per_s)} tokens/s")


def render_bar(s: ProgressSnapshot, outer: int) -> str:
    """The bar's one line, for outer step ``outer``; what matters most comes first, as a narrow terminal
    cuts the end off."""
    full = min(BAR_CELLS, BAR_CELLS * s.done // max(s.total, 1))
    return (f"outer {outer} | inner {s.done}/{s.total} [{'#' * full}{'-' * (BAR_CELLS - full)}] "
            f"ETA {fmt_clock(s.eta_s)}  loss {s.loss_text()}  {fmt_rate(s.tokens_per_s)} tok/s")


def live_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is the terminal this process is the foreground job of."""
    try:
        return stream.isatty() and os.tcgetpgrp(stream.fileno()) == os.getpgrp()
    except (AttributeError, OSError, ValueError):  # no fileno, not our controlling terminal, closed
        return False


class StepTimes:
    """Recent inner-step durations, the process's first (warm-up) step left out once others exist."""

    def __init__(self, window: int = WINDOW) -> None:
        self.recent: deque[float] = deque(maxlen=window)
        self.first: float | None = None

    def add(self, seconds: float) -> None:
        if self.first is None:
            self.first = seconds
        else:
            self.recent.append(seconds)

    @property
    def warmed(self) -> int:
        """Steps timed after the warm-up one (up to the window)."""
        return len(self.recent)

    def mean(self) -> float:
        if self.recent:
            return sum(self.recent) / len(self.recent)
        return self.first or 0.0


class _WipeBar(logging.Filter):
    """On a handler: wipe the bar before the handler writes a line."""

    def __init__(self, reporter: ProgressReporter) -> None:
        super().__init__()
        self.reporter = reporter

    def filter(self, record: logging.LogRecord) -> bool:
        self.reporter.clear()
        return True


class ProgressReporter:
    """Shows one inner phase after another: :meth:`begin` each, :meth:`step` after every inner step.

    ``stream`` (stderr), ``clock`` (monotonic) and ``every_s`` (``POTLUCK_PROGRESS_S``) are there
    for tests. Thread-safe: log lines written from other threads wipe the bar first.
    """

    def __init__(self, mode: str = "auto", *, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic,
                 every_s: float | None = None, logger: logging.Logger | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"progress mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.stream = stream if stream is not None else sys.stderr
        self.mode = mode if mode != "auto" else ("bar" if live_terminal(self.stream) else "lines")
        self.clock, self.log = clock, logger or log
        self.every_s = lines_every_s() if every_s is None else every_s
        self.times = StepTimes()
        self.outer, self.total, self.device = 0, 0, "this device"
        self.phase_started = self.last_shown = clock()
        self.estimated = False
        self.drawn = False  # the bar is on screen
        self._lock = threading.RLock()
        self._wipe: _WipeBar | None = None

    def begin(self, outer: int, total: int, device: str) -> None:
        """Outer step ``outer``'s inner phase of ``total`` steps starts on ``device`` (as people name it:
        ``cpu x16``, a GPU's model)."""
        self.outer, self.total, self.device = outer, total, device
        self.phase_started = self.last_shown = self.clock()  # the first line comes every_s into the phase

    def step(self, i: int, loss: float | None, seconds: float, tokens: int) -> None:
        """Inner step ``i`` (0-based) of the phase took ``seconds`` and trained on ``tokens`` tokens."""
        self.times.add(seconds)
        snap = ProgressSnapshot(i + 1, self.total, loss, self.times.mean(), tokens)
        end = snap.done >= snap.total
        if not self.estimated and (self.times.warmed >= ESTIMATE_AFTER or end):
            self.estimated = True
            self.log.info("about %s per inner step on %s: an outer step (H = %d) takes about %s, plus its sync",
                          fmt_duration(snap.seconds_per_step), self.device, snap.total,
                          fmt_duration(snap.seconds_per_step * snap.total))
        if self.mode == "off" or not self.log.isEnabledFor(logging.INFO):
            return
        now = self.clock()
        if end:
            self.clear()
            self.log.info("%s", describe_end(snap, now - self.phase_started))
            self.last_shown = now
        elif self.mode == "lines" and now - self.last_shown >= self.every_s:
            self.log.info("%s", describe(snap))
            self.last_shown = now
        elif self.mode == "bar" and (not self.drawn or now - self.last_shown >= BAR_EVERY_S):
            self._draw(render_bar(snap, self.outer))
            self.last_shown = now

    def clear(self) -> None:
        """Wipe the bar, if one is on screen (before a log line, when the phase is left)."""
        with self._lock:
            if self.drawn:
                self.drawn = False
                self._write("\r\x1b[K")

    def _draw(self, text: str) -> None:
        self._hook_logging()
        try:  # a line longer than the terminal wraps, and "\r" would then redraw only its last part
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            columns = 0
        with self._lock:
            self.drawn = True
            self._write("\r" + (text[: columns - 1] if columns > 0 else text) + "\x1b[K")  # 0: size unknown

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr must not stop training
            self.mode = "off"

    def _hook_logging(self) -> None:
        """Put the wiping filter on every handler that may write to our terminal (hivemind's too,
        which only exist once it is imported: hence at the first draw rather than at start)."""
        self._wipe = self._wipe or _WipeBar(self)
        for name in _LOGGERS:
            for handler in logging.getLogger(name).handlers:
                if self._wipe not in handler.filters:
                    handler.addFilter(self._wipe)
