"""Who may take part: the coordinator admits peers explicitly and certifies their TLS keys.

A peer asks to be admitted with a record signed by its identity key (``potluck/<coordinator>/
admission``, subkey its peer id) that names a fresh TLS key and, for a private run, proves it
knows the join token (an HMAC of its peer id and TLS key under the token; the token never travels).
The coordinator's :class:`Admission` reads those requests, applies the run's policy and answers
each admitted peer with a certificate for that TLS key (:mod:`potluck.protos.net.certs`), stored under
``potluck/<coordinator>/certs``. Certificates are short-lived and renewed while the peer keeps
heartbeating; an evicted peer gets none, and its id goes on the plan's revocation list, so every
peer refuses its calls at once.

One identity is one peer. A request naming a new TLS key for an admitted peer id is a new process of
that identity: a restart (the old process said goodbye, or died: its address no longer answers)
is admitted; while the old process still answers at the address of its live record, the key is live
in two places (a copied ``~/.potluck``), and the newcomer is refused, in one line telling it to use
a key of its own. The running peer is not touched: the newcomer never heartbeats under its id.

Policy (``admission`` section of the run file):

* ``open`` (the default, volunteer runs): any key is admitted, at most ``max_per_minute`` new
  ones a minute (a flood of fresh keys cannot swamp the coordinator; it can still join, slowly:
  see docs/threat-model.md on Sybils).
* ``private``: only keys that prove the join token, or whose peer id is on ``allow``.
"""

from __future__ import annotations

import hmac
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from potluck.coordinator.store.journal import kept_secret
from potluck.coordinator.swarm.service import answers
from potluck.coordinator.trust.evictions import Evictions
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.certs import CertError, CertificateAuthority, TlsIdentity, fingerprint, token_proof
from potluck.protos.net.swarm import SwarmNode
from potluck.protos.net.transport import PeerClient
from potluck.protos.runtime.log import get_logger, short_id
from potluck.protos.wire import work
from potluck.protos.wire.admissions import AdmissionRequest, Certificate
from potluck.protos.wire.records import PeerRecord, Round
from potluck.protos.wire.states import SAID_GOODBYE

log = get_logger(__name__)


JOURNAL_ADMISSIONS_S = 5.0


@dataclass
class Admitted:
    tls_fingerprint: str
    not_after: float
    issued_at: float


