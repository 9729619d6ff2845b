"""Bringing a coordinator up: its journal, identity, DHT node and the addresses it tells the world.

Restarted with the same journal directory, a coordinator keeps its identity (so the join address
stays valid), resumes at the committed outer step, and rejoins the swarm its peers kept running
through the peer addresses its journal remembers.

Nothing is written before the run passed its :func:`~potluck.coordinator.preflight.preflight`: a run its
peers could not train (no corpus, too big for any peer, another run's journal) is refused in one line,
and the fixed run file starts afresh (a journal that never committed a step pins no config).
"""

from __future__ import annotations

import json
import secrets
import shlex
import time
from collections.abc import Callable
from pathlib import Path

from potluck.coordinator.preflight import preflight
from potluck.coordinator.rounds import history
from potluck.coordinator.rounds.rounds import Rounds
from potluck.coordinator.status.snapshot import RunInfo
from potluck.coordinator.status.status import StatusServer
from potluck.coordinator.status.status_tls import status_tls
from potluck.coordinator.store.checkpointer import Served
from potluck.coordinator.store.journal import (
    Journal,
    JournalState,
    changed_sections,
    kept_secret,
    write_atomic,
)
from potluck.data import DataError
from potluck.data.corpus import ShardCorpus, locate
from potluck.protos.config.runcheck import file_identity, markov_identity, non_public
from potluck.protos.config.runconfig import CoordinatorConfig, RunConfig
from potluck.protos.config.section import ConfigError
from potluck.protos.net.certs import TlsIdentity
from potluck.protos.net.dhtguard import run_key
from potluck.protos.net.errors import CannotBind
from potluck.protos.net.identity import Identity
from potluck.protos.net.relay import RelayHub
from potluck.protos.net.servicer import Handlers
from potluck.protos.net.swarm import JoinError, SwarmNode, guess_reachable_host, host_of_multiaddr
from potluck.protos.net.transport import PeerServer, Traffic
from potluck.protos.runtime.log import get_logger
from potluck.protos.wire.envelope import next_seq
from potluck.protos.wire.records import DataIdentity, Manifest, PeerRecord
from potluck.protos.wire.refusals import log_refusal

log = get_logger(__name__)

def open_journal(cfg: RunConfig) -> tuple[Journal, JournalState]:
    """The run's journal: resumed if it exists and fits ``cfg``, else a new one.

    Raises ConfigError or JournalError (before anything is written) if the run cannot be trained."""
    checked = preflight(cfg)
    for note in checked.notes:
        log.info("%s", note)
    for warning in checked.warnings:
        log.warning("%s", warning)
    if cfg.data.source in ("shards", "hf"):
        log.info("the run's data: %s", shard_identity(cfg))
    journal = Journal(cfg.coordinator.journal_dir)
    state = journal.load()
    if state is None or not state.committed_run():
        run_id = cfg.run_id or (state.run_id if state else "") or f"run-{secrets.token_hex(3)}"
        fresh = JournalState(run_id=run_id, config=cfg.manifest_sections(), created_at=time.time())
        if state is not None:  # (restarted before its first committed step: the same address, the same peers)
            fresh = state.carried(fresh)
        journal.save(fresh)
        return journal, fresh
    changed = changed_sections(journal.path, state, cfg)
    if changed:
        log.info("resuming run %s with changed config sections: %s", state.run_id, ", ".join(changed))
        state.config = cfg.manifest_sections()
        if state.finished and state.committed < cfg.diloco.outer_steps:
            state.finished = False  # the run was extended
        journal.save(state)
    log.info("resuming run %s from the journal at outer step %d", state.run_id, state.committed)
    return journal, state


def resume_layout(rounds: Rounds, served: Served | None, state: JournalState, cfg: RunConfig) -> str:
    """Adopt the served checkpoint's hashes; resumed with another stage count, restart the run from that
    checkpoint re-split into the new stages (steps after it are rolled back). Returns the event to log."""
    latest = rounds.latest
    if latest is None or latest.stages == rounds.stages:
        if served is not None:
            rounds.adopt_checkpoint(served.checkpoint())
        return ""
    if served is None:
        raise ConfigError(f"pipeline.stages changed from {latest.stages} to {rounds.stages}, but there is no "
                          "checkpoint to re-split; keep the old value")
    rounds.reshard(rounds.stages, served.checkpoint(), time.monotonic())
    state.history, undone = history.roll_back(state.history, served.version)
    state.rolled_back += undone
    state.finished = served.version >= cfg.diloco.outer_steps
    return (f"pipeline.stages changed from {latest.stages} to {rounds.stages}: resuming from the checkpoint of "
            f"v{served.version} re-split into {rounds.stages} stages")


