"""A hivemind DHT node with typed, signed access to potluck's records.

Both the coordinator and peers hold one :class:`SwarmNode`. Its libp2p identity *is* the process's
potluck identity (:mod:`potluck.protos.net.identity`), so the DHT peer id, the id in records and the key
that signs them are one and the same.

hivemind's DHT runs in a child process; calls to it go through a pipe, so a node should be used
from one thread at a time (the coordinator's loop, a peer's heartbeat thread).
"""

from __future__ import annotations

import atexit
import os
import socket
import tempfile
import threading
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from pydantic import Field

from potluck.protos.net import hivemindenv, spill
from potluck.protos.net.errors import check_port_free
from potluck.protos.net.identity import Identity
from potluck.protos.net.join import JoinError, parse_join_address  # noqa: F401 - re-exported
from potluck.protos.runtime.log import get_logger
from potluck.protos.runtime.stopping import kill_tree
from potluck.protos.wire.admissions import AdmissionRequest, Certificate
from potluck.protos.wire.envelope import Record, RecordError, seal, unseal
from potluck.protos.wire.records import Manifest, PeerRecord, Plan, PlanHead

hivemindenv.apply()  # (before hivemind's first import)

from hivemind.dht import DHTID  # noqa: E402
from hivemind.utils import MSGPackSerializer, get_dht_time  # noqa: E402

from potluck.protos.net.dhtguard import BY_SUBKEY, MAX_TTL_S, RunRecords, run_key  # noqa: E402
from potluck.protos.net.dhtprocess import DHTProcess, free_locks_of_the_dead  # noqa: E402
from potluck.protos.net.feed import changed_records, store_at, store_many  # noqa: E402
from potluck.protos.net.spill import Spill, store_spilled  # noqa: E402

log = get_logger(__name__)

# How long one DHT call may take before the caller is told so and goes on: hivemind's own RPCs time out
# after a few seconds each, so only a wedged DHT process or p2pd gets near this.
DHT_CALL_TIMEOUT_S = 15.0


class LinkStat(Record):
    """What a peer measured of its link to one other peer (``None``: not measured yet)."""

    rtt_ms: float | None = Field(default=None, ge=0, description="round-trip time of a small RPC")
    bandwidth_mbps: float | None = Field(default=None, gt=0, description="achievable rate from the reporter to the other peer")
    samples: int = Field(default=0, ge=0, description="probes and observed transfers merged into these figures")
    ts: float = Field(default=0.0, description="wall-clock time of the newest sample")


class LinkReport(Record):
    """A peer's measurements of its links, ``potluck/<run_id>/links`` subkey = its peer id.

    ``links[q]`` describes the link from ``peer_id`` to ``q`` (the direction a probe's payload and
    an observed push travel), the ``alpha``/``beta`` the scheduler's cost model wants.
    """

    peer_id: str
    ts: float = 0.0
    seq: int = 0
    links: dict[str, LinkStat] = Field(default_factory=dict)


_S = TypeVar("_S", bound=Record)


