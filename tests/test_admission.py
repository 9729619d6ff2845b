"""The coordinator's admission policy and evictions (coordinator/trust/admission.py), without a swarm.

Real keys and certificates throughout: the CA issues X.509 certificates that the peers' TLS side
(:class:`potluck.protos.net.certs.TlsIdentity`) must accept, and refusals are what a peer is told.
"""

from __future__ import annotations

import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from potluck.coordinator.trust.admission import Admission, Gatekeeper
from potluck.coordinator.trust.evictions import RECENT_STEPS
from potluck.coordinator.trust.trust import Trust
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.certs import (
    CertError,
    CertificateAuthority,
    TlsIdentity,
    check_certificate,
    token_proof,
)
from potluck.protos.net.identity import Identity
from potluck.protos.net.swarm import DHTTimeout
from potluck.protos.wire.admissions import AdmissionRequest
from potluck.protos.wire.records import Member, PeerRecord, Round, StepReport
from potluck.protos.wire.states import PeerState

RUN, T0 = "adm", 1_000_000.0


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertificateAuthority:
    return CertificateAuthority.load_or_create(tmp_path_factory.mktemp("ca") / "ca.key", "coordinator-id")


def asking(proof: str = "", run_id: str = RUN, seq: int = 1) -> tuple[str, TlsIdentity, AdmissionRequest]:
    pid, tls = Identity.generate().peer_id, TlsIdentity.generate()
    return pid, tls, AdmissionRequest(peer_id=pid, run_id=run_id, tls_key=tls.public_pem.decode(), proof=proof,
                                      ts=T0, seq=seq)


def test_an_open_run_certifies_the_tls_key_of_whoever_asks(ca: CertificateAuthority) -> None:
    adm = Admission(ca, RUN)
    pid, tls, req = asking()
    certs, refused = adm.review({pid: req}, now=T0)
    assert refused == [] and len(certs) == 1 and not certs[0].refused and certs[0].request_seq == 1
    tls.adopt(certs[0].cert_pem.encode(), ca.cert_pem, pid)  # the peer's own check of what it got
    assert check_certificate(certs[0].cert_pem.encode(), ca.cert_pem, pid).peer_id == pid
    assert adm.is_admitted(pid, now=T0) and not adm.is_admitted(pid, now=T0 + adm.lifetime_s + 1)
    with pytest.raises(CertError):  # a certificate names its peer: nobody else can present it
        TlsIdentity(tls.key).adopt(certs[0].cert_pem.encode(), ca.cert_pem, Identity.generate().peer_id)
    with pytest.raises(CertError):  # and carries its TLS key: another key cannot use it either
        TlsIdentity.generate().adopt(certs[0].cert_pem.encode(), ca.cert_pem, pid)
    other_ca = CertificateAuthority.load_or_create(Path(tempfile.mkdtemp(prefix="potluck-ca-")) / "ca.key", "x")
    with pytest.raises(CertError):  # another run's CA is not this run's
        check_certificate(certs[0].cert_pem.encode(), other_ca.cert_pem, pid)


def test_a_private_run_needs_the_token_proof_for_this_key_or_the_allowlist(ca: CertificateAuthority) -> None:
    token = "s3cret"
    adm = Admission(ca, RUN, mode="private", token=token)
    stranger, _, req = asking()
    certs, refused = adm.review({stranger: req}, now=T0)
    assert [c.cert_pem for c in certs] == [""] and "private" in certs[0].refused and "join token" in refused[0]
    assert not adm.is_admitted(stranger, now=T0)

    holder, tls, _ = asking()
    good = AdmissionRequest(peer_id=holder, run_id=RUN, tls_key=tls.public_pem.decode(),
                            proof=token_proof(token, RUN, holder, tls.public_pem.decode()), ts=T0, seq=1)
    assert adm.review({holder: good}, now=T0)[0][0].cert_pem
    # the proof binds the key: replayed with another TLS key (someone who saw the request) it fails
    thief = good.model_copy(update={"tls_key": TlsIdentity.generate().public_pem.decode(), "seq": 2})
    assert adm.review({holder: thief}, now=T0 + 1)[0][0].refused
    # and the peer id: another peer cannot reuse it
    other, _, _ = asking()
    assert adm.review({other: good.model_copy(update={"peer_id": other})}, now=T0)[0][0].refused

    listed, _, req = asking()
    assert Admission(ca, RUN, mode="private", allow=frozenset({listed})).review({listed: req}, now=T0)[0][0].cert_pem


