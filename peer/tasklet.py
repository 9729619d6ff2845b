"""What a peer runs with: the run-wide toolbox, and the tasklet of the stage it holds.

A :class:`Toolbox` lives as long as the peer's part in the run: device, data, the gRPC client and
server, the heartbeat and the link prober. A :class:`Tasklet` is one stage's worth of state: the
stage worker (layers and inner optimizer), its all-reduce, its pipeline end and the committed
snapshots it serves. When the grid moves the peer to another stage, the tasklet is replaced whole.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import torch

from potluck.compression.int8 import Codec, make_codec
from potluck.compression.transfer import Snapshot, Target
from potluck.models import sizecheck, stage_bounds
from potluck.peer.devices.multidevice import Leader
from potluck.peer.follower import Recover
from potluck.peer.outer.diloco import outer_snapshot
from potluck.peer.outer.fragments import fragment_size
from potluck.peer.outer.recovery import recover
from potluck.peer.outer.spill import Spill
from potluck.peer.outer.states import States, epoch_of
from potluck.peer.pipeline.pipeline import Neighbour, Pipeline
from potluck.peer.reduce.allreduce import AllReduce, MemberAddr, RoundInfo
from potluck.peer.reduce.audit import Auditor
from potluck.peer.service import PeerService
from potluck.peer.swarm import admission
from potluck.peer.swarm.heartbeat import Heartbeat
from potluck.peer.swarm.joining import Joined, device_memory, pick_device
from potluck.peer.swarm.links import LinkConfig, LinkProber
from potluck.peer.training.data import Dataset
from potluck.peer.training.stage import StageWorker
from potluck.protos import potluck_pb2 as pb
from potluck.protos.config.runconfig import PeerConfig, RunConfig
from potluck.protos.config.section import ConfigError
from potluck.protos.net.certs import TlsIdentity
from potluck.protos.net.identity import Identity
from potluck.protos.net.transport import PeerClient, PeerServer, RelayedServer, Traffic
from potluck.protos.runtime.log import get_logger, set_context, short_id
from potluck.protos.runtime.stopping import stop_each
from potluck.protos.testkit.netem import NetEm
from potluck.protos.wire.limits import pipe_max_samples
from potluck.protos.wire.records import AuditReport, Manifest, PeerRecord, Plan, Round
from potluck.protos.wire.refusals import log_refusal

log = get_logger(__name__)


class CannotTakePart(ConfigError):
    """Admitted, this peer found it cannot train the run: its device holds less memory than the run needs a peer.
    It says so in its one record (state ``refused``), so the coordinator's page lists it with the reason."""

    def __init__(self, why: str, device: torch.device, memory_bytes: int) -> None:
        super().__init__(why)
        self.device, self.memory_bytes = device, memory_bytes

RENEW_CHECK_S = 60.0