def manifest(cfg: RunConfig, state: JournalState, info: RunInfo, grpc_address: str, served: Served | None,
             ca_pem: str) -> Manifest:
    """What a run is, as peers read it: its config, identity of its data, addresses, and how to join safely."""
    c = cfg.coordinator
    return Manifest(run_id=state.run_id, coordinator=info.coordinator, config=cfg.manifest_sections(),
                    created_at=state.created_at, coordinator_grpc=grpc_address, status_url=info.status_url,
                    finished=state.finished, seq=next_seq(), checkpoint_every=c.checkpoint_every,
                    checkpoint_version=served.version if served else 0, data=data_identity(cfg),
                    security="insecure" if c.insecure else "mtls", admission=cfg.admission.mode,
                    pow_bits=cfg.admission.pow_bits if cfg.admission.mode == "open" else 0, ca_pem=ca_pem)


def known_peers(live: list[PeerRecord], before: list[str], keep: int = 16) -> list[str]:
    """The DHT addresses a restarted coordinator rejoins through: the live peers' first, then those known before
    (one of them may be back; the live ones alone shrink to whoever was admitted after the last restart)."""
    return list(dict.fromkeys([m for rec in live for m in rec.dht_maddrs[:1]] + before))[:keep]


PORTS = {"dht": ("dht_port", "--dht-port"), "grpc": ("grpc_port", "--grpc-port"), "status": ("status_port", "--status-port")}


def kept_ports(c: CoordinatorConfig, state: JournalState) -> CoordinatorConfig:
    """``c`` with the ports this run listened on before (its journal's) where ``c`` leaves the choice to the system
    (0): a coordinator restarted with the same command is at the same join address and status page."""
    kept = {field: state.ports[name] for name, (field, _) in PORTS.items()
            if getattr(c, field) == 0 and state.ports.get(name)}
    if kept:
        log.info("listening where this run did before (its journal): %s",
                 ", ".join(f"{name} port {state.ports[name]}" for name, (field, _) in PORTS.items() if field in kept))
    return c.model_copy(update=kept)


def kept_port_taken(err: CannotBind, c: CoordinatorConfig, state: JournalState) -> CannotBind:
    """A bind failure on a port kept from the journal says so, and how to move the run (its peers find a
    coordinator on new ports again by its id, through the DHT and the peers it knew)."""
    for name, (field, flag) in PORTS.items():
        if err.flag == flag and state.ports.get(name) == getattr(c, field) == err.port:
            return KeptPortTaken(err.what, err.host, err.port, flag, f"coordinator.{field}", err.reason or "it is taken")
    return err


class KeptPortTaken(CannotBind):
    """A port this run listened on before (kept in its journal, so that its address survives a restart) is taken."""

    def __str__(self) -> str:
        return (f"{self.what} {self.port} on {self.host}, where this run listened before (its journal keeps the port, "
                f"so that its join address survives a restart), is taken ({self.reason}); stop what holds it, or move "
                f"the run with {self.flag} PORT: its peers find it again by its id")


def start_node(identity: Identity, identity_path: Path, c: CoordinatorConfig, known: list[str]) -> SwarmNode:
    """The DHT node the swarm bootstraps from; after a restart, rejoined through ``known`` peers. Its node id is
    its peers key's: the nearest node to that key, it stores every heartbeat and reads them locally.

    Bounded as a whole by ``startup_timeout_s``: a rejoin that fails leaves the rest of it to starting a
    new swarm, and a start that does not end in time is a JoinError (the coordinator exits with it)."""
    deadline = time.monotonic() + c.startup_timeout_s

    def start(peers: list[str]) -> SwarmNode:
        left = deadline - time.monotonic()
        if left <= 0:
            raise JoinError(f"could not start a DHT node within coordinator.startup_timeout_s = "
                            f"{c.startup_timeout_s:g} s; on a slow machine raise it")
        return SwarmNode(identity, initial_peers=peers, coordinator=identity.peer_id, host=c.host, port=c.dht_port,
                         announce_host=c.announce_host, startup_timeout=left, identity_path=identity_path,
                         node_id_source=run_key(identity.peer_id, "peers"))

    try:
        node = start(known)
    except JoinError as err:
        if not known:
            raise
        log.warning("none of the %d peers known from the journal answered (%s); starting a new swarm", len(known), err)
        return start([])
    if known:
        log.info("rejoined the swarm through %d peers known from the journal", len(known))
    return node


def shard_identity(cfg: RunConfig) -> DataIdentity:
    """The run's shards, fetched or prepared here and checked: ConfigError, naming the fix, if they cannot train it."""
    try:
        return ShardCorpus.open(locate(cfg.data), cfg.data, cfg.model).identity(cfg.data.source)
    except DataError as err:
        where = f"data.path = {cfg.data.path!r}" if cfg.data.source == "shards" else f"data.hf_dataset = {cfg.data.hf_dataset!r}"
        raise ConfigError(f"{where}: {err}") from None