@dataclass
class Admission:
    ca: CertificateAuthority
    run_id: str
    mode: str = "open"
    token: str = ""
    allow: frozenset[str] = frozenset()
    lifetime_s: float = 6 * 3600.0
    max_per_minute: int = 120
    pow_bits: int = 0  # open runs: the proof of work a new key must bring (potluck.protos.wire.work)
    admitted: dict[str, Admitted] = field(default_factory=dict)
    revoked: set[str] = field(default_factory=set)
    _recent: deque = field(default_factory=deque)  # wall times of recent new admissions
    _answered: dict[str, int] = field(default_factory=dict)  # peer -> seq of the request last refused
    # peer -> (its request, until when it needs no look): answered for good (refused) or holding a fresh
    # certificate; the same request object is passed over until then (at 1,000 peers, looking at every request
    # again each tick -- its key's fingerprint, its proof of work -- was a tenth of the tick)
    _settled: dict[str, tuple[AdmissionRequest, float]] = field(default_factory=dict)
    _fingerprints: dict[str, tuple[AdmissionRequest, str]] = field(default_factory=dict)  # peer -> (request, its key's)
    changed: bool = False  # admitted changed since the journal last took it (see journaled)
    issue_budget_s: float = float("inf")  # CPU one review may spend issuing certificates (the rest: the next one)
    more: bool = False  # the last review left requests to the next one (its budget was spent)
    journaled_at: float = 0.0  # (time.monotonic())
    on_revoke: Callable[[str], None] = lambda peer_id: None  # (the coordinator's table forgets it at once)

    def journal_due(self, every_s: float = JOURNAL_ADMISSIONS_S) -> bool:
        """Admissions changed and were last journaled ``every_s`` ago: a join burst of 1,000 peers is a journal
        write every few seconds, not every tick (one admitted in between and lost asks again: see peer/tasklet.py)."""
        return self.changed and time.monotonic() - self.journaled_at >= every_s

    def journaled(self, now: float | None = None) -> dict[str, dict[str, Any]]:
        """The admissions still valid, as the journal keeps them (and the change taken)."""
        now = time.time() if now is None else now
        self.changed, self.journaled_at = False, time.monotonic()
        return {pid: vars(a).copy() for pid, a in self.admitted.items() if a.not_after > now and pid not in self.revoked}

    def restore(self, journaled: dict[str, dict[str, Any]], now: float | None = None) -> int:
        """Take back the admissions a journal kept (a restarted coordinator: its peers' certificates, signed by
        the same CA, are still good); expired, revoked or unreadable ones are dropped. How many were taken."""
        now = time.time() if now is None else now
        for pid, a in journaled.items():
            try:
                kept = Admitted(str(a["tls_fingerprint"]), float(a["not_after"]), float(a["issued_at"]))
            except (KeyError, TypeError, ValueError):
                log.warning("journal: admission of %s unreadable; it asks again", short_id(pid))
                continue
            if kept.not_after > now and pid not in self.revoked:
                self.admitted[pid] = kept
        return len(self.admitted)

    def review(self, requests: dict[str, AdmissionRequest], now: float | None = None,
               in_use: dict[str, str] | None = None) -> tuple[list[Certificate], list[str]]:
        """Certificate records to publish (new admissions, renewals, and refusals that tell the peer
        why), and refusals worth an event. Only requests not answered yet get an answer. ``in_use``:
        peers whose identity another live process holds, and what to tell them."""
        now = time.time() if now is None else now
        in_use = in_use or {}
        out: list[Certificate] = []
        refused: list[str] = []
        began, self.more = time.thread_time(), False
        while self._recent and now - self._recent[0] > 60.0:
            self._recent.popleft()
        if len(self.admitted) > 2 * len(requests) + 1000:  # forget expired admissions: churn must not grow it forever
            self.admitted = {pid: a for pid, a in self.admitted.items() if a.not_after > now}
        if len(self._settled) > 2 * len(requests) + 100:
            self._settled = {pid: v for pid, v in self._settled.items() if pid in requests}
            self._fingerprints = {pid: v for pid, v in self._fingerprints.items() if pid in requests}
        settled_, revoked = self._settled, self.revoked  # (the requests that need a look, then sorted: not all 1,000)
        pending = [(pid, req) for pid, req in requests.items() if not ((settled := settled_.get(pid)) and settled[0] is req
                                                                       and now < settled[1] and pid not in in_use
                                                                       and pid not in revoked)]
        for pid, req in sorted(pending, key=lambda kv: kv[1].ts):
            reason = in_use.get(pid) or self._refusal(pid, req)
            if reason:
                if self._answered.get(pid) != req.seq:
                    self._answered[pid] = req.seq
                    refused.append(f"{short_id(pid)} not admitted: {reason}")
                    out.append(Certificate(peer_id=pid, refused=reason, request_seq=req.seq, seq=int(now * 1e6)))
                self._settled[pid] = (req, float("inf"))  # (answered once per request)
                continue
            have = self.admitted.get(pid)
            fp = self.fingerprint(pid, req)
            if have is not None and have.tls_fingerprint == fp and now < have.issued_at + self.lifetime_s / 2:
                self._settled[pid] = (req, have.issued_at + self.lifetime_s / 2)  # (until it is due for renewal)
                continue
            if have is None and len(self._recent) >= self.max_per_minute:
                if self._answered.get(pid) != req.seq:  # not a refusal: it is admitted once the minute allows
                    self._answered[pid] = req.seq
                    refused.append(f"{short_id(pid)} waits: more than {self.max_per_minute} admissions a minute")
                continue
            if out and time.thread_time() - began >= self.issue_budget_s:
                self.more = True  # (the oldest requests first: the next review goes on from here)
                break
            try:
                cert = self.ca.issue(pid, req.tls_key.encode(), self.lifetime_s)
            except CertError as err:
                refused.append(f"{short_id(pid)} not admitted: {err}")
                continue
            if have is None:
                self._recent.append(now)
                log.info("admitted %s", short_id(pid))
            self.admitted[pid] = Admitted(fp, now + self.lifetime_s, now)
            self.changed = True
            out.append(Certificate(peer_id=pid, cert_pem=cert.decode(), not_after=now + self.lifetime_s,
                                   request_seq=req.seq, seq=int(now * 1e6)))
        return out, refused

    def _refusal(self, pid: str, req: AdmissionRequest) -> str:
        if pid in self.revoked:
            return "evicted from this run"
        if req.run_id != self.run_id:
            return f"asks for run {req.run_id[:32]!r}"
        if pid in self.allow:
            return ""
        if self.mode == "open":
            if self.pow_bits and work.zero_bits(self.run_id, pid, req.pow_nonce) < self.pow_bits:
                return (f"this open run asks a new key for a proof of work of {self.pow_bits} bits "
                        "(admission.pow_bits), and the request has none: upgrade potluck")
            return ""
        if self.token and hmac.compare_digest(req.proof, token_proof(self.token, self.run_id, pid, req.tls_key)):
            return ""
        return "this run is private: it needs the join token (potluck peer --token) or an allowlisted key"

    def new_process(self, pid: str, req: AdmissionRequest) -> bool:
        """Does ``req`` come from another process than the one admitted as ``pid`` (a new TLS key)?"""
        have = self.admitted.get(pid)
        return have is not None and have.tls_fingerprint != self.fingerprint(pid, req)

    def fingerprint(self, pid: str, req: AdmissionRequest) -> str:
        """The fingerprint of ``req``'s TLS key (hashed once per request, not once per tick)."""
        if (known := self._fingerprints.get(pid)) is None or known[0] is not req:
            self._fingerprints[pid] = known = (req, fingerprint(req.tls_key.encode()))
        return known[1]

    def is_admitted(self, peer_id: str, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        a = self.admitted.get(peer_id)
        return a is not None and now < a.not_after and peer_id not in self.revoked

    def revoke(self, peer_id: str) -> None:
        self.revoked.add(peer_id)
        self.admitted.pop(peer_id, None)
        self.changed = True
        self.on_revoke(peer_id)


CERT_TTL_S = 300.0  # the certificate records in the DHT (peers re-ask every minute; see peer/swarm/admission.py)
# a tick issues certificates for at most this much of its CPU, the oldest requests first, and the loop goes on
# at once with the rest: in a join burst of 1,000 peers a tick admitted about 50 (90 ms), and those ticks made
# the tick's p99 of the minutes after
ISSUE_BUDGET_S = 0.02


class Gatekeeper:
    """The coordinator's admission room: reads requests from the DHT, answers them, keeps the
    membership to admitted peers, and evicts a peer most of whose recent steps were clipped or rejected
    (as the owners that averaged them report: :class:`~potluck.coordinator.trust.evictions.Evictions`)."""

    def __init__(self, cfg: RunConfig, run_id: str, me: str, journal_dir: Path, revoked: list[str],
                 admitted: dict[str, dict[str, Any]] | None = None) -> None:
        a = cfg.admission
        self.run_id, self.me = run_id, me
        self.ca = CertificateAuthority.load_or_create(journal_dir / "ca.key", me)
        self.tls = TlsIdentity.generate()  # the coordinator's own, for its server and its calls to peers
        self.tls.adopt(self.ca.issue(me, self.tls.public_pem, 30 * 86400.0), self.ca.cert_pem, me)
        self.token = join_token(journal_dir) if a.mode == "private" else ""
        self.admission = Admission(self.ca, run_id, a.mode, self.token, frozenset(a.allow), a.cert_lifetime_s,
                                   a.max_per_minute, revoked=set(revoked), pow_bits=a.pow_bits, issue_budget_s=ISSUE_BUDGET_S)
        if admitted and self.admission.restore(admitted):
            log.info("%d peers still admitted from the journal", len(self.admission.admitted))
        self.evictions = Evictions(self.admission, a.evict_after)  # (who is evicted for what owners flagged)
        self._unsent: list[Certificate] = []  # answers reviewed but not stored yet
        self._sending: tuple[Any, list[Certificate]] | None = None  # (future, answers) of the store in flight
        self._in_use_seen: dict[tuple[str, int], str] = {}  # (peer, request seq) -> why refused ('' if not)

    def tick(self, node: SwarmNode, records: dict[str, PeerRecord], round_at: Callable[[int], Round | None],
             client: PeerClient | None = None, read: tuple[dict[str, AdmissionRequest], list[str]] | None = None,
             changed: Callable[[], Collection[str]] | None = None) -> tuple[dict[str, PeerRecord], list[tuple[str, str, str]]]:
        """Answer admission requests; the records of admitted peers, and events as (kind, peer, message): kind
        ``rejected`` (admissions refused, heartbeats of strangers ignored) or ``evicted``. ``client`` pings a running
        process of an identity a new process asks for (without one, nobody is taken for running). ``read``: the
        requests and refusals already read (the coordinator reads them incrementally); else they are read here.
        ``changed()``: the peers whose record changed or went since it was last asked (the reader's; the votes look
        at those only), asked right before the votes are judged."""
        requests, refused = read if read is not None else node.get_admissions()
        still_there = (lambda rec: answers(client, self.run_id, self.me, rec)) if client is not None else (lambda rec: False)
        certs, events = self.admission.review(requests, in_use=self._in_use(requests, records, still_there))
        self._unsent += certs  # reviewed answers are not reviewed again: each is stored, whatever it takes
        self._send(node)
        out = [("rejected", "", e) for e in events + refused] + [
            ("evicted", p, m) for p, m in self.evictions.judge(records, round_at, changed() if changed else None)]
        now, admitted, revoked = time.time(), self.admission.admitted, self.admission.revoked
        kept = {pid: r for pid, r in records.items()  # (is_admitted, inlined: a call per peer per tick)
                if (a := admitted.get(pid)) is not None and now < a.not_after and pid not in revoked}
        strangers = sorted(set(records) - set(kept) - revoked) if len(kept) < len(records) else []
        return kept, out + [("rejected", p, "heartbeat ignored: not admitted") for p in strangers[:3]]

    def _send(self, node: SwarmNode) -> None:
        """Store the answers not stored yet, all in one DHT call the loop does not wait for; a call that did not
        store them all sends them again on the next tick."""
        if self._sending is not None:
            future, batch = self._sending
            if not future.done():
                return
            self._sending = None
            try:
                stored = bool(future.result())
            except Exception:  # (a DHTTimeout, the DHT child restarting: send them again)
                stored = False
            if not stored:
                self._unsent = batch + self._unsent
        if self._unsent:
            self._sending, self._unsent = (node.publish_certificates(self._unsent, ttl=CERT_TTL_S), self._unsent), []

    def _in_use(self, requests: dict[str, AdmissionRequest], records: dict[str, PeerRecord],
                answers: Callable[[PeerRecord], bool]) -> dict[str, str]:
        """Requests from a second live process of an admitted identity, and what to tell it (each request
        is looked at once: a restart is admitted, a copy refused)."""
        out: dict[str, str] = {}
        admitted, fingerprints = self.admission.admitted, self.admission._fingerprints
        for pid, req in requests.items():  # (Admission.new_process, inlined: a call or two per peer per tick)
            if (have := admitted.get(pid)) is None:
                continue
            known = fingerprints.get(pid)
            if have.tls_fingerprint == (known[1] if known is not None and known[0] is req else self.admission.fingerprint(pid, req)):
                continue
            key = (pid, req.seq)
            if key not in self._in_use_seen:
                rec = records.get(pid)  # the running process's record, if it still heartbeats and said no goodbye
                live = rec is not None and rec.state not in SAID_GOODBYE and rec.started_at < req.ts
                self._in_use_seen[key] = in_use_message(pid, rec) if rec is not None and live and answers(rec) else ""
            if self._in_use_seen[key]:
                out[pid] = self._in_use_seen[key]
        self._in_use_seen = {k: v for k, v in self._in_use_seen.items() if k[0] in requests}
        return out

    def revoked(self, peer_id: str) -> bool:
        return peer_id in self.admission.revoked


def in_use_message(pid: str, running: PeerRecord) -> str:
    """What a second process of one identity is told (one line, naming the fix)."""
    since = time.strftime("%H:%M:%S", time.localtime(running.started_at)) if running.started_at else "earlier"
    return (f"peer {short_id(pid)} is already running with this identity, at {running.address} (since {since}); one "
            "identity is one peer: give this one its own key with --identity FILE (a missing FILE is created)")


def join_token(journal_dir: Path) -> str:
    """A private run's join token: $POTLUCK_JOIN_TOKEN, else one kept in the journal dir (0600)."""
    return kept_secret(journal_dir / "join.token", "POTLUCK_JOIN_TOKEN")