def test_refusals_are_answered_once_per_request_and_name_the_run(ca: CertificateAuthority) -> None:
    adm = Admission(ca, RUN, mode="private", token="t")
    pid, _, req = asking(run_id="another-run")
    first = adm.review({pid: req}, now=T0)
    assert "another-run" in first[0][0].refused and first[1]
    assert adm.review({pid: req}, now=T0 + 5) == ([], [])  # the same request again: already answered
    assert adm.review({pid: req.model_copy(update={"seq": 2})}, now=T0 + 6)[0][0].request_seq == 2


def test_new_admissions_are_rate_limited_and_renewals_are_not(ca: CertificateAuthority) -> None:
    adm = Admission(ca, RUN, max_per_minute=2)
    asks = [asking() for _ in range(3)]
    certs, waiting = adm.review({pid: req for pid, _, req in asks}, now=T0)
    assert len(certs) == 2 and len(waiting) == 1 and "waits" in waiting[0]
    late = next(pid for pid, _, _ in asks if not adm.is_admitted(pid, now=T0))
    assert adm.review({pid: req for pid, _, req in asks}, now=T0 + 30) == ([], [])  # fresh ones are not re-issued
    certs, _ = adm.review({pid: req for pid, _, req in asks}, now=T0 + 61)
    assert [c.peer_id for c in certs] == [late]
    # past half its lifetime a peer's next request renews its certificate, whatever the rate
    pid, _, req = asks[0]
    renewal = adm.review({pid: req.model_copy(update={"seq": 5})}, now=T0 + adm.lifetime_s * 0.6)[0]
    assert len(renewal) == 1 and renewal[0].cert_pem and adm.is_admitted(pid, now=T0 + adm.lifetime_s * 1.2)


def test_a_review_issues_certificates_for_its_budget_oldest_first_and_the_next_goes_on(ca: CertificateAuthority) -> None:
    """In a join burst a tick issued about 50 certificates (90 ms of its CPU): a review stops issuing once it has
    spent ``issue_budget_s`` (after one at least), says so (``more``: the loop ticks again at once), and the next
    review goes on with the oldest requests left; every request is answered once."""
    adm = Admission(ca, RUN, issue_budget_s=0.0)
    asks = {pid: req.model_copy(update={"ts": T0 + i}) for i, (pid, _, req) in enumerate(asking() for _ in range(4))}
    order = sorted(asks, key=lambda p: asks[p].ts)
    got = []
    for _ in range(4):
        certs, refused = adm.review(asks, now=T0 + 10)
        assert refused == [] and len(certs) == 1
        got.append(certs[0].peer_id)
        assert adm.more == (len(got) < 4)  # (the last one leaves nothing to the next review)
    assert got == order and all(adm.is_admitted(p, now=T0 + 10) for p in asks)
    assert adm.review(asks, now=T0 + 10) == ([], []) and not adm.more
    whole = Admission(ca, RUN)  # (unbounded, as a test's: all at once)
    assert len(whole.review(asks, now=T0 + 10)[0]) == 4 and not whole.more


def test_an_evicted_peer_gets_no_certificate_again(ca: CertificateAuthority) -> None:
    adm = Admission(ca, RUN)
    pid, _, req = asking()
    adm.review({pid: req}, now=T0)
    adm.revoke(pid)
    assert not adm.is_admitted(pid, now=T0)
    certs, _ = adm.review({pid: req.model_copy(update={"seq": 2})}, now=T0 + 1)
    assert certs[0].refused == "evicted from this run"