def data_identity(cfg: RunConfig) -> DataIdentity:
    """What the manifest tells peers about the run's data (the file was hashed by check_run already)."""
    if cfg.data.source == "markov":
        return markov_identity(cfg.data, cfg.model)
    if cfg.data.source in ("shards", "hf"):
        return shard_identity(cfg)
    assert cfg.data.path is not None
    try:
        found = file_identity(Path(cfg.data.path).expanduser())
        windows = (found.size - 1) // cfg.model.seq_len - cfg.data.eval_samples
        return found.model_copy(update={"samples": min(cfg.data.num_samples, windows)})
    except OSError as err:  # it was there a moment ago (check_run)
        raise ConfigError(f"data.path = {cfg.data.path!r}: cannot read it ({err.strerror or err})") from None


def public_host(c: CoordinatorConfig) -> str:
    """The address peers reach this box at; says so when peers on other machines will not reach it."""
    if c.announce_host:
        return c.announce_host
    if c.host not in ("0.0.0.0", "::", ""):
        if non_public(c.host) == "loopback":
            log.info("listening on %s: peers on this machine only (for volunteers elsewhere pass --host 0.0.0.0)",
                     c.host)
        return c.host
    guessed = guess_reachable_host()
    kind = non_public(guessed)
    if kind:
        log.warning("announcing %s (a %s address, guessed from this box's route to the internet): peers on other "
                    "networks will not reach it; pass --announce-host PUBLIC_IP, the address they reach this box at",
                    guessed, kind)
    return guessed


def port_of(maddrs: list[str]) -> int:
    """The TCP port of a node's multiaddrs (``/ip4/.../tcp/PORT/p2p/...``)."""
    return int(maddrs[0].split("/tcp/")[1].split("/")[0])


def join_address(node: SwarmNode, host: str, peer_id: str) -> str:
    """The multiaddr peers join through: one of the node's own at ``host`` if it has one."""
    maddrs = node.maddrs
    for m in maddrs:
        if host_of_multiaddr(m) == host:
            return m
    return f"/ip4/{host}/tcp/{port_of(maddrs)}/p2p/{peer_id}"


def announce(run: RunInfo, manifest: Manifest, committed: int, cfg: RunConfig, ready_file: str | None) -> None:
    """Tell the operator (and a launcher waiting on ``ready_file``) where the run can be found."""
    # the command pastes and runs on this machine as it is; the notes below it say what differs on another one
    journal, flags, notes = Path(cfg.coordinator.journal_dir), [], []
    if cfg.admission.mode == "private":
        flags.append(f'--token "$(cat {shlex.quote(str((journal / "join.token").resolve()))})"')
        notes.append("the join token is read from its file here; hand it to volunteers out of band")
    if cfg.data.source == "bytes" and cfg.data.path:
        flags.append(f"--data-path {shlex.quote(str(Path(cfg.data.path).expanduser().resolve()))}")
        notes.append(f"on another machine, --data-path is its copy of the corpus (sha256 {manifest.data.sha256})")
    more = "".join(f" {f}" for f in flags) + "".join(f"\n                ({n})" for n in notes)
    tls = f"  status TLS:   SHA-256 {run.fingerprint} (visitors compare it with their browser's)\n" if run.fingerprint else ""
    print(
        f"potluck coordinator ready\n"
        f"  run:          {run.run_id} (outer step {committed} of {cfg.diloco.outer_steps})\n"
        f"  join address: {run.join_address}\n"
        f"  status page:  {run.status_url}\n"
        f"{tls}"
        f"  admin token:  {journal / 'admin.token'} (or $POTLUCK_ADMIN_TOKEN)\n"
        f"  start a peer: potluck peer --join {run.join_address}{more}",
        flush=True,
    )
    if ready_file:
        info = {"run_id": run.run_id, "join": run.join_address, "status_url": run.status_url,
                "grpc": manifest.coordinator_grpc, "coordinator": run.coordinator}
        write_atomic(Path(ready_file), json.dumps(info).encode())


def admin_token(journal_dir: Path) -> str:
    """The token admin actions need: $POTLUCK_ADMIN_TOKEN, else one kept in the journal dir (0600)."""
    return kept_secret(journal_dir / "admin.token", "POTLUCK_ADMIN_TOKEN")


def grpc_server(service: Handlers, traffic: Traffic, c: CoordinatorConfig, tls: TlsIdentity | None,
                revoked: Callable[[str], bool], run_id: str) -> PeerServer:
    """The coordinator's gRPC server: checkpoints for recovering peers, pings, and the relay through
    which peers that accept no connections (``potluck peer --relay``) are reached."""
    return PeerServer(service, traffic, host=c.host, port=c.grpc_port, tls=tls, revoked=revoked, relay=RelayHub(run_id),
                      on_reject=log_refusal)


def status_server(c: CoordinatorConfig, host: str, snapshot: Callable[[], dict], actions: dict) -> tuple[StatusServer, str]:
    """The status page's server (HTTPS when ``status_tls`` says so) and its certificate's fingerprint."""
    tls, fingerprint = status_tls(c.status_tls_cert, c.status_tls_key, c.status_tls == "self-signed",
                                  Path(c.journal_dir), host=host)
    server = StatusServer(c.host, c.status_port, snapshot, admin_token=admin_token(Path(c.journal_dir)),
                          actions=actions, tls=tls)
    return server, fingerprint
