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
from dataclasses import dataclass, field, replace

import torch

from potluck.compression.int8 import Codec, make_codec
from potluck.compression.transfer import Snapshot
from potluck.models import sizecheck, stage_bounds
from potluck.peer import admission
from potluck.peer.allreduce import AllReduce, MemberAddr, RoundInfo
from potluck.peer.audit import Auditor
from potluck.peer.data import Dataset
from potluck.peer.diloco import outer_snapshot
from potluck.peer.heartbeat import Heartbeat
from potluck.peer.joining import Joined, device_memory, pick_device
from potluck.peer.links import LinkConfig, LinkProber
from potluck.peer.multidevice import Leader
from potluck.peer.pipeline import Neighbour, Pipeline
from potluck.peer.service import PeerService
from potluck.peer.stage import StageWorker
from potluck.peer.states import States
from potluck.protos import potluck_pb2 as pb
from potluck.protos.certs import TlsIdentity
from potluck.protos.config import PeerConfig, RunConfig
from potluck.protos.identity import Identity
from potluck.protos.limits import pipe_max_samples
from potluck.protos.log import get_logger, set_context, short_id
from potluck.protos.netem import NetEm
from potluck.protos.records import AuditReport, PeerRecord, Plan, Round
from potluck.protos.refusals import log_refusal
from potluck.protos.transport import PeerClient, PeerServer, RelayedServer, Traffic

log = get_logger(__name__)

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
            sizecheck.fits(rc, device.type, device_memory(device))  # one line, not the allocator's traceback
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
        m = self.rc.membership
        heartbeat = self.heartbeat = Heartbeat(self.joined.node, self.joined.manifest, record, m.heartbeat_s,
                                               m.heartbeat_timeout_s)
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
        """Re-ask for admission every minute (a restarted coordinator re-admits from these requests, and
        renews certificates at half their life) and adopt a renewed certificate when it comes."""
        j = self.joined
        while not self.stopping.wait(RENEW_CHECK_S):
            try:
                admission.request(j.node, j.manifest, self.me, j.tls, j.token_proof)
                admission.take(j.node, j.manifest, self.me, j.tls)
            except Exception as err:  # the coordinator may be away: the certificate lasts hours
                log.debug("admission refresh failed: %s", err)

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
                log.debug("link measurement round failed: %s", err)

    def ping_member(self, peer_id: str, timeout: float) -> pb.PingReply:
        request = pb.PingRequest(header=pb.Header(run_id=self.rc.run_id, sender=self.me), sent_at=time.time())
        return self.client.ping(self.addresses[peer_id], request, timeout, peer=peer_id)

    def close(self, tasklet: Tasklet) -> None:
        self.stopping.set()
        for stop in (lambda: self.server and self.server.stop(grace=0.5), tasklet.close, self.client.close,
                     self.joined.node.shutdown):
            try:
                stop()
            except Exception as err:  # everything else must still be stopped
                log.debug("closing: %s", err)
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
        allreduce = AllReduce(run_id=rc.run_id, me=tools.me, numel=worker.numel, codec=tools.codec, client=tools.client,
                              chunk_bytes=rc.sync.chunk_bytes, rpc_timeout=rc.sync.rpc_timeout_s,
                              ping=tools.ping_member, stopping=tools.stopping, sign=tools.sign,
                              clip_factor=rc.sync.clip_factor, reject_below=rc.sync.reject_below, pinned=worker.pinned)
        auditor = Auditor(rc.run_id, tools.me, tools.client, tools.codec, rc.sync.chunk_bytes, rc.sync.clip_factor,
                          rc.sync.reject_below, allreduce.held_result,
                          lambda a, inputs: allreduce.keep_evidence(a.step, a.epoch, a.shard, a.attempt, inputs),
                          lambda report: tools.on_audit(report), allreduce.own_input)
        theta0 = worker.theta()
        first = outer_snapshot(theta0, torch.zeros_like(theta0), 0, {**worker.meta(), "epoch": 0})
        tasklet = cls(tools, stage, worker, allreduce, pipeline, States(rc.run_id, rc.sync.chunk_bytes, first), auditor)
        tasklet.expect_next()
        return tasklet

    def round_info(self, rnd: Round, step: int) -> RoundInfo:
        """What the all-reduce of ``step`` needs of ``rnd``: this stage's members, from the state held."""
        self.tools.addresses.update({m.peer_id: m.address for m in rnd.members})  # whom the all-reduce may ping
        cells = rnd.stage_members(self.stage)
        members = tuple(MemberAddr(m.peer_id, m.address) for m in cells)
        owners = () if all(m.owns for m in cells) else tuple(m.peer_id for m in cells if m.owns)  # probation
        return RoundInfo(step=step, members=members, me=self.tools.me, base_hash=self.states.current.hash,
                         epoch=rnd.epoch, replicas=tuple(m.replica for m in cells), owners=owners)

    def learn_round(self, plan: Plan | None, step: int) -> bool:
        """Once the coordinator's round for ``step`` is known (it may arrive while this tasklet trains on the
        last plan's), tell the all-reduce: members that finish sooner are checked against it at once, and a
        stranger is refused as one instead of held until the outer step. True if it was."""
        rnd = plan.round_for(step) if plan is not None else None
        cell = rnd.member(self.tools.me) if rnd is not None and rnd.step == step else None
        if rnd is None or cell is None or cell.stage != self.stage:
            return False
        return self.allreduce.set_round(self.round_info(rnd, step))

    def replace(self, stage: int) -> Tasklet:
        """A fresh tasklet of ``stage`` (at theta_0) in place of this one."""
        self.close()
        return Tasklet.build(self.tools, stage)

    def adopt(self, snap: Snapshot) -> None:
        """Hold ``snap`` as theta_global (committed here or recovered) and train on from it."""
        self.worker.load(snap.tensors["theta"], int(snap.meta.get("inner_steps", self.worker.steps_done)))
        epoch = int(snap.meta.get("epoch", 0))
        self.states.commit(replace(snap, meta={**self.worker.meta(), "epoch": epoch}))  # (its hash may still be under way)
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
        """Accept all-reduce messages for the step after the state held (and drop any others)."""
        current = self.states.current
        self.allreduce.expect(current.version + 1, current.digest, self.states.epoch)

    def close(self) -> None:
        self.allreduce.close()
        self.auditor.close()
        if self.pipeline is not None:
            self.pipeline.close()
