"""The coordinator: hosts a run's DHT, decides its rounds, keeps its journal, serves its status.

It is not on the data path (peers keep training on the last plan while it is away). Every ``tick_s``::

    gather      read the peers' signed records             (membership: who is live)
                fold them into the round lifecycle          (rounds: committed | failed -> rolled back)
                place and decide the next round when due    (placement off the loop)
    decide      what to do about it, as values             (decisions.decide: pure)
    carry out   journal saves (written off the loop), plans put in the DHT, checkpoints asked for, log lines
    then        rebuild the status snapshot, and hand its new points to the experiment trackers (never waiting)

The checkpointer, the placement worker, the pinger, the journal writer and the trackers run on threads of their own;
this loop alone applies their results."""

from __future__ import annotations

import shlex
import shutil
import threading
import time
from collections import deque
from functools import partial
from pathlib import Path
from typing import Any, cast

from potluck import __version__
from potluck.coordinator import bootstrap, decisions
from potluck.coordinator.health import Health
from potluck.coordinator.placement.placement import PlacementWorker, grid_for, members
from potluck.coordinator.rounds import history, roundevents
from potluck.coordinator.rounds.finishing import Finish
from potluck.coordinator.rounds.rounds import Rounds
from potluck.coordinator.status.snapshot import RunInfo, Series, build, export_command
from potluck.coordinator.status.status import StatusServer
from potluck.coordinator.store.checkpointer import Checkpointer, Job
from potluck.coordinator.store.journal import JournalError, JournalWriter
from potluck.coordinator.swarm.membership import PeerTable, announce, describe_round
from potluck.coordinator.swarm.pings import Waiting
from potluck.coordinator.swarm.publisher import Publisher
from potluck.coordinator.swarm.reader import Reader
from potluck.coordinator.swarm.service import IDLE_CONNECTION_S, CoordinatorService, Pinger
from potluck.coordinator.trackers.backends import TrackerError
from potluck.coordinator.trackers.feed import Trackers
from potluck.coordinator.trust.admission import Gatekeeper
from potluck.coordinator.trust.integrity import Integrity
from potluck.protos.config.runconfig import CoordinatorConfig, RunConfig
from potluck.protos.config.section import ConfigError
from potluck.protos.net.errors import CannotBind
from potluck.protos.net.identity import Identity
from potluck.protos.net.swarm import DHTTimeout, JoinError
from potluck.protos.net.transport import PeerClient, PeerServer, Traffic
from potluck.protos.runtime.log import get_logger, set_context, short_id
from potluck.protos.runtime.stopping import stop_each
from potluck.protos.testkit.faults import fault

log = get_logger(__name__)


