"""The round's window: how many inner steps a member trains (pure rules, no clock, no network)."""

from __future__ import annotations

import threading

import pytest
import torch

from potluck.models import stage_bounds
from potluck.peer.training.data import Dataset
from potluck.peer.training.stage import StageWorker
from potluck.peer.training.window import OWN_MARGIN, Pace, Why, decide, too_slow_advice
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig


def test_a_step_that_ends_inside_the_window_starts() -> None:
    assert decide(cap=20, done=3, at=3.0, step_s=1.0, end_s=10.0) is None
    assert decide(cap=20, done=20, at=3.0, step_s=1.0, end_s=None) is Why.DONE
    assert decide(cap=20, done=0, at=0.0, step_s=None, end_s=1.0) is None  # not measured yet: it trains (and measures)
    assert decide(cap=20, done=5, at=5.0, step_s=1.0, end_s=None) is None  # no window known: H steps


def test_a_step_that_would_end_after_the_window_does_not() -> None:
    assert decide(cap=20, done=9, at=9.5, step_s=1.0, end_s=10.0) is Why.WINDOW
    assert decide(cap=20, done=0, at=0.0, step_s=16.0, end_s=10.0) is Why.WINDOW  # too slow for even one step
    assert decide(cap=20, done=0, at=0.0, step_s=12.0, end_s=10.0) is None  # a first step a little late: it counts


def test_equal_peers_each_train_every_step_whoever_finished_first() -> None:
    """The rest of the phase within the slack past the window's end: finish it (a homogeneous swarm keeps H each)."""
    assert decide(cap=20, done=19, at=19.2, step_s=1.0, end_s=19.0) is None  # 20.2 <= 19 x 1.1
    assert decide(cap=20, done=17, at=17.2, step_s=1.0, end_s=19.0) is None  # 20.2 as well
    assert decide(cap=20, done=10, at=10.0, step_s=1.0, end_s=10.0) is Why.WINDOW  # half the phase left: stop


def test_pace_learns_the_window_from_the_round_before() -> None:
    """A quarter-speed member: in its first round it stops when the fast one says it finished; in the next it
    stops on its own, before a step that would end after the window, less the time its own sends take more."""
    p = Pace()
    p.begin(1, frozenset({"fast"}), cap=20, now=0.0)  # its first phase, begun whenever its round reached it
    p.end(0, None)
    p.begin(2, frozenset({"fast"}), cap=20, now=100.0)  # begun as the step before committed: with its cohort
    for k in range(5):
        assert p.next(k, 100.0 + 4.0 * k) is None
        p.stepped(4.0)
    assert p.finished(2, "fast", send_s=0.5, now=120.5)
    assert not p.finished(2, "fast", send_s=0.5, now=121.0)  # the first word only
    assert p.next(5, 120.5) is Why.SIGNALLED
    assert p.end(5, Why.SIGNALLED).window_s == pytest.approx(20.5)
    p.sent(1.5)  # its own contributions take a second longer to send than the fast one's
    p.begin(3, frozenset({"fast"}), cap=20, now=200.0)  # its window: 20.5 + 0.5 - 1.5 = 19.5 s
    assert p.next(0, 200.0) is None and p.step_s() == 4.0
    for _ in range(4):
        p.stepped(4.0)
    assert p.next(3, 212.0) is None  # ends at 16 s
    assert p.next(4, 216.0) is Why.WINDOW  # would end at 20 s: after the window, and 16 steps are left
    assert p.end(4, Why.WINDOW).window_s == pytest.approx(19.5)


def test_a_send_longer_than_the_window_shortens_it_by_half_at_most() -> None:
    """Phases shorter than a send (an overlapped run of a tiny model: 15 steps of 3 ms, sends of 0.3 s): the send
    difference once made the window 0 s and the member "too slow" for every round. It stops earlier by at most half
    the window, and trains."""
    p = Pace()
    p.begin(1, frozenset({"fast"}), cap=15, now=0.0)
    p.end(0, None)
    p.begin(2, frozenset({"fast"}), cap=15, now=10.0)
    p.stepped(0.003)
    p.stepped(0.003)
    assert p.finished(2, "fast", send_s=0.0, now=10.05)
    p.end(2, Why.SIGNALLED)
    p.sent(0.3)
    p.begin(3, frozenset({"fast"}), cap=15, now=20.0)
    assert p.next(0, 20.0) is None, "a first step that fits half the window"
    assert p.end(0, None).window_s == pytest.approx(0.025)


