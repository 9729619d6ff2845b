"""The peer daemon: join a run, then follow its rounds until it ends.

:meth:`Session.train` is the algorithm box of the DiLoCo paper, one call deeper for each line::

    while the run is not over:
        act on the plan: wait, switch stage or recover state      (follower)
        inner AdamW steps, as many as fit the round's window (H at most) -> theta_local   (stage worker, window)
        delta <- theta_global - theta_local
        mean  <- all-reduce(delta, weighed by its samples) among the stage's replicas   (outer step)
        theta_global <- Nesterov(theta_global, mean); theta_local <- theta_global

With ``diloco.overlap`` the outer step of ``k`` runs while the inner steps of ``k + 1`` train
(:mod:`potluck.peer.outer.outersteps`).

Membership comes from the coordinator's plan (one explicit round per outer step, read through the
DHT); the data path (all-reduce, pipeline, state transfer) is peer-to-peer gRPC, so peers keep
training on the last plan while the coordinator is away.
"""

from __future__ import annotations

import threading
import time

from potluck.peer.devices.multidevice import Leader
from potluck.peer.follower import (
    PLACE,
    CannotGoOn,
    Finish,
    Follower,
    GiveUp,
    Recover,
    Switch,
    Train,
    Wait,
    boundary_in,
)
from potluck.peer.outer.outersteps import OuterSteps
from potluck.peer.outer.states import epoch_of
from potluck.peer.pipeline.piperound import PipelineBroken
from potluck.peer.swarm.joining import Joined, Stopped, join
from potluck.peer.swarm.keyfile import load_identity
from potluck.peer.swarm.telemetry import Telemetry
from potluck.peer.tasklet import CannotTakePart, Tasklet, Toolbox
from potluck.peer.training.data import DataError
from potluck.peer.training.phases import InnerPhases
from potluck.protos import potluck_pb2 as pb
from potluck.protos.config.runconfig import PeerConfig
from potluck.protos.config.section import ConfigError
from potluck.protos.net.errors import CannotBind
from potluck.protos.net.identity import Identity
from potluck.protos.net.swarm import JoinError
from potluck.protos.runtime.heap import Heap
from potluck.protos.runtime.log import get_logger, set_context
from potluck.protos.runtime.warmup import warm_up
from potluck.protos.testkit.faults import fault
from potluck.protos.testkit.netem import NetemTopologyError
from potluck.protos.wire.records import PeerRecord, Round
from potluck.protos.wire.states import PeerState

log = get_logger(__name__)


class Peer:
    """A volunteer's daemon: ``run()`` joins, trains until the run ends or ``stopping`` is set, leaves."""

    def __init__(self, cfg: PeerConfig, progress: str = "auto", devices: Leader | None = None,
                 identity: Identity | None = None) -> None:
        self.cfg, self.devices = cfg, devices  # devices: rank 0 of a torchrun peer speaks for all its processes
        self.identity = identity or load_identity(cfg.identity)  # (the CLI claims it before the heavy imports)
        self.id = self.identity.peer_id
        self.stopping = threading.Event()
        self.telemetry = Telemetry(self.id, cfg.name, time.time(), progress)
        set_context(role="peer", peer_id=self.id)

    def run(self) -> int:
        """Returns a process exit code: 0 when the run ended or we were asked to stop, 2 on bad input, 3 on a
        failure that cannot heal (its reason is the goodbye record's ``error``: the coordinator's page shows it)."""
        # torch's optimizers import torch._dynamo on first use (seconds of CPU): do it while we wait on the network
        warm_up("torch._dynamo")
        session: Session | None = None
        joined: Joined | None = None
        try:
            joined = join(self.cfg, self.identity, self.stopping)
            session = Session(self.cfg, joined, Toolbox.build(self.cfg, joined, self.identity, self.stopping, self.devices),
                              self.telemetry)
            session.train()
            return 0
        except Stopped:
            log.info("stopped before joining the run")
            return 0
        except CannotTakePart as err:
            log.error("%s", err)
            assert joined is not None  # (raised once admitted: its record is listed, with why)
            self._say_refused(joined, err)
            return 2
        except (JoinError, ConfigError, NetemTopologyError, DataError, CannotBind) as err:
            log.error("%s", err)
            return 2
        except (PipelineBroken, CannotGoOn) as err:
            log.error("this peer cannot go on: %s", err)
            self.telemetry.error = str(err)
            return 3
        finally:
            self.stopping.set()
            if session is not None:
                session.close()
            elif joined is not None:
                joined.node.shutdown()


    def _say_refused(self, joined: Joined, err: CannotTakePart) -> None:
        """One record, state ``refused``, so the run's page shows this peer and why it cannot take part."""
        rec = self.telemetry.refusal(err.device, err.memory_bytes, str(err))
        ttl = 2 * joined.config.membership.heartbeat_timeout_s
        try:
            if not joined.node.publish_peer(rec, ttl=ttl):
                log.warning("could not tell the coordinator why: its page will not list this peer")
        except Exception as e:  # (a DHT that fails here changes nothing: the peer stops either way)
            log.warning("could not tell the coordinator why (%s): its page will not list this peer", e)


