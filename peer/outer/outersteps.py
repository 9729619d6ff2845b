"""A peer's outer steps, blocking or overlapped: after the inner phase, until the step is committed.

Blocking (the DiLoCo algorithm box)::

    delta <- theta_global - theta_local
    mean  <- all-reduce(delta) among the stage's replicas
    theta_global <- Nesterov(theta_global, mean); theta_local <- theta_global

Overlapped (``diloco.overlap``, one-step-delayed DiLoCo): the outer step of ``k`` runs on a thread
while the inner steps of ``k + 1`` train. ``delta`` is what the phase moved from where it started;
the local model goes on from ``theta_global - delta`` (the committed state plus its own progress,
not yet averaged), and the average is applied when the next phase ends. The step commits on its
thread as soon as the all-reduce ends, so the swarm sees the version at once. Members commit the
same ``theta_global`` bits at every step either way.

While a step is in flight the follower sees it as committed, so the next step trains at once; any
other action (recover, switch, wait, finish) first lands the step in flight (:meth:`OuterSteps.pending`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from potluck.compression.transfer import Snapshot
from potluck.peer.follower import Action, Held, Train
from potluck.peer.outer.diloco import all_finite, host_vector
from potluck.peer.outer.fragments import fragment_delta, mix
from potluck.peer.outer.outer import OuterResult, outer_step, pseudo_gradient, step_fragment
from potluck.peer.outer.states import epoch_of
from potluck.peer.reduce.allreduce import IncompleteRound, RoundInfo
from potluck.peer.reduce.pacing import pace_seconds
from potluck.peer.tasklet import Tasklet
from potluck.protos.runtime.log import get_logger, set_context
from potluck.protos.testkit.faults import fault
from potluck.protos.wire.records import AuditReport
from potluck.protos.wire.states import PeerState

if TYPE_CHECKING:
    from potluck.peer.follower import Follower
    from potluck.peer.swarm.heartbeat import Heartbeat
    from potluck.peer.swarm.telemetry import Telemetry
    from potluck.peer.training.phases import InnerPhases
    from potluck.protos.config.runconfig import PeerConfig, RunConfig

PACE_PHASES = 5  # sync.pace: the inner phases whose median duration an overlapped step is paced over
log = get_logger(__name__)


class StepHost(Protocol):
    """What the outer steps use of the peer's session (the daemon's Session), and nothing else: its tasklet and
    replica change as the grid moves it, so they are read each time, never kept."""

    cfg: PeerConfig
    rc: RunConfig
    tasklet: Tasklet
    replica: int
    follower: Follower
    heartbeat: Heartbeat
    telemetry: Telemetry
    inner: InnerPhases

    def set_state(self, state: PeerState, poke: bool = True) -> None: ...

    def over(self) -> bool: ...


@dataclass
class InFlight:
    """An outer step whose all-reduce runs on a thread while the next inner phase trains."""

    step: int
    info: RoundInfo
    contributed: bool
    thread: threading.Thread | None = None
    blocked_s: float = 0.0  # seconds the training loop spent starting it
    done: OuterResult | None = None
    error: str = ""


class OuterSteps:
    """``inflight`` is the training loop's (it starts and lands the step); the step's own thread only commits the
    state (``States`` has its lock) and fills in the InFlight's ``done`` or ``error`` before it ends, which the
    loop reads after joining it."""

    def __init__(self, session: StepHost) -> None:
        self.s = session
        self.inflight: InFlight | None = None
        self._phases: deque[float] = deque(maxlen=PACE_PHASES)  # the last inner phases' seconds (sync.pace)

    def after_phase(self, step: int, inner_seconds: float, start: torch.Tensor | None, interrupted: bool,
                    contribute: bool, samples: int = 1) -> None:
        """The inner phase of ``step`` ended: its outer step, overlapped if ``start`` (where it began) is given.
        ``samples``: what the phase trained on (its contribution's weight)."""
        if start is not None:
            self._overlapped(step, inner_seconds, start, interrupted, contribute, samples)
        elif not interrupted:
            self._blocking(step, inner_seconds, contribute, samples)

    # ------------------------------------------------------------------ what the follower sees

    def held(self) -> Held:
        """The state held, as the follower should see it: with a step in flight, as if it had committed."""
        t = self.s.tasklet
        held = t.states.held(t.stage)
        if self.inflight is None:
            return held
        return Held(self.inflight.step, "", held.stage, self.inflight.info.epoch, time.monotonic())

    def over(self) -> bool:
        """The run is over, or the step in flight is its last."""
        return self.s.over() or (self.inflight is not None and self.inflight.step >= self.s.rc.diloco.outer_steps)

    def pending(self, action: Action) -> bool:
        """A step is in flight and ``action`` is not training the next one: land it first."""
        return self.inflight is not None and not (isinstance(action, Train) and action.step == self.inflight.step + 1)

    # ------------------------------------------------------------------ blocking

    def _blocking(self, step: int, inner_seconds: float, contribute: bool, samples: int) -> None:
        s = self.s
        s.set_state(PeerState.SYNCING)
        t0, t = time.monotonic(), s.tasklet
        info = self._resolve(step)
        if info is None:
            log.warning("step %d is not this peer's to commit (not a member after all, or rolled back); discarding "
                        "its inner steps", step)
            return self._fail(step)
        held = t.states.current
        theta = held.tensors["theta"]
        bounds = step_fragment(s.rc, theta.numel(), t.allreduce.codec.align, step)
        local = None
        if bounds is None:
            delta = pseudo_gradient(theta, t.worker.theta()) if contribute else None
        else:  # streaming: this step's fragment only; the others train on from where this member has them
            local = t.worker.theta() if contribute else None  # (a stalled phase goes back to theta_global whole)
            delta = fragment_delta(theta, local, *bounds, t.allreduce.numel) if local is not None else None
        try:
            done = outer_step(s.rc, t.allreduce, info, held, delta, inner_seconds, t.worker.meta(), self._base(info),
                              samples)
        except IncompleteRound as err:
            log.warning("%s; recovering state from the other members", err)
            return self._fail(step, info.epoch)
        s.inner.pace.sent(done.stats.send_s)
        if local is not None and bounds is not None:
            lo, hi = bounds
            mix(local[lo:hi], done.snapshot.tensors["theta"][lo:hi], s.rc.sync.fragment_alpha, out=local[lo:hi])
        t.adopt(done.snapshot, local)
        self._committed(step, done, info, time.monotonic() - t0, contribute)

    def _committed(self, step: int, done: OuterResult, info: RoundInfo, sync_s: float, contribute: bool) -> None:
        """Report a committed step (``sync_s``: what it cost the training loop) and evaluate it when due."""
        s, t = self.s, self.s.tasklet
        s.telemetry.outer_step(done.stats, sync_s, done.mean_norm, info.epoch, t.stage, max(s.replica, 0),
                               done.snapshot.digest, asdict(t.pipeline.traffic) if t.pipeline is not None else None)
        for shard, attempt, owner in done.stats.omitted:  # a proof the coordinator checks (its receipt, the result)
            s.telemetry.audited(AuditReport(step=step, epoch=info.epoch, stage=t.stage, group=info.group, shard=shard,
                                            attempt=attempt, owner=owner, verdict="omitted", t=time.time(),
                                            reason="it receipted this peer's contribution and left it out"))
        owners = info.shard_owners
        for shard, why in done.stats.unreceipted:  # (a complaint, not a proof: weighed by how many say it, how often)
            s.telemetry.audited(AuditReport(step=step, epoch=info.epoch, stage=t.stage, group=info.group, shard=shard,
                                            owner=owners[shard], verdict="unreceipted", t=time.time(),
                                            reason=f"it did not receipt this peer's contribution: {why}"[:200]))
        for shard in done.stats.short:
            s.telemetry.audited(AuditReport(step=step, epoch=info.epoch, stage=t.stage, group=info.group, shard=shard,
                                            owner=owners[shard], verdict="short", t=time.time(),
                                            reason="its result named too few of the step's contributors (sync.quorum): "
                                                   "not adopted; its backup took the shard over"))
        fault("outer.committed", step)
        every = s.rc.data.eval_every
        if every and step % every == 0 and contribute:  # (theta_global: not what a streaming or overlapped member holds)
            held = t.states.current  # (as held: the vector the worker loaded, when it did)
            value = t.worker.evaluate_global(step, (held if held.version == step else done.snapshot).tensors["theta"])
            if value is not None:
                s.telemetry.evaluated(step, value)
        s.heartbeat.poke()

    # ------------------------------------------------------------------ overlapped

    def _overlapped(self, step: int, inner_seconds: float, start: torch.Tensor, interrupted: bool,
                    contribute: bool, samples: int) -> None:
        """Land the step in flight, start ``step``'s all-reduce on a thread, and train on from
        ``theta_global - delta`` while it runs.

        What the training loop waits for here is only what the next phase needs: theta_local off the
        device, ``delta``, and ``theta_global - delta`` onto it (through pinned vectors on a GPU). The
        all-reduce, the Nesterov step and hashing the new state run on the step's thread and the
        state hasher's, and the vector loaded here is where the next phase starts (no copy back).
        """
        t = self.s.tasklet
        theta_local = t.worker.theta()
        before = self.inflight
        landed = before is not None
        if landed and not self.land(load=False):  # (its wait counts as the step before's)
            return  # the step before did not commit here: this phase trained from a state the swarm does not hold
        if interrupted:
            if landed:  # as a landed step leaves the worker: at the committed theta_global
                t.worker.load(t.states.current.tensors["theta"])
            return
        if self.s.rc.sync.fragments > 1:
            return self._overlapped_fragment(step, inner_seconds, start, theta_local,
                                             before.step if before is not None else None, contribute, samples)
        t0 = time.monotonic()
        delta = pseudo_gradient(start, theta_local) if contribute else None
        if delta is not None and not all_finite(delta):
            log.error("local training produced NaN/Inf; contributing nothing to step %d", step)
            delta = None
        held = t.states.current
        theta = held.tensors["theta"]
        # the committed theta_global plus this member's own progress, until the average of it arrives
        t.worker.load(torch.sub(theta, delta, out=host_vector(theta.numel(), t.worker.pinned)) if delta is not None
                      else theta)
        self._fly(step, held, delta, inner_seconds, samples, t0)

    def _overlapped_fragment(self, step: int, inner_seconds: float, start: torch.Tensor, theta_local: torch.Tensor,
                             landed: int | None, contribute: bool, samples: int) -> None:
        """:meth:`_overlapped` with streaming outer steps: the fragment of the step just landed (``landed``) goes
        on from its new theta_global plus what the phase since trained on it (``start - theta_local`` there, as
        the whole vector does without fragments); this step's fragment contributes ``theta_global - theta_local``
        there and, like every other fragment, trains on locally until its average lands."""
        t, t0 = self.s.tasklet, time.monotonic()
        held = t.states.current
        theta = held.tensors["theta"]
        n, align = theta.numel(), t.allreduce.codec.align
        if landed is not None and (was := step_fragment(self.s.rc, n, align, landed)) is not None:
            lo, hi = was
            progress = torch.sub(start[lo:hi], theta_local[lo:hi])  # (minus what the phase since trained on it)
            torch.sub(mix(start[lo:hi], theta[lo:hi], self.s.rc.sync.fragment_alpha), progress, out=theta_local[lo:hi])
        bounds = step_fragment(self.s.rc, n, align, step)
        assert bounds is not None
        delta = fragment_delta(theta, theta_local, *bounds, t.allreduce.numel) if contribute else None
        if delta is not None and not all_finite(delta):
            log.error("local training produced NaN/Inf; contributing nothing to step %d", step)
            delta = None
        t.worker.load(theta_local if delta is not None else theta)  # (a stalled phase: back to theta_global whole)
        self._fly(step, held, delta, inner_seconds, samples, t0)

    def _fly(self, step: int, held: Snapshot, delta: torch.Tensor | None, inner_seconds: float, samples: int,
             t0: float) -> None:
        """Resolve ``step``'s round and start its outer step on a thread (see :meth:`_overlapped`)."""
        t = self.s.tasklet
        info = self._resolve(step)
        if info is None:
            log.warning("step %d is not this peer's to commit (not a member after all, or rolled back); discarding "
                        "its inner steps", step)
            return self._fail(step)
        try:
            base = self._base(info)
        except IncompleteRound as err:
            log.warning("%s; recovering state from the other members", err)
            return self._fail(step, info.epoch)
        flight = InFlight(step, info, contributed=delta is not None)
        flight.thread = threading.Thread(target=self._run, args=(flight, t, held, delta, inner_seconds, t.worker.meta(), base,
                                                                 samples), name=f"outer-{step}", daemon=True)
        flight.thread.start()
        self.inflight = flight
        flight.blocked_s = time.monotonic() - t0

    def _run(self, flight: InFlight, t: Tasklet, held: Snapshot, delta: torch.Tensor | None, inner_seconds: float,
             meta: dict, base: Snapshot | None, samples: int) -> None:
        """The outer step on its own thread: commit as soon as it is done, so the swarm sees the version."""
        try:
            # overlapped: nothing needs the result before the next inner phase ends, so its sends may be spread out
            self._phases.append(inner_seconds)
            pace_s = pace_seconds(self.s.rc.sync.pace, self._phases, self.s.rc.sync.rpc_timeout_s)
            done = outer_step(self.s.rc, t.allreduce, flight.info, held, delta, inner_seconds, meta, base, samples,
                              pace_s)
        except IncompleteRound as err:
            flight.error = str(err)
            return
        except Exception as err:  # reported by the training loop when it lands the step
            log.exception("outer step %d failed", flight.step)
            flight.error = f"{type(err).__name__}: {err}"
            return
        self.s.inner.pace.sent(done.stats.send_s)
        done.snapshot = t.states.commit(done.snapshot)  # (as held: with --outer-state-dir, in files)
        t.expect_next()
        flight.done = done
        self.s.heartbeat.poke()

    def land(self, load: bool = True) -> bool:
        """Wait for the step in flight; on success the local model is the committed theta_global (unless
        not ``load``: the caller loads the parameters itself)."""
        flight, self.inflight = self.inflight, None
        assert flight is not None and flight.thread is not None
        self.s.set_state(PeerState.SYNCING)
        t0 = time.monotonic()
        flight.thread.join()
        if flight.done is None:
            log.warning("%s; recovering state from the other members", flight.error)
            self._fail(flight.step, flight.info.epoch)
            return False
        if load:
            t, theta = self.s.tasklet, flight.done.snapshot.tensors["theta"]
            if flight.done.bounds is None:
                t.worker.load(theta)
            else:  # streaming: the landed fragment at its new theta_global, the others as this member trained them
                lo, hi = flight.done.bounds  # (landing outside a phase: what it trained since mixes in too)
                local = t.worker.theta()
                mix(local[lo:hi], theta[lo:hi], self.s.rc.sync.fragment_alpha, out=local[lo:hi])
                t.worker.load(local)
        set_context(step=flight.step)
        self._committed(flight.step, flight.done, flight.info, flight.blocked_s + time.monotonic() - t0, flight.contributed)
        return True

    def close(self) -> None:
        if self.inflight is not None and self.inflight.thread is not None:
            self.inflight.thread.join(timeout=5.0)  # stopping is set: its all-reduce gives up at once

    # ------------------------------------------------------------------ both

    def _resolve(self, step: int) -> RoundInfo | None:
        """The round ``step`` belongs to, once the coordinator decided it, or rolled the run back (a round of a
        later epoch than the state held: no round for ``step`` is coming), or ``plan_wait_s`` passed."""
        s = self.s
        held = s.tasklet.states.current
        epoch = epoch_of(held)
        plan = s.heartbeat.wait_plan(lambda p: p is not None and any(r.step == step or r.epoch > epoch for r in p.rounds),
                                     timeout=s.cfg.plan_wait_s)
        rnd = s.follower.resolve(plan, step, s.tasklet.stage, held.hash, epoch, s.heartbeat.coordinator_silent_s())
        if rnd is None:
            return None
        info = s.tasklet.round_info(rnd, step)
        s.tasklet.ready(info)
        return info

    def _base(self, info: RoundInfo) -> Snapshot | None:
        """Grouped averaging: the state this member's group starts from (None: averaging pseudo-gradients
        from the state held). Raises :class:`IncompleteRound` if this member holds it not."""
        if not self.s.rc.sync.group_size:
            return None
        base = self.s.tasklet.base(info.base_hash)
        if base is None:
            raise IncompleteRound(f"step {info.step}: this peer does not hold its group's base state "
                                  f"{info.base_hash[:12]}")
        return base

    def _fail(self, step: int, epoch: int | None = None) -> None:
        """This peer did not commit ``step`` (of ``epoch``, its round's; without a round, the held state's: a
        rollback past it makes it a step of the abandoned epoch): drop the round's messages and recover
        before going on."""
        if epoch is None:
            epoch = self.s.tasklet.states.epoch
        self.s.follower.failed(step, time.monotonic(), epoch)
        self.s.tasklet.expect_next()