class _Node:
    """The two DHT calls the gatekeeper makes, answered from memory."""

    def __init__(self, requests: dict[str, AdmissionRequest]) -> None:
        self.requests, self.published = requests, []

    def get_admissions(self) -> tuple[dict, list[str]]:
        return self.requests, []

    def publish_certificates(self, certs: list[object], ttl: float) -> Future:
        self.published += certs
        return done(True)


def done(result: object) -> Future:
    """A DHT call's future that has already answered."""
    f: Future = Future()
    f.set_result(result)
    return f


def test_eviction_needs_most_owners_so_one_liar_cannot_evict_honest_peers(tmp_path: Path) -> None:
    """Every member reports each owner's signed flags as it received them; the liar, an owner, names both honest
    owners over an honest mean (and lies in its own report too). Owners are counted, not the members repeating
    them: the poisoner, flagged by both honest owners, is evicted; nobody the liar names is."""
    cfg = apply_overrides(RunConfig(), {"admission.evict_after": 3})
    gate = Gatekeeper(cfg, RUN, Identity.generate().peer_id, tmp_path, [])
    asks = {name: asking() for name in ("a", "b", "liar", "poisoner")}
    node = _Node({pid: req for pid, _, req in asks.values()})
    ids = {name: pid for name, (pid, _, _) in asks.items()}
    rounds = {s: Round(step=s, members=[Member(peer_id=p, address="x:1", replica=i) for i, p in
                                        enumerate(sorted(ids.values()))]) for s in range(1, RECENT_STEPS + 1)}
    signed = {ids["a"]: [ids["poisoner"]], ids["b"]: [ids["poisoner"]], ids["liar"]: [ids["a"], ids["b"]],
              ids["poisoner"]: []}

    def record(name: str, flags: dict[str, list[str]]) -> PeerRecord:
        steps = [StepReport(step=s, flags=flags) for s in range(1, RECENT_STEPS + 1)]
        return PeerRecord(peer_id=ids[name], address="x:1", recent=steps)

    records = {ids[n]: record(n, signed) for n in ("a", "b", "poisoner")}
    records[ids["liar"]] = record("liar", {o: [ids["a"], ids["b"], "12D3KooWnobody"] for o in signed})
    kept, events = gate.tick(node, records, rounds.get)  # type: ignore[arg-type]
    assert set(kept) == set(ids.values()) - {ids["poisoner"]}  # all four admitted on this tick, one evicted at once
    evicted = [(pid, msg) for kind, pid, msg in events if kind == "evicted"]
    assert evicted == [(ids["poisoner"], evicted[0][1])] and "most owners" in evicted[0][1]
    assert gate.revoked(ids["poisoner"]) and not gate.revoked(ids["a"]) and not gate.revoked(ids["b"])
    kept, _ = gate.tick(node, records, rounds.get)  # type: ignore[arg-type]
    assert ids["poisoner"] not in kept  # its heartbeats no longer count, and it gets no certificate
    assert any(c.peer_id == ids["poisoner"] and c.refused for c in node.published)


class _SlowNode(_Node):
    """A DHT that times out on the first ``stalls`` certificate stores."""

    def __init__(self, requests: dict[str, AdmissionRequest], stalls: int) -> None:
        super().__init__(requests)
        self.stalls = stalls

    def publish_certificates(self, certs: list[object], ttl: float) -> Future:
        if self.stalls:
            self.stalls -= 1
            f: Future = Future()
            f.set_exception(DHTTimeout("storing the certs record: no answer from the DHT process within 15 s"))
            return f
        return super().publish_certificates(certs, ttl)