@dataclass
class Toolbox:
    cfg: PeerConfig
    rc: RunConfig
    me: str
    sign: Callable[[bytes], bytes]  # this peer's Ed25519 signature (results it reduces are signed)
    stopping: threading.Event
    joined: Joined
    device: torch.device
    data: Dataset
    bounds: list[tuple[int, int]]
    netem: NetEm | None
    traffic: Traffic
    client: PeerClient
    codec: Codec
    links: LinkProber
    addresses: dict[str, str] = field(default_factory=dict)  # peer id -> gRPC address, from the rounds seen
    tls: TlsIdentity | None = None  # mutual TLS for gRPC, unless the run is --insecure
    heartbeat: Heartbeat | None = None
    server: PeerServer | RelayedServer | None = None
    address: str = ""
    maddrs: list[str] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    devices: Leader | None = None  # this peer's other processes, when torchrun started several (rank 0 speaks for them)
    on_audit: Callable[[AuditReport], None] = lambda report: None  # where this peer's audit reports go (its record)

    @classmethod
    def build(cls, cfg: PeerConfig, joined: Joined, identity: Identity, stopping: threading.Event,
              devices: Leader | None = None) -> Toolbox:
        rc = joined.config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if devices is not None:
            devices.setup(rc)  # refuses a run the group cannot train (pipelines; a batch that does not split)
        netem = NetEm.from_file(cfg.netem, region=cfg.region, peer=cfg.name) if cfg.netem else None
        traffic = Traffic()
        tls = joined.tls if joined.manifest.security == "mtls" else None
        client = PeerClient(traffic, netem, tls)
        me = identity.peer_id
        lc = rc.links
        links = LinkProber(client, me, rc.run_id, LinkConfig(
            period_s=lc.probe_period_s, max_probes_per_period=lc.probes_per_period, probe_bytes=lc.probe_bytes,
            budget_bytes_per_min=lc.budget_bytes_per_min))
        device = devices.device if devices is not None else pick_device(cfg.device)
        if devices is None:  # (a torchrun peer splits its batch over its devices: the estimate is per whole batch)
            memory = device_memory(device)
            try:
                sizecheck.fits(rc, device.type, memory, outer_on_disk=bool(cfg.outer_state_dir))  # one line, not a traceback
            except ConfigError as err:
                raise CannotTakePart(str(err), device, memory) from None
        return cls(cfg, rc, me, identity.sign, stopping, joined, device, Dataset(rc.data, rc.model),
                   stage_bounds(rc.model, rc.pipeline), netem, traffic, client, make_codec(rc.sync.codec, rc.sync.block_size),
                   links, tls=tls, maddrs=joined.node.maddrs[:4], devices=devices)

    def serve(self, tasklet: Callable[[], Tasklet], ping: Callable[[pb.PingRequest], pb.PingReply],
              record: Callable[[], PeerRecord]) -> Heartbeat:
        """Start answering RPCs, heartbeating and probing links; returns the heartbeat (the plan's reader)."""
        service = PeerService(self.rc.run_id, ping, lambda: tasklet().allreduce, lambda: tasklet().states.server,
                              lambda: tasklet().pipeline)
        if self.cfg.relay:  # behind a NAT: no port, calls come down a tunnel to the coordinator
            m = self.joined.manifest
            relayed = RelayedServer(service, self.traffic, self.client, m.coordinator_grpc, m.coordinator, self.rc.run_id,
                                    self.me, revoked=self.revoked, on_reject=log_refusal)
            self.server, self.address = relayed, relayed.address
            log.info("accepting no connections: calls to this peer are relayed by the coordinator at %s",
                     m.coordinator_grpc)
        else:
            self.server = PeerServer(service, self.traffic, host=self.cfg.host, port=self.cfg.port, netem=self.netem,
                                     tls=self.tls, revoked=self.revoked, on_reject=log_refusal)
            self.address = f"{self.joined.announce_host}:{self.server.port}"
        ms = self.rc.membership
        heartbeat = self.heartbeat = Heartbeat(self.joined.node, self.joined.manifest, record, ms.heartbeat_s,
                                               ms.heartbeat_timeout_s)
        # a rollback stops an abandoned epoch's all-reduce at once (read off the plan, not at its deadline)
        heartbeat.on_plan = lambda plan: tasklet().allreduce.supersede(*plan.newest_epoch())
        heartbeat.start()
        self.threads = [heartbeat]
        for target, name in ((self._measure_links, "links"), (self._keep_admitted, "admission")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self.threads.append(thread)
        return heartbeat

    def revoked(self, peer_id: str) -> bool:
        """Was ``peer_id`` evicted from the run (the coordinator's signed plan says so)?"""
        plan = self.heartbeat.plan if self.heartbeat is not None else None
        return plan is not None and peer_id in plan.revoked

    def _keep_admitted(self) -> None:
        """Re-ask for admission every minute (the coordinator renews certificates at half their life), and at
        once when the coordinator publishes a new manifest: a restarted coordinator holds no admission request
        (they are stored on its own DHT node) and ignores this peer's heartbeats until it has one. Adopt a
        renewed certificate when it comes."""
        j = self.joined
        asked_at, seen = time.monotonic(), j.manifest.seq
        while not self.stopping.wait(1.0):
            manifest = self.heartbeat.manifest if self.heartbeat is not None else j.manifest
            if manifest.seq == seen and time.monotonic() - asked_at < RENEW_CHECK_S:
                continue
            asked_at, seen = time.monotonic(), manifest.seq
            try:
                admission.request(j.node, j.manifest, self.me, j.tls, j.token_proof)
                admission.take(j.node, j.manifest, self.me, j.tls)
            except Exception as err:  # the coordinator may be away: the certificate lasts hours
                log.warning("could not renew admission (%s); the certificate is good until %s, then this peer is "
                            "refused", err, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(j.tls.not_after)) if j.tls is not None
                            else "ever (an insecure run)")

    def announce(self, numel: int, phases: dict[str, float]) -> None:
        rc = self.rc
        log.info("joined run %s as %s: gRPC %s, device %s%s, model %.2fM parameters%s, H=%d (%s)",
                 rc.run_id, short_id(self.me), self.address, self.device,
                 self._more_devices(), numel / 1e6,
                 f" in stage 0 of {rc.pipeline.stages}" if rc.pipeline.stages > 1 else "", rc.diloco.inner_steps,
                 ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))

    def _more_devices(self) -> str:
        n = self.devices.world - 1 if self.devices is not None else 0
        return f" and {n} more process{'es' if n > 1 else ''} (torchrun: one peer)" if n else ""

    def _measure_links(self) -> None:
        """Probe a few peers per period (bounded bytes) and publish the signed link report."""
        period = self.rc.links.probe_period_s
        node = self.joined.node
        while not self.stopping.wait(min(period, 2.0) if not self.links.report().links else period):
            try:
                records, _ = node.get_peers()
                peers = {pid: r.address for pid, r in records.items()
                         if pid != self.me and r.address and r.state not in ("left", "finished")}
                if peers:
                    self.links.probe_round(peers)
                    node.publish_links(self.links.report(), ttl=max(60.0, 3 * period))
            except Exception as err:  # measuring links must never take the peer down
                log.warning("measuring links failed (%s); placement uses the links this peer reported before, if any",
                            err)

    def ping_member(self, peer_id: str, timeout: float) -> pb.PingReply:
        request = pb.PingRequest(header=pb.Header(run_id=self.rc.run_id, sender=self.me), sent_at=time.time())
        return self.client.ping(self.addresses[peer_id], request, timeout, peer=peer_id)

    def close(self, tasklet: Tasklet) -> None:
        self.stopping.set()
        stop_each((lambda: self.server and self.server.stop(grace=0.5), tasklet.close, self.client.close,
                   self.joined.node.shutdown), "closing the peer")
        for thread in self.threads[1:]:
            thread.join(timeout=2.0)


