"""Peers of different speeds in real swarms: a slower one adds its work and is never dropped, a peer slowed down
mid-run keeps contributing while the rounds go back to the fast one's pace, and nobody gets more weight than the
data it was handed or than it signed for (processes, DHT, gRPC with mutual TLS; slowness is injected with
``POTLUCK_FAULTS=inner.step@N+:slow=F``: each inner step takes F times as long)."""

from __future__ import annotations

import os
import statistics

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

H = 12
RUN = {"model.d_model": 64, "model.n_layers": 2, "model.seq_len": 64, "train.batch_size": 8, "diloco.inner_steps": H,
       "data.eval_every": 0}


def slow(factor: float, from_step: int = 1) -> dict[str, str]:
    return {**os.environ, "POTLUCK_FAULTS": f"inner.step@{from_step}+:slow={factor:g}"}


def finished(steps: int):  # type: ignore[no-untyped-def]
    return lambda s: s["run"]["finished"] and len(s["history"]) == steps and all(
        h.get("samples") for h in s["history"])


def names(state: dict) -> dict[str, str]:
    return {p["name"]: p["id"] for p in state["peers"]}


def test_a_quarter_speed_peer_adds_its_work_and_is_never_dropped(swarm) -> None:  # type: ignore[no-untyped-def]
    steps = 6
    swarm.start_coordinator({**RUN, "membership.min_peers": 2, "diloco.outer_steps": steps})
    swarm.start_peer(name="fast")
    swarm.start_peer(name="slow", env=slow(4))
    state = swarm.wait_state(finished(steps), 300, "the run to finish")
    ids = names(state)
    hist = state["history"]
    assert not [h for h in hist if h["dropped"]], [h["dropped"] for h in hist]
    assert all(len(set(h["state_hashes"].values())) == 1 for h in hist)  # bit-identical states, every step
    per_step = [h["inner_steps"] for h in hist]
    assert all(s[ids["fast"]] == H for s in per_step), per_step  # the fast peer never waits nor stops short
    slow_steps = [s[ids["slow"]] for s in per_step[1:]]  # (from the second round on it knows the window)
    assert all(1 <= n < H for n in slow_steps), per_step  # it trains what fits, and its work counts
    assert all(h["samples"] == 8 * sum(h["inner_steps"].values()) for h in hist), hist  # every sample in the model
    assert state["run"]["data"]["repeats"] == 0
    by_id = {p["id"]: p for p in state["peers"]}
    share = by_id[ids["slow"]]["work_share"]
    assert share is not None and 0.02 < share < 0.5, share
    assert state["run"]["window_s"] and by_id[ids["slow"]]["step_s"] > by_id[ids["fast"]]["step_s"]
    events = " ".join(e["message"] for e in state["events"])
    assert "evicted" not in events and "clipped" not in " ".join(str(h["clipped"]) for h in hist if h["clipped"])


def test_a_peer_slowed_8x_mid_run_keeps_contributing_and_the_rounds_regain_their_pace(swarm) -> None:  # type: ignore[no-untyped-def]
    """Two equal peers; one becomes 8x slower from outer step 5. It is never dropped and its work counts in every
    step; from step 7 the rounds go at the other one's pace again: their median within 1.5x the median before, none
    twice as long, where waiting for the slowed peer's H steps would take 8x. (One slowed step is 8/H = 2/3 of a
    phase: when it ends past the window the round waits for it, so the rounds after are not as even as before; alone
    on this box their median measured 0.84-1.27x the one before, which failed the 1.25x bound this test had.) (Steps
    of a bigger batch here: each round is mostly compute.)"""
    steps, k = 11, 5
    swarm.start_coordinator({**RUN, "model.seq_len": 128, "train.batch_size": 16, "membership.min_peers": 2,
                             "diloco.outer_steps": steps})
    swarm.start_peer(name="steady")
    swarm.start_peer(name="slowed", env=slow(8, from_step=k))
    state = swarm.wait_state(finished(steps), 500, "the run to finish")
    ids, hist = names(state), state["history"]
    assert not [h for h in hist if h["dropped"]]
    slowed = [h["inner_steps"][ids["slowed"]] for h in hist]
    assert all(n >= 1 for n in slowed), slowed  # it keeps contributing
    assert max(slowed[k + 1:]) < H / 2 <= min(slowed[1:k - 1]), slowed  # equal before, a fraction after
    took = {h["step"]: h["t"] - prev["t"] for prev, h in zip(hist, hist[1:], strict=False)}
    before = statistics.median(took[s] for s in range(2, k))
    after = [took[s] for s in range(k + 2, steps + 1)]
    assert statistics.median(after) <= 1.5 * before and max(after) <= 2 * before, (before, took)


@pytest.mark.parametrize("fault,says", [("outer.samples@*:scale=10", "claim of"),
                                        ("owner.weight@*:scale=10", "not the average")])
def test_more_weight_than_its_work_is_refused_and_its_owner_proven(swarm, fault: str, says: str) -> None:  # type: ignore[no-untyped-def]
    """A member that claims ten times the samples it trained is refused by every other owner (its replica was
    handed fewer) and, averaging its own claim in its shard, is proven by that shard's audit; an owner that weighs
    its own contribution up is proven the same way. Either is evicted, the run goes back to before its lie, and
    the honest peers train to the end without it."""
    steps = 5
    swarm.start_coordinator({**RUN, "membership.min_peers": 3, "diloco.outer_steps": steps, "sync.audit_fraction": 1.0,
                             "data.eval_every": steps})
    swarm.start_peer(name="liar", env={**os.environ, "POTLUCK_FAULTS": fault})
    swarm.start_peer(name="a")
    swarm.start_peer(name="b")
    state = swarm.wait_state(lambda s: s["run"]["finished"] and len(s["history"]) == steps, 400, "the run to finish")
    liar = names(state)["liar"]
    proven = [e for e in state["events"] if e["kind"] == "proven"]
    assert proven and proven[0]["peer"] == liar and says in proven[0]["message"], proven
    assert not [e for e in state["events"] if e["kind"] in ("proven", "evicted") and e["peer"] != liar]
    assert all(liar not in h["state_hashes"] for h in state["history"])  # no kept step holds its weight
    assert liar not in {m["peer_id"] for m in state["round"]["members"]}
    if fault.startswith("outer.samples"):
        logs = "".join(p.read_text(errors="replace") for p in swarm.logs.glob("peer-*.log"))
        assert "OVERCLAIM" in logs  # the other owners refused its slices