class Coordinator:
    def __init__(self, cfg: RunConfig, *, exit_when_finished: bool = False, ready_file: str | None = None) -> None:
        c = cfg.coordinator
        self.cfg, self.exit_when_finished, self.ready_file = cfg, exit_when_finished, ready_file
        set_context(role="coordinator")  # (its id once its identity is loaded, below)
        self.stopping, self.traffic = threading.Event(), Traffic()
        self._wake = threading.Event()  # set by what finished off the loop (pings, a journal save): the next tick now
        self.finish = Finish()  # the run's end: all steps committed, or the admin's request from the status page
        self.events: deque[dict[str, Any]] = deque(maxlen=500)
        self._made_folder = not Path(c.journal_dir).exists()  # (a start that fails in a folder it made removes it)
        self._serving = False
        self.journal, self.state = bootstrap.open_journal(cfg)  # checks the run first: a refused one writes nothing
        self.writer = JournalWriter(self.journal, done=self._wake.set)  # (saves off the loop)
        self.identity = Identity.load_or_create(Path(c.journal_dir) / "identity.key")
        self.id, self.run_id = self.identity.peer_id, self.state.run_id
        self.table, self.rounds = PeerTable.for_run(cfg), Rounds.for_run(cfg)
        self.gate = Gatekeeper(cfg, self.run_id, self.id, Path(c.journal_dir), self.state.revoked, self.state.admitted)
        self.tls = None if c.insecure else self.gate.tls  # gRPC with peers over mutual TLS unless --insecure
        self.client = PeerClient(self.traffic, tls=self.tls, idle_connection_s=IDLE_CONNECTION_S)
        self.pinger = Pinger(self.client, self.run_id, self.id, done=self._wake.set)  # (off the loop; it wakes it)
        self.gate.admission.on_revoke = self._revoked  # (revoked: in no later round; its shards audited again)
        self.table.on_lost = self.client.forget  # (lost: its channels close)
        self.table.on_seen = self.pinger.prime  # (seen: pinged before a decision)
        self.checkpointer = Checkpointer.for_run(cfg, self.client, self.run_id, self.id)
        self.integrity = Integrity.for_run(cfg, self.client, self.run_id, self.id, self.state.trust)
        self.gate.evictions.trusted = self.integrity.trust.eligible
        self.gate.evictions.trust_moved = self.integrity.trust.moved
        self.placement = PlacementWorker(cfg, cfg.links.search_budget_s)
        self.series, self.health, self.folder = Series(), Health(settle=True), history.Folder()
        self.node = self.reader = self.publisher = cast(Any, None)  # (the DHT node, its reader and publisher: start())
        self.grpc: PeerServer | None = None
        self.status: StatusServer | None = None
        self.info = RunInfo(self.run_id, self.id, "", "", time.time(), self.state.finished)
        self._snapshot = dict[str, Any]()
        self.trackers = Trackers(cfg, self.run_id)  # (opened at the start; fed each snapshot, off the loop)
        self.loop = decisions.LoopState(decisions.Rules(cfg.diloco.outer_steps, c.checkpoint_every))
        set_context(role="coordinator", peer_id=self.id)

    def run(self) -> int:
        try:
            self.start()
            while not self.stopping.is_set():
                t0, c0 = time.monotonic(), time.thread_time()
                try:
                    self.tick()
                except DHTTimeout as err:  # a wedged or swamped DHT process: the next tick tries again
                    log.warning("%s", err)
                self.health.ticked(time.monotonic() - t0, time.thread_time() - c0)  # (then settles or collects the heap)
                if self.exit_when_finished and self.state.finished and self.finish.drained(self.checkpointer, self.table):
                    log.info("run finished; exiting")
                    break
                self._wake.wait(max(0.0, self.cfg.coordinator.tick_s - (time.monotonic() - t0)))  # (or a decision's
                self._wake.clear()  # pings are in: it is decided at once, not up to a tick later)
            return 0
        except (ConfigError, JournalError, CannotBind, JoinError, TrackerError) as err:
            log.error("%s", err)
            return 2
        finally:
            self.stop()
            if self._made_folder and not self._serving:  # (it never served: no run to resume, nothing to keep)
                shutil.rmtree(self.cfg.coordinator.journal_dir, ignore_errors=True)

    def start(self) -> None:
        s = self.state
        self.trackers.start(s.committed, s.epoch)  # (first: a tracker that cannot start leaves nothing started)
        c = bootstrap.kept_ports(self.cfg.coordinator, s)  # (where it listened before: its join address survives)
        try:
            self._serve(c)
        except CannotBind as err:
            raise bootstrap.kept_port_taken(err, c, s) from None
        assert self.grpc is not None and self.status is not None  # (_serve started both)
        s.ports = {"dht": bootstrap.port_of(self.node.maddrs), "grpc": self.grpc.port, "status": self.status.port}
        self._serving = True
        self._save()
        bootstrap.announce(self.info, self.publisher.manifest, self.rounds.committed, self.cfg, self.ready_file)

    def _serve(self, c: CoordinatorConfig) -> None:
        s = self.state
        self.rounds.restore(s.committed, s.epoch, s.rounds, s.hashes, s.outcomes, time.monotonic(), s.cursors)
        self.checkpointer.start()
        if resharded := bootstrap.resume_layout(self.rounds, self.checkpointer.served, self.state, self.cfg):
            self._event("reshard", "", resharded)  # another stage count: on from the newest checkpoint
            self._save()
        self.node = bootstrap.start_node(self.identity, Path(c.journal_dir) / "identity.key", c, list(s.known_peers))
        self.reader = Reader(self.node, self.cfg)
        self.rounds.resumed(time.monotonic())  # (the node's start took its time: the journaled round's grace starts now)
        host = bootstrap.public_host(c)
        self.grpc = bootstrap.grpc_server(CoordinatorService(self.id, lambda: self.rounds.committed, self.checkpointer),
                                          self.traffic, c, self.tls, self.gate.revoked, self.run_id)
        self.status, self.info.fingerprint = bootstrap.status_server(c, host, lambda: self._snapshot,
                                                                     {"finish": lambda body: self.finish.request(
                                                                         body, self.rounds.committed)})
        self.info.join_address = bootstrap.join_address(self.node, host, self.id)
        self.info.status_url = f"{'https' if self.info.fingerprint else 'http'}://{host}:{self.status.port}/"
        manifest = bootstrap.manifest(self.cfg, s, self.info, f"{host}:{self.grpc.port}", self.checkpointer.served,
                                      self.gate.ca.cert_pem.decode())
        self.publisher, self.info.samples = Publisher(self.node, manifest, self.gate.admission.revoked), manifest.data.samples
        self.publisher.publish(self.rounds.rounds.values())
        self._event("started", "", f"coordinator {__version__} serving run {self.run_id} at step {self.rounds.committed}")

    def stop(self) -> None:
        self.stopping.set()
        fault("shutdown.start")
        try:
            self._save()  # the history's latest figures, on a clean shutdown
        except OSError as err:
            log.warning("could not save the journal on shutdown: %s", err)
        stop_each((partial(self.trackers.close, self._snapshot, time.monotonic()), self.writer.stop, self.status.stop if self.status else None, self.grpc.stop if self.grpc else None,
                   self.checkpointer.stop, self.placement.stop, self.integrity.stop, self.client.close,
                   self.node and self.node.shutdown), "stopping the coordinator")

    def tick(self) -> None:
        """One turn of the loop: gather what happened, decide what to do (:func:`decisions.decide`, pure), carry it
        out, then the status snapshot."""
        began, now = time.thread_time(), time.monotonic()  # (a long tick leaves what may wait to the next)
        inputs = self._gather(now, began)
        self.loop, actions = decisions.decide(self.loop, inputs, now)
        for action in actions:
            self._carry_out(action)
        if self.loop.hurried or self.gate.admission.more:
            self._wake.set()  # (a save owed, admissions past a tick's budget: the next tick starts at once)
        self.info.finished = self.state.finished
        self.info.checkpoint_version = self.publisher.manifest.checkpoint_version
        long = self.health.long(began) or self.loop.holding
        if self.health.snapshot_due(now, inputs.history_added, self.cfg.coordinator.tick_s, long):
            self._snapshot = build(self.info, self.cfg, list(self.table.peers.values()), self.rounds, self.state.history,
                                   self.state.rolled_back, self.events, self.series, self.reader.links.records,
                                   health=self.health.section(self.reader.stats(), len(self.table.peers)))
            self.health.snapshot_built(now)
            self.trackers.offer(self._snapshot, now)

    def _gather(self, now: float, began: float) -> decisions.Inputs:
        """What happened since the tick before: the peers' records read and folded into the membership, the audits
        and the round lifecycle, checkpoints written, the run's end, a round placed and decided when one is due;
        the plan republished where it changed and the history made to follow the rounds (both are views of the
        rounds, kept by the loop that owns them)."""
        if self.writer.error is not None:
            raise JournalError(f"could not write the journal {self.journal.path}: {self.writer.error}")
        refused = self.reader.poll(now)  # what the DHT reads brought (only the records that changed), refusals said once
        records, notes = self.gate.tick(self.node, self.reader.peers.records, self.rounds.round_at, self.client,
                                        (self.reader.admissions.records, refused), self.reader.peers.take)
        for kind, pid, message in notes:  # (kinds from the admission room, never read off the message's text)
            self._event(kind, pid, message)
        self.publisher.revoked_changed()
        met = False
        for kind, pid, message, warn in announce(self.table.update(records, now, self.reader.peers.as_of), self.table,
                                                 self.cfg):
            self._event(kind, pid, message, warn)
            met = met or kind in ("joined", "back")  # (a restart rejoins the swarm through them)
        changed = {v.record.peer_id: v.record for v in self.table.changed}
        for pid, message in self.integrity.observe(changed, self.rounds.round_at):
            self._event("audit", pid, message, True)
        for kind, pid, message in self.integrity.complaints(changed, self.rounds.round_at):
            self._event(kind, pid, message, True)
        reports, checkpoint = self.table.reports(), self.checkpointer.checkpoint()
        retract = partial(self.rounds.retract, reports=reports, checkpoint=checkpoint, now=now)
        events = self.integrity.judge(self.gate.admission.revoke, retract, self._event)
        events += self.rounds.observe(reports, now, checkpoint, self.table.take_changed())
        for ev in events:
            if isinstance(ev, roundevents.RolledBack):  # (before the fold: no report of the new epoch is folded into a step undone)
                self.state.history, undone = history.roll_back(self.state.history, ev.to_version)
                self.state.rolled_back = (self.state.rolled_back + undone)[-200:]
        written = self.checkpointer.written()
        for message, warn in self.checkpointer.upload_news():  # (the store failing or back: the page's events)
            self._event("checkpoint", "", message, warn)
        for done in written:
            self.rounds.adopt_checkpoint(done.checkpoint)
        over, admin = self.finish.due(self.cfg, self.rounds, self.table.reports(), now, self.integrity)
        decided = None if self.loop.holding or self.state.finished else self._placed(now)
        if not self.loop.holding and decided is None:  # (never a round not journaled yet; before a fold: peers wait)
            if self.publisher.publish(self.rounds.rounds.values(), partial(self.health.waits, "plan", began, 1)):
                self._wake.set()  # (a long tick's plan: the next tick starts at once)
        self.state.history, added = self.folder.fold(self.state.history, self.table.records(changed=True),
                                                     self.rounds.round_at, self.rounds.committed, self.table.records(),
                                                     partial(self.health.waits, began=began))
        return decisions.Inputs(
            committed=self.rounds.committed, finished=self.state.finished, events=tuple(events),
            checkpoints=tuple(decisions.Written(d.version, d.path.name) for d in written), peers_met=met,
            history_added=added, admissions_due=self.gate.admission.journal_due(), over=over, admin=admin,
            decided=decided, durable=self.writer.durable, long=self.health.long(began))

    def _placed(self, now: float) -> decisions.Decided | None:
        """The next round, placed and decided, when one is due and its pings are in; else None (not due, its pings
        still out, not one whole pipeline yet, or the placement's search still running off this loop)."""
        live, made = self.table.live(), self.rounds.rounds.get(self.rounds.committed)
        min_peers = self.cfg.membership.min_peers
        due = self.health.due(self.rounds.ready_to_decide(len(live), min_peers, now, self.table.reports()), now)
        if self.rounds.committed >= self.cfg.diloco.outer_steps or not (due or self.rounds.settling(len(live), min_peers)):
            return None
        at_work = partial(self.table.at_work, self.rounds.committed, self.rounds.epoch, made)  # (they need no ping)
        short = partial(self.rounds.short_of, live=len(live), min_peers=min_peers, now=now)
        if isinstance(answered := self.pinger.poll((v.record for v in live), at_work, due, short), Waiting):
            return None  # (answered.why: pings started, or in flight, off this loop; settling; short of min_peers)
        records, began = answered.records, self.health.decision_began(answered.began)  # (from when it was due, or its pings)
        before = {m.peer_id: (m.stage, m.replica) for m in getattr(made, "members", [])}
        placed = grid_for(self.cfg, records, self.rounds.stages, before, self.reader.links.records, self.placement)
        if placed is None:
            return None
        if (replan := placed[1]) is not None and any(before.get(pid) != cell for pid, cell in placed[0].items()):
            self._event("replan", "", replan.describe())
        cells, audits = self.integrity.roles(members(placed[0], records), self.rounds)  # owners past probation; audits
        return decisions.Decided(self.rounds.decide(cells, now, time.time(), self.table.reports(), audits), before, began)

    def _carry_out(self, action: decisions.Action) -> None:
        """The executor: one action :func:`decisions.decide` chose, done."""
        match action:
            case decisions.Note(kind, peer, message, warn):
                self._event(kind, peer, message, warn)
            case decisions.Commit(step):
                fault("coordinator.committed", step)
                self.integrity.committed(self.rounds.round_at(step), step, self.table.reports())
                self._remember_peers()
            case decisions.WantCheckpoint(step):
                if (rnd := self.rounds.round_at(step)) is not None:
                    self.checkpointer.want(Job.of(rnd, step, self.rounds.canonical, self.rounds.data.cursor(step)))
            case decisions.RollBack(to_version):
                self.integrity.rolled_back(to_version)
            case decisions.AdoptCheckpoint(version):
                self.state.checkpoints = [p.name for p in self.checkpointer.store.manifests()]
                self.publisher.update(checkpoint_version=version)
            case decisions.PrintExport():
                journal = shlex.quote(str(Path(self.cfg.coordinator.journal_dir).expanduser().resolve()))
                print(f"  export the model: {export_command(self.cfg, journal)}", flush=True)  # (the page shows JOURNAL_DIR)
            case decisions.MarkFinished():
                self.state.finished = True
                self.publisher.update(finished=True)
            case decisions.RememberPeers():
                self._remember_peers()
            case decisions.Save(ticket):
                self.writer.submit(self._encode(), ticket)
            case decisions.Publish(decided):
                self.publisher.new_plan(self.rounds.rounds.values())
                self._event("round", "", describe_round(decided.round, decided.before))
                self.health.decided(time.monotonic() - decided.began)
                fault("coordinator.decided", decided.round.step)

    def _revoked(self, peer_id: str) -> None:
        """A peer evicted, for whatever reason: in no later round, and the shards it owned that no auditor vouched for
        are audited again (or rolled back: :meth:`Integrity.evicted`)."""
        self.table.evict(peer_id)
        self.integrity.evicted(peer_id, self.rounds.round_at, self.rounds.committed)

    def _remember_peers(self) -> None:
        self.state.known_peers = bootstrap.known_peers([v.record for v in self.table.live()], self.state.known_peers)

    def _encode(self) -> bytes:
        """The journal's bytes: the run's state as the loop holds it now."""
        s, r = self.state, self.rounds
        r.prune_hashes()
        s.committed, s.epoch, s.rounds, s.hashes = r.committed, r.epoch, list(r.rounds.values()), r.hashes
        s.cursors, s.outcomes = r.data.to_json(), [vars(o) for o in r.outcomes]
        s.revoked, s.trust = sorted(self.gate.admission.revoked), self.integrity.trust.to_json()
        s.admitted = self.gate.admission.journaled()
        return self.journal.encode(s)

    def _save(self) -> None:
        """Save the journal now and wait for it (outside the loop's ticks: the start, a reshard, the stop)."""
        self.writer.submit(self._encode(), 0)
        self.writer.flush()
        if self.writer.error is not None:
            raise self.writer.error

    def _event(self, kind: str, peer: str, message: str, warn: bool = False) -> None:
        self.events.append({"t": time.time(), "kind": kind, "peer": peer, "message": message})
        if kind != "round":
            (log.warning if warn else log.info)("%s%s", f"{short_id(peer)} " if peer else "", message)