def test_a_certificate_the_dht_did_not_take_is_stored_on_a_later_tick(tmp_path: Path) -> None:
    """An admission is decided once; if storing its certificate times out, the next tick stores it
    (it used to be lost until the certificate's half-life, leaving the peer waiting). The loop never
    waits for the store: all answers of a tick go in one DHT call, checked on the next tick."""
    gate = Gatekeeper(RunConfig(), RUN, Identity.generate().peer_id, tmp_path, [])
    asks = [asking() for _ in range(2)]
    node = _SlowNode({pid: req for pid, _, req in asks}, stalls=1)
    gate.tick(node, {}, lambda s: None)
    assert node.published == []
    gate.tick(node, {}, lambda s: None)
    assert sorted(c.peer_id for c in node.published) == sorted(pid for pid, _, _ in asks)  # type: ignore[attr-defined]
    gate.tick(node, {}, lambda s: None)
    assert len(node.published) == 2  # answered once each


def test_heartbeats_of_peers_never_admitted_are_ignored(tmp_path: Path) -> None:
    gate = Gatekeeper(RunConfig(), RUN, Identity.generate().peer_id, tmp_path, [])
    pid = Identity.generate().peer_id
    kept, events = gate.tick(_Node({}), {pid: PeerRecord(peer_id=pid, address="x:1", version=5000)}, lambda s: None)
    assert kept == {} and events == [("rejected", pid, "heartbeat ignored: not admitted")]


def test_a_restarted_coordinator_keeps_its_admissions_and_drops_what_it_must_not(tmp_path: Path) -> None:
    """Admissions are journaled: a restarted coordinator takes its peers' heartbeats at once (their certificates,
    signed by the same CA, are still good) instead of ignoring them until each asks again. An expired, revoked or
    unreadable entry is not taken back."""
    me, t0 = Identity.generate().peer_id, time.time()  # (the restart reads the clock)
    first = Gatekeeper(RunConfig(), RUN, me, tmp_path, [])
    asks = [asking() for _ in range(3)]
    first.admission.review({pid: req for pid, _, req in asks}, now=t0)
    assert first.admission.changed
    first.admission.revoke(asks[2][0])
    kept = first.admission.journaled(now=t0 + 1)
    assert sorted(kept) == sorted(pid for pid, _, _ in asks[:2]) and not first.admission.changed
    kept["stale"] = {**kept[asks[0][0]], "not_after": t0}  # expired
    kept["garbled"] = {"tls_fingerprint": "x"}  # (a journal edited by hand)
    again = Gatekeeper(RunConfig(), RUN, me, tmp_path, [asks[1][0]], kept)  # asks[1] was evicted since
    now = t0 + 2
    assert again.admission.is_admitted(asks[0][0], now) and not again.admission.is_admitted(asks[1][0], now)
    assert not again.admission.is_admitted("stale", now) and not again.admission.is_admitted("garbled", now)
    again_req = asks[0][2]  # its next renewal request (same TLS key, fresh): nothing to answer
    assert again.admission.review({asks[0][0]: again_req}, now=now) == ([], [])
    assert not again.admission.new_process(asks[0][0], again_req)


def test_a_restarted_peer_waits_past_the_certificate_of_its_previous_tls_key(ca: CertificateAuthority) -> None:
    """The DHT still holds the certificate issued to the identity's previous process (another TLS key):
    that is a delay until the coordinator answers the new request, not a refusal."""
    from types import SimpleNamespace

    from potluck.peer.swarm.admission import take
    from potluck.protos.wire.admissions import Certificate

    pid, old, new = Identity.generate().peer_id, TlsIdentity.generate(), TlsIdentity.generate()
    manifest = SimpleNamespace(ca_pem=ca.cert_pem.decode())
    answer = [Certificate(peer_id=pid, cert_pem=ca.issue(pid, old.public_pem, 3600).decode(), request_seq=1)]
    node = SimpleNamespace(get_certificate=lambda peer_id: answer[0])
    assert take(node, manifest, pid, new, {2}) == (False, "")  # type: ignore[arg-type]
    answer[0] = Certificate(peer_id=pid, cert_pem=ca.issue(pid, new.public_pem, 3600).decode(), request_seq=2)
    assert take(node, manifest, pid, new, {2}) == (True, "") and new.cert_pem  # type: ignore[arg-type]
    answer[0] = Certificate(peer_id=pid, refused="evicted from this run", request_seq=3)
    assert take(node, manifest, pid, TlsIdentity.generate(), {3}) == (False, "evicted from this run")  # type: ignore[arg-type]
    assert take(node, manifest, pid, TlsIdentity.generate(), {4}) == (False, "")  # type: ignore[arg-type]


