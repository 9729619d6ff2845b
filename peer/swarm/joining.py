"""Joining a run: a DHT node next to the coordinator's, its signed manifest, the run's config.

Everything a peer trains with comes from the manifest the coordinator signed, never from the peer's
own files, so a swarm cannot silently train with two configs. The address a peer announces is the
one other machines reach it at (peers that announced 127.0.0.1 could not be reached by others), and
every failure to join says what was tried and what to check.

The one thing a peer brings from its own disk is its data: a byte corpus (``data.source = "bytes"``)
read at the run's ``data.path`` relative to the peer's working directory, or where ``--data-path``
says, and used only if its sha256 is the one in the manifest; or token shards (``"shards"``,
``"hf"``), fetched from the run's URL or prepared from its dataset into ``data.cache_dir`` (or
found at ``--data-path``), and used only if their index (which hashes every shard and the
tokenizer) is the manifest's.

Then the peer is admitted (:mod:`potluck.peer.swarm.admission`): the coordinator certifies a fresh TLS
key of this process, and the data path runs over mutual TLS with it.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from potluck.data import DataError
from potluck.data.corpus import locate
from potluck.peer.swarm import admission
from potluck.protos.config.files import known_fields_only, parse_config
from potluck.protos.config.runcheck import checked_identity, markov_identity, non_public
from potluck.protos.config.runconfig import PeerConfig, RunConfig
from potluck.protos.config.section import ConfigError
from potluck.protos.net.certs import TlsIdentity, token_proof
from potluck.protos.net.identity import Identity
from potluck.protos.net.swarm import (
    DHTTimeout,
    JoinError,
    SwarmNode,
    guess_reachable_host,
    host_of_multiaddr,
    parse_join_address,
)
from potluck.protos.runtime.log import get_logger, short_id
from potluck.protos.wire.envelope import RecordError
from potluck.protos.wire.records import DataIdentity, Manifest

log = get_logger(__name__)


class Stopped(Exception):
    """Asked to stop (a signal) before the peer had joined: not an error."""


@dataclass
class Joined:
    node: SwarmNode
    manifest: Manifest
    config: RunConfig
    announce_host: str
    joined_at: float
    tls: TlsIdentity  # certified by the run's CA (used for gRPC unless the run is --insecure)
    token_proof: str  # what this peer shows to be (re-)admitted to a private run
    phases: dict[str, float] = field(default_factory=dict)  # seconds spent joining, by phase (for the logs)


def join(cfg: PeerConfig, identity: Identity, stopping: threading.Event) -> Joined:
    """Start a DHT node, find the run's manifest and read its config; raises JoinError, ConfigError or
    DataError (this peer does not have the run's data)."""
    t0 = time.time()
    if cfg.data_path and "://" not in cfg.data_path and not Path(cfg.data_path).expanduser().exists():
        raise ConfigError(f"--data-path {cfg.data_path}: no such file or folder")
    address, coordinator = parse_join_address(cfg.join)
    announce = cfg.announce_host or guess_reachable_host(host_of_multiaddr(address))
    if not cfg.announce_host:
        warn_unreachable(announce, host_of_multiaddr(address) or "")
    node = SwarmNode(identity, coordinator=coordinator, initial_peers=[address], host=cfg.host, port=cfg.dht_port, announce_host=announce,
                     startup_timeout=cfg.startup_timeout_s, client_mode=cfg.dht_client)
    joined_at = time.time()
    try:
        manifest = await_manifest(node, coordinator, cfg.join_timeout_s, stopping)
        config = with_local_data(config_from(manifest), manifest.data, cfg.data_path)
        t_manifest = time.time()
        tls = TlsIdentity.generate()
        token = cfg.token or os.environ.get("POTLUCK_JOIN_TOKEN", "")
        proof = token_proof(token, manifest.run_id, identity.peer_id, tls.public_pem.decode()) if token else ""
        admission.admit(node, manifest, identity.peer_id, tls, proof, cfg.join_timeout_s, stopping)
    except BaseException:
        node.shutdown()
        raise
    return Joined(node, manifest, config, announce, joined_at, tls, proof,
                  {"dht": joined_at - t0, "manifest": t_manifest - joined_at, "admission": time.time() - t_manifest})


def await_manifest(node: SwarmNode, coordinator: str, timeout_s: float, stopping: threading.Event) -> Manifest:
    deadline = time.monotonic() + timeout_s
    last_err = "no manifest in the DHT yet"
    while time.monotonic() < deadline and not stopping.is_set():
        try:
            m = node.get_manifest()
            if m is not None:
                return m
        except (RecordError, DHTTimeout) as err:
            last_err = str(err)
        stopping.wait(0.2)
    if stopping.is_set():
        raise Stopped("stopped while joining")
    raise JoinError(f"found no valid run manifest from coordinator {short_id(coordinator)} in {timeout_s:.0f} s "
                    f"({last_err}); is the coordinator running?")


def config_from(manifest: Manifest) -> RunConfig:
    """The run's config as the manifest states it; fields this version does not know are ignored."""
    data, dropped = known_fields_only(RunConfig, dict(manifest.config))
    if dropped:
        log.warning("manifest has fields this version does not know (ignored): %s", ", ".join(dropped))
    return parse_config({**data, "run_id": manifest.run_id}, source="run manifest")


def with_local_data(config: RunConfig, run_data: DataIdentity, data_path: str | None) -> RunConfig:
    """``config`` with ``data.path`` at this peer's copy of the corpus, once its sha256 is the run's.

    Raises DataError, in one line naming both hashes, the file looked at and the fix, when this
    peer's data is not the run's."""
    d = config.data
    if d.source == "markov":
        if data_path:
            log.warning("--data-path %s is not used: this run trains on built-in synthetic data", data_path)
        mine = markov_identity(d, config.model)
        if run_data.sha256 and mine.sha256 != run_data.sha256:
            raise DataError(f"this peer would draw other synthetic samples than the run (parameters hash "
                            f"{mine.sha256[:16]}, the run's {run_data.sha256[:16]}): run the coordinator's potluck version")
        return config
    if d.source in ("shards", "hf"):  # fetched or prepared into data.cache_dir, and checked against the manifest
        folder = locate(d, override=data_path, expect=run_data if run_data.sha256 else None)
        if not run_data.sha256:
            log.warning("the coordinator did not publish its shards' index sha256: cannot check they are the run's")
        config.data.path = str(folder)
        return config
    assert d.path is not None
    path = Path(data_path or d.path).expanduser().absolute()
    theirs = f"the run's corpus {d.path!r} (sha256 {run_data.sha256 or 'not published'}, {run_data.size} bytes)"
    fix = "get the run's corpus and pass --data-path FILE" + (
        "" if data_path or Path(d.path).expanduser().is_absolute()
        else f" (without it, data.path is looked up in this peer's working directory {os.getcwd()})")
    mine = checked_identity(path, DataError, f"no corpus at {path}: this peer needs {theirs}; {fix}",
                            lambda why: f"cannot read the corpus at {path}: {why}")
    if not run_data.sha256:
        log.warning("the coordinator did not publish its corpus's sha256: cannot check that %s is the run's corpus", path)
    elif (mine.sha256, mine.size) != (run_data.sha256, run_data.size):
        raise DataError(f"this peer's corpus {path} (sha256 {mine.sha256}, {mine.size} bytes) is not {theirs}: {fix}")
    config.data.path = str(path)
    return config


def warn_unreachable(announce: str, coordinator_host: str) -> None:
    """Other peers of a run over the internet reach this one at ``announce``: say so when they cannot."""
    kind = non_public(announce)
    if kind and not non_public(coordinator_host):
        log.warning("announcing %s (a %s address) to a run on the internet: peers on other networks will not reach "
                    "this one; pass --announce-host PUBLIC_IP", announce, kind)


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {choice!r} requested but torch sees no CUDA device")
    return torch.device(choice)


def device_memory(device: torch.device) -> int:
    """Bytes of memory ``device`` has (a CPU: this machine's RAM); 0 when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError):
            return 0
    return 0