def test_the_window_is_the_finishers_own_phase_not_when_its_word_came() -> None:
    """Tiny phases (15 steps of 3 ms: 50 ms) and a member whose phase began 40 ms after the finisher's (its commit
    landed later: a relay's latency, an overlapped step): the word comes 10 ms into its own phase. Timed from there,
    the next window was 10 ms and the member "too slow (window 0.00 s)" in every round (the full suite's relay and
    overlap tests once); the finisher says its phase took 50 ms, and that is the window. An older finisher that says
    nothing (phase_s 0) leaves the rule as it was."""
    p = Pace()
    p.begin(1, frozenset({"fast"}), cap=15, now=0.0)
    p.end(0, None)
    p.begin(2, frozenset({"fast"}), cap=15, now=10.0)
    p.stepped(0.003)
    p.stepped(0.003)
    assert p.finished(2, "fast", send_s=0.0, now=10.01, phase_s=0.05)
    assert p.next(1, 10.01) is Why.SIGNALLED
    p.end(1, Why.SIGNALLED)
    p.begin(3, frozenset({"fast"}), cap=15, now=20.0)
    for k in range(10):
        assert p.next(k, 20.0 + 0.003 * k) is None, k
        p.stepped(0.003)
    assert p.end(10, None).window_s == pytest.approx(0.05)
    old = Pace()
    old.begin(1, frozenset({"fast"}), cap=15, now=0.0)
    old.end(0, None)
    old.begin(2, frozenset({"fast"}), cap=15, now=10.0)
    assert old.finished(2, "fast", send_s=0.0, now=10.01)
    old.end(0, Why.SIGNALLED)
    old.begin(3, frozenset({"fast"}), cap=15, now=20.0)
    assert old.end(0, None).window_s == pytest.approx(0.01)


def test_a_first_phase_teaches_no_window() -> None:
    """A member's first phase begins whenever its round reached it (here 15 s after the fast one's): the fast one's
    word, 5 s into it, says nothing of how long a round is, so the next phase has no window to stop at and a slow
    step there is not 'too slow' (the full suite once saw a quarter-speed peer sit a round out for it)."""
    p = Pace()
    p.begin(1, frozenset({"fast"}), cap=12, now=15.0)
    p.stepped(0.5)  # (its warm-up step)
    assert p.finished(1, "fast", send_s=0.1, now=20.0)
    assert p.end(1, Why.SIGNALLED).window_s == pytest.approx(5.0)
    p.begin(2, frozenset({"fast"}), cap=12, now=30.0)
    p.stepped(7.0)
    assert p.next(1, 37.0) is None  # no window known: it trains on until the word comes
    assert p.end(2, None).window_s is None


def test_pace_ignores_other_steps_and_strangers() -> None:
    p = Pace()
    p.begin(3, frozenset({"a"}), cap=10, now=0.0)
    assert not p.finished(2, "a", 0.0, 1.0) and not p.finished(3, "stranger", 0.0, 1.0)
    assert p.finished(3, "a", 0.0, 1.0)
    p.begin(7, frozenset({"a"}), cap=10, now=50.0)  # a gap of rounds: the old timing says nothing
    p.stepped(1.0)
    assert p.next(1, 52.0) is None


def test_a_slowed_device_is_seen_at_its_next_step() -> None:
    """Step times of the running phase count first: a device 8x slower from this phase on stops after one step."""
    p = Pace()
    p.begin(1, frozenset({"f"}), cap=20, now=-50.0)  # (a first phase: it teaches no window)
    p.begin(2, frozenset({"f"}), cap=20, now=0.0)
    for _ in range(10):
        p.stepped(1.0)
    p.finished(2, "f", 0.0, 10.0)
    p.begin(3, frozenset({"f"}), cap=20, now=100.0)
    assert p.next(0, 100.0) is None
    p.stepped(8.0)
    assert p.next(1, 108.0) is Why.WINDOW  # 8 + 8 > 10, and the rest by far


def test_a_first_finisher_slowed_8x_stops_at_its_own_window() -> None:
    """The member that finished first set the window, and nobody says where the next one ends: its cohort stops by
    the window it learned, without a word. Slowed 8x in the next phase, it once trained all 12 steps (6.6 s against a
    0.66 s window) and was dropped from that round and every one after (the full suite). It stops at its own phase
    times OWN_MARGIN; at its old speed it trains every step, even 40 % slower; a finisher that heard a word first
    uses the word's window; and one that trained fewer than H (``seconds`` not given) sets none."""
    p = Pace()
    p.begin(1, frozenset({"f"}), cap=12, now=-50.0)  # (a first phase: it teaches no window)
    p.begin(2, frozenset({"f"}), cap=12, now=0.0)
    for _ in range(12):
        p.stepped(0.055)
    p.end(12, Why.DONE, seconds=0.66)
    p.begin(3, frozenset({"f"}), cap=12, now=10.0)
    assert p.next(0, 10.0) is None
    p.stepped(0.55)
    assert p.next(1, 10.55) is Why.WINDOW  # 0.55 + 0.55 > 1.5 x 0.66, and the rest by far
    assert p.end(1, Why.WINDOW).window_s == pytest.approx(OWN_MARGIN * 0.66)
    assert decide(cap=12, done=11, at=11 * 0.077, step_s=0.077, end_s=OWN_MARGIN * 0.66) is None  # 40 % slower

    heard = Pace()  # the other member finished first and said so: its window, not this one's own
    heard.begin(1, frozenset({"f"}), cap=12, now=-50.0)
    heard.begin(2, frozenset({"f"}), cap=12, now=0.0)
    assert heard.finished(2, "f", send_s=0.0, now=0.6, phase_s=0.6)
    heard.end(12, Why.DONE, seconds=0.66)
    heard.begin(3, frozenset({"f"}), cap=12, now=10.0)
    assert heard.end(0, None).window_s == pytest.approx(0.6)

    short = Pace()  # trained its whole share, fewer than H: it said nothing and sets no window
    short.begin(1, frozenset({"f"}), cap=4, now=-50.0)
    short.begin(2, frozenset({"f"}), cap=4, now=0.0)
    short.end(4, Why.DONE)
    short.begin(3, frozenset({"f"}), cap=12, now=10.0)
    assert short.end(0, None).window_s is None