def test_a_second_live_process_of_one_identity_is_refused_and_a_restart_is_not(tmp_path: Path) -> None:
    """A new TLS key for an admitted id is a new process of that identity: admitted when the old one said
    goodbye or no longer answers at its record's address (a restart), refused in one line naming the fix
    while it does (the key copied to a second machine); the running process keeps its certificate.
    (tests/test_restart.py does it with real processes and real pings.)"""
    import grpc

    from potluck.protos import potluck_pb2 as pb

    class Pinged:
        """The coordinator's client as the gatekeeper uses it: a ping that the running process answers, or not."""

        def __init__(self, there: bool) -> None:
            self.there, self.asked = there, []

        def ping(self, address: str, request: pb.PingRequest, timeout: float, peer: str = "") -> pb.PingReply:
            self.asked.append(address)
            if not self.there:
                raise grpc.RpcError("connection refused")
            return pb.PingReply(peer_id=peer, state="training")

    gate = Gatekeeper(RunConfig(), RUN, Identity.generate().peer_id, tmp_path, [])
    pid, _, first = asking()
    node = _Node({pid: first})
    gate.tick(node, {}, lambda s: None)
    running = PeerRecord(peer_id=pid, address="10.0.0.1:5000", state="training", started_at=T0 - 60)
    alive = Pinged(there=True)

    copy_tls = TlsIdentity.generate()
    copy = AdmissionRequest(peer_id=pid, run_id=RUN, tls_key=copy_tls.public_pem.decode(), ts=T0 + 1, seq=2)
    node.requests = {pid: copy}
    kept, events = gate.tick(node, {pid: running}, lambda s: None, alive)  # type: ignore[arg-type]
    told = node.published[-1]
    assert told.refused and told.request_seq == 2 and "--identity FILE" in told.refused and "10.0.0.1:5000" in told.refused
    assert "\n" not in told.refused and alive.asked == ["10.0.0.1:5000"] and pid in kept
    assert any("not admitted" in msg for _, _, msg in events)
    gate.tick(node, {pid: running}, lambda s: None, alive)  # type: ignore[arg-type]
    assert alive.asked == ["10.0.0.1:5000"] and len(node.published) == 2  # each request is looked at, and answered, once
    node.requests = {pid: first.model_copy(update={"seq": 3, "ts": T0 + 2})}  # the running one re-asks: nothing new
    gate.tick(node, {pid: running}, lambda s: None, alive)  # type: ignore[arg-type]
    assert len(node.published) == 2 and gate.admission.is_admitted(pid)

    # a restart after SIGKILL: the old record is still live, but its address no longer answers
    node.requests = {pid: copy.model_copy(update={"seq": 4, "ts": T0 + 3})}
    gate.tick(node, {pid: running}, lambda s: None, Pinged(there=False))  # type: ignore[arg-type]
    assert node.published[-1].cert_pem and node.published[-1].request_seq == 4
    # a restart after a goodbye (Ctrl+C, SIGTERM): nobody is asked
    later = TlsIdentity.generate()
    node.requests = {pid: AdmissionRequest(peer_id=pid, run_id=RUN, tls_key=later.public_pem.decode(), ts=T0 + 4, seq=5)}
    gate.tick(node, {pid: running.model_copy(update={"state": PeerState.LEFT})}, lambda s: None, alive)  # type: ignore[arg-type]
    assert node.published[-1].cert_pem and node.published[-1].request_seq == 5 and len(alive.asked) == 1