class Session:
    """One peer's part in one run, from admission to the end."""

    def __init__(self, cfg: PeerConfig, joined: Joined, tools: Toolbox, telemetry: Telemetry) -> None:
        self.cfg, self.joined, self.tools, self.telemetry = cfg, joined, tools, telemetry
        self.rc, self.me, self.stopping = tools.rc, tools.me, tools.stopping
        self.follower = Follower(self.me, pipelined=self.rc.pipeline.stages > 1, plan_wait_s=cfg.plan_wait_s,
                                 coordinator_timeout_s=cfg.coordinator_timeout_s,
                                 started_at=joined.joined_at - joined.phases["dht"])
        tools.on_audit = telemetry.audited  # audit verdicts ride on this peer's heartbeats
        self.tasklet = Tasklet.build(tools, stage=0)
        self.replica, self.waiting, self.waiting_said = -1, "", 0.0
        self.round_known = False  # the all-reduce knows the coordinator's round for the step in training
        self.training = 0  # the step whose inner phase runs (with diloco.overlap, the one before may still sync)
        self.inner = InnerPhases(self.rc, self.me, telemetry)  # as many inner steps as fit each round's window
        self.heartbeat = tools.serve(lambda: self.tasklet, self.ping, self.record)
        self.phases = {**joined.phases, "setup": time.time() - joined.joined_at - joined.phases["manifest"]}
        self.ready_at, self.first_round_at, self.recovered_s = time.time(), 0.0, 0.0
        self.outer = OuterSteps(self)
        tools.announce(self.tasklet.worker.numel, self.phases)
        # the cycle collector off the steps' critical path: what the peer holds once set up (torch, hivemind, gRPC,
        # the model: ~200,000 objects) is frozen, and full collections run between steps (_begin), not wherever an
        # allocation in the all-reduce's threads happened to trigger one (a full pass walked all of it: 39 % of the
        # busy CPU of benchmarks/allreduce_vs_hivemind.py's members); the C allocator's free pages are not given back
        # after them: the next step needs them again (potluck.protos.runtime.heap.hold)
        self.heap = Heap(give_back=False)
        self.heap.settle(time.monotonic())

    def train(self) -> None:
        while True:
            action = self.follower.next(self.heartbeat.plan, self.outer.held(), time.monotonic(), self.outer.over(),
                                        self.heartbeat.coordinator_silent_s())
            if self.outer.pending(action):
                self.outer.land()  # anything but training the next step waits for the step in flight, then decides again
                continue
            match action:
                case Finish():
                    break
                case GiveUp(reason=why):
                    raise CannotGoOn(why)
                case Wait() as wait:
                    self._wait(wait)
                case Switch(stage=stage):
                    log.info("assigned to stage %d (held stage %d): fetching its state", stage, self.tasklet.stage)
                    self.tasklet = self.tasklet.replace(stage)
                case Recover() as want:
                    self._recover(want)
                case Train(round=rnd, step=step):
                    self._begin(rnd, step)
                    start = self.tasklet.worker.start_point() if self.rc.diloco.overlap else None
                    phase = self.inner.run(self.tasklet, rnd, step, self.replica, self.stopping, self._inner_step)
                    if self._found_lie(step):
                        continue  # the step before holds a lie: commit nothing on it, the coordinator rolls it back
                    self.outer.after_phase(step, phase.seconds, start, phase.interrupted,
                                           not phase.stalled and phase.steps > 0, phase.steps * self.rc.train.batch_size)
        if self.completed() and not self.stopping.is_set():
            self.set_state(PeerState.FINISHED)  # serve the final state until the coordinator has seen it
            self.heartbeat.await_confirmation(self.tasklet.states.current.version, self.stopping)
        log.info("done at version %d", self.tasklet.states.current.version)

    # ------------------------------------------------------------------ the steps of the loop

    def _wait(self, wait: Wait) -> None:
        now = time.time()
        if wait.reason != self.waiting or (wait.reason == PLACE and now - self.waiting_said > 60):
            eta = boundary_in(self.heartbeat.plan, now) if wait.reason == PLACE else None
            log.info("%s%s", wait.reason, "" if eta is None else f" (in about {eta:.0f} s, at the run's pace)")
            self.waiting, self.waiting_said = wait.reason, now
        self.set_state(PeerState.WAITING)
        seq = self.heartbeat.plan.seq if self.heartbeat.plan else -1
        self.heartbeat.wait_plan(lambda p: p is not None and p.seq > seq, timeout=wait.seconds)

    def _begin(self, rnd: Round, step: int) -> None:
        t, me = self.tasklet, rnd.member(self.me)
        assert me is not None  # (a Train's round is one this peer is a member of: Follower.next)
        self.replica, self.waiting = me.replica, ""
        self.first_round_at = self.first_round_at or time.time()
        if self.heap.due(time.monotonic()):
            self.heap.collect(time.monotonic())
        set_context(step=step)
        self.set_state(PeerState.TRAINING)
        self.telemetry.begin_inner(step, self.rc.diloco.inner_steps, self.tools.device)
        t.begin(rnd, step, self.replica)
        # the coordinator's round for it (not the last plan's): now, or as soon as it arrives (_inner_step)
        self.training, self.round_known = step, False
        self._learn_round()

    def _found_lie(self, step: int) -> bool:
        """Did this peer's audit of the step before find a lie? Then this step is not committed (see Auditor)."""
        (a := self.tasklet.auditor).start_for(self.heartbeat.plan, step, self.tools.addresses)  # (a round known late)
        if lied := a.lied(self.rc.sync.deadline_floor_s):
            self.set_state(PeerState.WAITING)
            a.await_ruling(self.heartbeat, step, 2 * self.rc.membership.round_timeout_floor_s)
        return lied

    def _inner_step(self, i: int, loss: float, seconds: float) -> None:
        rc = self.rc
        self._learn_round()
        self.telemetry.inner_step(i, loss, seconds, rc.train.batch_size, rc.train.batch_size * rc.model.seq_len)
        if not self.telemetry.first_step_logged:  # where the time to the first step went, once
            self.telemetry.first_step(self.joined.joined_at, {**self.phases, "to first round": self.first_round_at
                                      - self.ready_at, "of which state download": self.recovered_s})

    def _learn_round(self) -> None:
        """Once the coordinator's round for the step in training is known (at its start, or while it trains on
        the last plan's), tell the all-reduce; with grouped averaging, fetch the group's base if not held."""
        if self.round_known:
            return
        t, plan = self.tasklet, self.heartbeat.plan
        self.round_known = t.learn_round(plan, self.training)
        if self.round_known and self.rc.sync.group_size:
            t.fetch_base(plan, self.training, self.heartbeat.manifest)

    def _recover(self, want: Recover) -> None:
        self.set_state(PeerState.RECOVERING)
        t, t0 = self.tasklet, time.monotonic()
        if want.version == 0:  # the run went back to theta_0: every peer builds it from the run's seed
            log.info("%s: starting over from theta_0", want.reason)
            self.tasklet = t.replace(t.stage)
            return
        own = t.states.previous(want.version, want.state_hash) if want.version is not None else None
        if own is not None:
            log.info("%s: back to this peer's own v%d", want.reason, own.version)
            return t.adopt(own)
        snap = t.fetch(want, self.heartbeat.plan, self.heartbeat.manifest)
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
        self.outer.close()
        self.set_state(PeerState.FAILED if self.telemetry.error else PeerState.FINISHED if self.completed()
                       else PeerState.LEFT, poke=False)
        self.heartbeat.stop(goodbye=self.record())
        self.tools.close(self.tasklet)

    # ------------------------------------------------------------------ what this peer reports

    def set_state(self, state: PeerState, poke: bool = True) -> None:
        if self.telemetry.set_state(state) and poke:
            self.heartbeat.poke()

    def ping(self, request: pb.PingRequest) -> pb.PingReply:
        self.inner.heard(request)  # (a member it averages with may say it trained its whole phase)
        if request.abstain:  # (or that it has nothing to contribute: its owners need not wait for it)
            self.tasklet.allreduce.inbox.abstains(request.header)
        held = self.tasklet.states.current
        return self.telemetry.ping_reply(request, held.version, epoch_of(held))

    def record(self) -> PeerRecord:
        t, tools = self.tasklet, self.tools
        snap = t.states.current
        return self.telemetry.record(
            address=tools.address, version=snap.version, state_hash=snap.hash, epoch=t.states.epoch,
            prev=t.states.prev_of(), stage=t.stage, replica=self.replica, device=tools.device, numel=t.worker.numel,
            loss_floor=tools.data.loss_floor, maddrs=tools.maddrs, traffic=tools.traffic, busy_s=t.worker.busy_s,
            step_s=self.inner.pace.step_s(),
            extras={**({"buffers": t.pipeline.footprint()} if t.pipeline is not None else {}),
                    **({"devices": tools.devices.world} if tools.devices is not None else {})})
