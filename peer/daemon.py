"""The peer daemon: join a run, then follow its rounds until it ends.

:meth:`Session.train` is the algorithm box of the DiLoCo paper, one call deeper for each line::

    while the run is not over:
        act on the plan: wait, switch stage or recover state      (follower)
        H inner AdamW steps on this peer's shard -> theta_local    (stage worker; pipeline if S > 1)
        delta <- theta_global - theta_local
        mean  <- all-reduce(delta) among the stage's replicas     (outer step)
        theta_global <- Nesterov(theta_global, mean); theta_local <- theta_global

With ``diloco.overlap`` the outer step of ``k`` runs on a thread while the inner steps of ``k + 1``
train (one-step-delayed DiLoCo): ``delta`` is what the phase moved from where it started, the
local model goes on from ``theta_global - delta`` (the committed state plus its own progress, not
yet averaged), and the result is applied when the next phase ends. Members commit the same
``theta_global`` bits at every step either way.

Membership comes from the coordinator's plan (one explicit round per outer step, read through the
DHT); the data path (all-reduce, pipeline, state transfer) is peer-to-peer gRPC, so peers keep
training on the last plan while the coordinator is away.
"""

from __future__ import annotations

import importlib
import threading
import time
from dataclasses import asdict, dataclass

import torch

from potluck.compression.transfer import Snapshot, Target
from potluck.peer.allreduce import IncompleteRound, RoundInfo
from potluck.peer.data import DataError
from potluck.peer.diloco import all_finite
from potluck.peer.follower import Finish, Follower, Held, Recover, Switch, Train, Wait
from potluck.peer.joining import Joined, Stopped, join, load_identity
from potluck.peer.outer import OuterResult, outer_step, pseudo_gradient
from potluck.peer.recovery import recover
from potluck.peer.tasklet import Tasklet, Toolbox
from potluck.peer.telemetry import Telemetry
from potluck.protos import potluck_pb2 as pb
from potluck.protos.config import ConfigError, PeerConfig
from potluck.protos.errors import CannotBind
from potluck.protos.faults import fault
from potluck.protos.log import get_logger, set_context
from potluck.protos.netem import TopologyError
from potluck.protos.records import PeerRecord, Round
from potluck.protos.swarm import JoinError

log = get_logger(__name__)


class Peer:
    """A volunteer's daemon: ``run()`` joins, trains until the run ends or ``stopping`` is set, leaves."""

    def __init__(self, cfg: PeerConfig, progress: str = "auto") -> None:
        self.cfg = cfg
        self.identity = load_identity(cfg)
        self.id = self.identity.peer_id
        self.stopping = threading.Event()
        self.telemetry = Telemetry(self.id, cfg.name, time.time(), progress)
        set_context(role="peer", peer_id=self.id)

    def run(self) -> int:
        """Returns a process exit code: 0 when the run ended or we were asked to stop, 2 on bad input."""
        # torch's optimizers import torch._dynamo on first use (seconds of CPU): do it while we wait on the network
        threading.Thread(target=importlib.import_module, args=("torch._dynamo",), name="warm-up", daemon=True).start()
        session: Session | None = None
        joined: Joined | None = None
        try:
            joined = join(self.cfg, self.identity, self.stopping)
            session = Session(self.cfg, joined, Toolbox.build(self.cfg, joined, self.identity, self.stopping), self.telemetry)
            session.train()
            return 0
        except Stopped:
            log.info("stopped before joining the run")
            return 0
        except (JoinError, ConfigError, TopologyError, DataError, CannotBind) as err:
            log.error("%s", err)
            return 2
        finally:
            self.stopping.set()
            if session is not None:
                session.close()
            elif joined is not None:
                joined.node.shutdown()


@dataclass
class InFlight:
    """An outer step whose all-reduce runs on a thread while the next inner phase trains (diloco.overlap)."""

    step: int
    info: RoundInfo
    contributed: bool
    thread: threading.Thread | None = None
    blocked_s: float = 0.0  # seconds the training loop spent starting it
    done: OuterResult | None = None
    error: str = ""