def test_reporters_on_probation_do_not_count(tmp_path: Path) -> None:
    """A crowd of fresh keys reporting that every owner flagged an honest peer moves nothing: only the
    reports of members past probation are read (here: 'a' alone is trusted, and it reports the truth)."""
    cfg = apply_overrides(RunConfig(), {"admission.evict_after": 3})
    gate = Gatekeeper(cfg, RUN, Identity.generate().peer_id, tmp_path, [])
    asks = {name: asking() for name in ("a", "s1", "s2", "s3")}
    node = _Node({pid: req for pid, _, req in asks.values()})
    ids = {name: pid for name, (pid, _, _) in asks.items()}
    gate.evictions.trusted = lambda cells, step: {ids["a"]}
    rounds = {s: Round(step=s, members=[Member(peer_id=p, address="x:1", replica=i, owns=p == ids["a"])
                                        for i, p in enumerate(sorted(ids.values()))])
              for s in range(1, RECENT_STEPS + 1)}
    truth = {ids["a"]: []}
    records = {ids["a"]: PeerRecord(peer_id=ids["a"], address="x:1",
                                    recent=[StepReport(step=s, flags=truth) for s in range(1, RECENT_STEPS + 1)])}
    for n in ("s1", "s2", "s3"):
        lie = {ids["a"]: [ids["a"]]}
        records[ids[n]] = PeerRecord(peer_id=ids[n], address="x:1",
                                     recent=[StepReport(step=s, flags=lie) for s in range(1, RECENT_STEPS + 1)])
    for _ in range(2):
        kept, events = gate.tick(node, records, rounds.get)  # type: ignore[arg-type]
    assert not [e for e in events if e[0] == "evicted"] and not gate.revoked(ids["a"])


def test_trusted_reporters_cannot_put_flags_in_an_honest_owners_mouth(tmp_path: Path) -> None:
    """Past probation, a crowd of reporters (the majority of the trusted ones) says honest owner 'a' flagged
    honest 'b' at every step; 'a''s own signed record says it flagged nobody. An owner's list counts only as far
    as its own record says the same: 'b' stays (the crowd's majority alone evicted it before)."""
    cfg = apply_overrides(RunConfig(), {"admission.evict_after": 3})
    gate = Gatekeeper(cfg, RUN, Identity.generate().peer_id, tmp_path, [])
    asks = {name: asking() for name in ("a", "b", "s1", "s2", "s3")}
    node = _Node({pid: req for pid, _, req in asks.values()})
    ids = {name: pid for name, (pid, _, _) in asks.items()}
    rounds = {s: Round(step=s, members=[Member(peer_id=p, address="x:1", replica=i, owns=p == ids["a"])
                                        for i, p in enumerate(sorted(ids.values()))])
              for s in range(1, RECENT_STEPS + 1)}  # everyone trusted (the default), 'a' the one owner

    def record(name: str, flags: dict[str, list[str]]) -> PeerRecord:
        return PeerRecord(peer_id=ids[name], address="x:1",
                          recent=[StepReport(step=s, flags=flags) for s in range(1, RECENT_STEPS + 1)])

    records = {ids[n]: record(n, {ids["a"]: []}) for n in ("a", "b")}
    records |= {ids[n]: record(n, {ids["a"]: [ids["b"]]}) for n in ("s1", "s2", "s3")}
    for _ in range(2):
        kept, events = gate.tick(node, records, rounds.get)  # type: ignore[arg-type]
    assert not [e for e in events if e[0] == "evicted"] and not gate.revoked(ids["b"])
    records[ids["a"]] = record("a", {ids["a"]: [ids["b"]]})  # and when 'a' itself says so, it counts
    kept, events = gate.tick(node, records, rounds.get)  # type: ignore[arg-type]
    assert [pid for kind, pid, _ in events if kind == "evicted"] == [ids["b"]]