def guess_reachable_host(target_host: str | None = None) -> str:
    """The local address other machines would use to reach us (the interface that routes to them).

    With no target, the interface that routes to the public internet; loopback targets give
    127.0.0.1. No packet is sent: connecting a UDP socket only selects a route.
    """
    if target_host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    probe = target_host or "8.8.8.8"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((probe, 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def host_of_multiaddr(maddr: str) -> str | None:
    parts = maddr.split("/")
    for proto in ("ip4", "ip6", "dns", "dns4", "dns6"):
        if proto in parts and parts.index(proto) + 1 < len(parts):
            return parts[parts.index(proto) + 1]
    return None


class DHTTimeout(TimeoutError):
    """A DHT call did not answer in time; the caller tries again later."""


class SwarmNode:
    """One DHT node; ``initial_peers`` empty means this node bootstraps a new swarm.

    Start it from a thread that lives as long as the node (the main thread): the DHT process gets
    SIGKILL when the thread that forked it ends.
    """

    def __init__(
        self,
        identity: Identity,
        *,
        coordinator: str,
        initial_peers: list[str] | None = None,
        host: str = "0.0.0.0",
        port: int = 0,
        announce_host: str | None = None,
        startup_timeout: float = 60.0,
        client_mode: bool = False,
        identity_path: str | Path | None = None,
        node_id_source: str | None = None,
    ) -> None:
        # p2pd binds with SO_REUSEPORT, so it would share a taken port silently; refuse it here instead
        check_port_free("DHT port", host, port, "--dht-port")
        self.identity, self.coordinator = identity, coordinator
        self.call_timeout_s = DHT_CALL_TIMEOUT_S
        self._pipe_lock = threading.Lock()
        self.spill = Spill()  # (a big record reaches the DHT process through a file: see protos/net/spill.py)
        tmpdir = None
        if identity_path is None:
            tmpdir = tempfile.TemporaryDirectory(prefix="potluck-id-")
            identity_path = Path(tmpdir.name) / "identity.key"
            identity.save(identity_path)
        announce = [f"/ip4/{announce_host}/tcp/{port}"] if announce_host and port else None
        self._owner_pid = os.getpid()
        self._stopped = False
        self._stop_lock = threading.Lock()
        self.dht = DHTProcess(
            initial_peers=initial_peers or None,
            start=False,
            host_maddrs=[f"/ip4/{host}/tcp/{port}"],
            announce_maddrs=announce,
            identity_path=str(identity_path),
            check_if_identity_free=False,
            startup_timeout=startup_timeout,
            client_mode=client_mode,
            record_validators=[RunRecords(coordinator)],  # this run's signed records only, everywhere
            # one identity, one DHT node id (hivemind draws a random one per process): a restarted peer is the same
            # node, not a second one beside a ghost of itself, and a node that pings a copy of a running peer
            # back (another machine, the same key) hears the id it expects and lets it on to admission, which
            # tells it to use its own key (a random id failed that ping as "can't access this node ... firewall")
            # (the coordinator's is its peers key's own id instead, see :meth:`changes`)
            node_id=DHTID.generate(source=node_id_source or identity.peer_id),
        )
        # multiprocessing's own exit hook would join the DHT process forever (it ignores SIGTERM);
        # ours is registered later, so it runs first
        atexit.register(self._shutdown_at_exit)
        try:  # bounded: hivemind waits for its DHT process forever, even one that died or hung on the way
            self.dht.run_in_background(await_ready=True, timeout=startup_timeout)
        except Exception as err:
            self.shutdown(timeout=0)
            if isinstance(err, TimeoutError):
                err = TimeoutError(f"the DHT process was not ready within {startup_timeout:.0f} s")
            where = f"the swarm at {initial_peers[0]}" if initial_peers else f"a DHT node on {host}:{port}"
            hint = (
                "check that the coordinator is running, that its address is reachable from this machine "
                "(firewall, NAT) and that you copied the whole join address"
                if initial_peers
                else "check that the port is free; on a slow machine raise coordinator.startup_timeout_s"
            )
            raise JoinError(f"could not start or join {where}: {err}; {hint}") from err
        finally:
            if tmpdir is not None:
                tmpdir.cleanup()
        if str(self.dht.peer_id) != identity.peer_id:
            self.shutdown()
            raise JoinError(f"DHT came up as {self.dht.peer_id}, expected {identity.peer_id}")

    @property
    def maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def _store(self, kind: str, record: Any, ttl: float, subkey: str | None = None, wait: bool = True,
               sealed: dict[str, Any] | None = None) -> Any:
        """True if stored; with ``wait=False``, the future of that answer (the caller does not wait for the DHT).
        ``sealed``: ``record`` already sealed for ``ttl`` by :meth:`seal` (a big plan is sealed once, not twice)."""
        if not 0 < ttl <= MAX_TTL_S:  # every node's validator would refuse it: say so here, not with a silent False
            raise ValueError(f"a {kind} record asks to live {ttl:.0f} s; records live (0, {MAX_TTL_S:.0f}] s")
        value = sealed if sealed is not None else seal(self.identity, record, ttl)
        key, expires = run_key(self.coordinator, kind), get_dht_time() + ttl
        direct = subkey is not None and kind in BY_SUBKEY and self.identity.peer_id != self.coordinator
        spilled = self.spill.write(value) if not direct and len(value.get("body", b"")) > spill.SPILL_BYTES else None
        with self._pipe_lock:  # hivemind's DHT pipe is not safe for concurrent senders
            if direct:  # (to the coordinator's own node; a file written for another path would never be read)
                assert subkey is not None  # (direct: stored under a subkey)
                future = self.dht.run_coroutine(partial(store_at, peer=self.coordinator, key=key, subkey=subkey,
                                                        value=value, expiration=expires), return_future=True)
            elif spilled is not None:
                future = self.dht.run_coroutine(partial(store_spilled, key=key, subkey=subkey, path=spilled,
                                                        expiration=expires), return_future=True)
            else:
                future = self.dht.store(key, value, expiration_time=expires, subkey=subkey, return_future=True)
        return bool(self.answer(future, f"storing the {kind} record")) if wait else future

    def seal(self, record: Any, ttl: float, raw: dict[str, str] | None = None) -> dict[str, Any]:
        """``record`` signed by this node's identity, to live ``ttl`` s (``raw``: see :func:`envelope.seal`)."""
        return seal(self.identity, record, ttl, raw)

    def sealed_size(self, record: Any, ttl: float) -> int:
        """Bytes ``record`` (or a value :meth:`seal` made) takes in the DHT once signed by this node's identity."""
        return len(MSGPackSerializer.dumps(record if isinstance(record, dict) else seal(self.identity, record, ttl)))

    def _dht_get(self, kind: str, latest: bool = True) -> Any:
        with self._pipe_lock:
            future = self.dht.get(run_key(self.coordinator, kind), latest=latest, return_future=True)
        return self.answer(future, f"reading the {kind} records")

    def answer(self, future: Any, what: str) -> Any:
        """A DHT call's answer; DHTTimeout past ``call_timeout_s`` (a wedged DHT process must not take
        the heartbeat, the coordinator's loop or a shutdown's goodbye with it)."""
        try:
            return future.result(timeout=self.call_timeout_s)
        except TimeoutError as err:  # (concurrent.futures' TimeoutError is this one since Python 3.11)
            raise DHTTimeout(f"{what}: no answer from the DHT process within {self.call_timeout_s:.0f} s") from err

    # -- the coordinator's records (it signs them; everyone reads them)

    def publish_manifest(self, manifest: Manifest, ttl: float, wait: bool = True) -> Any:
        return self._store("manifest", manifest, ttl, wait=wait)

    def get_manifest(self, min_seq: int = 0) -> Manifest | None:
        found = self._dht_get("manifest")
        return None if found is None else unseal(Manifest, found.value, author=self.coordinator, min_seq=min_seq)

    def publish_plan(self, plan: Plan, ttl: float, wait: bool = True, sealed: dict[str, Any] | None = None) -> Any:
        return self._store("plan", plan, ttl, wait=wait, sealed=sealed)

    def get_plan(self, min_seq: int = 0) -> Plan | None:
        found = self._dht_get("plan")
        return None if found is None else unseal(Plan, found.value, author=self.coordinator, min_seq=min_seq)

    def publish_plan_head(self, head: PlanHead, ttl: float, wait: bool = True) -> Any:
        return self._store("plan_head", head, ttl, wait=wait)

    def get_plan_head(self) -> PlanHead | None:
        found = self._dht_get("plan_head")
        return None if found is None else unseal(PlanHead, found.value, author=self.coordinator)

    def publish_certificate(self, cert: Certificate, ttl: float) -> bool:
        return self._store("certs", cert, ttl, subkey=cert.peer_id)

    def publish_certificates(self, certs: list[Certificate], ttl: float) -> Any:
        """Store many certificates in one DHT call (one search, one store per replica), without waiting:
        the future of whether all were stored. A thousand joiners' answers, one at a time, took minutes."""
        items = [(cert.peer_id, seal(self.identity, cert, ttl)) for cert in certs]
        fn = partial(store_many, key=run_key(self.coordinator, "certs"), items=items, expiration=get_dht_time() + ttl)
        with self._pipe_lock:
            return self.dht.run_coroutine(fn, return_future=True)

    def get_certificate(self, peer_id: str) -> Certificate | None:
        """The coordinator's answer to ``peer_id``'s admission request, if any (RecordError if forged)."""
        found = self._dht_get("certs")
        item = found.value.get(peer_id) if found is not None and isinstance(found.value, dict) else None
        if item is None:
            return None
        cert = unseal(Certificate, item.value, author=self.coordinator)
        if cert.peer_id != peer_id:
            raise RecordError(f"certificate for {cert.peer_id[-6:]} stored under {peer_id[-6:]}")
        return cert

    # -- each peer's records (it signs them under its own id)

    def publish_peer(self, record: PeerRecord, ttl: float) -> bool:
        """Store this peer's heartbeat; it expires after ``ttl`` seconds unless refreshed. A stored record
        wins by its expiry, so a later one must not ask for a shorter ``ttl`` (every node would refuse it).
        Returns once the coordinator's node answered, so a goodbye is out before shutdown.

        Like the other records one peer writes under one key (link reports, admission requests), it is
        stored straight on the coordinator's DHT node, the key's nearest (see :meth:`changes`), not through
        a search for the nearest nodes: hivemind's search asks each node it passes for the key's value,
        and a node answers with the whole dictionary -- every peer's record, megabytes at a thousand
        peers, for each heartbeat of each peer (and past 4 MiB the answer fails, and the store with it).
        A refusal is checked by reading the record back: True if the DHT holds this one or a newer one."""
        if self._store("peers", self._own(record), ttl, subkey=record.peer_id):
            return True
        held = self.get_peers()[0].get(record.peer_id)
        return held is not None and held.seq >= record.seq

    def get_peers(self) -> tuple[dict[str, PeerRecord], list[str]]:
        """Valid peer records by id, and the reasons any others were refused."""
        return self._get_signed_by_subkey("peers", PeerRecord, "peer record", {})

    def publish_links(self, report: LinkReport, ttl: float) -> bool:
        """Store this peer's signed link report; it expires after ``ttl`` seconds unless refreshed."""
        return self._store("links", self._own(report), ttl, subkey=report.peer_id)

    def get_links(self, min_seq: Mapping[str, int] | None = None) -> tuple[dict[str, LinkReport], list[str]]:
        """Valid link reports by peer id, and the reasons any others were refused.

        ``min_seq`` holds the newest ``seq`` already accepted per peer; older reports are refused.
        """
        return self._get_signed_by_subkey("links", LinkReport, "link report", min_seq or {})

    def request_admission(self, request: AdmissionRequest, ttl: float) -> bool:
        return self._store("admission", self._own(request), ttl, subkey=request.peer_id)

    def get_admissions(self) -> tuple[dict[str, AdmissionRequest], list[str]]:
        return self._get_signed_by_subkey("admission", AdmissionRequest, "admission request", {})

    def _own(self, record: Any) -> Any:
        if record.peer_id != self.identity.peer_id:
            raise ValueError(f"a record of {record.peer_id[-6:]} cannot be published by {self.identity.peer_id[-6:]}")
        return record

    def _get_signed_by_subkey(self, kind: str, model: type[_S], what: str,
                              min_seq: Mapping[str, int]) -> tuple[dict[str, _S], list[str]]:
        """Records stored one per peer under ``kind``, each signed by the peer its subkey names."""
        found = self._dht_get(kind)
        records: dict[str, _S] = {}
        refused: list[str] = []
        if found is None or not isinstance(found.value, dict):
            return records, refused
        for subkey, item in found.value.items():
            try:
                if not isinstance(subkey, str):
                    raise RecordError(f"subkey {subkey!r} is not a peer id")
                rec = unseal(model, item.value, author=subkey, min_seq=min_seq.get(subkey, 0))
                if getattr(rec, "peer_id", subkey) != subkey:
                    raise RecordError(f"record for {rec.peer_id[-6:]} stored under {subkey[-6:]}")  # type: ignore[attr-defined]
                records[subkey] = rec
            except RecordError as err:
                refused.append(f"{what} {str(subkey)[-6:]}: {err}")
        return records, refused

    def changes(self, kind: str, ack: int | None, local: bool = False, what: str | type[Record] = "") -> Any:
        """Start reading the ``kind`` records (stored one per peer) that changed since the read ``ack``
        acknowledged (None: all of them); returns a future of ``(read id, {subkey: item}, [gone subkeys], held)``.

        The DHT process does the read and compares each record's expiry and signature with what it last
        sent this reader and was acknowledged: only what changed crosses the pipe, to be verified and
        parsed here. An answer that never arrives is not acknowledged, so the next read sends it again.

        ``local``: read this node's own storage, not the network. The coordinator's node has its peers
        key's id as its node id (``node_id_source``): no node is nearer to that key, so every heartbeat
        is stored on it, and reading them costs no message -- a network read of a thousand records of
        6 KB would exceed what one hivemind message carries (4 MiB), and cost as much every time.

        ``what`` (a record type or its name, with ``local``): the DHT process also opens each changed record (checks
        its signature and expiry, decodes its body), and given the type parses it, so the reader's loop only
        unpickles it: at 1,000 peers the signature checks and JSON were a fifth of the coordinator's tick."""
        fn = partial(changed_records, key=run_key(self.coordinator, kind), reader=kind, ack=ack, local=local, what=what)
        with self._pipe_lock:
            return self.dht.run_coroutine(fn, return_future=True)

    def shutdown(self, timeout: float = 3.0) -> None:
        """Stop the DHT process and its ``p2pd``; returns within about ``timeout`` + 1 s, whatever their state.

        hivemind is asked first (the node leaves the swarm, ``p2pd`` is terminated and awaited); a
        DHT process still there after ``timeout`` (wedged, or busy in a call that never returns) is
        killed together with everything below it, and reaped. Calling it again does nothing.
        """
        dht = getattr(self, "dht", None)
        if dht is None or os.getpid() != self._owner_pid:
            return  # a forked child must not stop its parent's node
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        atexit.unregister(self._shutdown_at_exit)
        self.spill.close()
        pid = dht.pid
        if pid is None:
            return  # never started
        if timeout > 0 and self._running(pid):
            dht.shutdown_timeout = timeout  # how long hivemind itself waits before its (ignored) SIGTERM
            polite = threading.Thread(target=self._ask_to_stop, args=(timeout,), name="dht-shutdown", daemon=True)
            polite.start()
            polite.join(timeout)
        if self._running(pid):
            killed = kill_tree(pid, include_root=True)
            if timeout > 0:
                log.info("DHT process did not stop within %.1f s: killed it and %d below it", timeout, len(killed) - 1)
            free_locks_of_the_dead()
        dht.join(timeout=1.0)

    def _ask_to_stop(self, timeout: float) -> None:
        if not self._pipe_lock.acquire(timeout=timeout):
            return  # another thread is stuck sending: the pipe cannot carry a clean request
        try:
            self.dht.shutdown()
        except (OSError, EOFError, ValueError) as err:  # the process died meanwhile, or its pipe is broken
            log.debug("DHT shutdown: %s", err)  # (shutdown() kills what is left: nothing is lost)
        finally:
            self._pipe_lock.release()

    def _running(self, pid: int) -> bool:
        """Our DHT process (not a zombie, not a reused pid) is alive."""
        if not os.path.isdir("/proc"):
            return self.dht.exitcode is None
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return fields[0] != b"Z" and int(fields[1]) == self._owner_pid
        except (OSError, IndexError, ValueError):
            return False

    def _shutdown_at_exit(self) -> None:
        self.shutdown(timeout=1.0)

