"""The peer daemon: join the swarm, then DiLoCo until the run ends.

``Peer.run`` is the algorithm box of the DiLoCo paper, one call deeper for each line::

    while the run is not over:
        round <- next round this peer belongs to   (admission; state recovery if behind)
        H inner AdamW steps on this peer's shard    (theta_local)
        delta <- theta_global - theta_local
        mean  <- all-reduce(delta) among the round's members
        theta_global <- Nesterov(theta_global, mean);  theta_local <- theta_global

Membership comes from the coordinator's plan (one explicit round per outer step, read through the
DHT); the data path (all-reduce, state transfer) is peer-to-peer gRPC, so peers keep training on
the last plan when the coordinator is away.
"""

from __future__ import annotations

import importlib
import math
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass

import grpc
import torch

from potluck import __version__
from potluck.compression.int8 import make_codec
from potluck.compression.transfer import (
    Snapshot,
    SnapshotServer,
    SnapshotUnavailable,
    fetch_snapshot,
    probe_sources,
)
from potluck.peer.allreduce import AllReduce, AllReduceStats, IncompleteRound, MemberAddr, RoundInfo
from potluck.peer.data import Dataset, ShardSampler
from potluck.peer.diloco import flatten_params, load_flat, nesterov_step, outer_snapshot
from potluck.peer.heartbeat import Heartbeat
from potluck.peer.links import LinkConfig, LinkProber
from potluck.peer.model import build_layers, forward_layers, lm_loss
from potluck.peer.pipeline import Neighbour, Pipeline, PipelineStall, stage_bounds
from potluck.protos import potluck_pb2 as pb
from potluck.protos.config import ConfigError, PeerConfig, RunConfig, known_fields_only, parse_config
from potluck.protos.identity import Identity
from potluck.protos.log import get_logger, set_context, short_id
from potluck.protos.netem import NetEm, TopologyError
from potluck.protos.records import Manifest, PeerRecord, Plan, RecordError, Round, next_seq
from potluck.protos.swarm import (
    JoinError,
    SwarmNode,
    guess_reachable_host,
    host_of_multiaddr,
    parse_join_address,
)
from potluck.protos.transport import PeerClient, PeerServer, Rejected, Traffic

log = get_logger(__name__)


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {choice!r} requested but torch sees no CUDA device")
    return torch.device(choice)


@dataclass
class Progress:
    """What this peer reports about itself (heartbeat record, Ping replies, logs)."""

    state: str = "joining"
    inner_step: int = 0
    loss: float | None = None
    eval_loss: float | None = None
    eval_version: int = -1
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    tokens_total: int = 0
    step_time_s: float = 0.0
    last_outer_s: float = 0.0
    last_outer_bytes: int = 0
    outer_wait_s: float = 0.0
    compute_s: float = 0.0
    sync_s: float = 0.0
    last_pipe: dict | None = None  # pipeline bytes of the last outer step, by kind (and fp32 equivalents)