def test_an_open_run_can_ask_fresh_keys_for_a_proof_of_work(tmp_path: Path) -> None:
    """admission.pow_bits: a request without the work (or with work for another key or run) is refused in one
    line; with it, admitted. The work is bound to the run and the key."""
    from potluck.protos.wire import work

    gate = Gatekeeper(apply_overrides(RunConfig(), {"admission.pow_bits": 12}), RUN, Identity.generate().peer_id,
                      tmp_path, [])
    (lazy, _, lazy_req), (worker, _, worker_req), (thief, _, thief_req) = asking(), asking(), asking()
    nonce = work.solve(RUN, worker, 12)
    assert work.zero_bits(RUN, worker, nonce) >= 12
    while work.zero_bits(RUN, thief, nonce) >= 12:  # (one key in 4096 would pass with this nonce: not this one)
        thief, _, thief_req = asking()
    worker_req = worker_req.model_copy(update={"pow_nonce": nonce})
    thief_req = thief_req.model_copy(update={"pow_nonce": nonce})  # another key's work
    certs, refused = gate.admission.review({lazy: lazy_req, worker: worker_req, thief: thief_req})
    by = {c.peer_id: c for c in certs}
    assert by[worker].cert_pem and not by[worker].refused
    for pid in (lazy, thief):
        assert not by[pid].cert_pem and "proof of work of 12 bits" in by[pid].refused
    assert len(refused) == 2


def test_trust_earned_later_does_not_reach_back_to_the_steps_reported_on_probation(tmp_path: Path) -> None:
    """A key is trusted as of a step by the work it committed before that step: what it reports of the steps
    it ran on probation never counts, even once it is past probation (8 fresh keys, trusted after 2 steps, had
    their reports of their second step counted at the run's end and got the 3 honest peers evicted)."""
    trust = Trust(probation_steps=2, work={"fresh": [5, 6, 7, 8], "founder": [1, 2, 3, 4, 5, 6, 7, 8]},
                  founders={"founder"})
    assert trust.trusted("fresh") and not trust.trusted("fresh", before=6)
    assert trust.trusted("fresh", before=7) and trust.trusted("founder", before=3)
    cells = [Member(peer_id=p, address="x:1", replica=i) for i, p in enumerate(("founder", "fresh"))]
    assert trust.eligible(cells, before=6) == {"founder"} and trust.eligible(cells, before=8) == {"founder", "fresh"}
    assert trust.eligible(cells) == {"founder", "fresh"}  # (owners of the next round: as trust stands now)



def test_a_request_already_answered_is_not_looked_at_again_until_its_certificate_is_due(
        ca: CertificateAuthority, monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator reviews the requests it holds every tick; one answered (admitted with a fresh certificate,
    or refused) is passed over, its key not hashed and its proof not checked again, until its certificate is due
    for renewal; an eviction still answers it at once."""
    from potluck.coordinator.trust import admission as module
    hashed: list[str] = []
    real = module.fingerprint
    monkeypatch.setattr(module, "fingerprint", lambda pem: hashed.append("x") or real(pem))
    adm = Admission(ca, RUN, lifetime_s=100.0)
    (pid, _, req), (other, _, wrong) = asking(), asking(run_id="another-run")
    requests = {pid: req, other: wrong}
    certs, refused = adm.review(requests, now=T0)
    assert [bool(c.cert_pem) for c in certs] == [True, False] and len(refused) == 1
    looked = len(hashed)
    for t in (T0 + 1, T0 + 20, T0 + 49):
        assert adm.review(requests, now=t) == ([], [])
    assert len(hashed) == looked  # passed over
    certs, _ = adm.review(requests, now=T0 + 50)  # half its lifetime: renewed
    assert [c.peer_id for c in certs] == [pid] and certs[0].cert_pem
    adm.revoke(pid)
    certs, _ = adm.review(requests, now=T0 + 51)
    assert [(c.peer_id, c.refused) for c in certs] == [(pid, "evicted from this run")]
