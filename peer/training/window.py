"""How many inner steps a member trains in a round: as many as fit the round's window.

Volunteers' devices differ by 10x and more, and a round is synchronous: every member's pseudo-gradient
goes into one all-reduce. With H inner steps for everyone, the fast members would wait for the slowest
(or drop it at a deadline, its work lost). Instead a round is a *window* of wall time: the time the
fastest member takes for its H inner steps (``diloco.inner_steps``, the most any member trains). Each
member trains as many steps as fit in it, and its pseudo-gradient counts in proportion to the samples
they held (:mod:`potluck.compression.aggregate`), so a quarter-speed peer adds a quarter of a peer's
work instead of taking three quarters of everyone's time (Liu et al. 2024, "dynamic local updates";
hivemind's ``target_batch_size`` ends its epochs the same way, on the swarm's work rather than a count).

Nobody needs a clock in common. A member learns where the window ends from the members it averages
with:

* a member that trained all its steps says so at once (a ``finished`` ping to its cohort): the others
  end their phase at their next step boundary (``Why.SIGNALLED``), unless what they have left is within
  ``slack`` of the window, so a swarm of equal peers still trains exactly H steps each;
* a member that finished first (it said so, and heard no word before its own) takes its own phase, with
  ``OWN_MARGIN`` to spare, as the next round's window: it set the window, and nobody will say where the next
  one ends if it slows down (its cohort then stops by the window it learned, without a word; a peer slowed 8x
  right after it had finished first once trained its whole phase at the new speed, 10x the window, and was
  dropped from that round and every round after it in the full suite);
* from the round before, a member knows *when* that came, counted from the start of its own phase
  (members start their phases together: they commit the same all-reduce), and how long its own
  contribution takes to send against the finisher's: it does not start a step that would end after
  the window, less the extra time its own (slower) uplink needs (``Why.WINDOW``). So a slower member ends
  on time instead of one of its steps late, and a slow uplink's sync time is counted in the window too.

Nothing here holds the round back: a member whose single step is longer than the whole window trains
none (it still takes part in the all-reduce and gathers the result) and says why, with what would help.
:func:`decide` is the rule, a pure function; :class:`Pace` is one member's observations across rounds
(written by the ping handler's thread and the training loop, so it holds a lock) and asks it.
"""

from __future__ import annotations

import enum
import statistics
import threading
from collections import deque
from dataclasses import dataclass

SLACK = 0.1  # a member finishes its phase if what is left ends within this share of the window past its end
FIRST_STEP = 1.5  # a member's first step starts if it ends within this many windows: only a clearly slower one trains
# none (with windows of tens of milliseconds, a loaded box's noise made members skip whole rounds)
KEEP_STEP_TIMES = 16
OWN_MARGIN = 1.5  # a first finisher's next window is its own phase times this: only a clear slowdown stops it early
# (the slack alone would cut an equal swarm's steps on a loaded box's noise between rounds)
RETRY_AFTER = 4  # a member too slow for one step tries one again after this many rounds without (it may be faster now)


class Why(enum.Enum):
    """Why an inner phase ended."""

    DONE = "trained every step the round allows"
    WINDOW = "the next step would end after the round's window"
    SIGNALLED = "a faster member finished its inner phase"


def decide(*, cap: int, done: int, at: float, step_s: float | None, end_s: float | None,
           slack: float = SLACK) -> Why | None:
    """Whether to start inner step ``done`` (0-based) at ``at`` seconds into the phase: None, or why not.

    ``cap``: the most steps the round allows this member (H, or fewer if its data share holds fewer
    batches); ``step_s``: what one of its steps takes (None: not measured yet, so it trains); ``end_s``:
    where the window ends, in seconds from the start of this member's phase (None: not known). A step
    that ends inside the window starts; so does the rest of the phase if it ends within ``slack`` of
    the window past its end (equal peers then all train ``cap`` steps, whoever finished first). The first step
    starts unless it would end more than ``FIRST_STEP`` windows in: a member trains none only when clearly too slow.
    """
    if done >= cap:
        return Why.DONE
    if step_s is None or end_s is None:
        return None
    if at + step_s <= end_s or at + (cap - done) * step_s <= end_s * (1 + slack):
        return None
    if done == 0 and at + step_s <= FIRST_STEP * end_s:
        return None  # (one step, a little late, rather than none: it counts, and the round waits a fraction of it)
    return Why.WINDOW