@dataclass
class Tasklet:
    tools: Toolbox
    stage: int
    worker: StageWorker
    allreduce: AllReduce
    pipeline: Pipeline | None
    states: States
    auditor: Auditor
    fetched_base: Snapshot | None = None  # a group's base state this member did not hold (grouped averaging)
    expected: tuple[int, str | Future[str]] = (0, "")  # the (step, base hash) the all-reduce expects
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def build(cls, tools: Toolbox, stage: int) -> Tasklet:
        """Stage ``stage``'s layers at theta_0 (version 0); a running run then recovers its state."""
        rc = tools.rc
        pipeline = None
        if rc.pipeline.stages > 1:
            pipeline = Pipeline(run_id=rc.run_id, me=tools.me, stage=stage, stages=rc.pipeline.stages, model=rc.model,
                                cfg=rc.pipeline, client=tools.client, num_samples=tools.data.num_samples,
                                stopping=tools.stopping, on_transfer=tools.links.observe,
                                max_samples=pipe_max_samples(rc.train.batch_size, rc.pipeline.micro_batches,
                                                             rc.data.eval_samples), device=tools.device)
        worker = StageWorker(rc, stage, tools.bounds[stage], tools.device, tools.data, pipeline)
        if tools.devices is not None:
            tools.devices.attach(worker)  # the other processes build the same worker and hold its theta
        # grouped averaging averages theta and momentum (as differences from the group's base): twice the vector
        numel = worker.numel * (2 if rc.sync.group_size else 1)
        if rc.sync.fragments > 1:  # streaming outer steps: each all-reduces one fragment (zero-padded to m)
            numel = fragment_size(worker.numel, rc.sync.fragments, tools.codec.align)
        allreduce = AllReduce(run_id=rc.run_id, me=tools.me, numel=numel, codec=tools.codec, client=tools.client,
                              chunk_bytes=rc.sync.chunk_bytes, rpc_timeout=rc.sync.rpc_timeout_s,
                              ping=tools.ping_member, stopping=tools.stopping, sign=tools.sign,
                              clip_factor=rc.sync.clip_factor, reject_below=rc.sync.reject_below, pinned=worker.pinned,
                              quorum=rc.sync.quorum,
                              evidence_share=rc.sync.audit_fraction * (1 + rc.sync.second_audit))
        auditor = Auditor(rc.run_id, tools.me, tools.client, tools.codec, rc.sync.chunk_bytes, rc.sync.clip_factor,
                          rc.sync.reject_below, allreduce.inbox.held_result,
                          lambda a, inputs: allreduce.inbox.keep_evidence(a.step, a.epoch, a.shard, a.attempt, inputs),
                          lambda report: tools.on_audit(report), allreduce.inbox.own_input)
        theta0 = worker.theta()
        first = outer_snapshot(theta0, torch.zeros_like(theta0), 0, {**worker.meta(), "epoch": 0})
        spill = Spill(tools.cfg.outer_state_dir) if tools.cfg.outer_state_dir else None
        tasklet = cls(tools, stage, worker, allreduce, pipeline, States(rc.run_id, rc.sync.chunk_bytes, first, spill),
                      auditor)
        tasklet.expect_next()
        return tasklet

    def round_info(self, rnd: Round, step: int) -> RoundInfo:
        """What the all-reduce of ``step`` needs of ``rnd``: the members this one averages with (its group of
        its stage; the whole stage unless ``sync.group_size``) and the state they all start from."""
        self.tools.addresses.update({m.peer_id: m.address for m in rnd.members})  # whom the all-reduce may ping
        me = rnd.member(self.tools.me)
        cells = rnd.group_members(self.stage, me.group if me is not None else 0)
        members = tuple(MemberAddr(m.peer_id, m.address) for m in cells)
        owners = () if all(m.owns for m in cells) else tuple(m.peer_id for m in cells if m.owns)  # probation
        # the most work each may claim: its replica's share of the step (a round from before shares: unknown)
        given = rnd.handed(step, self.stage, me.group if me is not None else 0)
        handed = tuple(given[m.peer_id] for m in cells) if given else ()
        return RoundInfo(step=step, members=members, me=self.tools.me, base_hash=self.base_hash(rnd, step),
                         epoch=rnd.epoch, replicas=tuple(m.replica for m in cells), owners=owners, handed=handed,
                         group=me.group if me is not None else 0)

    def base_hash(self, rnd: Round, step: int) -> str:
        """The hash of the state this member's group starts ``step`` from: the state held, or with grouped
        averaging the base the round names for the group. A step run on an older round (the coordinator is
        away) keeps that round's groups: when its step has this step's parity, rows or diagonals, the step two
        before had them too, and their common state is the one before the held one (what the all-reduce
        expects by default); otherwise this member's group is the one it has just averaged with."""
        me = rnd.member(self.tools.me)
        if not self.tools.rc.sync.group_size or me is None:
            return self.states.current.hash
        if rnd.step == step:
            named = rnd.group_base(self.stage, me.group)
            return named.hash if named is not None and named.hash else self.states.current.hash
        prev = self.states.server.previous
        if rnd.step % 2 == step % 2 and prev is not None and prev.version == step - 2:
            return prev.hash
        return self.states.current.hash

    def base(self, base_hash: str) -> Snapshot | None:
        """The held state (newest, the one before it, or one fetched for a group) hashing to ``base_hash``."""
        return next((s for s in (self.states.current, self.states.server.previous, self.fetched_base)
                     if s is not None and s.hash == base_hash), None)

    def ready(self, info: RoundInfo) -> bool:
        """Have the all-reduce expect ``info``'s step from its base and know its members. False while it still
        expects another step (the step before is in flight, with ``diloco.overlap``)."""
        with self.lock:
            if self.expected[0] != info.step:
                return False
            held = self.expected[1]
            if (held if isinstance(held, str) else held.result()) != info.base_hash:  # a group's base, not the held
                self.allreduce.expect(info.step, info.base_hash, self.states.epoch)
                self.expected = (info.step, info.base_hash)
        return self.allreduce.inbox.set_round(info)

    def learn_round(self, plan: Plan | None, step: int) -> bool:
        """Once the coordinator's round for ``step`` is known (it may arrive while this tasklet trains on the
        last plan's), tell the all-reduce: members that finish sooner are checked against it at once, and a
        stranger is refused as one instead of held until the outer step. True if it was.
        The audits that rounds up to ``step`` give this peer start too (see :class:`Auditor`)."""
        self.auditor.start_for(plan, step, self.tools.addresses)
        rnd = plan.round_for(step) if plan is not None else None
        cell = rnd.member(self.tools.me) if rnd is not None and rnd.step == step else None
        if rnd is None or cell is None or cell.stage != self.stage:
            return False
        return self.ready(self.round_info(rnd, step))

    def fetch_base(self, plan: Plan | None, step: int, manifest: Manifest) -> None:
        """Grouped averaging: fetch the base state the round of ``step`` names for this member's group, if this
        member does not hold it (it joined, or its group changed with the membership), while the group serves it."""
        rnd = plan.round_for(step) if plan is not None else None
        cell = rnd.member(self.tools.me) if rnd is not None and rnd.step == step else None
        named = rnd.group_base(self.stage, cell.group) if rnd is not None and cell is not None else None
        if rnd is None or named is None or self.base(base_hash := self.base_hash(rnd, step)) is not None:
            return
        want = Recover(named.version, base_hash, f"the base state of group {named.group} in step {step}")
        if (snap := self.fetch(want, plan, manifest)) is not None:
            log.info("fetched v%d (%s): %s", snap.version, snap.hash[:12], want.reason)
            self.fetched_base = snap

    def fetch(self, want: Recover, plan: Plan | None, manifest: Manifest) -> Snapshot | None:
        """The state ``want`` names, from the members of the plan's rounds or the coordinator's checkpoint."""
        coordinator = Target(manifest.coordinator, manifest.coordinator_grpc) if manifest.coordinator_grpc else None
        return recover(self.tools, self.stage, self.worker.numel, want, self.states.current.version, plan, coordinator)

    def replace(self, stage: int) -> Tasklet:
        """A fresh tasklet of ``stage`` (at theta_0) in place of this one."""
        self.close()
        return Tasklet.build(self.tools, stage)

    def adopt(self, snap: Snapshot, local: torch.Tensor | None = None) -> None:
        """Hold ``snap`` as theta_global (committed here or recovered) and train on from it, or from ``local``
        (streaming outer steps: the fragments not synced go on from this member's own progress)."""
        self.worker.steps_done = int(snap.meta.get("inner_steps", self.worker.steps_done))  # (the meta records it)
        held = self.states.commit(replace(snap, meta={**self.worker.meta(), "epoch": epoch_of(snap)}))  # (hash may be under way)
        self.worker.load(held.tensors["theta"] if local is None else local, self.worker.steps_done)
        self.expect_next()
        set_context(step=snap.version)

    def begin(self, rnd: Round, step: int, replica: int) -> None:
        """Start ``step`` of ``rnd``: a pipeline end learns its neighbours in this replica."""
        if self.pipeline is None:
            return
        cells = {m.stage: m for m in rnd.members if m.replica == replica}
        prev, nxt = cells.get(self.stage - 1), cells.get(self.stage + 1)
        self.pipeline.begin_round(step, replica, Neighbour(prev.peer_id, prev.address) if prev else None,
                                  Neighbour(nxt.peer_id, nxt.address) if nxt else None, epoch=rnd.epoch)

    def expect_next(self) -> None:
        """Accept all-reduce messages for the step after the state held (and drop any others), computed from
        the state held or, with grouped averaging, from the one before it: the base the coordinator names
        for a group whose members averaged together two steps before (every group, while the membership
        holds; a round that names another is adopted when it arrives, :meth:`ready`). The hash may still be
        under way (see :class:`~potluck.compression.transfer.Snapshot`)."""
        with self.lock:
            current, prev = self.states.current, self.states.server.previous
            grouped = self.tools.rc.sync.group_size and prev is not None and prev.version == current.version - 1
            base = prev.digest if grouped and prev is not None else current.digest
            self.allreduce.expect(current.version + 1, base, self.states.epoch)
            self.expected = (current.version + 1, base)
            if self.fetched_base is not None and self.fetched_base.version < current.version - 1:
                self.fetched_base = None  # no group starts from it any more

    def close(self) -> None:
        self.allreduce.close()
        self.auditor.close()
        if self.pipeline is not None:
            self.pipeline.close()
