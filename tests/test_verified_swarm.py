"""Verified reduction and probation in real swarms (issue 29): a shard owner that lies is proven a liar by
an audit and evicted, and the run goes back to before its lie; an owner's false flags get nobody evicted
but itself; a crowd of fresh keys neither owns a shard during probation nor votes an honest peer out."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from potluck.protos.net.identity import Identity

pytestmark = pytest.mark.slow

RUN = {
    "membership.min_peers": 4, "diloco.outer_steps": 5, "diloco.inner_steps": 10, "data.eval_every": 1,
    "sync.audit_fraction": 1.0, "model.d_model": 32, "model.n_layers": 1, "train.batch_size": 8,
    "diloco.rounds": "fixed",  # (the runs are compared with each other: every member trains H steps in each)
}
SLOW = "inner.step@*:slow=2"  # an honest peer at half speed: volunteers' devices differ


def run(swarm, peers: int, liar: str = "", overrides: dict | None = None, slow: str = "") -> dict:  # type: ignore[no-untyped-def]
    """A swarm of ``peers`` (the first one with ``liar``'s POTLUCK_FAULTS, the last one with ``slow``'s: an honest
    peer on a slower device) to the end; its final state."""
    swarm.start_coordinator({**RUN, "membership.min_peers": peers, **(overrides or {})})
    if liar:
        swarm.start_peer(env={**os.environ, "POTLUCK_FAULTS": liar})
    for k in range(peers - bool(liar)):
        last = k == peers - bool(liar) - 1
        swarm.start_peer(env={**os.environ, "POTLUCK_FAULTS": slow} if slow and last else None)
    outer = (overrides or {}).get("diloco.outer_steps", RUN["diloco.outer_steps"])
    return swarm.wait_state(lambda s: s["run"]["finished"] and len(s["history"]) == outer
                            and s["history"][-1]["eval_loss"] is not None, 300, "the run to finish")


def fresh(swarm, tmp_path: Path, name: str) -> None:  # type: ignore[no-untyped-def]
    swarm.stop()
    swarm.__init__(swarm.procs, tmp_path / name)


@pytest.mark.parametrize("lie", ["shift=0.5", "spike"])
def test_a_lying_owner_is_proven_evicted_and_its_steps_undone(swarm, tmp_path: Path, lie: str) -> None:  # type: ignore[no-untyped-def]
    """The owner of a shard lies at every step: it shifts its mean by 0.5, sets one coordinate to 1e6 or flips
    its sign (the flip and a scaled mean, lies of size like the shift, passed here too, 36 s each: they are tried
    in-process only, for CI's time). Its auditor finds the first lie during the next step, the coordinator checks the
    evidence itself, evicts the owner and rolls the run back to before step 1; the three honest peers train to
    the end. For the shift (the costlier comparisons once): they land within 2 % of an honest-only run, and
    with audits off the same attack visibly harms the run (every kind of lie, and forged evidence, is also
    tried in-process: tests/test_verified.py)."""
    attacked = run(swarm, 4, f"owner.mean@*:{lie}")
    proven = [e for e in attacked["events"] if e["kind"] == "proven"]
    assert proven and "step 1" in proven[0]["message"], [e for e in attacked["events"] if e["kind"] in ("audit", "proven")]
    liar_id = proven[0]["peer"]
    assert any(e["kind"] == "rollback" and "to v0" in e["message"] for e in attacked["events"])
    assert not [e for e in attacked["events"] if e["kind"] in ("proven", "evicted") and e["peer"] != liar_id]
    assert all(liar_id not in h["state_hashes"] for h in attacked["history"])  # no kept step holds its lie
    assert liar_id not in {m["peer_id"] for m in attacked["round"]["members"]}
    if lie != "shift=0.5":
        return
    fresh(swarm, tmp_path, "honest")
    honest = run(swarm, 3)
    loss, ref = attacked["history"][-1]["eval_loss"], honest["history"][-1]["eval_loss"]
    assert abs(loss - ref) <= 0.02 * ref, (loss, ref)
    fresh(swarm, tmp_path, "unchecked")
    harmed = run(swarm, 4, f"owner.mean@*:{lie}", {"sync.audit_fraction": 0.0})
    assert not [e for e in harmed["events"] if e["kind"] == "proven"]
    # (at this size, 5 outer steps: +6 % in one run; the 8 steps of a bigger model: +45 %)
    assert harmed["history"][-1]["eval_loss"] > 1.04 * ref, (harmed["history"][-1]["eval_loss"], ref)
    print(f"eval loss: attacked with audits {loss:.4f}, honest-only {ref:.4f}, attacked without audits "
          f"{harmed['history'][-1]['eval_loss']:.4f}")


def test_false_flags_get_nobody_evicted_but_their_owner(swarm) -> None:  # type: ignore[no-untyped-def]
    """An owner signs an honest mean but names every other contributor as clipped, at every step: its audit
    proves the flags false and it is evicted; no honest peer is, and all three train to the end."""
    state = run(swarm, 4, "owner.flags@*:flag")
    proven = [e for e in state["events"] if e["kind"] == "proven"]
    assert proven and "clipped" in proven[0]["message"], proven
    liar_id = proven[0]["peer"]
    evicted = {e["peer"] for e in state["events"] if e["kind"] in ("proven", "evicted")}
    assert evicted == {liar_id}, evicted
    finished = [p for p in state["peers"] if p["state"] == "finished"]
    assert len(finished) == 3 and liar_id not in {p["id"] for p in finished}


def test_fresh_keys_own_no_shard_and_outvote_nobody_during_probation(swarm, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Three honest peers train; five fresh keys join once the first round is decided (the founders are the
    honest three), each reporting every step that every owner flagged every other (a Sybil vote: five of the
    eight reporters). None owns a shard before it has been a member of `probation_steps` steps, no honest peer
    is evicted, and training goes on to the end."""
    overrides = {"membership.min_peers": 3, "diloco.outer_steps": 8, "diloco.inner_steps": 100,
                 "admission.probation_steps": 2}
    swarm.start_coordinator({**RUN, **overrides})
    honest = [swarm.start_peer() for _ in range(3)]
    swarm.wait_state(lambda s: s["round"] is not None, 120, "the honest peers' first round")
    for _ in range(5):  # (eight, in the run that found it; five are the majority too, and CI's 2 cores start them faster)
        swarm.start_peer(env={**os.environ, "POTLUCK_FAULTS": "outer.report@*:flag"})
    state = swarm.wait_state(lambda s: s["run"]["finished"] and len(s["history"]) == 8, 400, "the run to finish")
    assert not [e for e in state["events"] if e["kind"] in ("evicted", "proven")]
    journal = json.loads((tmp_path / "journal" / "journal.json").read_text())
    honest_ids = {p["id"] for p in state["peers"][:3]}
    work: dict[str, int] = {}
    for rnd in sorted(journal["rounds"], key=lambda r: r["step"]):
        for m in rnd["members"]:
            if m["peer_id"] not in honest_ids:
                assert not m.get("owns", True) or work.get(m["peer_id"], 0) >= 2, (rnd["step"], m)
        for m in rnd["members"]:
            work[m["peer_id"]] = work.get(m["peer_id"], 0) + 1
    assert any(len(r["members"]) > 3 for r in journal["rounds"])  # the fresh keys did take part
    owned = sorted({r["step"] for r in journal["rounds"] for m in r["members"]
                    if m["peer_id"] not in honest_ids and m.get("owns", True)})
    print(f"fresh keys joined at step {min(r['step'] for r in journal['rounds'] if len(r['members']) > 3)}, "
          f"owned shards at steps {owned}")
    assert all(p.poll() is None or p.returncode == 0 for p in honest)


def undone(events: list[dict], step: int) -> bool:
    """After the first proof, the run went back to before ``step``: a rollback to an earlier version, or (a proof that
    came before the step was committed: it comes with the accuser's report, often before the slowest member's) the
    round running then, of ``step`` or one before it, failed, so the run never took the step."""
    after = events[next(k for k, e in enumerate(events) if e["kind"] == "proven"):]
    return any((e["kind"] == "rollback" and any(f"to v{k} " in e["message"] for k in range(step))) or
               (e["kind"] == "failed" and any(e["message"].startswith(f"round {k} ") for k in range(1, step + 1))
                and "proven" in e["message"]) for e in after)


@pytest.mark.parametrize("drop", ["others", "one"])
def test_an_owner_that_leaves_out_what_it_receipted_is_proven_evicted_and_its_steps_undone(  # type: ignore[no-untyped-def]
        swarm, tmp_path: Path, drop: str) -> None:
    """The owner of a shard signs a receipt for every contribution and averages only its own (``others``; its own
    pseudo-gradient sign-flipped and 10x larger, issue 47's attack) or leaves out one honest contributor
    (``one``). Its result is honestly the average of the inputs it names, so its audit passes; but a contributor
    it left out holds its receipt and the signed result, reports them, and the coordinator checks them: the owner
    is proven within 2 outer steps, evicted, and the run goes back to before the step; the three honest peers
    train to the end, within 2 % of an honest-only run."""
    attack = f"owner.drop@*:{drop}" + (",outer.delta@*:scale=-10" if drop == "others" else "")
    attacked = run(swarm, 4, attack, slow=SLOW)
    proven = [e for e in attacked["events"] if e["kind"] == "proven"]
    assert proven and "receipted" in proven[0]["message"], [e for e in attacked["events"]
                                                             if e["kind"] in ("audit", "proven", "evicted")]
    first = int(proven[0]["message"].split("of step ")[1].split(")")[0])
    assert first <= 2, proven[0]["message"]
    liar_id = proven[0]["peer"]
    said = [e for e in attacked["events"] if e["kind"] not in ("round", "joined", "started", "replan")]
    assert undone(attacked["events"], first), said
    assert not [e for e in attacked["events"] if e["kind"] in ("proven", "evicted") and e["peer"] != liar_id]
    assert liar_id not in {m["peer_id"] for m in attacked["round"]["members"]}
    fresh(swarm, tmp_path, "honest")
    honest = run(swarm, 3, slow=SLOW)
    loss, ref = attacked["history"][-1]["eval_loss"], honest["history"][-1]["eval_loss"]
    assert abs(loss - ref) <= 0.02 * ref, (loss, ref)
    print(f"eval loss: an owner leaving out what it receipted ({drop}) {loss:.4f}, honest-only {ref:.4f}")


def test_an_auditor_colluding_with_a_lying_owner_does_not_hide_its_lie(swarm) -> None:  # type: ignore[no-untyped-def]
    """Three peers: an owner that shifts its mean at every step, an accomplice that says "ok" to every audit it runs,
    and an honest peer. With every audited shard given a second auditor (``sync.second_audit = 1``) the honest one
    audits the liar's shard whoever is drawn first: the lie of step 1 is proven, the liar evicted and the run rolled
    back, and nobody honest is evicted; the accomplice's ok to a proven lie is false, and it is evicted too. (At the
    default 0.25 and R = 4 such a pair is caught with probability 0.75 a step, against 0.67 with one auditor:
    ``benchmarks/verified_reduction.py`` measures it.)"""
    swarm.start_coordinator({**RUN, "membership.min_peers": 3, "sync.second_audit": 1.0})
    swarm.start_peer(env={**os.environ, "POTLUCK_FAULTS": "owner.mean@*:shift=0.5"})
    swarm.start_peer(env={**os.environ, "POTLUCK_FAULTS": "audit.verdict@*:ok"})
    swarm.start_peer()
    state = swarm.wait_state(lambda s: s["run"]["finished"] and len(s["history"]) == RUN["diloco.outer_steps"]
                             and s["history"][-1]["eval_loss"] is not None, 300, "the run to finish")
    proven = [e for e in state["events"] if e["kind"] == "proven"]
    assert proven and "step 1" in proven[0]["message"], [e for e in state["events"] if e["kind"] in ("audit", "proven")]
    liar_id = proven[0]["peer"]
    assert any(e["kind"] == "rollback" and "to v0" in e["message"] for e in state["events"])
    accomplice = Identity.load_or_create(swarm.key(1)).peer_id
    evicted = {e["peer"] for e in state["events"] if e["kind"] in ("proven", "evicted")}
    assert evicted == {liar_id, accomplice}, [e for e in state["events"] if e["kind"] in ("audit", "proven", "evicted")]
    assert not evicted & {m["peer_id"] for m in state["round"]["members"]}


def test_an_owner_that_refuses_every_contribution_is_worked_around_by_its_backup(swarm, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """An owner refuses every contribution sent to it (OVERLOADED) and signs a result of its own alone, at every
    step, beside an honest peer at half speed: no receipt, so no proof, but its result names 1 of the step's 4
    contributors, short of the quorum (``sync.quorum`` 0.5): every member drops it and the shard's backup takes it
    over from the slices each sent it as soon as they were refused. Training goes on, every step has all four members,
    and nothing is lost: the run ends where an honest run of four ends (2 %). The page says why each time; named by
    three members in three steps, the owner loses its shard (``sync.demote_after``) and the steps after are plain."""
    steps = 7
    attacked = run(swarm, 4, "owner.refuse@*:all", {"diloco.outer_steps": steps}, slow=SLOW)
    assert [h["members"] for h in attacked["history"]] == [4] * steps
    assert not [e for e in attacked["events"] if e["kind"] in ("failed", "rollback", "proven")], attacked["events"]
    floor = 10.0  # (sync.deadline_floor_s: the owner waits for what it refuses until its deadline, then the backup)
    assert all(h["outer_s"] is not None and h["outer_s"] < floor for h in attacked["history"]), attacked["history"]
    logs = "".join(p.read_text() for p in swarm.logs.glob("peer-*.log"))
    assert "not adopted; its backup takes the shard over" in logs and "sent to its backup and reported" in logs
    short = [e for e in attacked["events"] if e["kind"] == "short"]
    demoted = [e for e in attacked["events"] if e["kind"] == "demoted"]
    assert short and demoted and {e["peer"] for e in short + demoted} == {demoted[0]["peer"]}, attacked["events"]
    refuser = demoted[0]["peer"]
    assert not next(m for m in attacked["round"]["members"] if m["peer_id"] == refuser)["owns"]
    # nothing lost: every shard of every step averaged all four contributions (the refuser's own too, sent to the
    # backup that took its shard over)
    assert [h["contributors"] for h in attacked["history"]] == [4] * steps, [
        {k: h.get(k) for k in ("step", "members", "contributors", "dropped", "rejected", "clipped", "samples")}
        for h in attacked["history"]]
    took = [h["outer_s"] for h in attacked["history"]]
    assert took[-1] < min(took[:3]), f"the steps after its demotion need no take-over: {took}"
    fresh(swarm, tmp_path, "honest")
    honest = run(swarm, 4, overrides={"diloco.outer_steps": steps}, slow=SLOW)
    loss, ref = attacked["history"][-1]["eval_loss"], honest["history"][-1]["eval_loss"]
    assert abs(loss - ref) <= 0.02 * ref, (loss, ref)
    print(f"eval loss: an owner refusing every contribution {loss:.4f}, honest {ref:.4f}; outer step seconds "
          f"{[round(h['outer_s'] or 0, 2) for h in attacked['history']]} (honest "
          f"{[round(h['outer_s'] or 0, 2) for h in honest['history']]})")


def test_a_peer_evicted_for_its_contributions_leaves_no_lasting_damage(swarm, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A peer sends its pseudo-gradient sign-flipped and 10x larger at every step while it owns a shard: the other
    owners reject it, their signed flags get it evicted (``admission.evict_after``), and the shards it owned that
    no picked auditor vouched for are audited again by the coordinator, or rolled back. The honest three end within
    2 % of an honest-only run."""
    attacked = run(swarm, 4, "outer.delta@*:scale=-10", {"diloco.outer_steps": 6}, slow=SLOW)
    evicted = [e for e in attacked["events"] if e["kind"] == "evicted"]
    assert evicted, [e for e in attacked["events"] if e["kind"] in ("audit", "proven", "evicted")]
    bad = evicted[0]["peer"]
    assert not [e for e in attacked["events"] if e["kind"] in ("proven", "evicted") and e["peer"] != bad]
    assert bad not in {m["peer_id"] for m in attacked["round"]["members"]}
    rechecked = [e for e in attacked["events"] if e["kind"] == "audit" and "owned by the evicted" in e["message"]]
    print("after the eviction:", [e["message"] for e in rechecked])
    fresh(swarm, tmp_path, "honest")
    honest = run(swarm, 3, overrides={"diloco.outer_steps": 6}, slow=SLOW)
    loss, ref = attacked["history"][-1]["eval_loss"], honest["history"][-1]["eval_loss"]
    # (damage is a higher loss; lower is the honest work the attacker's own shard averaged while it owned one: -0.2 to
    # -1.4 % in runs here, as its eviction came a step earlier or later)
    assert loss <= 1.02 * ref, (loss, ref)
    print(f"eval loss: a peer evicted for its contributions {loss:.4f}, honest-only {ref:.4f}")