@dataclass(frozen=True)
class Ended:
    """One inner phase as the window saw it: the steps trained, the window's end it used (None: unknown), why it
    ended, and this member's step time then."""

    steps: int
    cap: int
    window_s: float | None
    why: Why | None  # None: the caller stopped it (interrupted, stalled)
    step_s: float | None


class Pace:
    """One member's timing across rounds, and the window rule asked with it.

    The training loop calls :meth:`begin` when a phase starts, :meth:`next` before each inner step and
    :meth:`stepped` after it, :meth:`end` when the phase ends and :meth:`sent` once its own contributions are
    sent (with ``diloco.overlap``, during the next phase: it counts for the one after); the ping handler calls :meth:`finished` when a member of this round says it trained its whole phase.
    """

    def __init__(self, slack: float = SLACK) -> None:
        self.slack = slack
        self._lock = threading.Lock()
        self._steps: deque[float] = deque(maxlen=KEEP_STEP_TIMES)  # this member's recent step times
        self._phase_steps: list[float] = []
        self._step = -1  # the outer step whose phase runs (or ran last)
        self._cohort: frozenset[str] = frozenset()
        self._started = 0.0  # monotonic seconds at the start of the phase
        self._cap = 0
        self._signal: float | None = None  # when (since the phase began) a member of the round finished its phase
        self._their_send_s = 0.0  # and how long that member's contribution took to send, the round before
        self._their_phase_s = 0.0  # and how long that member's phase took, on its own clock (the window's length)
        self._send_s = 0.0  # how long this member's own contributions took to send, the round before
        self._own_phase_s: float | None = None  # this member's own phase, when it finished first (it set the window)
        self._expect: float | None = None  # where this phase's window ends: from the round before
        self._aligned = False  # this phase began when the step before committed, as its cohort's did
        self._warm = False  # the process's first step (optimizer, lazy imports) says nothing of its speed: not counted
        self._idle = 0  # rounds in a row this member was too slow for a single step
        self.last: Ended | None = None

    # ------------------------------------------------------------------ the training loop

    def begin(self, step: int, cohort: frozenset[str], cap: int, now: float) -> None:
        """The phase of ``step`` starts at ``now`` (monotonic); ``cohort``: who may end it early (the members this one
        averages with); ``cap``: the most steps it may train."""
        with self._lock:
            # when the fastest member finished, the round before, if that phase began with its cohort's: a member's first
            # phase (joined, recovered, after a gap) begins whenever its round reached it, and a word timed from that start
            # made the window of a quarter-speed peer that started late look five times shorter than it was
            if self._signal is not None and step == self._step + 1 and self._aligned:
                # (a slower uplink stops earlier, by at most half the window: with phases shorter than a send, as an
                # overlapped run of a tiny model has, the difference made the window 0 s and the member "too slow")
                self._expect = max(0.5 * self._their_phase_s, self._their_phase_s + self._their_send_s - self._send_s)
            elif self._own_phase_s is not None and step == self._step + 1 and self._aligned:
                self._expect = OWN_MARGIN * self._own_phase_s  # (it finished first: the window was its own phase)
            elif step != self._step:
                self._expect = None  # (a gap, or a first phase: its timing says nothing of this one)
            self._aligned = step == self._step + 1  # (phases after a commit begin together: the members commit it together)
            self._step, self._cohort, self._started, self._cap = step, cohort, now, cap
            self._signal, self._phase_steps, self._own_phase_s = None, [], None

    def next(self, done: int, now: float, ahead: float = 0.0) -> Why | None:
        """Whether to start inner step ``done`` now (plus ``ahead`` seconds: a pipeline's first stage decides one
        step ahead whether a step is its last, so the stages after it know); None, or why not."""
        with self._lock:
            at = now - self._started + ahead
            end = self._signal if self._signal is not None else self._expect
            why = decide(cap=self._cap, done=done, at=at, step_s=self._step_time(), end_s=end, slack=self.slack)
            if why is Why.WINDOW and done == 0 and self._idle >= RETRY_AFTER:
                return None  # measure again: one step late once in a while, not out of the run for good
            if why is Why.WINDOW and self._signal is not None:
                why = Why.SIGNALLED
            return why

    def step_s(self) -> float | None:
        with self._lock:
            return self._step_time()

    def stepped(self, seconds: float) -> None:
        """An inner step of the phase took ``seconds``."""
        with self._lock:
            if not self._warm:
                self._warm = True
                return
            self._phase_steps.append(seconds)
            self._steps.append(seconds)

    def end(self, steps: int, why: Why | None, seconds: float | None = None) -> Ended:
        """The phase ended after ``steps`` steps; what it was, kept as :attr:`last` (the telemetry reads it).
        ``seconds``: how long it took, given when it trained all H steps and says so to its cohort; if no word came
        before, it set the round's window, and the next one is that long (times ``OWN_MARGIN``)."""
        with self._lock:
            window = self._signal if self._signal is not None else self._expect
            if why is Why.DONE and self._signal is None and steps > 0 and seconds is not None and seconds > 0:
                self._own_phase_s = seconds
            self._idle = self._idle + 1 if steps == 0 and why is Why.WINDOW else 0
            self.last = Ended(steps, self._cap, window, why, self._step_time())
            return self.last

    def sent(self, seconds: float) -> None:
        """This member's contributions to its last all-reduce took ``seconds`` to send (from the start of it)."""
        with self._lock:
            self._send_s = max(0.0, seconds)

    def send_s(self) -> float:
        with self._lock:
            return self._send_s

    # ------------------------------------------------------------------ the ping handler's thread

    def finished(self, step: int, sender: str, send_s: float, now: float, phase_s: float = 0.0) -> bool:
        """``sender`` says it trained its whole phase of ``step``, in ``phase_s`` seconds of its own (0: it did not say;
        an older version), its contributions taking ``send_s`` to send the round before. The first such word of a
        member of this round ends this phase at its next step; the next phase's window is ``phase_s`` long, not the
        time the word took to come since this member's own phase began (the members' starts are skewed by their
        commits' landing: with phases of tens of milliseconds the skew made the window ~0 s, and a member "too slow").
        True if it marked the window."""
        with self._lock:
            if step != self._step or sender not in self._cohort or self._signal is not None:
                return False
            self._signal, self._their_send_s = max(0.0, now - self._started), max(0.0, send_s)
            self._their_phase_s = phase_s if phase_s > 0 else self._signal
            return True

    # ------------------------------------------------------------------ inside

    def _step_time(self) -> float | None:
        """This phase's mean step so far (a device that slowed down mid-run is seen at its next step), else the
        median of the recent ones."""
        if self._phase_steps:
            return sum(self._phase_steps) / len(self._phase_steps)
        return statistics.median(self._steps) if self._steps else None


def too_slow_advice(step_s: float, window_s: float, batch_size: int, stages: int) -> str:
    """What to tell a volunteer whose one inner step takes longer than the whole window."""
    helps = [f"a smaller train.batch_size than {batch_size} for the run (its operator's choice)"]
    if stages == 1:
        helps.append("a pipeline (pipeline.stages > 1), where this device holds a fraction of the model")
    helps.append("a faster device, or fewer other programs on this one")
    return (f"this peer is too slow for the round: one inner step takes {step_s:.2f} s, the round's window "
            f"{window_s:.2f} s (the fastest member's H steps); it contributes nothing until that changes "
            f"(it still averages and keeps the run's state). What would help: {'; '.join(helps)}")
