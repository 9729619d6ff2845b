"""The coordinator: bootstraps the run's DHT, publishes its manifest and plan, keeps the journal.

It is not on the data path: peers average and fetch state among themselves over gRPC. Its loop
(every ``tick_s``) reads the peers' signed records, decides the next round when the current one is
committed (:mod:`potluck.coordinator.membership`), writes checkpoints fetched from members, and
rebuilds the snapshot the status server renders. Restarted with the same journal directory it keeps
its identity (so the join address stays valid) and resumes at the committed outer step.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from potluck import __version__
from potluck.compression.transfer import (
    Snapshot,
    SnapshotServer,
    SnapshotUnavailable,
    fetch_snapshot,
    probe_sources,
)
from potluck.coordinator.checkpoint import CheckpointStore, consolidate, slice_stage
from potluck.coordinator.journal import Journal, JournalError, JournalState, write_atomic
from potluck.coordinator.membership import PeerTable
from potluck.coordinator.placement import Replan, make_placer
from potluck.coordinator.status import API, StatusServer
from potluck.peer.pipeline import stage_bounds
from potluck.protos import potluck_pb2 as pb
from potluck.protos.config import ConfigError, RunConfig
from potluck.protos.identity import Identity
from potluck.protos.log import get_logger, set_context, short_id
from potluck.protos.records import MANIFEST_KEY, Manifest, Plan, Round, next_seq, plan_key
from potluck.protos.swarm import JoinError, SwarmNode, guess_reachable_host, host_of_multiaddr
from potluck.protos.transport import PeerClient, PeerServer, Rejected, Traffic

log = get_logger(__name__)

RECORD_TTL_S = 60.0
REFRESH_S = 15.0
KEEP_EVENTS = 500


class Coordinator:
    def __init__(self, cfg: RunConfig, *, exit_when_finished: bool = False, ready_file: str | None = None) -> None:
        self.cfg, self.exit_when_finished, self.ready_file = cfg, exit_when_finished, ready_file
        self.stopping = threading.Event()
        self.events: deque[dict[str, Any]] = deque(maxlen=KEEP_EVENTS)
        self.traffic = Traffic()
        self._lock = threading.Lock()
        self._state_json: dict[str, Any] = {}
        self._checkpointing = threading.Lock()
        self._checkpoint_wanted = 0
        self._warned: set[str] = set()
        self._journal_dirty = False  # tick() saves the journal once when something in it changed
        self._manifest_update: dict[str, Any] | None = None  # set by the checkpoint thread, applied by tick()
        self.series: deque[dict[str, Any]] = deque(maxlen=1800)
        set_context(role="coordinator")

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> int:
        try:
            self.start()
            while not self.stopping.is_set():
                t0 = time.monotonic()
                self.tick()
                if self.exit_when_finished and self._finished_and_drained():
                    log.info("run finished; exiting")
                    break
                self.stopping.wait(max(0.0, self.cfg.coordinator.tick_s - (time.monotonic() - t0)))
            return 0
        except (ConfigError, JournalError) as err:
            log.error("%s", err)
            return 2
        finally:
            self.stop()

    def start(self) -> None:
        c = self.cfg.coordinator
        self.journal = Journal(c.journal_dir)
        self.checkpoints = CheckpointStore(Path(c.journal_dir) / "checkpoints", keep=c.keep_checkpoints)
        identity_path = Path(c.journal_dir) / "identity.key"
        self.identity = Identity.load_or_create(identity_path)
        self.id = self.identity.peer_id
        set_context(peer_id=self.id)
        self.state = self._load_or_create_journal()
        self.run_id = self.state.run_id
        self.table = PeerTable(self.cfg.membership.heartbeat_timeout_s, settle_s=1.0)
        self.table.restore(self.state.committed, self.state.rounds, self.state.hashes)

        # A restarted coordinator rejoins the swarm its peers kept running, through their addresses.
        known = list(self.state.known_peers)
        try:
            self.node = SwarmNode(
                self.identity, initial_peers=known, host=c.host, port=c.dht_port, announce_host=c.announce_host,
                startup_timeout=c.startup_timeout_s, identity_path=identity_path,
            )
        except JoinError as err:
            if not known:
                raise
            log.warning("none of the %d peers known from the journal answered (%s); starting a new swarm", len(known), err)
            self.node = SwarmNode(
                self.identity, host=c.host, port=c.dht_port, announce_host=c.announce_host,
                startup_timeout=c.startup_timeout_s, identity_path=identity_path,
            )
        if known:
            log.info("rejoined the swarm through %d peers known from the journal", len(known))
        self.public_host = c.announce_host or (c.host if c.host not in ("0.0.0.0", "") else guess_reachable_host())
        self.join_address = self._join_address()
        self.bounds = stage_bounds(self.cfg.model, self.cfg.pipeline)
        self.whole: Snapshot | None = None
        self.stage_servers: dict[int, SnapshotServer] = {}
        self._serve_checkpoint(self.checkpoints.latest_valid())
        self._maybe_reshard()
        self.client = PeerClient(self.traffic)
        self.grpc = PeerServer(self, self.traffic, host=c.host, port=c.grpc_port)
        self.admin_token = _admin_token(Path(c.journal_dir))
        self.status = StatusServer(c.host, c.status_port, self.status_json, admin_token=self.admin_token,
                                   actions={"finish": self._admin_finish})
        self.status_url = f"http://{self.public_host}:{self.status.port}/"
        self.started_at = time.time()
        self.manifest = Manifest(
            run_id=self.run_id, coordinator=self.id, config=self.cfg.manifest_sections(),
            coordinator_grpc=f"{self.public_host}:{self.grpc.port}", status_url=self.status_url,
            created_at=self.state.created_at, finished=self.state.finished, seq=next_seq(),
            checkpoint_every=c.checkpoint_every,
            checkpoint_version=self.whole.version if self.whole else 0,
        )
        self.plan_seq = next_seq()
        self._publish(force=True)
        self._event("started", "", f"coordinator {__version__} serving run {self.run_id} at step {self.table.committed}")
        self._announce()

    def stop(self) -> None:
        self.stopping.set()
        if getattr(self, "state", None) is not None and getattr(self, "journal", None) is not None:
            try:
                with self._lock:
                    self.journal.save(self.state)  # the history's latest figures, on a clean shutdown
            except OSError as err:
                log.warning("could not save the journal on shutdown: %s", err)
        for name, method in (("status", "stop"), ("grpc", "stop"), ("client", "close"), ("node", "shutdown")):
            obj = getattr(self, name, None)
            if obj is not None:
                try:
                    getattr(obj, method)()
                except Exception as err:
                    log.debug("stopping %s: %s", name, err)

    def _load_or_create_journal(self) -> JournalState:
        state = self.journal.load()
        sections = self.cfg.manifest_sections()
        if state is None:
            run_id = self.cfg.run_id or f"run-{secrets.token_hex(3)}"
            state = JournalState(run_id=run_id, config=sections, created_at=time.time())
            self.journal.save(state)
            return state
        if self.cfg.run_id and self.cfg.run_id != state.run_id:
            raise JournalError(f"{self.journal.path} belongs to run {state.run_id!r}, not {self.cfg.run_id!r}; use another journal_dir")
        changed = sorted(k for k in set(state.config) | set(sections) if state.config.get(k) != sections.get(k))
        fixed = [k for k in changed if k not in RESUMABLE_SECTIONS]
        if fixed:
            raise JournalError(
                f"{self.journal.path} was written with a different config (sections differ: {', '.join(fixed)}); "
                f"resume with the same values there (only {', '.join(sorted(RESUMABLE_SECTIONS))} may change) "
                "or use another journal_dir"
            )
        if changed:
            log.warning("resuming run %s with changed config sections: %s", state.run_id, ", ".join(changed))
            state.config = sections
            if state.finished and state.committed < self.cfg.diloco.outer_steps:
                state.finished = False  # the run was extended
            self.journal.save(state)
        log.info("resuming run %s from the journal at outer step %d", state.run_id, state.committed)
        return state

    def _join_address(self) -> str:
        maddrs = self.node.maddrs
        for m in maddrs:
            if host_of_multiaddr(m) == self.public_host:
                return m
        port = maddrs[0].split("/tcp/")[1].split("/")[0]
        return f"/ip4/{self.public_host}/tcp/{port}/p2p/{self.id}"

    def _announce(self) -> None:
        info = {
            "run_id": self.run_id, "join": self.join_address, "status_url": self.status_url,
            "grpc": self.manifest.coordinator_grpc, "coordinator": self.id,
        }
        print(
            f"potluck coordinator ready\n"
            f"  run:          {self.run_id} (outer step {self.table.committed} of {self.cfg.diloco.outer_steps})\n"
            f"  join address: {self.join_address}\n"
            f"  status page:  {self.status_url}\n"
            f"  admin token:  {Path(self.cfg.coordinator.journal_dir) / 'admin.token'} (or $POTLUCK_ADMIN_TOKEN)\n"
            f"  start a peer: potluck peer --join {self.join_address}",
            flush=True,
        )
        if self.ready_file:
            write_atomic(Path(self.ready_file), json.dumps(info).encode())

    # ------------------------------------------------------------------ the loop

    def tick(self) -> None:
        now = time.monotonic()
        if now - getattr(self, "_links_read_at", 0.0) > 5.0:  # for the status page's heatmap
            self._links_read_at = now
            self._link_reports()
        records, refused = self.node.get_peers(self.run_id)
        self._warn_refused(refused)
        before = self.table.committed
        for kind, pid in self.table.update(records):
            rec = self.table.peers[pid].record
            detail = {"joined": f"joined from {rec.address} ({rec.device_name or rec.device})", "left": "left the run",
                      "lost": f"lost: no heartbeat for {self.cfg.membership.heartbeat_timeout_s:.0f} s", "back": "is back"}[kind]
            self._event(kind, pid, detail)
        if self.table.committed != before:
            self._on_commit(before)
        if not self.state.finished and getattr(self, "_finish_requested", False):
            self._finish()
        if not self.state.finished and self.table.committed >= self.cfg.diloco.outer_steps and self.table.settled(
                grace_s=self.cfg.membership.heartbeat_timeout_s):
            self._finish()
        if (not self.state.finished and self.table.committed < self.cfg.diloco.outer_steps
                and self.table.ready_to_decide(self.cfg.membership.min_peers)):
            self._decide()
        self._update_history()
        if self._journal_dirty:  # commit, decision and new history entries often land in one tick
            self._journal_dirty = False
            self.journal.save(self.state)
        update, self._manifest_update = self._manifest_update, None
        if update:
            self.manifest = self.manifest.model_copy(update={**update, "seq": next_seq()})
        self._publish(force=bool(update))
        with self._lock:
            self._state_json = self._build_state()

    def _decide(self) -> None:
        candidates = [v.record for v in self.table.live()]
        stages = self.cfg.pipeline.stages
        if len(candidates) < stages:
            return  # not one whole pipeline yet; the waiting reason says so
        reachable = self._reachable(candidates)
        if len(reachable) < stages:
            return  # not one whole pipeline yet; the waiting reason says so
        self._maybe_roll_back({p.peer_id: p for p in candidates if p.peer_id in reachable})
        placer = None
        if stages > 1 and self.cfg.links.placement == "scheduler":
            placer = make_placer(self.cfg, self._link_reports, self._model_parameters,
                                 budget_s=self.cfg.links.search_budget_s, on_replan=self._on_replan)
        decision = self.table.decide(reachable, decided_at=time.time(), stages=stages, placer=placer)
        r = decision.round
        self.state.rounds = list(self.table.rounds.values())
        self.state.hashes = dict(self.table.hashes)
        self._journal_dirty = True
        self.plan_seq = next_seq()
        self._publish(force=True)
        changes = ""
        if decision.joined and r.step > 1:
            changes += f"; admitted {', '.join(short_id(p) for p in decision.joined)}"
        if decision.dropped:
            changes += f"; without {', '.join(short_id(p) for p in decision.dropped)}"
        grid = f" ({stages} stages x {len(r.members) // stages} replicas)" if stages > 1 else ""
        self._event("round", "", f"step {r.step}: {len(r.members)} members{grid}{changes}")
        log.info("round %d decided: %s%s", r.step, ", ".join(short_id(m.peer_id) for m in r.members), changes)

    def _link_reports(self) -> dict:
        try:
            reports, refused = self.node.get_links(self.run_id)
        except Exception as err:
            log.warning("could not read link reports: %s", err)
            return {}
        self._warn_refused(refused)
        self.links = reports
        return reports

    def _warn_refused(self, refused: list[str]) -> None:
        """An event for each record refused for a reason not seen before (forged, stale, malformed)."""
        for reason in refused:
            if reason not in self._warned:
                self._warned.add(reason)
                self._event("rejected", "", reason)

    def _model_parameters(self) -> int:
        per_stage: dict[int, int] = {}
        for v in self.table.peers.values():
            per_stage[v.record.stage] = max(per_stage.get(v.record.stage, 0), v.record.parameters)
        return sum(per_stage.values())

    def _on_replan(self, r: Replan) -> None:
        if r.moved:
            gain = f"{(1 - r.cost / r.kept_cost) * 100:.0f}%" if r.kept_cost else "?"
            self._event("replan", "", f"moved {r.moved} tasklets: predicted cost {r.cost:.3f} s vs "
                                      f"{r.kept_cost:.3f} s kept ({gain} faster; {r.evaluations} plans in {r.seconds:.1f} s)")

    def _reachable(self, candidates: list) -> set[str]:
        """Ping candidates in parallel; a live record of a dead process should not enter a round."""
        def ping(rec) -> str | None:  # type: ignore[no-untyped-def]
            try:
                self.client.ping(rec.address, pb.PingRequest(header=pb.Header(run_id=self.run_id, sender=self.id), sent_at=time.time()), 2.0)
                return rec.peer_id
            except grpc.RpcError:
                return None

        if not candidates:
            return set()
        with ThreadPoolExecutor(max_workers=min(32, len(candidates))) as pool:
            return {pid for pid in pool.map(ping, candidates) if pid}

    def _maybe_roll_back(self, live: dict) -> None:
        """If every peer holding the committed state is gone, resume from the newest checkpoint."""
        committed = self.table.committed
        if committed == 0 or any(p.version >= committed for p in live.values()):
            return
        ckpt = self.whole
        best = max([p.version for p in live.values()] + [ckpt.version if ckpt else 0])
        if best >= committed:
            return
        msg = f"state after v{best} was lost with its peers; resuming from v{best}" + (
            " (checkpoint)" if ckpt and ckpt.version == best else ""
        )
        log.warning(msg)
        self._event("rollback", "", msg)
        self.table.committed = best
        if ckpt and ckpt.version == best:
            self._serve_checkpoint(ckpt)  # its stage hashes become the canonical ones
        for step in [s for s in self.table.rounds if s > best]:
            del self.table.rounds[step]

    def _on_commit(self, before: int) -> None:
        v = self.table.committed
        self.state.committed = v
        self.state.hashes = dict(self.table.hashes)
        self.state.known_peers = [m for view in self.table.live() for m in view.record.dht_maddrs[:1]][:16]
        self._journal_dirty = True
        every = self.cfg.coordinator.checkpoint_every
        if every and (v // every > before // every or v >= self.cfg.diloco.outer_steps):
            self._checkpoint_wanted = v
            if self._checkpointing.acquire(blocking=False):
                threading.Thread(target=self._checkpoint_loop, name="checkpoint", daemon=True).start()

    def _checkpoint_loop(self) -> None:
        """Checkpoint the newest wanted version until no newer one is wanted (never skip the final one)."""
        done = -1
        while True:
            try:
                while not self.stopping.is_set() and self._checkpoint_wanted > done:
                    done = self._checkpoint_wanted
                    self._checkpoint(done)
            finally:
                self._checkpointing.release()
            # a commit that came while the lock was being released must not be skipped
            if (self.stopping.is_set() or self._checkpoint_wanted <= done
                    or not self._checkpointing.acquire(blocking=False)):
                return

    def _checkpoint(self, version: int) -> None:
        """Fetch every stage's state at ``version`` from its members, consolidate, write, serve."""
        try:
            round_ = self.table.rounds.get(version) or self.table.rounds.get(max(self.table.rounds, default=0))
            header = pb.Header(run_id=self.run_id, sender=self.id)
            deadline = time.monotonic() + 30.0
            parts: dict[int, Snapshot] = {}
            stages = round_.stages if round_ else 1
            while (time.monotonic() < deadline and not self.stopping.is_set() and len(parts) < stages
                   and self._checkpoint_wanted == version):  # a newer wanted version supersedes this one
                for stage in range(stages):
                    if stage in parts or round_ is None:
                        continue
                    want = self.table.canonical_hash(version, stage)
                    addresses = [m.address for m in round_.members if m.stage == stage]
                    sources = [src for src in probe_sources(self.client, header, addresses, stage=stage)
                               if src.info.version == version
                               and (not want or src.info.state_hash == want)]
                    if sources:
                        parts[stage] = fetch_snapshot(self.client, header, sources, timeout=self.cfg.sync.rpc_timeout_s,
                                                      stage=stage)
                if len(parts) < stages:
                    time.sleep(0.2)
            if len(parts) < stages:
                if self._checkpoint_wanted != version:
                    return  # superseded by a newer version
                log.warning("no member served v%d of stages %s for a checkpoint", version,
                            sorted(set(range(stages)) - set(parts)))
                return
            whole = consolidate([parts[i] for i in range(stages)])
            path = self.checkpoints.write(whole, {"run_id": self.run_id, "stages": stages,
                                                  "model": self.cfg.model.model_dump(mode="json")})
            self._serve_checkpoint(whole)
            self.state.checkpoints = [p.name for p in self.checkpoints.manifests()]
            self._manifest_update = {"checkpoint_version": version}
            self._event("checkpoint", "", f"v{version} written to {path.name}")
        except (SnapshotUnavailable, OSError, ValueError) as err:
            log.warning("checkpoint of v%d failed: %s", version, err)

    def _serve_checkpoint(self, whole: Snapshot | None) -> None:
        """Serve ``whole`` to recovering peers, cut into this run's stages; its hashes become canonical."""
        if whole is None:
            return
        servers = {}
        for stage, (start, stop) in enumerate(self.bounds):
            part = slice_stage(whole, start, stop, stage) if whole.meta.get("layout") else whole
            server = SnapshotServer(self.run_id, self.cfg.sync.chunk_bytes)
            server.publish(part)
            servers[stage] = server
            self.table.hash_store(stage).setdefault(whole.version, part.hash)
        self.whole, self.stage_servers = whole, servers

    def _maybe_reshard(self) -> None:
        """A run resumed with another number of stages continues from its latest checkpoint."""
        latest = self.table.rounds.get(max(self.table.rounds, default=0))
        if latest is None or latest.stages == self.cfg.pipeline.stages:
            return
        if self.whole is None:
            raise ConfigError(f"pipeline.stages changed from {latest.stages} to {self.cfg.pipeline.stages}, "
                              "but there is no checkpoint to re-split; keep the old value")
        v = self.whole.version
        msg = (f"pipeline.stages changed from {latest.stages} to {self.cfg.pipeline.stages}: resuming from the "
               f"checkpoint of v{v} re-split into {self.cfg.pipeline.stages} stages")
        log.warning(msg)
        self._event("reshard", "", msg)
        self.table.rounds.clear()
        self.table.committed = v
        self.table.hashes = {v: self.table.hashes.get(v, "")} if v in self.table.hashes else {}
        self.table.stage_hashes = {}
        self._serve_checkpoint(self.whole)
        self.state.committed, self.state.rounds = v, []
        self.state.hashes = dict(self.table.hashes)
        self.state.finished = v >= self.cfg.diloco.outer_steps
        self.journal.save(self.state)

    def _admin_finish(self, body: dict) -> dict:
        """Admin action: end the run at the committed step (peers stop after it)."""
        reason = str(body.get("reason", ""))[:200]
        self._event("admin", "", f"run ended by the admin at outer step {self.table.committed}"
                    + (f": {reason}" if reason else ""))
        self._finish_requested = True  # the coordinator's own loop ends the run (one writer of its state)
        return {"finishing": True, "outer_step": self.table.committed}

    def _finish(self) -> None:
        self.state.finished = True
        self.journal.save(self.state)
        self.manifest = self.manifest.model_copy(update={"finished": True, "seq": next_seq()})
        self._publish(force=True)
        self._event("finished", "", f"all {self.cfg.diloco.outer_steps} outer steps committed")
        log.info("run %s finished at outer step %d", self.run_id, self.table.committed)

    def _finished_and_drained(self) -> bool:
        if not self.state.finished:
            return False
        busy = self._checkpointing.locked()
        return not busy and all(v.record.state in ("finished", "left") for v in self.table.live())

    def _publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - getattr(self, "_published_at", 0.0) < REFRESH_S:
            return
        self._published_at = now
        self.node.store(MANIFEST_KEY, self.manifest, ttl=RECORD_TTL_S)
        rounds = sorted(self.table.rounds.values(), key=lambda r: r.step)[-4:]
        if rounds:
            self.node.store(plan_key(self.run_id), Plan(seq=self.plan_seq, rounds=rounds, ts=time.time()), ttl=RECORD_TTL_S)

    # ------------------------------------------------------------------ status

    def _event(self, kind: str, peer: str, message: str) -> None:
        self.events.append({"t": time.time(), "kind": kind, "peer": peer, "message": message})
        if kind not in ("round",):
            log.info("%s%s", f"{short_id(peer)} " if peer else "", message)

    def _update_history(self) -> None:
        """Fold the members' reports for each recent version into its history entry.

        A member publishes its record right after committing version ``v`` (and again once it has
        evaluated ``theta_global`` at ``v``), so the entry fills in within a heartbeat or two.
        """
        hist = {h["step"]: h for h in self.state.history}
        # steps the peers committed on the last plan while this coordinator was away get entries too
        start = min(self.table.committed - 2, max(hist, default=0) + 1)
        for v in range(max(1, start), self.table.committed + 1):
            if v in hist:
                continue
            plan_round = self.table.rounds.get(v) or self._round_at(v)
            if plan_round is not None:
                hist[v] = {
                    "step": v, "t": time.time(), "members": len(plan_round.members), "loss": None,
                    "eval_loss": None, "outer_s": None, "state_hashes": {}, "stages": {},
                    "bytes": {"activations": 0, "gradients": 0, "outer": 0},
                    "bytes_fp32": {"activations": 0, "gradients": 0, "outer": 0},
                }
        for view in self.table.peers.values():
            rec = view.record
            entry = hist.get(rec.version)
            rnd = self.table.rounds.get(rec.version) or self._round_at(rec.version) if entry is not None else None
            me = rnd.member(rec.peer_id) if rnd is not None else None
            if entry is None or me is None:
                continue
            if rec.eval_version == rec.version and entry["eval_loss"] is None:
                entry["eval_loss"] = rec.eval_loss
            if rec.peer_id in entry["state_hashes"]:
                continue  # only a member's first report at a version describes that outer step
            stage = me.stage
            n = len(rnd.stage_members(stage))
            entry["state_hashes"][rec.peer_id] = rec.state_hash
            entry.setdefault("stages", {})[rec.peer_id] = stage
            entry.setdefault("tasklets", {})[rec.peer_id] = [stage, me.replica]
            pipe = rec.extras.get("pipe") if isinstance(rec.extras.get("pipe"), dict) else {}
            if pipe:
                per = entry.setdefault("by_stage", {}).setdefault(str(stage), {
                    "activations": 0, "activations_fp32": 0, "gradients": 0, "gradients_fp32": 0, "losses": []})
                if rec.loss is not None:
                    per["losses"].append(rec.loss)
            for kind in ("activations", "gradients"):
                entry["bytes"][kind] += int(pipe.get(kind, 0))
                entry["bytes_fp32"][kind] += int(pipe.get(kind + "_fp32", 0))
                if pipe:
                    per[kind] += int(pipe.get(kind, 0))
                    per[kind + "_fp32"] += int(pipe.get(kind + "_fp32", 0))
            if rec.loss is not None:
                losses = entry.setdefault("_losses", [])
                losses.append(rec.loss)
                entry["loss"] = sum(losses) / len(losses)
            entry["outer_s"] = max(entry["outer_s"] or 0.0, rec.last_outer_s)
            entry["bytes"]["outer"] += rec.last_outer_bytes
            if n > 1:  # what a ring all-reduce of fp32 would have sent from this member
                entry["bytes_fp32"]["outer"] += int(2 * (n - 1) / n * 4 * rec.parameters)
        added = len(hist) != len(self.state.history)
        self.state.history = sorted(hist.values(), key=lambda h: h["step"])[-2000:]
        if added:
            self._journal_dirty = True  # a resumed run keeps the history of every committed step

    def _round_at(self, step: int) -> Round | None:
        """The round that applied to ``step``: the latest decided at or before it (peers use the last plan)."""
        best = max((s for s in self.table.rounds if s <= step), default=None)
        return self.table.rounds[best] if best is not None else None

    def status_json(self) -> dict[str, Any]:
        with self._lock:
            return self._state_json

    def _sample_series(self, live: list[dict]) -> None:
        now = time.time()
        if self.series and now - self.series[-1]["t"] < 2.0:
            return
        tps = sum(p["tokens_per_s"] for p in live if p["state"] == "training")
        self.series.append({"t": now, "tokens_per_s": tps, "live_peers": len(live)})

    def _build_state(self) -> dict[str, Any]:
        now_wall, now = time.time(), time.monotonic()
        current = self.table.rounds.get(max(self.table.rounds, default=0))
        tasklet_of = {m.peer_id: {"stage": m.stage, "replica": m.replica} for m in current.members} if current else {}
        stages = current.stages if current else self.cfg.pipeline.stages
        replicas = len(current.members) // stages if current else 0
        peers = []
        for view in sorted(self.table.peers.values(), key=lambda v: v.first_seen):
            r = view.record
            state = "lost" if view.lost else r.state
            peers.append({
                "id": r.peer_id, "short_id": short_id(r.peer_id), "name": r.name, "state": state,
                "address": r.address, "device": r.device, "device_name": r.device_name, "memory_gb": r.memory_gb,
                "tasklet": tasklet_of.get(r.peer_id),
                "version": r.version, "inner_step": r.inner_step, "loss": r.loss, "eval_loss": r.eval_loss,
                "tokens_per_s": r.tokens_per_s, "tokens_total": r.tokens_total,
                "bytes_sent": r.bytes_sent, "bytes_received": r.bytes_received,
                "last_seen_s": round(now - view.last_seen, 2), "software": r.software, "state_hash": r.state_hash,
                "compute_s": r.compute_s, "sync_s": r.sync_s,
            })
        live = [p for p in peers if p["state"] not in ("lost", "left", "finished")]
        self._sample_series(live)
        full = self.state.history
        history = [{k: v for k, v in h.items() if not k.startswith("_")} for h in full[-500:]]
        last = next((h for h in reversed(full) if h["loss"] is not None), None)
        last_eval = next((h for h in reversed(full) if h["eval_loss"] is not None), None)
        records = [v.record for v in self.table.peers.values()]
        compute = sum(r.compute_s for r in records)
        sync = sum(r.sync_s for r in records)
        training = [p for p in live if p["state"] == "training"]
        by_id = {p["id"]: p for p in peers}
        m = self.cfg.model
        return {
            "api": API,
            "generated_at": now_wall,
            "run": {
                "run_id": self.run_id, "coordinator": self.id, "join_address": self.join_address,
                "status_url": self.status_url, "finished": self.state.finished, "started_at": self.started_at,
                "outer_step": self.table.committed, "outer_steps_total": self.cfg.diloco.outer_steps,
                "inner_steps_per_outer": self.cfg.diloco.inner_steps,
                "inner_step": min((p["inner_step"] for p in training), default=0),
                "model": {"parameters": max((r.parameters for r in records), default=0), "d_model": m.d_model,
                          "n_layers": m.n_layers, "n_heads": m.n_heads, "vocab_size": m.vocab_size, "seq_len": m.seq_len},
                "stages": stages, "replicas": replicas,
                # tokens enter the model at stage 0: count them once per pipeline
                "tokens_trained": sum(r.tokens_total for r in records if r.stage == 0),
                "tokens_per_s": sum(p["tokens_per_s"] for p in training if not p["tasklet"] or p["tasklet"]["stage"] == 0),
                "loss": last["loss"] if last else None, "eval_loss": last_eval["eval_loss"] if last_eval else None,
                "loss_floor": next((r.loss_floor for r in records if r.loss_floor is not None), None),
                "compute_utilization": compute / (compute + sync) if compute + sync > 0 else None,
                "last_outer_at": full[-1]["t"] if full else None,
                "last_allreduce_s": full[-1]["outer_s"] if full else None,
                "waiting_reason": self._waiting_reason(live),
            },
            "grid": {
                "stages": stages, "replicas": replicas,
                "cells": [
                    {"stage": mb.stage, "replica": mb.replica, "peer": mb.peer_id,
                     "state": by_id[mb.peer_id]["state"] if mb.peer_id in by_id else "lost"}
                    for i, mb in enumerate(current.members)
                ] if current else [],
            },
            "round": current.model_dump(mode="json") if current else None,
            "history": history,
            "series": list(self.series),
            "peers": peers,
            # a finished run keeps showing the links its peers measured last
            "links": self._links_state([p for p in peers if p["state"] not in ("lost", "left")]),
            "events": list(self.events)[-200:],
            "config": {"heartbeat_timeout_s": self.cfg.membership.heartbeat_timeout_s},
        }

    def _links_state(self, live: list[dict]) -> dict[str, Any]:
        """Measured links among ``live`` peers, ordered by tasklet (stage, replica) so pipelines sit together."""
        reports = getattr(self, "links", {})
        ids = [p["id"] for p in sorted(live, key=lambda p: (p["tasklet"] is None, (p["tasklet"] or {}).get("stage", 0),
                                                             (p["tasklet"] or {}).get("replica", 0), p["id"]))]
        if not reports or not ids:
            return {"peers": [], "rtt_ms": [], "bandwidth_mbps": []}
        cached = getattr(self, "_links_cache", None)  # reports are replaced (every 5 s), never changed in place
        if cached is not None and cached[0] is reports and cached[1] == ids:
            return cached[2]

        def cell(a: str, b: str, field: str) -> float | None:
            stat = reports[a].links.get(b) if a in reports else None
            value = getattr(stat, field) if stat is not None else None
            return round(value, 3) if value is not None else None

        out = {"peers": ids,
               "rtt_ms": [[None if a == b else cell(a, b, "rtt_ms") for b in ids] for a in ids],
               "bandwidth_mbps": [[None if a == b else cell(a, b, "bandwidth_mbps") for b in ids] for a in ids]}
        self._links_cache = (reports, ids, out)
        return out

    def _waiting_reason(self, live: list[dict]) -> str:
        need = max(self.cfg.membership.min_peers, self.cfg.pipeline.stages)
        if self.state.finished:
            return ""
        if not self.table.rounds:
            return f"waiting for peers: {len(live)} of {need} needed to start" if len(live) < need else ""
        current = self.table.rounds.get(self.table.committed + 1)
        if current is None:
            return "deciding the next round"
        by_id = {p["id"]: p for p in live}
        members = [by_id.get(m.peer_id) for m in current.members]
        syncing = [p for p in members if p and p["state"] == "syncing"]
        behind = [p for p in members if p is None or p["state"] != "syncing"]
        if syncing and behind:
            lost = sum(1 for p in members if p is None)
            extra = f" ({lost} lost)" if lost else ""
            return (f"outer step {current.step}: {len(syncing)} of {len(members)} members are ready; "
                    f"waiting for {len(behind)}{extra}")
        return ""

    # ------------------------------------------------------------------ PeerService (checkpoints only)

    def ping(self, request: pb.PingRequest) -> pb.PingReply:
        return pb.PingReply(peer_id=self.id, state="coordinator", version=self.table.committed, sent_at=request.sent_at)

    def _stage_server(self, stage: int) -> SnapshotServer:
        server = self.stage_servers.get(stage)
        if server is None:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, f"no checkpoint of stage {stage}")
        return server

    def get_state_info(self, request: pb.StateInfoRequest) -> pb.StateInfo:
        return self._stage_server(request.stage).get_state_info(request)

    def fetch_state(self, request: pb.StateRequest) -> Iterator[pb.StateChunk]:
        return self._stage_server(request.stage).fetch_state(request)

    def _not_here(self, *_: Any) -> Any:
        raise Rejected(grpc.StatusCode.UNIMPLEMENTED, "the coordinator takes no part in the all-reduce")

    push_contribution = push_result = fetch_result = push_pipe = _not_here


# What a resumed run may change: how the model is laid out and how peers are managed, not what is
# trained (model, data, optimizers, codec) -- a universal checkpoint re-splits into any stage count.
RESUMABLE_SECTIONS = {"pipeline", "membership", "links", "diloco"}


def _admin_token(journal_dir: Path) -> str:
    """The token admin actions need: $POTLUCK_ADMIN_TOKEN, else one kept in the journal dir (0600)."""
    token = os.environ.get("POTLUCK_ADMIN_TOKEN", "")
    if token:
        return token
    path = journal_dir / "admin.token"
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_urlsafe(24)
    journal_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def latest_checkpoint(journal_dir: str | Path) -> Snapshot | None:
    return CheckpointStore(Path(journal_dir) / "checkpoints").latest_valid()
