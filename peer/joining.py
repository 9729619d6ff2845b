"""Joining a run: a DHT node next to the coordinator's, its signed manifest, the run's config.

Everything a peer trains with comes from the manifest the coordinator signed, never from the peer's
own files, so a swarm cannot silently train with two configs. The address a peer announces is the
one other machines reach it at (LESSONS: peers that announced 127.0.0.1 could not be reached), and
every failure to join says what was tried and what to check.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from potluck.protos.config import ConfigError, PeerConfig, RunConfig, known_fields_only, parse_config
from potluck.protos.identity import Identity
from potluck.protos.log import get_logger, short_id
from potluck.protos.records import Manifest, RecordError
from potluck.protos.swarm import (
    JoinError,
    SwarmNode,
    guess_reachable_host,
    host_of_multiaddr,
    parse_join_address,
)

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
    phases: dict[str, float] = field(default_factory=dict)  # seconds spent joining, by phase (for the logs)


def join(cfg: PeerConfig, identity: Identity, stopping: threading.Event) -> Joined:
    """Start a DHT node, find the run's manifest and read its config; raises JoinError or ConfigError."""
    t0 = time.time()
    address, coordinator = parse_join_address(cfg.join)
    announce = cfg.announce_host or guess_reachable_host(host_of_multiaddr(address))
    node = SwarmNode(identity, initial_peers=[address], host=cfg.host, port=cfg.dht_port, announce_host=announce,
                     startup_timeout=cfg.startup_timeout_s, client_mode=cfg.dht_client)
    joined_at = time.time()
    try:
        manifest = await_manifest(node, coordinator, cfg.join_timeout_s, stopping)
        config = config_from(manifest)
    except BaseException:
        node.shutdown()
        raise
    return Joined(node, manifest, config, announce, joined_at,
                  {"dht": joined_at - t0, "manifest": time.time() - joined_at})


def await_manifest(node: SwarmNode, coordinator: str, timeout_s: float, stopping: threading.Event) -> Manifest:
    deadline = time.monotonic() + timeout_s
    last_err = "no manifest in the DHT yet"
    while time.monotonic() < deadline and not stopping.is_set():
        try:
            m = node.get_manifest(coordinator)
            if m is not None:
                return m
        except RecordError as err:
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


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {choice!r} requested but torch sees no CUDA device")
    return torch.device(choice)