class Session:
    """One peer's part in one run, from admission to the end."""

    def __init__(self, cfg: PeerConfig, joined: Joined, tools: Toolbox, telemetry: Telemetry) -> None:
        self.cfg, self.joined, self.tools, self.telemetry = cfg, joined, tools, telemetry
        self.rc, self.me, self.stopping = tools.rc, tools.me, tools.stopping
        self.follower = Follower(self.me, pipelined=self.rc.pipeline.stages > 1, plan_wait_s=cfg.plan_wait_s)
        self.tasklet = Tasklet.build(tools, stage=0)
        self.replica, self.waiting = -1, ""
        self.round_known = False  # the all-reduce knows the coordinator's round for the step in training
        self.training = 0  # the step whose inner phase runs (with diloco.overlap, the one before may still sync)
        self.heartbeat = tools.serve(lambda: self.tasklet, self.ping, self.record)
        self.phases = {**joined.phases, "setup": time.time() - joined.joined_at - joined.phases["manifest"]}
        self.ready_at, self.first_round_at, self.recovered_s = time.time(), 0.0, 0.0
        self.inflight: InFlight | None = None
        tools.announce(self.tasklet.worker.numel, self.phases)

    def train(self) -> None:
        while True:
            action = self.follower.next(self.heartbeat.plan, self._held(), time.monotonic(), self._over())
            if self.inflight is not None and not (isinstance(action, Train) and action.step == self.inflight.step + 1):
                self._land()  # anything but training the next step waits for the step in flight, then decides again
                continue
            match action:
                case Finish():
                    break
                case Wait() as wait:
                    self._wait(wait)
                case Switch(stage=stage):
                    log.info("assigned to stage %d (held stage %d): fetching its state", stage, self.tasklet.stage)
                    self.tasklet = self.tasklet.replace(stage)
                case Recover() as want:
                    self._recover(want)
                case Train(round=rnd, step=step):
                    self._begin(rnd, step)
                    start = self.tasklet.worker.theta() if self.rc.diloco.overlap else None
                    phase = self.tasklet.worker.inner_phase(rnd.data_spans(step, self.replica), self.stopping,
                                                            self._inner_step, step)  # H inner AdamW steps
                    self.telemetry.progress.compute_s += phase.seconds
                    if phase.stalled:
                        log.warning("replica %d stalled at inner step %d: %s; contributing nothing to outer step %d",
                                    self.replica, phase.steps, phase.stalled, step)
                    if start is not None:
                        self._outer_overlapped(step, phase.seconds, start, phase.interrupted, not phase.stalled)
                    elif not phase.interrupted:
                        self._outer(step, phase.seconds, contribute=not phase.stalled)
        if self.completed() and not self.stopping.is_set():
            self._set_state("finished")  # serve the final state until the coordinator has seen it
            self.heartbeat.await_confirmation(self.tasklet.states.current.version, self.stopping)
        log.info("done at version %d", self.tasklet.states.current.version)

    # ------------------------------------------------------------------ the steps of the loop

    def _wait(self, wait: Wait) -> None:
        if wait.reason != self.waiting:
            log.info("%s", wait.reason)
            self.waiting = wait.reason
        self._set_state("waiting")
        seq = self.heartbeat.plan.seq if self.heartbeat.plan else -1
        self.heartbeat.wait_plan(lambda p: p is not None and p.seq > seq, timeout=wait.seconds)

    def _begin(self, rnd: Round, step: int) -> RoundInfo:
        t, me = self.tasklet, rnd.member(self.me)
        self.replica, self.waiting = me.replica, ""
        self.first_round_at = self.first_round_at or time.time()
        set_context(step=step)
        self._set_state("training")
        self.telemetry.begin_inner(step, self.rc.diloco.inner_steps, self.tools.device)
        t.begin(rnd, step, self.replica)
        # the coordinator's round for it (not the last plan's): now, or as soon as it arrives (_inner_step)
        self.training = step
        self.round_known = t.learn_round(self.heartbeat.plan, step)
        return t.round_info(rnd, step)

    def _inner_step(self, i: int, loss: float, seconds: float) -> None:
        rc, t = self.rc, self.tasklet
        self.round_known = self.round_known or t.learn_round(self.heartbeat.plan, self.training)
        self.telemetry.inner_step(i, loss, seconds, rc.train.batch_size, rc.train.batch_size * rc.model.seq_len)
        if not self.telemetry.first_step_logged:  # where the time to the first step went, once
            self.telemetry.first_step(self.joined.joined_at, {**self.phases, "to first round": self.first_round_at
                                      - self.ready_at, "of which state download": self.recovered_s})

    def _outer(self, step: int, inner_seconds: float, contribute: bool) -> None:
        self._set_state("syncing")
        t0, t = time.monotonic(), self.tasklet
        info = self._resolve(step)
        if info is None:
            log.warning("not a member of step %d after all; discarding its inner steps", step)
            return self._fail(step)
        held = t.states.current
        delta = pseudo_gradient(held.tensors["theta"], t.worker.theta()) if contribute else None
        try:
            done = outer_step(self.rc, t.allreduce, info, held, delta, inner_seconds, t.worker.meta())
        except IncompleteRound as err:
            log.warning("%s; recovering state from the other members", err)
            return self._fail(step)
        t.adopt(done.snapshot)
        self._committed(step, done, info, time.monotonic() - t0, contribute)

    def _committed(self, step: int, done: OuterResult, info: RoundInfo, sync_s: float, contribute: bool) -> None:
        """Report a committed step (``sync_s``: what it cost the training loop) and evaluate it when due."""
        t = self.tasklet
        self.telemetry.outer_step(done.stats, sync_s, done.mean_norm, info.epoch, t.stage, max(self.replica, 0),
                                  done.snapshot.hash, asdict(t.pipeline.traffic) if t.pipeline is not None else None)
        fault("outer.committed", step)
        every = self.rc.data.eval_every
        if every and step % every == 0 and contribute:
            value = t.worker.evaluate(step)
            if value is not None:
                self.telemetry.evaluated(step, value)
        self.heartbeat.poke()

    # ------------------------------------------------------------------ the overlapped outer step

    def _outer_overlapped(self, step: int, inner_seconds: float, start: torch.Tensor, interrupted: bool,
                          contribute: bool) -> None:
        """Land the step in flight, start ``step``'s all-reduce on a thread, and train on from
        ``theta_global - delta`` while it runs (see the module docstring)."""
        t = self.tasklet
        theta_local = t.worker.theta()
        if self.inflight is not None and not self._land():  # (its wait counts as the step before's)
            return  # the step before did not commit here: this phase trained from a state the swarm does not hold
        if interrupted:
            return
        t0 = time.monotonic()
        delta = pseudo_gradient(start, theta_local) if contribute else None
        if delta is not None and not all_finite(delta):
            log.error("local training produced NaN/Inf; contributing nothing to step %d", step)
            delta = None
        held = t.states.current
        theta = held.tensors["theta"]
        # the committed theta_global plus this member's own progress, until the average of it arrives
        t.worker.load(theta - delta if delta is not None else theta)
        info = self._resolve(step)
        if info is None:
            log.warning("not a member of step %d after all; discarding its inner steps", step)
            return self._fail(step)
        inf = InFlight(step, info, contributed=delta is not None)
        inf.thread = threading.Thread(target=self._run_outer, args=(inf, t, held, delta, inner_seconds, t.worker.meta()),
                                      name=f"outer-{step}", daemon=True)
        inf.thread.start()
        self.inflight = inf
        inf.blocked_s = time.monotonic() - t0

    def _run_outer(self, inf: InFlight, t: Tasklet, held: Snapshot, delta: torch.Tensor | None, inner_seconds: float,
                   meta: dict) -> None:
        """The outer step on its own thread: commit as soon as it is done, so the swarm sees the version."""
        try:
            done = outer_step(self.rc, t.allreduce, inf.info, held, delta, inner_seconds, meta)
        except IncompleteRound as err:
            inf.error = str(err)
            return
        except Exception as err:  # reported by the training loop when it lands the step
            log.exception("outer step %d failed", inf.step)
            inf.error = f"{type(err).__name__}: {err}"
            return
        t.states.commit(done.snapshot)
        t.expect_next()
        inf.done = done
        self.heartbeat.poke()

    def _land(self) -> bool:
        """Wait for the step in flight; on success the local model is the committed theta_global."""
        inf, self.inflight = self.inflight, None
        assert inf is not None and inf.thread is not None
        self._set_state("syncing")
        t0 = time.monotonic()
        inf.thread.join()
        if inf.done is None:
            log.warning("%s; recovering state from the other members", inf.error)
            self._fail(inf.step)
            return False
        self.tasklet.worker.load(inf.done.snapshot.tensors["theta"])
        set_context(step=inf.step)
        self._committed(inf.step, inf.done, inf.info, inf.blocked_s + time.monotonic() - t0, inf.contributed)
        return True

    def _held(self) -> Held:
        """The state held, as the follower should see it: with a step in flight, as if it had committed
        (so the next step trains at once); any other action then lands the step first."""
        held = self.tasklet.states.held(self.tasklet.stage)
        if self.inflight is None:
            return held
        return Held(self.inflight.step, "", held.stage, self.inflight.info.epoch, time.monotonic())

    def _over(self) -> bool:
        return self.over() or (self.inflight is not None and self.inflight.step >= self.rc.diloco.outer_steps)

    def _resolve(self, step: int) -> RoundInfo | None:
        """The round ``step`` belongs to, once the coordinator decided it (or ``plan_wait_s`` passed)."""
        plan = self.heartbeat.wait_plan(lambda p: p is not None and any(r.step == step for r in p.rounds),
                                        timeout=self.cfg.plan_wait_s)
        rnd = self.follower.resolve(plan, step, self.tasklet.stage, self.tasklet.states.current.hash)
        return self.tasklet.round_info(rnd, step) if rnd is not None else None

    def _fail(self, step: int) -> None:
        """This peer did not commit ``step``: drop the round's messages and recover before going on."""
        self.follower.failed(step, time.monotonic())
        self.tasklet.expect_next()

    def _recover(self, want: Recover) -> None:
        self._set_state("recovering")
        t, t0 = self.tasklet, time.monotonic()
        if want.version == 0:  # the run went back to theta_0: every peer builds it from the run's seed
            log.info("%s: starting over from theta_0", want.reason)
            self.tasklet = t.replace(t.stage)
            return
        own = t.states.previous(want.version, want.state_hash) if want.version is not None else None
        if own is not None:
            log.info("%s: back to this peer's own v%d", want.reason, own.version)
            return t.adopt(own)
        m = self.heartbeat.manifest
        snap = recover(self.tools, t.stage, t.worker.numel, want, t.states.current.version, self.heartbeat.plan,
                       Target(m.coordinator, m.coordinator_grpc) if m.coordinator_grpc else None)
        if snap is None:
            self.heartbeat.wait_plan(lambda p: False, timeout=0.25)
            return
        fault("recover.fetched", snap.version)
        log.info("%s: recovered v%d (%s)", want.reason, snap.version, snap.hash[:12])
        t.adopt(snap)
        self.recovered_s += time.monotonic() - t0

    # ------------------------------------------------------------------ the end of the run

    def over(self) -> bool:
        return self.stopping.is_set() or self.completed()

    def completed(self) -> bool:
        """All outer steps committed, or the coordinator ended the run."""
        return (self.tasklet.states.current.version >= self.rc.diloco.outer_steps
                or self.heartbeat.manifest.finished)

    def close(self) -> None:
        fault("shutdown.start")
        if self.inflight is not None and self.inflight.thread is not None:
            self.inflight.thread.join(timeout=5.0)  # stopping is set: its all-reduce gives up at once
        self._set_state("finished" if self.completed() else "left", poke=False)
        self.heartbeat.stop(goodbye=self.record())
        self.tools.close(self.tasklet)

    # ------------------------------------------------------------------ what this peer reports

    def _set_state(self, state: str, poke: bool = True) -> None:
        if self.telemetry.set_state(state) and poke:
            self.heartbeat.poke()

    def ping(self, request: pb.PingRequest) -> pb.PingReply:
        return self.telemetry.ping_reply(request, self.tasklet.states.current.version)

    def record(self) -> PeerRecord:
        t, tools = self.tasklet, self.tools
        snap = t.states.current
        return self.telemetry.record(
            address=tools.address, version=snap.version, state_hash=snap.hash, epoch=t.states.epoch,
            prev=t.states.prev_of(), stage=t.stage, replica=self.replica, device=tools.device, numel=t.worker.numel,
            loss_floor=tools.data.loss_floor, maddrs=tools.maddrs, traffic=tools.traffic.snapshot(),
            extras={"buffers": t.pipeline.footprint()} if t.pipeline is not None else {})
