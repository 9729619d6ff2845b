"""The status API's snapshot against its JSON schema (static/state.schema.json), closed: every field
the coordinator sends is described there, and nothing described is missing."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from fake_state import fresh_state, make_state
from test_status_api import request

from potluck.coordinator.status.status import STATIC_DIR, StatusServer


def dumps(snap: dict[str, Any]) -> str:
    """A snapshot as the API serves it (top-level ``_`` keys are the coordinator's own)."""
    return json.dumps({k: v for k, v in snap.items() if not k.startswith("_")})

SCHEMA = json.loads((STATIC_DIR / "state.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def closed(schema: Any) -> Any:
    """``schema`` with every object that lists its properties closed to any other.

    The published schema stays open (v1 clients must ignore fields they do not know); the tests
    check snapshots against this closed copy, so a field the coordinator adds without describing
    it fails here, as does a missing or renamed one (every always-present field is required).
    """
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if out.get("type") == "object" and "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


CLOSED = jsonschema.Draft202012Validator(closed(SCHEMA))


def schema_errors(doc: dict[str, Any], validator: jsonschema.Draft202012Validator = CLOSED) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(doc)]


@pytest.mark.parametrize("state", [
    make_state(12, stages=2, steps=15, hole=True, links=True),
    make_state(300, stages=4, steps=120, seed=3),
    make_state(3, steps=40, finished=True),
    fresh_state(),
], ids=["holes-links", "large", "finished", "fresh"])
def test_state_is_versioned_and_matches_the_schema(state: dict[str, Any]) -> None:
    srv = StatusServer("127.0.0.1", 0, lambda: state)
    try:
        code, headers, body = request(srv, "GET", "/api/v1/state")
        assert code == 200 and headers["Content-Type"] == "application/json"
        doc = json.loads(body)
        errors = schema_errors(doc, VALIDATOR) + schema_errors(doc)
        assert not errors, errors[:5]
        public = {k: v for k, v in state.items() if not k.startswith("_")}  # (``_peers``: the coordinator's own)
        assert doc["api"] == "potluck.status/v1" and doc == json.loads(json.dumps(public))
    finally:
        srv.stop()


def test_the_coordinators_own_snapshot_matches_the_schema() -> None:
    """Builds a snapshot with the coordinator's own fold (no network) so schema and builder cannot drift."""
    from potluck.coordinator.placement.placement import members, sticky_placement
    from potluck.coordinator.rounds.history import fold
    from potluck.coordinator.rounds.rounds import Rounds
    from potluck.coordinator.status.snapshot import RunInfo, Series, build
    from potluck.coordinator.swarm.membership import PeerTable
    from potluck.protos.config.runconfig import RunConfig
    from potluck.protos.wire.records import PeerRecord, StepReport

    table, rounds = PeerTable(5), Rounds(stages=1)
    ids = ["12D3KooWaaaaaa", "12D3KooWbbbbbb"]
    table.update({p: PeerRecord(peer_id=p, address=f"{p}:1", state="waiting") for p in ids}, now=0)
    rounds.decide(members(sticky_placement(ids, 1, 2, {}), [v.record for v in table.live()]), now=0, decided_at=1.0)
    step = StepReport(step=1, state_hash="h1", loss=3.5, outer_s=0.4, outer_bytes=1000, members=2, contributors=2)
    table.update({p: PeerRecord(peer_id=p, address=f"{p}:1", state="training", version=1, state_hash="h1", seq=2,
                                loss=3.5, last_outer_bytes=1000, parameters=4096, bytes_sent={"outer": 1000},
                                compute_s=10.0, sync_s=1.0, tokens_per_s=50.0, recent=[step]) for p in ids}, now=1)
    rounds.observe(table.reports(), now=1)
    history, _ = fold([], [v.record for v in table.peers.values()], rounds.round_at, rounds.committed)
    run = RunInfo("run-x", "12D3coord", "/ip4/10.0.0.1/tcp/1", "http://x/", 0.0, False)
    snap = json.loads(dumps(build(run, RunConfig(), list(table.peers.values()), rounds, history, [], [],
                                  Series(), {})))
    errors = schema_errors(snap, VALIDATOR) + schema_errors(snap)
    assert not errors, errors[:5]
    assert snap["history"] and snap["grid"]["cells"] and snap["peers"][0]["tasklet"] == {"stage": 0, "replica": 0}
    assert snap["history"][0]["state_hashes"] == dict.fromkeys(ids, "h1") and snap["run"]["outer_step"] == 1


def rolled_back_pipeline_snapshot() -> dict[str, Any]:
    """A snapshot from the coordinator's own fold of a 2 x 2 pipelined run that lived through most of
    what the status API can say: steps 1 and 2 commit (an owner clips one update, rejects another, an
    all-reduce goes on without a member), stage 1's members vanish during round 3, so it fails and the
    run rolls back to the checkpoint of v1 in epoch 1, and two newcomers fill a new round 2."""
    from potluck.coordinator.rounds import history
    from potluck.coordinator.rounds.roundevents import Checkpoint, RolledBack
    from potluck.coordinator.rounds.rounds import Rounds
    from potluck.coordinator.status.snapshot import RunInfo, Series, build
    from potluck.coordinator.swarm.membership import PeerTable
    from potluck.protos.config.runconfig import RunConfig
    from potluck.protos.net.swarm import LinkReport, LinkStat
    from potluck.protos.wire.records import Member, PeerRecord, StepReport

    cfg = RunConfig.model_validate({"pipeline": {"stages": 2}, "coordinator": {"insecure": True},
                                    "admission": {"mode": "private"}, "membership": {"min_peers": 4}})
    a, b, c, d, e, f = ids = [f"12D3KooW{x * 44}" for x in "ABCDEF"]
    place = {a: (0, 0), b: (0, 1), c: (1, 0), d: (1, 1), e: (1, 0), f: (1, 1)}
    address = {p: f"10.0.0.{i + 1}:4000" for i, p in enumerate(ids)}
    table, rounds = PeerTable(cfg.membership.heartbeat_timeout_s), Rounds.for_run(cfg)
    checkpoint = Checkpoint(1, {0: "s0v1", 1: "s1v1"})
    wall, seq = 1.7e9, iter(range(1, 1000))
    state: dict[str, list[dict[str, Any]]] = {"history": [], "rolled_back": []}

    def record(pid: str, status: str = "waiting", version: int = 0, recent: list[StepReport] | None = None) -> PeerRecord:
        stage, replica = place[pid]
        return PeerRecord(peer_id=pid, address=address[pid], state=status, version=version, seq=next(seq),
                          state_hash=f"s{stage}v{version}" if version else "", stage=stage, replica=replica,
                          loss=3.1 if version and stage == 1 else None, tokens_per_s=900.0 if version else 0.0,
                          tokens_total=5000 * version, parameters=100_000, compute_s=10.0 * version,
                          sync_s=1.0 * version, bytes_sent={"outer": 4000 * version}, recent=recent or [])

    def step(pid: str, v: int, **flags: list[str]) -> StepReport:
        stage, replica = place[pid]
        pipe = {"activations": 100, "activations_fp32": 400} if stage == 0 else {"gradients": 100, "gradients_fp32": 400}
        return StepReport(step=v, stage=stage, replica=replica, state_hash=f"s{stage}v{v}", outer_s=0.5, outer_bytes=4000,
                          loss=3.0 + 1 / v if stage == 1 else None, members=2, contributors=2, pipe=pipe, **flags)

    def tick(now: float, *records: PeerRecord) -> None:
        table.update({r.peer_id: r for r in records}, now)
        for ev in rounds.observe(table.reports(), now, checkpoint):
            if isinstance(ev, RolledBack):  # what the coordinator's loop does with it
                state["history"], undone = history.roll_back(state["history"], ev.to_version)
                state["rolled_back"] += undone
        state["history"], _ = history.fold(state["history"], [v.record for v in table.peers.values()],
                                           rounds.round_at, rounds.committed, now=wall + now)

    def decide(now: float, *who: str) -> None:
        assert rounds.ready_to_decide(len(table.live()), cfg.membership.min_peers, now, table.reports())
        rounds.decide([Member(peer_id=p, address=address[p], stage=place[p][0], replica=place[p][1]) for p in who],
                      now, decided_at=wall + now)

    first = [a, b, c, d]
    tick(0, *map(record, first))
    decide(0, *first)
    v1 = {p: [step(p, 1, clipped=[b] if p == a else [])] for p in first}
    tick(2, *(record(p, "training", 1, v1[p]) for p in first))
    tick(3.5, *(record(p, "training", 1, v1[p]) for p in first))
    decide(3.5, *first)
    v2 = {p: v1[p] + [step(p, 2, rejected=[d] if p == c else [], dropped=[b] if p == a else [])] for p in first}
    tick(5, *(record(p, "syncing", 2, v2[p]) for p in first))
    tick(6.5, *(record(p, "training", 2, v2[p]) for p in first))
    decide(6.5, *first)
    tick(20, record(a, "training", 2, v2[a]), record(b, "training", 2, v2[b]), record(e), record(f))
    decide(20, a, b, e, f)
    run = RunInfo("run-x", "12D3KooWcoordinator", "/ip4/10.0.0.1/tcp/1/p2p/12D3KooWcoordinator",
                  "https://10.0.0.1:8080/", wall, False, fingerprint="AB:CD")
    events = [{"t": wall + 20, "kind": "rollback", "peer": "", "message": "rolled back from step 2 to v1 (checkpoint)"}]
    links = {a: LinkReport(peer_id=a, links={b: LinkStat(rtt_ms=1.5, bandwidth_mbps=900.0, samples=3)})}
    return json.loads(dumps(build(run, cfg, list(table.peers.values()), rounds, state["history"],
                                  state["rolled_back"], events, Series(), links, now=21.0)))


def test_a_rolled_back_pipelined_runs_snapshot_matches_the_closed_schema() -> None:
    snap = rolled_back_pipeline_snapshot()
    assert not schema_errors(snap, VALIDATOR) and not (errors := schema_errors(snap)), errors[:5]
    run, (kept,), (undone,), (failed,) = snap["run"], snap["history"], snap["rolled_back"], snap["failed_rounds"]
    assert (run["security"], run["admission"], run["epoch"], run["outer_step"]) == ("insecure", "private", 1, 1)
    assert kept["clipped"] == [f"12D3KooW{'B' * 44}"] and "by_stage" in kept and "rolled_back" not in kept
    assert undone["rolled_back"] is True and undone["step"] == 2 and undone["rejected"] == [f"12D3KooW{'D' * 44}"]
    assert failed["step"] == 3 and failed["rolled_back_to"] == 1 and "stage 1" in failed["reason"]
    assert snap["round"]["epoch"] == 1 and len(snap["round"]["base_hashes"]) == 2
    assert {p["short_id"]: p["clipped"] for p in snap["peers"]}["BBBBBB"] == 1


def test_the_closed_schema_catches_a_missing_renamed_or_undescribed_field() -> None:
    snap = rolled_back_pipeline_snapshot()
    snap["run"]["transport"] = snap["run"].pop("security")
    snap["history"][0].pop("contributors")
    snap["peers"][0]["flagged"] = 1
    snap["failed_rounds"][0]["when"] = 0.0
    errors = " | ".join(schema_errors(snap))
    for expected in ("'security' is a required", "'transport' was unexpected", "'contributors' is a required",
                     "'flagged' was unexpected", "'when' was unexpected"):
        assert expected in errors, errors
    assert len(schema_errors(snap, VALIDATOR)) == 2  # the published schema tolerates what it does not know