class Peer:
    def __init__(self, cfg: PeerConfig) -> None:
        self.cfg = cfg
        self.identity = Identity.generate()
        self.id = self.identity.peer_id
        self.stopping = threading.Event()
        self.progress = Progress()
        self.traffic = Traffic()
        self.started_at = time.time()
        self.failed_step = 0  # a round this peer could not complete; it must recover past it
        self.failed_at = 0.0
        # where the time to the first training step went (logged once, see _log_first_step)
        self.first_round_at: float | None = None
        self.recovered_s = 0.0
        self._first_step_logged = False
        self._pipe_before: dict[str, int] = {}
        set_context(role="peer", peer_id=self.id)

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> int:
        """Train until the run ends or a signal stops us; returns a process exit code."""
        try:
            self.start()
            while not self.finished():
                info = self.next_round()
                if info is None:
                    break
                if not self.inner_phase(info):
                    continue
                self.outer_step(info.step)
            if self.completed() and not self.stopping.is_set():
                self._await_final_checkpoint()
            log.info("done at version %d", self.snapshot.version if hasattr(self, "snapshot") else 0)
            return 0
        except (JoinError, ConfigError, TopologyError) as err:
            log.error("%s", err)
            return 2
        finally:
            self.stop()

    def start(self) -> None:
        t_start = time.time()
        # torch's optimizers import torch._dynamo on first use (seconds of CPU); do it while we
        # wait on the network (DHT, admission, state download) rather than before the first step
        threading.Thread(target=importlib.import_module, args=("torch._dynamo",), name="warm-up", daemon=True).start()
        self.phases: dict[str, float] = {"imports": t_start - _process_started_at()}
        join, coordinator = parse_join_address(self.cfg.join)
        announce = self.cfg.announce_host or guess_reachable_host(host_of_multiaddr(join))
        self.node = SwarmNode(
            self.identity,
            initial_peers=[join],
            host=self.cfg.host,
            port=self.cfg.dht_port,
            announce_host=announce,
            startup_timeout=self.cfg.startup_timeout_s,
            client_mode=self.cfg.dht_client,
        )
        self.joined_at = time.time()
        self.phases["dht"] = self.joined_at - t_start
        manifest = self._await_manifest(coordinator)
        self.phases["manifest"] = time.time() - self.joined_at
        self.manifest = manifest
        self.run_cfg = self._config_from(manifest)
        self.run_id = manifest.run_id
        rc = self.run_cfg
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        self.device = pick_device(self.cfg.device)

        self.data = Dataset(rc.data, rc.model)
        self.sampler: ShardSampler | None = None
        self.total_inner_steps = 0
        self.bounds = stage_bounds(rc.model, rc.pipeline)
        self.netem = NetEm.from_file(self.cfg.netem, region=self.cfg.region, peer=self.cfg.name) if self.cfg.netem else None
        self.client = PeerClient(self.traffic, self.netem)
        self.codec = make_codec(rc.sync.codec, rc.sync.block_size)
        self.snapshots = SnapshotServer(self.run_id, rc.sync.chunk_bytes)
        self.pipeline: Pipeline | None = None
        self.replica = -1
        self.stalled = ""
        self._enter_stage(0)
        self.server = PeerServer(self, self.traffic, host=self.cfg.host, port=self.cfg.port, netem=self.netem)
        self.address = f"{announce}:{self.server.port}"
        self._addresses: dict[str, str] = {}
        self.heartbeat = Heartbeat(
            self.node, manifest, self.record, rc.membership.heartbeat_s, rc.membership.heartbeat_timeout_s
        )
        self.heartbeat.start()
        lc = rc.links
        self.links = LinkProber(self.client, self.id, self.run_id, LinkConfig(
            period_s=lc.probe_period_s, max_probes_per_period=lc.probes_per_period, probe_bytes=lc.probe_bytes,
            budget_bytes_per_min=lc.budget_bytes_per_min))
        self._links_thread = threading.Thread(target=self._measure_links, name="links", daemon=True)
        self._links_thread.start()
        self.phases["setup"] = time.time() - t_start - self.phases["dht"] - self.phases["manifest"]
        self.ready_at = time.time()
        log.info(
            "joined run %s as %s: gRPC %s, device %s, model %.2fM parameters%s, H=%d (%s)",
            self.run_id, short_id(self.id), self.address, self.device, self.numel / 1e6,
            f" in stage 0 of {rc.pipeline.stages}" if rc.pipeline.stages > 1 else "", rc.diloco.inner_steps,
            ", ".join(f"{k} {v:.1f} s" for k, v in self.phases.items()),
        )

    def _measure_links(self) -> None:
        """Probe a few peers per period (bounded bytes) and publish the signed link report."""
        period = self.run_cfg.links.probe_period_s
        while not self.stopping.wait(min(period, 2.0) if not self.links.report().links else period):
            try:
                records, _ = self.node.get_peers(self.run_id)
                peers = {pid: r.address for pid, r in records.items()
                         if pid != self.id and r.address and r.state not in ("left", "finished")}
                if peers:
                    self.links.probe_round(peers)
                    self.node.publish_links(self.run_id, self.links.report(), ttl=max(60.0, 3 * period))
            except Exception as err:  # measuring links must never take the peer down
                log.debug("link measurement round failed: %s", err)

    def _enter_stage(self, stage: int) -> None:
        """Hold stage ``stage``'s layers, from theta_0 (version 0); a running run then recovers them."""
        rc = self.run_cfg
        start, stop = self.bounds[stage]
        self.stage = stage
        self.layers = build_layers(rc.model, rc.train.seed, start, stop).to(self.device)
        self.params = list(self.layers.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.optimizer: torch.optim.Optimizer | None = None  # built on the first inner step (see _warm_up)
        old = getattr(self, "allreduce", None)
        self.allreduce = AllReduce(
            run_id=self.run_id, me=self.id, numel=self.numel, codec=self.codec, client=self.client,
            chunk_bytes=rc.sync.chunk_bytes, rpc_timeout=rc.sync.rpc_timeout_s, ping=self._ping_member,
            stopping=self.stopping,
        )
        if old is not None:
            old.close()
        if self.pipeline is not None:
            self.pipeline.close()
        self.pipeline = None
        if rc.pipeline.stages > 1:
            self.pipeline = Pipeline(
                run_id=self.run_id, me=self.id, stage=stage, stages=rc.pipeline.stages, model=rc.model,
                cfg=rc.pipeline, client=self.client, num_samples=self.data.num_samples, stopping=self.stopping,
                on_transfer=lambda pid, n, s: self.links.observe(pid, n, s) if hasattr(self, "links") else None,
            )
        theta0 = flatten_params(self.params)
        self._commit(outer_snapshot(theta0, torch.zeros_like(theta0), 0, self._snapshot_meta()))

    def stop(self) -> None:
        completed = self.completed()
        self.stopping.set()
        hb = getattr(self, "heartbeat", None)
        if hb is not None:
            self.progress.state = "finished" if completed else "left"
            hb.stop(goodbye=self.record())
        for name in ("server", "allreduce", "pipeline", "client", "node"):
            obj = getattr(self, name, None)
            if obj is None:
                continue
            if name == "server":
                obj.stop(grace=0.5)
            elif name == "node":
                obj.shutdown()
            else:
                obj.close()

    def install_signal_handlers(self) -> None:
        def handler(signum: int, frame: object) -> None:
            log.info("received signal %d: leaving the run", signum)
            self.stopping.set()

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    def finished(self) -> bool:
        return self.stopping.is_set() or self.completed()

    def completed(self) -> bool:
        """The run is over for this peer: all outer steps committed, or the coordinator ended the run."""
        snap = getattr(self, "snapshot", None)
        if snap is None:
            return False
        hb = getattr(self, "heartbeat", None)
        return snap.version >= self.run_cfg.diloco.outer_steps or (hb is not None and hb.manifest.finished)

    def _await_final_checkpoint(self, timeout: float = 30.0) -> None:
        """Keep announcing and serving the final state until the coordinator has seen it: the run
        is marked finished (so every member's final hash is in the history) and, if the run
        checkpoints, the final checkpoint is written. Gives up after ``timeout``."""
        self._set_state("finished")
        version = self.snapshot.version
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stopping.is_set():
            m = self.heartbeat.manifest
            if m.finished and (not m.checkpoint_every or m.checkpoint_version >= version):
                return
            self.heartbeat.wait_plan(lambda p: False, timeout=0.2)
        if not self.stopping.is_set():
            log.warning("the coordinator did not confirm the end of the run (v%d) within %.0f s; leaving anyway",
                        version, timeout)

    # ------------------------------------------------------------------ joining

    def _await_manifest(self, coordinator: str) -> Manifest:
        deadline = time.monotonic() + self.cfg.join_timeout_s
        last_err = "no manifest in the DHT yet"
        while time.monotonic() < deadline and not self.stopping.is_set():
            try:
                m = self.node.get_manifest(coordinator)
                if m is not None:
                    return m
            except RecordError as err:
                last_err = str(err)
            time.sleep(0.2)
        raise JoinError(
            f"found no valid run manifest from coordinator {short_id(coordinator)} in {self.cfg.join_timeout_s:.0f} s "
            f"({last_err}); is the coordinator running?"
        )

    @staticmethod
    def _config_from(manifest: Manifest) -> RunConfig:
        data, dropped = known_fields_only(RunConfig, dict(manifest.config))
        if dropped:
            log.warning("manifest has fields this version does not know (ignored): %s", ", ".join(dropped))
        return parse_config({**data, "run_id": manifest.run_id}, source="run manifest")

    def next_round(self) -> RoundInfo | None:
        """The round to train for next; recovers state first when this peer is behind the swarm."""
        while not self.finished():
            plan = self.heartbeat.plan
            mine = [r for r in plan.rounds if r.member(self.id)] if plan else []
            latest = max(mine, key=lambda r: r.step, default=None)
            if latest is not None:
                cell = latest.member(self.id)
                assert cell is not None
                if cell.stage != self.stage:
                    log.info("assigned to stage %d (held stage %d): fetching its state", cell.stage, self.stage)
                    self._enter_stage(cell.stage)
            step = self.snapshot.version + 1
            admitted_at = latest.step if latest else 0
            if self.failed_step or admitted_at > step:
                self.recover(plan)
                continue
            current = plan.round_for(step) if plan else None
            if current is not None and current.step < step and self._await_decision(step):
                self._set_state("waiting")
                self.heartbeat.wait_plan(lambda p, s=step: p is not None and any(r.step >= s for r in p.rounds), timeout=0.5)
                continue
            if current is not None and current.member(self.id) is not None:
                want = current.base_hash_of(self.stage)
                if current.step == step and want and want != self.snapshot.hash:
                    log.warning(
                        "this peer's v%d (%s) differs from the swarm's (%s); recovering",
                        self.snapshot.version, self.snapshot.hash[:12], want[:12],
                    )
                    self.recover(plan, want_hash=want)
                    continue
                if self.first_round_at is None:
                    self.first_round_at = time.time()
                return self._round_info(step, current)
            self._set_state("waiting")
            self.heartbeat.wait_plan(lambda p, seq=plan.seq if plan else -1: p is not None and p.seq > seq, timeout=1.0)
        return None

    def _await_decision(self, step: int) -> bool:
        """Wait for the coordinator's round for ``step`` rather than train it on the last plan?

        In a pipeline the grid decides who this peer's neighbours are, so starting on the last plan
        while the coordinator re-plans would pair it with peers that moved: wait up to
        ``plan_wait_s`` after our last commit (a live coordinator decides within about a second),
        then go on with the last plan (the coordinator is down). With S = 1 the inner steps need
        nobody, and the members are resolved at the end of the inner phase.
        """
        return self.run_cfg.pipeline.stages > 1 and time.monotonic() - self.committed_at < self.cfg.plan_wait_s

    def recover(self, plan: Plan | None, want_hash: str = "") -> None:
        """Catch up: fetch the newest state the members of the plan serve, and verify it.

        After a failed round, if no member gets past it within ``plan_wait_s`` (the whole round
        failed), give up waiting and run the round again from the state we hold.
        """
        self._set_state("recovering")
        addresses = sorted({m.address for r in (plan.rounds if plan else []) for m in r.members
                            if m.peer_id != self.id and m.stage == self.stage})
        if self.heartbeat.manifest.coordinator_grpc:
            addresses.append(self.heartbeat.manifest.coordinator_grpc)  # its checkpoint, if no member is newer
        mine = self.snapshot.version
        sources = [
            s for s in probe_sources(self.client, self._header(0), addresses, stage=self.stage)
            if (s.info.version > mine or (want_hash and s.info.version == mine and s.info.state_hash == want_hash))
        ]
        if not sources:
            if self.failed_step and time.monotonic() - self.failed_at > self.cfg.plan_wait_s:
                log.warning("no member got past step %d; running it again", self.failed_step)
                self.failed_step = 0
            else:
                self.heartbeat.wait_plan(lambda p: False, timeout=0.25)
            return
        best = max(sources, key=lambda s: (s.info.version, sum(t.info.state_hash == s.info.state_hash for t in sources)))
        chosen = [s for s in sources if (s.info.version, s.info.state_hash) == (best.info.version, best.info.state_hash)]
        t_fetch = time.monotonic()
        try:
            snap = fetch_snapshot(
                self.client, self._header(0), chosen, expect={"momentum": self.numel, "theta": self.numel},
                timeout=self.run_cfg.sync.rpc_timeout_s, stage=self.stage,
            )
        except SnapshotUnavailable as err:
            log.warning("state recovery failed: %s", err)
            self.heartbeat.wait_plan(lambda p: False, timeout=0.5)
            return
        self.failed_step = 0
        self._adopt(snap)
        self.recovered_s += time.monotonic() - t_fetch

    def _fail(self, step: int) -> None:
        """This peer did not commit ``step``: drop the round's messages and recover before going on."""
        self.failed_step, self.failed_at = step, time.monotonic()
        self.allreduce.expect(step, self.snapshot.hash)

    def _adopt(self, snap: Snapshot) -> None:
        load_flat(self.params, snap.tensors["theta"])
        self.total_inner_steps = int(snap.meta.get("inner_steps", self.total_inner_steps))
        self._commit(Snapshot(snap.tensors, snap.version, snap.hash, self._snapshot_meta()))
        log.info("recovered state v%d (%s)", snap.version, snap.hash[:12])

    # ------------------------------------------------------------------ training

    def inner_phase(self, info: RoundInfo) -> bool:
        """H inner AdamW steps on this peer's shard; False if interrupted."""
        rc = self.run_cfg
        set_context(step=info.step)
        self._set_state("training")
        self._ensure_sampler(info)
        assert self.sampler is not None
        self.layers.train()
        t_phase = time.monotonic()
        tokens_per_step = rc.train.batch_size * rc.model.seq_len
        self.stalled = ""
        if self.pipeline is not None:
            r = self._round
            cells = {m.stage: m for m in r.members if m.replica == self.replica}
            prev, nxt = cells.get(self.stage - 1), cells.get(self.stage + 1)
            self.pipeline.begin_round(
                info.step, self.replica,
                Neighbour(prev.peer_id, prev.address) if prev else None,
                Neighbour(nxt.peer_id, nxt.address) if nxt else None,
            )
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(
                self.params, lr=rc.train.lr, betas=(rc.train.beta1, rc.train.beta2), weight_decay=rc.train.weight_decay
            )
        for i in range(rc.diloco.inner_steps):
            if self.stopping.is_set():
                return False
            t0 = time.monotonic()
            for group in self.optimizer.param_groups:
                group["lr"] = self._inner_lr()
            self.optimizer.zero_grad(set_to_none=True)
            if self.pipeline is None:
                x, y = self.data.batch(self.sampler.next_ids(rc.train.batch_size))
                x, y = x.to(self.device), y.to(self.device)
                loss = lm_loss(forward_layers(self.layers, x), y)
                loss.backward()
                value = float(loss.detach())
            else:
                batch = None
                if self.stage == 0:
                    ids = self.sampler.next_ids(rc.train.batch_size)
                    x, y = self.data.batch(ids)
                    batch = (ids, x, y)
                try:
                    value = self.pipeline.train_step(self.layers, i, batch, self.device)
                except PipelineStall as err:
                    self.stalled = str(err)
                    log.warning("replica %d stalled at inner step %d: %s; this peer contributes nothing to "
                                "outer step %d", self.replica, i, err, info.step)
                    break
            if rc.train.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, rc.train.grad_clip)
            self.optimizer.step()
            self.total_inner_steps += 1
            dt = time.monotonic() - t0
            p = self.progress
            p.loss = value if p.loss is None or not math.isfinite(p.loss) else 0.9 * p.loss + 0.1 * value
            p.inner_step = i + 1
            p.step_time_s = dt if p.step_time_s == 0 else 0.9 * p.step_time_s + 0.1 * dt
            p.tokens_total += tokens_per_step
            p.tokens_per_s = tokens_per_step / max(p.step_time_s, 1e-9)
            p.samples_per_s = rc.train.batch_size / max(p.step_time_s, 1e-9)
            if not self._first_step_logged:
                self._first_step_logged = True
                self._log_first_step()
        self.inner_seconds = time.monotonic() - t_phase
        self.progress.compute_s += self.inner_seconds
        return True

    def _log_first_step(self) -> None:
        """When this peer's first optimizer step is done, and where the time before it went."""
        now = time.time()
        phases = {**self.phases, "to first round": (self.first_round_at or now) - self.ready_at}
        if self.recovered_s:
            phases["of which state download"] = self.recovered_s
        log.info("first training step %.1f s after the process started (%.1f s after joining the DHT; %s)",
                 now - _process_started_at(), now - self.joined_at, ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))

    def _inner_lr(self) -> float:
        t = self.run_cfg.train
        if t.warmup_steps and self.total_inner_steps < t.warmup_steps:
            return t.lr * (self.total_inner_steps + 1) / t.warmup_steps
        return t.lr

    def _ensure_sampler(self, info: RoundInfo) -> None:
        index, count = info.index, len(info.members)
        if self.sampler is None or (self.sampler.index, self.sampler.count) != (index, count):
            self.sampler = ShardSampler(self.data.num_samples, index, count, self.run_cfg.data.seed)

    def outer_step(self, step: int) -> None:
        """Average pseudo-gradients with the round's members and apply the outer Nesterov step."""
        rc = self.run_cfg
        self._set_state("syncing")
        t0 = time.monotonic()
        info = self._resolve_round(step)
        if info is None:
            log.warning("not a member of step %d after all; discarding %d inner steps", step, rc.diloco.inner_steps)
            self._fail(step)
            return
        theta = self.snapshot.tensors["theta"]
        delta: torch.Tensor | None = theta - flatten_params(self.params)
        if self.stalled:
            delta = None
        elif not bool(torch.isfinite(delta).all()):
            log.error("local training produced NaN/Inf; contributing nothing to step %d", step)
            delta = None
        wait_s = max(rc.sync.deadline_floor_s, rc.sync.deadline_factor * getattr(self, "inner_seconds", 0.0))
        try:
            mean, stats = self.allreduce.run(info, delta, wait_s=wait_s, grace_s=max(2.0, 0.25 * wait_s))
        except IncompleteRound as err:
            log.warning("%s; recovering state from the other members", err)
            self._fail(step)
            return
        new_theta, new_m = nesterov_step(
            theta, self.snapshot.tensors["momentum"], mean, rc.diloco.outer_lr, rc.diloco.outer_momentum, rc.diloco.nesterov
        )
        self._commit(outer_snapshot(new_theta, new_m, step, self._snapshot_meta()))
        load_flat(self.params, new_theta)
        self._report_outer(stats, time.monotonic() - t0, mean)
        if rc.data.eval_every and step % rc.data.eval_every == 0 and not self.stalled:
            value = self.evaluate(step)
            if value is not None:
                self.progress.eval_loss, self.progress.eval_version = value, step
        self.heartbeat.poke()

    def _resolve_round(self, step: int) -> RoundInfo | None:
        """The explicit round for ``step``; after ``plan_wait_s`` without one, the last plan's members."""
        plan = self.heartbeat.wait_plan(
            lambda p: p is not None and any(r.step == step for r in p.rounds), timeout=self.cfg.plan_wait_s
        )
        current = plan.round_for(step) if plan else None
        if current is None:
            return None
        if current.step != step:
            log.warning("no decision from the coordinator for step %d; using the members of step %d", step, current.step)
        me = current.member(self.id)
        if me is None or me.stage != self.stage:
            return None
        want = current.base_hash_of(self.stage)
        if current.step == step and want and want != self.snapshot.hash:
            log.warning("step %d starts from %s, this peer holds %s", step, want[:12], self.snapshot.hash[:12])
            return None
        return self._round_info(step, current)

    def _round_info(self, step: int, r: Round) -> RoundInfo:
        """This peer's view of round ``r``: the all-reduce group is its stage's members, in replica order."""
        me = r.member(self.id)
        assert me is not None
        self._round, self.replica = r, me.replica
        members = tuple(MemberAddr(m.peer_id, m.address) for m in r.stage_members(self.stage))
        self._addresses.update({m.peer_id: m.address for m in r.members})
        return RoundInfo(step=step, members=members, me=self.id, base_hash=self.snapshot.hash)

    def _commit(self, snap: Snapshot) -> None:
        self.snapshot, self.committed_at = snap, time.monotonic()
        self.snapshots.publish(snap)
        self.allreduce.expect(snap.version + 1, snap.hash)
        set_context(step=snap.version)

    def _report_outer(self, stats: AllReduceStats, seconds: float, mean: torch.Tensor) -> None:
        p = self.progress
        p.last_outer_s, p.outer_wait_s, p.last_outer_bytes = seconds, stats.wait_seconds, stats.bytes_sent
        p.sync_s += seconds
        if self.pipeline is not None:
            now = asdict(self.pipeline.traffic)
            p.last_pipe = {k: v - self._pipe_before.get(k, 0) for k, v in now.items()}
            self._pipe_before = now
        dropped = f", dropped {', '.join(short_id(d) for d in stats.dropped)}" if stats.dropped else ""
        log.info(
            "outer step %d: %d members, %.2f s (waited %.2f s), sent %.2f MB, |mean delta| %.3g, loss %.4f%s",
            stats.step, stats.members, seconds, stats.wait_seconds, stats.bytes_sent / 1e6,
            float(mean.norm()), p.loss or float("nan"), dropped,
        )

    @torch.no_grad()
    def evaluate(self, version: int) -> float | None:
        """Eval loss of theta_global at ``version`` (through the whole pipeline when S > 1; the
        last stage reports it)."""
        self.layers.eval()
        try:
            ids = self.data.eval_ids()
            chunks = [ids[k : k + 64] for k in range(0, len(ids), 64)]
            if self.pipeline is not None:
                batches = [(list(c), *self.data.batch(c)) for c in chunks] if self.stage == 0 else None
                try:
                    return self.pipeline.evaluate(self.layers, version, batches, len(chunks), self.device)
                except PipelineStall as err:
                    log.warning("evaluation of v%d skipped: %s", version, err)
                    return None
            total, n = 0.0, 0
            for c in chunks:
                x, y = self.data.batch(c)
                total += float(lm_loss(forward_layers(self.layers, x.to(self.device)), y.to(self.device))) * len(x)
                n += len(x)
            return total / max(n, 1)
        finally:
            self.layers.train()

    # ------------------------------------------------------------------ reporting

    def _set_state(self, state: str) -> None:
        if state != self.progress.state:
            self.progress.state = state
            if state != "training":
                self.progress.inner_step = 0
            if hasattr(self, "heartbeat"):
                self.heartbeat.poke()

    def _snapshot_meta(self) -> dict:
        start, stop = self.bounds[self.stage]
        return {"inner_steps": self.total_inner_steps, "stage": self.stage, "layers": [start, stop],
                # parameters named by their layer in the whole model, so checkpoints re-split into any S
                "layout": [[f"layers.{start + int(n.split('.', 1)[0])}.{n.split('.', 1)[1]}", list(p.shape)]
                           for n, p in self.layers.named_parameters()]}

    def record(self) -> PeerRecord:
        p = self.progress
        sent, received = self.traffic.snapshot()
        snap = getattr(self, "snapshot", None)
        mem = torch.cuda.get_device_properties(self.device).total_memory / 2**30 if self.device.type == "cuda" else 0.0
        return PeerRecord(
            peer_id=self.id,
            address=getattr(self, "address", ""),
            state=p.state,
            version=snap.version if snap else 0,
            state_hash=snap.hash if snap else "",
            inner_step=p.inner_step,
            device=self.device.type if hasattr(self, "device") else "cpu",
            device_name=torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else f"cpu x{os.cpu_count()}",
            memory_gb=mem,
            name=self.cfg.name,
            loss=p.loss if p.loss is None or math.isfinite(p.loss) else None,
            eval_loss=p.eval_loss,
            eval_version=p.eval_version,
            samples_per_s=p.samples_per_s,
            tokens_per_s=p.tokens_per_s,
            tokens_total=p.tokens_total,
            bytes_sent=sent,
            bytes_received=received,
            last_outer_s=p.last_outer_s,
            last_outer_bytes=p.last_outer_bytes,
            compute_s=p.compute_s,
            sync_s=p.sync_s,
            parameters=getattr(self, "numel", 0),
            loss_floor=self.data.loss_floor if hasattr(self, "data") else None,
            software=__version__,
            started_at=self.started_at,
            seq=next_seq(),
            ts=time.time(),
            stage=getattr(self, "stage", 0),
            dht_maddrs=self._dht_maddrs(),
            replica=self.replica if hasattr(self, "replica") else -1,
            extras={"outer_wait_s": p.outer_wait_s, "step_time_s": p.step_time_s,
                    **({"pipe": p.last_pipe, "buffers": self.pipeline.footprint()} if self.pipeline and p.last_pipe else {})},
        )

    def _dht_maddrs(self) -> list[str]:
        if not getattr(self, "_maddrs", None) and getattr(self, "node", None) is not None:
            try:
                self._maddrs = self.node.maddrs[:4]
            except Exception:  # the DHT is shutting down
                return []
        return getattr(self, "_maddrs", [])

    def _header(self, step: int) -> pb.Header:
        return pb.Header(run_id=self.run_id, sender=self.id, step=step)

    def _ping_member(self, peer_id: str, timeout: float) -> pb.PingReply:
        address = self._addresses[peer_id]
        return self.client.ping(address, pb.PingRequest(header=self._header(0), sent_at=time.time()), timeout)

    # ------------------------------------------------------------------ PeerService handlers

    def ping(self, request: pb.PingRequest) -> pb.PingReply:
        p = self.progress
        left = max(0, self.run_cfg.diloco.inner_steps - p.inner_step) if p.state == "training" else 0
        padding = b"\0" * max(0, min(request.reply_bytes, 4 << 20))
        return pb.PingReply(
            peer_id=self.id, state=p.state, version=self.snapshot.version, inner_step=p.inner_step,
            eta_s=left * p.step_time_s, sent_at=request.sent_at, padding=padding,
        )

    def push_contribution(self, chunks):  # type: ignore[no-untyped-def]
        return self.allreduce.on_contribution(chunks)

    def push_result(self, chunks):  # type: ignore[no-untyped-def]
        return self.allreduce.on_result(chunks)

    def fetch_result(self, request):  # type: ignore[no-untyped-def]
        return self.allreduce.on_fetch_result(request)

    def get_state_info(self, request):  # type: ignore[no-untyped-def]
        return self.snapshots.get_state_info(request)

    def fetch_state(self, request):  # type: ignore[no-untyped-def]
        return self.snapshots.fetch_state(request)

    def push_pipe(self, request: pb.PipeMessage) -> pb.Ack:
        pipeline = self.pipeline
        if pipeline is None:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "this peer runs no pipeline stage", request.header.sender)
        return pipeline.on_message(request)


def _process_started_at() -> float:
    """Wall-clock start of this process (Linux /proc; else the time the module was imported)."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()