def test_too_slow_advice_names_what_helps() -> None:
    text = too_slow_advice(12.0, 3.0, 8, stages=1)
    assert "12.00 s" in text and "3.00 s" in text and "pipeline" in text and "batch_size" in text


def worker(h: int = 6) -> StageWorker:
    rc = apply_overrides(RunConfig(), {"model.d_model": 16, "model.n_layers": 1, "model.n_heads": 2,
                                       "model.seq_len": 8, "train.batch_size": 2, "diloco.inner_steps": h})
    return StageWorker(rc, 0, stage_bounds(rc.model, rc.pipeline)[0], torch.device("cpu"), Dataset(rc.data, rc.model),
                       None)


class Script:
    """A pacer that ends the phase after ``stop_at`` steps (what the window would say), counting what it is told."""

    def __init__(self, stop_at: int) -> None:
        self.stop_at, self.seen, self.times = stop_at, [], []

    def next(self, done: int, now: float, ahead: float = 0.0) -> Why | None:
        self.seen.append(done)
        return Why.WINDOW if done >= self.stop_at else None

    def stepped(self, seconds: float) -> None:
        self.times.append(seconds)

    def step_s(self) -> float | None:
        return None


def test_the_worker_trains_what_the_window_allows_on_the_first_samples_of_its_share() -> None:
    w = worker()
    pace = Script(stop_at=2)
    steps = []
    phase = w.inner_phase([(0, 12)], threading.Event(), lambda i, loss, s: steps.append(i), 1, pace)  # type: ignore[arg-type]
    assert phase.steps == 2 and phase.why is Why.WINDOW and steps == [0, 1] and len(pace.times) == 2
    assert w.sampler is not None and w.sampler.position == 4  # the first 2 batches of the share, in order


def test_the_worker_stops_at_its_share_and_at_h() -> None:
    w = worker(h=6)
    assert w.cap([(0, 7)]) == 3 and w.cap([(0, 100)]) == 6
    phase = w.inner_phase([(0, 6)], threading.Event(), lambda *a: None, 1, Script(stop_at=99))  # type: ignore[arg-type]
    assert phase.steps == 3 and phase.why is Why.DONE
    assert w.inner_phase([(0, 6)], threading.Event(), lambda *a: None, 2, Script(stop_at=0)).steps == 0  # type: ignore[arg-type]


def test_the_page_names_whom_a_round_waits_for_and_who_went_silent() -> None:
    """One member synced, two not: the waiting reason names them, what they do, and one silent for 5 heartbeats."""
    import time as clock

    from potluck.coordinator.rounds.rounds import Rounds
    from potluck.coordinator.status.snapshot import waiting_reason
    from potluck.protos.wire.records import Member

    cfg = apply_overrides(RunConfig(), {"membership.heartbeat_s": 1.0})
    rounds = Rounds(stages=1)
    rounds.decide([Member(peer_id=p, address=f"{p}:1", replica=i) for i, p in enumerate("abc")], 0.0,
                  decided_at=clock.time() - 12)
    live = [{"id": "a", "short_id": "a", "state": "syncing", "inner_step": 0, "last_seen_s": 0.5},
            {"id": "b", "short_id": "b", "state": "training", "inner_step": 7, "last_seen_s": 0.4},
            {"id": "c", "short_id": "c", "state": "syncing", "inner_step": 0, "last_seen_s": 0.3}]
    live[2]["state"] = "recovering"
    live[1]["last_seen_s"] = 5.0
    why = waiting_reason(cfg, rounds, live, False, live)
    assert why.startswith("outer step 1: 1 of 3 members are ready; waiting for 2: ") and "decided 12 s ago" in why, why
    assert "b (inner step 7, silent for 5 s)" in why and "c (recovering)" in why, why
