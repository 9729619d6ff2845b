"""Inner-step progress (peer/swarm/progress.py) and a peer's goodbye on Ctrl+C.

The unit tests drive :class:`ProgressReporter` with a fake stream, a list-collecting logger and an
injected clock, so rate limits are checked without sleeping; the swarm test reads a real peer's log
and the coordinator's state after SIGINT.
"""

from __future__ import annotations

import io
import logging
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from potluck import cli
from potluck.peer.swarm import progress
from potluck.peer.swarm.progress import (
    BAR_EVERY_S,
    MODES,
    ProgressReporter,
    ProgressSnapshot,
    StepTimes,
    describe,
    fmt_clock,
    fmt_duration,
    fmt_rate,
    live_terminal,
    render_bar,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(autouse=True)
def no_wiping_left_behind() -> Iterator[None]:
    """A bar hooks the process's log handlers; take its hooks off after each test."""
    yield
    for name in progress._LOGGERS:
        for handler in logging.getLogger(name).handlers:
            for f in [f for f in handler.filters if isinstance(f, progress._WipeBar)]:
                handler.removeFilter(f)


@pytest.fixture
def logged() -> Lines:
    handler = Lines()
    logger = logging.getLogger(f"test.progress.{id(handler)}")
    logger.propagate, logger.level = False, logging.INFO
    logger.addHandler(handler)
    handler.logger = logger  # type: ignore[attr-defined]
    return handler


def reporter(mode: str, logged: Lines, clock: Clock, stream: io.StringIO | None = None,
             every_s: float = 15.0) -> ProgressReporter:
    r = ProgressReporter(mode, stream=stream or io.StringIO(), clock=clock, every_s=every_s,
                         logger=logged.logger)  # type: ignore[attr-defined]
    r.begin(7, 10, "cpu x2")
    return r


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:
        return 2


# ---------------------------------------------------------------------- the figures


def test_eta_and_speed_by_hand() -> None:
    times = StepTimes()
    for s in (2.0, 0.5, 0.7, 0.6):  # the first one pays for warm-up and is left out
        times.add(s)
    assert times.warmed == 3 and times.mean() == pytest.approx(0.6)
    snap = ProgressSnapshot(done=4, total=10, loss=3.14159, seconds_per_step=times.mean(), tokens_per_step=1200)
    assert snap.eta_s == pytest.approx(6 * 0.6)  # 6 steps left at 0.6 s
    assert snap.tokens_per_s == pytest.approx(2000.0)
    assert describe(snap) == "inner step 4/10, loss 3.142, 2k tokens/s, ETA 0:04"
    assert render_bar(snap, 7) == "outer 7 | inner 4/10 [####------] ETA 0:04  loss 3.142  2k tok/s"


def test_only_the_warm_up_step_is_its_own_estimate() -> None:
    times = StepTimes(window=2)
    assert times.mean() == 0.0
    times.add(3.0)
    assert times.mean() == 3.0 and times.warmed == 0
    for s in (1.0, 2.0, 4.0):  # a window of 2: the last two
        times.add(s)
    assert times.mean() == 3.0


def test_formats() -> None:
    assert [fmt_clock(s) for s in (0, 41.4, 723, 3723)] == ["0:00", "0:41", "12:03", "1:02:03"]
    assert [fmt_duration(s) for s in (0.0123, 1.43, 5, 41, 192, 5400)] == [
        "0.012 s", "1.4 s", "5 s", "41 s", "3.2 min", "1.5 h"]
    assert [fmt_rate(r) for r in (812, 18234, 1_350_000)] == ["812", "18.2k", "1.35M"]
    assert ProgressSnapshot(1, 2, float("nan"), 1.0, 1).loss_text() == "-"
    assert ProgressSnapshot(1, 2, None, 0.0, 1).tokens_per_s == 0.0


# ---------------------------------------------------------------------- lines: logs and files


def test_lines_are_rate_limited_and_every_phase_ends_with_one(logged: Lines) -> None:
    clock = Clock()
    r = reporter("lines", logged, clock, every_s=15.0)
    for i in range(9):  # 9 steps of 4 s: lines at 16 s and 32 s into the phase, not more often
        clock.now += 4.0
        r.step(i, 3.0, 4.0, 100)
    progress_lines = [m for m in logged.lines if m.startswith("inner step")]
    assert progress_lines == ["inner step 4/10, loss 3.000, 25 tokens/s, ETA 0:24",
                              "inner step 8/10, loss 3.000, 25 tokens/s, ETA 0:08"]
    clock.now += 4.0
    r.step(9, 2.5, 4.0, 100)
    assert logged.lines[-1] == "inner phase done: 10/10 steps in 40 s, loss 2.500, 25 tokens/s"
    clock.now += 30.0  # the outer step's sync
    r.begin(7, 10, "cpu x2")  # a new phase: the gap counts from its start, not from the last line
    n = len(logged.lines)
    clock.now += 14.0
    r.step(0, 2.5, 14.0, 100)
    assert len(logged.lines) == n
    clock.now += 2.0
    r.step(1, 2.5, 2.0, 100)
    assert logged.lines[-1].startswith("inner step 2/10")


def test_the_first_run_estimate_is_logged_once_after_the_warm_up(logged: Lines) -> None:
    clock = Clock()
    r = reporter("off", logged, clock)  # logged in every mode: it is what a volunteer should expect
    for i, s in enumerate((5.0, 0.25, 0.5, 0.75)):
        r.step(i, 3.0, s, 100)
        assert (len(logged.lines) == 1) == (i == 3)
    assert logged.lines == ["about 0.5 s per inner step on cpu x2: an outer step (H = 10) takes about 5 s, plus its sync"]
    for i in range(4, 10):
        r.step(i, 3.0, 0.5, 100)
    assert len(logged.lines) == 1  # once; "off" shows no progress


def test_a_phase_shorter_than_the_warm_up_still_gets_an_estimate(logged: Lines) -> None:
    r = ProgressReporter("lines", stream=io.StringIO(), clock=Clock(), logger=logged.logger)  # type: ignore[attr-defined]
    r.begin(1, 2, "NVIDIA H100 80GB HBM3")
    r.step(0, 3.0, 60.0, 100)
    r.step(1, 3.0, 120.0, 100)
    assert logged.lines[0] == ("about 2.0 min per inner step on NVIDIA H100 80GB HBM3: an outer step (H = 2) takes "
                               "about 4.0 min, plus its sync")


def test_a_hidden_info_level_shows_nothing(logged: Lines) -> None:
    logged.logger.setLevel(logging.WARNING)  # type: ignore[attr-defined]
    stream = io.StringIO()
    r = reporter("bar", logged, Clock(), stream)
    for i in range(10):
        r.step(i, 3.0, 1.0, 100)
    assert logged.lines == [] and stream.getvalue() == ""


# ---------------------------------------------------------------------- bar: a terminal


def test_the_bar_redraws_one_line_at_a_bounded_rate(logged: Lines) -> None:
    clock, stream = Clock(), io.StringIO()
    r = reporter("bar", logged, clock, stream)
    r.step(0, 3.0, 1.0, 100)  # drawn at once
    clock.now += BAR_EVERY_S / 2
    r.step(1, 3.0, 1.0, 100)  # too soon
    clock.now += BAR_EVERY_S
    r.step(2, 3.0, 1.0, 100)
    out = stream.getvalue()
    assert "\n" not in out and out.count("\r") == 2
    assert out.endswith("\router 7 | inner 3/10 [###-------] ETA 0:07  loss 3.000  100 tok/s\x1b[K")
    assert not [m for m in logged.lines if m.startswith("inner")]  # the bar is not logged
    r.clear()
    assert stream.getvalue().endswith("\r\x1b[K") and not r.drawn
    r.clear()  # nothing on screen: nothing written
    assert stream.getvalue().count("\r") == 3


def test_the_bar_is_wiped_before_log_lines_and_at_the_end(logged: Lines) -> None:
    clock, stream = Clock(), io.StringIO()
    r = reporter("bar", logged, clock, stream)
    r.step(0, 3.0, 1.0, 100)
    handlers = logging.getLogger("potluck").handlers
    assert handlers and all(r._wipe in h.filters for h in handlers)
    record = logging.LogRecord("potluck.x", logging.INFO, __file__, 1, "hello", None, None)
    assert handlers[0].filter(record)
    assert stream.getvalue().endswith("\r\x1b[K") and not r.drawn
    r.step(1, 3.0, 1.0, 100)  # redrawn at the next step, however soon
    assert r.drawn
    for i in range(2, 10):
        clock.now += 1.0
        r.step(i, 3.0, 1.0, 100)
    assert stream.getvalue().endswith("\r\x1b[K") and not r.drawn
    assert logged.lines[-1] == "inner phase done: 10/10 steps in 8 s, loss 3.000, 100 tokens/s"


def test_the_bar_fits_the_terminal(logged: Lines, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrapped line would be redrawn only in part; a size of 0 (unknown, e.g. under ``script``) cuts nothing."""
    for columns, want in ((30, 29), (0, 65)):
        monkeypatch.setattr(progress.os, "get_terminal_size", lambda fd, c=columns: os.terminal_size((c, 24)))
        stream = FakeTTY()
        reporter("bar", logged, Clock(), stream).step(0, 3.0, 1.0, 100)
        assert len(stream.getvalue()) == len("\r") + want + len("\x1b[K")


def test_a_broken_stderr_turns_the_bar_off(logged: Lines) -> None:
    stream = io.StringIO()
    r = reporter("bar", logged, Clock(), stream)
    stream.close()
    r.step(0, 3.0, 1.0, 100)
    assert r.mode == "off"


# ---------------------------------------------------------------------- auto


def test_auto_is_a_bar_only_on_the_terminal_we_run_in(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ProgressReporter("auto", stream=io.StringIO()).mode == "lines"  # a file, a pipe
    monkeypatch.setattr(progress.os, "tcgetpgrp", lambda fd: os.getpgrp())
    assert ProgressReporter("auto", stream=FakeTTY()).mode == "bar"
    monkeypatch.setattr(progress.os, "tcgetpgrp", lambda fd: os.getpgrp() + 1)  # a background job
    assert ProgressReporter("auto", stream=FakeTTY()).mode == "lines"
    assert ProgressReporter("bar", stream=io.StringIO()).mode == "bar"  # asked for: as asked


def test_a_terminal_that_is_not_ours_gets_lines() -> None:
    """The demo's peers with --verbose: a terminal inherited into a session of their own."""
    leader, follower = os.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as tty:
            assert tty.isatty() and not live_terminal(tty)
    finally:
        os.close(leader)
        os.close(follower)


def test_the_modes_and_the_flag_agree() -> None:
    assert cli.build_parser().parse_args(["peer", "--join", "x"]).progress == "auto"
    for mode in MODES:
        assert cli.build_parser().parse_args(["peer", "--join", "x", "--progress", mode]).progress == mode
    with pytest.raises(ValueError, match="one of auto, bar, lines, off"):
        ProgressReporter("fancy")


def test_the_interval_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, want in (("", 15.0), ("2.5", 2.5), ("soon", 15.0), ("-1", 15.0), ("nan", 15.0)):
        monkeypatch.setenv("POTLUCK_PROGRESS_S", raw)
        assert progress.lines_every_s() == want


# ---------------------------------------------------------------------- a real peer


PROGRESS_LINE = re.compile(r"inner step \d+/60, loss [\d.]+, [\d.]+[kM]? tokens/s, ETA \d+:\d\d$", re.M)
ESTIMATE = re.compile(r"about [\d.]+ s per inner step on cpu x\d+: an outer step \(H = 60\) takes about [\d.]+ (s|min)")


@pytest.mark.slow
def test_a_peer_shows_its_progress_and_says_goodbye_on_ctrl_c(swarm) -> None:  # type: ignore[no-untyped-def]
    # (fixed rounds: every phase trains its 60 steps; with windows the peer that evaluates each version starts its
    # phases late and, on a loaded box, may end every one early when the other says it finished)
    swarm.start_coordinator({"diloco.inner_steps": 60, "diloco.outer_steps": 200, "membership.min_peers": 2,
                             "diloco.rounds": "fixed"})
    env = {"POTLUCK_PROGRESS_S": "0.02"}  # a line per 20 ms instead of 15 s: the tiny model's phase is short
    leaving, staying = swarm.start_peer(env=env), swarm.start_peer(env=env)
    log = Path(swarm.logs / "peer-0.log")

    def shown() -> bool:
        text = log.read_text(errors="replace") if log.exists() else ""
        return bool(PROGRESS_LINE.search(text) and ESTIMATE.search(text) and "inner phase done: 60/60" in text)

    swarm.wait_for(shown, 180, "progress lines, an end-of-phase line and the speed estimate in peer-0's log")
    state = swarm.wait_state(lambda s: s["run"]["outer_step"] >= 1 and sum(p["state"] not in ("lost", "left")
                             for p in s["peers"]) == 2, 120, "both peers in the run after an outer step")
    pid = next(p["id"] for p in state["peers"] if p["name"] == "peer-0")

    swarm.procs.kill(leaving, signal.SIGINT)  # Ctrl+C: the whole process group, as a terminal sends it
    state = swarm.wait_state(
        lambda s: any(p["id"] == pid and p["state"] == "left" for p in s["peers"])
        and any(e["kind"] == "left" and e["peer"] == pid for e in s["events"]),
        60, "the coordinator to record peer-0 as left")
    assert leaving.wait(timeout=30) == 0, swarm.tail("peer-0")
    events = [e for e in state["events"] if e["peer"] == pid]
    assert not [e for e in events if e["kind"] == "lost"], events
    assert next(e for e in events if e["kind"] == "left")["message"] == "left the run"
    assert staying.poll() is None
