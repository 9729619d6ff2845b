"""The simulated peers of ``benchmarks/swarm_scale.py``: one worker process, its DHT node and its share of peers.

A simulated peer is everything a peer is to the coordinator, with training replaced by a sleep (the
parent's docstring lists it: own keys, real admission, signed heartbeats with step reports, churn).
The parent starts this file once per worker; it runs until the stop file appears, then writes what
it counted (stores, admissions, when each step's report was stored) as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any


class Slots:
    """The worker's gRPC server: ``capacity`` ports bound at start (gRPC takes no port once it serves), each
    lent to one simulated peer at a time and serving that peer's TLS key and certificate over mutual TLS."""

    def __init__(self, capacity: int, ca_pem: bytes) -> None:
        from concurrent import futures

        import grpc

        from potluck.protos import potluck_pb2 as pb
        from potluck.protos.net.certs import TlsIdentity
        from potluck.protos.net.transport import CHANNEL_OPTIONS, SERVER_OPTIONS, Traffic, service_handler
        from potluck.protos.wire.refusals import Rejected

        class Handlers:
            def ping(self, request: Any) -> Any:
                return pb.PingReply(peer_id="", state="waiting", version=0, sent_at=request.sent_at)

            def _unsupported(self, *_: Any) -> Any:
                raise Rejected(pb.UNSUPPORTED, "a simulated peer only answers pings")

            push_contribution = push_result = fetch_result = get_state_info = fetch_state = push_pipe = _unsupported

        placeholder = TlsIdentity.generate()  # until a peer takes the port: a key no client is asked to trust
        placeholder.cert_pem = _self_signed(placeholder)
        self.ca_pem, self.free = ca_pem, list(range(capacity))
        self.held: list[list[Any]] = [[placeholder.key_pem, placeholder.cert_pem, 0] for _ in range(capacity)]
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                                  options=[*CHANNEL_OPTIONS, *SERVER_OPTIONS, ("grpc.so_reuseport", 0)])
        self.server.add_generic_rpc_handlers((service_handler(Handlers(), Traffic(), lambda *a: None, per_client=64),))
        self.ports = [self.server.add_secure_port("127.0.0.1:0", self._credentials(i)) for i in range(capacity)]
        self.server.start()

    def _credentials(self, i: int) -> Any:
        import grpc

        seen = [-1]

        def config() -> Any:
            key, cert, _ = self.held[i]
            return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=self.ca_pem)

        def fetch() -> Any:  # on each new handshake: the certificate of the peer that holds the port now
            if self.held[i][2] == seen[0]:
                return None
            seen[0] = self.held[i][2]
            return config()

        return grpc.dynamic_ssl_server_credentials(config(), fetch, require_client_authentication=True)

    def take(self, key_pem: bytes, cert_pem: bytes) -> int | None:
        if not self.free:
            return None
        i = self.free.pop()
        self.held[i] = [key_pem, cert_pem, self.held[i][2] + 1]
        return i

    def give_back(self, i: int) -> None:
        self.free.append(i)


def _self_signed(tls: Any) -> bytes:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "unused")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(tls.key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(tls.key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM)


class SimPeer:
    def __init__(self, now: float) -> None:
        from potluck.protos.net.certs import TlsIdentity
        from potluck.protos.net.identity import Identity

        self.identity, self.tls = Identity.generate(), TlsIdentity.generate()
        self.id = self.identity.peer_id
        self.asked_wall, self.asked_at, self.seqs = time.time(), -1e9, set[int]()
        self.admitted_wall: float | None = None
        self.slot: int | None = None
        self.address = ""
        self.state, self.version, self.epoch, self.replica, self.hash = "waiting", 0, 0, -1, ""
        self.recent: deque[Any] = deque(maxlen=16)
        self.training: tuple[Any, float, float] | None = None  # (round, started, finishes)
        self.next_beat, self.poke, self.reported = now, False, -1
        self.tokens, self.compute_s, self.sync_s, self.sent = 0, 0.0, 0.0, 0
        self.started_at = time.time()


class Worker:
    """One simulator process: a real DHT node and ``peers`` simulated peers (see the module's docstring)."""

    def __init__(self, a: argparse.Namespace) -> None:
        from potluck.protos.net.identity import Identity
        from potluck.protos.net.swarm import SwarmNode

        self.a, self.rng = a, random.Random(a.index)
        self.node = SwarmNode(Identity.generate(), coordinator=a.coordinator, initial_peers=[a.join], host="127.0.0.1")
        self.manifest = self._manifest()
        self.ca = self.manifest.ca_pem.encode()
        self.slots = Slots(int(a.peers * 1.2) + 16, self.ca)  # (a peer that leaves frees its port for a joiner)
        self.maddrs = self.node.maddrs[:1]
        self.peers: dict[str, SimPeer] = {}
        self.waiting: dict[str, SimPeer] = {}  # asked to be admitted, no certificate yet
        self.inflight: list[tuple[Any, SimPeer | None, int, int, float]] = []  # (future, peer, step, size, sent at)
        self.out: dict[str, Any] = {"reports": {}, "admissions": [], "stores": 0, "store_failed": 0, "store_bytes": 0,
                                    "beat_lag_s": [], "joined": 0, "left": 0, "vanished": 0, "refused": []}
        self.plan_seq = 0
        self.head_seq = 0  # the newest plan head read: the plan itself is read only while it is newer than ours
        self.round: Any = None
        self.churn_at: float | None = None
        self.reads: dict[str, tuple[Any, float]] = {}  # kind -> (future of the read in flight, when it began)
        self.params = int(self.manifest.config.get("model", {}).get("d_model", 64)) ** 2 * 12

    def _manifest(self) -> Any:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            m = self.node.get_manifest()
            if m is not None:
                return m
            time.sleep(0.5)
        raise SystemExit("no manifest from the coordinator within 120 s")

    # ---------------------------------------------------------------- the loop

    def run(self) -> None:
        now = time.monotonic()
        for _ in range(self.a.peers):
            self._join(now)
        stop = Path(self.a.stop_file)
        go = Path(self.a.churn_file)
        while not stop.exists():
            now = time.monotonic()
            self._collect()
            if self.waiting:
                self._read("certs", now, self._certificates)
            for p in list(self.waiting.values()):
                if now - p.asked_at > 5.0:  # peers ask again every 5 s until admitted, as real ones do
                    self._ask(p, now)
            self._read("plan_head", now, self._head)  # (as a real peer polls: the head, then the plan when newer)
            if self.head_seq > self.plan_seq:
                self._read("plan", now, self._plan)
            self._train(now)
            self._beats(now)
            if self.churn_at is None and go.exists():
                self.churn_at = now
            if self.churn_at is not None and self.a.churn > 0:
                every = 60.0 / (self.a.churn * self.a.peers)
                while now - self.churn_at >= every:
                    self.churn_at += every
                    self._churn(now)
            time.sleep(0.05)
        if self.a.index == 0:
            self.out["full_read"] = self._full_read()
        self._collect(wait=True)
        Path(self.a.out).write_text(json.dumps(self.out))
        self.slots.server.stop(0)
        self.node.shutdown()

    # ---------------------------------------------------------------- admission

    def _join(self, now: float) -> None:
        p = SimPeer(now)
        self.waiting[p.id] = p
        self.out["joined"] += 1
        self._ask(p, now)

    def _ask(self, p: SimPeer, now: float) -> None:
        from potluck.protos.wire.admissions import AdmissionRequest
        from potluck.protos.wire.envelope import next_seq

        req = AdmissionRequest(peer_id=p.id, run_id=self.manifest.run_id, tls_key=p.tls.public_pem.decode(),
                               ts=time.time(), seq=next_seq())
        p.seqs.add(req.seq)
        p.asked_at = now
        self._store("admission", p, req, 120.0)

    def _read(self, kind: str, now: float, take: Any) -> None:
        """Read the coordinator's ``kind`` record every 0.5 s, without waiting: ``take(found, now)`` once it came."""
        from potluck.protos.net.dhtguard import run_key

        future, started = self.reads.get(kind, (None, -1e9))
        if future is not None and future.done():
            del self.reads[kind]
            try:
                take(future.result(), now)
            except Exception as err:
                self.out.setdefault("read_errors", []).append(f"{kind}: {err}"[:200])
        elif future is None and now - started >= 0.5:
            with self.node._pipe_lock:
                self.reads[kind] = (self.node.dht.get(run_key(self.a.coordinator, kind), latest=True, return_future=True),
                                    now)
        elif future is not None and now - started > 30:
            del self.reads[kind]  # (no answer: ask again)

    def _certificates(self, found: Any, now: float) -> None:
        from potluck.protos.net.certs import CertError
        from potluck.protos.wire.admissions import Certificate
        from potluck.protos.wire.envelope import RecordError, unseal

        items = found.value if found is not None and isinstance(found.value, dict) else {}
        for pid, p in list(self.waiting.items()):
            item = items.get(pid)
            if item is None:
                continue
            try:
                cert = unseal(Certificate, item.value, author=self.a.coordinator)
            except RecordError:
                continue
            if cert.refused:
                if cert.request_seq in p.seqs:
                    self.out["refused"].append(cert.refused)
                    del self.waiting[pid]
                continue
            try:
                p.tls.adopt(cert.cert_pem.encode(), self.ca, pid)
            except CertError:
                continue
            slot = self.slots.take(p.tls.key_pem, p.tls.cert_pem)
            if slot is None:
                continue  # (capacity is sized for the churn asked for)
            del self.waiting[pid]
            p.slot, p.address, p.admitted_wall = slot, f"127.0.0.1:{self.slots.ports[slot]}", time.time()
            p.version = max(0, self.round.step - 1) if self.round is not None else 0
            p.next_beat = now + self.rng.uniform(0, 0.2)
            self.peers[pid] = p
            self.out["admissions"].append([p.asked_wall, p.admitted_wall])

    # ---------------------------------------------------------------- rounds and "training"

    def _head(self, found: Any, now: float) -> None:
        from potluck.protos.wire.envelope import RecordError, unseal
        from potluck.protos.wire.records import PlanHead

        if found is None:
            return
        try:
            self.head_seq = max(self.head_seq, unseal(PlanHead, found.value, author=self.a.coordinator).seq)
        except RecordError:
            return

    def _plan(self, found: Any, now: float) -> None:
        from potluck.protos.wire.envelope import RecordError, unseal
        from potluck.protos.wire.records import Plan

        if found is None:
            return
        try:
            plan = unseal(Plan, found.value, author=self.a.coordinator, min_seq=self.plan_seq)
        except RecordError:
            return
        if not plan.rounds or plan.seq <= self.plan_seq:
            return
        self.plan_seq = plan.seq
        newest = max(plan.rounds, key=lambda r: r.step)
        if self.round is not None and (newest.step, newest.epoch) == (self.round.step, self.round.epoch):
            return
        self.round = newest
        for m in newest.members:
            p = self.peers.get(m.peer_id)
            if p is None:
                continue
            if p.training is not None and p.training[0].step >= newest.step:
                continue
            p.version = max(p.version, newest.step - 1)  # (a newcomer "recovered" the round's base)
            p.replica, p.state = m.replica, "training"
            p.training = (newest, now, now + self.a.step_s * self.rng.uniform(0.9, 1.1))
            p.poke = True

    def _train(self, now: float) -> None:
        from potluck.protos.wire.records import StepReport

        for p in self.peers.values():
            if p.training is None or now < p.training[2]:
                continue
            rnd, started, _ = p.training
            p.training = None
            p.version, p.epoch, p.hash = rnd.step, rnd.epoch, f"{rnd.step:08x}{rnd.epoch:04x}" * 4
            for old in p.recent:  # a real peer keeps `included` on all 16: at R ~ 700 its record passes 64 KB
                old.included = []
            p.recent.append(StepReport(
                step=rnd.step, epoch=rnd.epoch, stage=0, replica=p.replica, state_hash=p.hash, loss=3.0,
                outer_s=0.5, allreduce_s=0.4, outer_bytes=2 * self.params, members=len(rnd.members),
                contributors=len(rnd.members), included=[s.replica for s in rnd.shares][:1024], t=time.time()))
            p.state, p.poke = "waiting", True
            p.tokens += 1000
            p.compute_s += now - started
            p.sent += 2 * self.params

    def _beats(self, now: float) -> None:
        from potluck.protos.wire.envelope import next_seq
        from potluck.protos.wire.records import PeerRecord

        for p in self.peers.values():
            if len(self.inflight) >= 48 and p.state != "left":
                return
            if not p.poke and now < p.next_beat:
                continue
            if not p.poke:
                self.out["beat_lag_s"].append(now - p.next_beat)
            p.poke, p.next_beat = False, now + self.a.heartbeat_s
            inner = 0
            if p.training is not None:
                inner = int(20 * (now - p.training[1]) / max(1e-3, p.training[2] - p.training[1]))
            rec = PeerRecord(
                peer_id=p.id, address=p.address, state=p.state, version=p.version, state_hash=p.hash,
                inner_step=inner, device="cpu", device_name="simulated peer", loss=3.0 if p.version else None,
                tokens_per_s=1000.0 if p.state == "training" else 0.0, tokens_total=p.tokens,
                bytes_sent={"outer": p.sent}, bytes_received={"outer": p.sent}, compute_s=p.compute_s,
                sync_s=p.sync_s, parameters=self.params, stage=0, replica=p.replica, epoch=p.epoch,
                recent=list(p.recent), software="swarm_scale", started_at=p.started_at, seq=next_seq(), ts=time.time(),
                dht_maddrs=self.maddrs)
            step = p.recent[-1].step if p.recent and p.recent[-1].step == p.version else -1
            if step == p.reported:
                step = -1  # (counted at its first store only)
            elif step >= 0:
                p.reported = step
            self._store("peers", p, rec, self.a.heartbeat_timeout_s, step)

    def _churn(self, now: float) -> None:
        live = [p for p in self.peers.values()]
        if live:
            p = self.rng.choice(live)
            del self.peers[p.id]
            if self.rng.random() < 0.5:  # a goodbye
                p.state, p.poke = "left", True
                self.peers[p.id] = p
                self._beats_one(p, now)
                del self.peers[p.id]
                self.out["left"] += 1
            else:  # it vanishes: the coordinator finds it lost
                self.out["vanished"] += 1
            if p.slot is not None:
                self.slots.give_back(p.slot)
        self._join(now)

    def _beats_one(self, p: SimPeer, now: float) -> None:
        others, self.peers = self.peers, {p.id: p}
        try:
            self._beats(now)
        finally:
            self.peers = others

    # ---------------------------------------------------------------- the DHT

    def _store(self, kind: str, p: SimPeer, record: Any, ttl: float, step: int = -1) -> None:
        from functools import partial

        from hivemind.utils import MSGPackSerializer, get_dht_time

        from potluck.protos.net.dhtguard import run_key
        from potluck.protos.net.feed import store_at
        from potluck.protos.wire.envelope import seal

        value = seal(p.identity, record, ttl)
        size, sent = len(MSGPackSerializer.dumps(value)), time.time()
        with self.node._pipe_lock:  # straight to the coordinator's node, as SwarmNode.publish_peer stores them
            future = self.node.dht.run_coroutine(partial(
                store_at, peer=self.a.coordinator, key=run_key(self.a.coordinator, kind), subkey=p.id, value=value,
                expiration=get_dht_time() + ttl), return_future=True)
        self.inflight.append((future, p, step, size, sent))

    def _collect(self, wait: bool = False) -> None:
        keep = []
        for future, p, step, size, sent in self.inflight:
            if not wait and not future.done():
                keep.append((future, p, step, size, sent))
                continue
            try:
                ok = future.result(timeout=15)
            except Exception:
                ok = False
            self.out["stores"] += 1
            self.out["store_bytes"] += size
            if not ok:
                self.out["store_failed"] += 1
            elif step >= 0 and p is not None:  # (when the peer handed its report to the DHT, and when it was stored)
                self.out["reports"].setdefault(str(step), []).append([p.id, sent, time.time()])
        self.inflight = keep

    def _full_read(self) -> dict[str, Any]:
        """The baseline: one network read of every peer record, each verified and parsed (the old tick)."""
        t0 = time.monotonic()
        try:
            records, refused = self.node.get_peers()
        except Exception as err:
            return {"error": str(err)[:200], "seconds": time.monotonic() - t0}
        return {"records": len(records), "refused": len(refused), "seconds": time.monotonic() - t0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag in ("--join", "--coordinator", "--stop-file", "--churn-file", "--out"):
        p.add_argument(flag, required=True)
    p.add_argument("--peers", type=int, required=True)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--heartbeat-s", type=float, default=5.0)
    p.add_argument("--heartbeat-timeout-s", type=float, required=True)
    p.add_argument("--step-s", type=float, default=10.0)
    p.add_argument("--churn", type=float, default=0.1)
    a = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: Path(a.stop_file).touch())
    Worker(a).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
