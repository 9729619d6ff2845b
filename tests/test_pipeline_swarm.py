"""A real 2 stages x 2 replicas swarm: 4 peer processes run the model as two pipelines."""

from __future__ import annotations

import math
import os
from collections import defaultdict

import pytest

pytestmark = pytest.mark.slow

GRID = {
    "pipeline.stages": 2, "pipeline.micro_batches": 2, "pipeline.compression": "acsgd", "pipeline.bits": 4,
    "pipeline.pipe_timeout_s": 15.0, "model.n_layers": 2, "data.num_samples": 64,
    "membership.min_peers": 4, "diloco.outer_steps": 5, "diloco.inner_steps": 12,
}


def stage_hashes(entry: dict) -> dict[int, set[str]]:
    by_stage: dict[int, set[str]] = defaultdict(set)
    for pid, h in entry["state_hashes"].items():
        by_stage[entry["stages"][pid]].add(h)
    return by_stage


def test_two_stages_by_two_replicas_train_with_identical_replicas(swarm) -> None:  # type: ignore[no-untyped-def]
    swarm.start_coordinator(GRID)
    for _ in range(4):
        swarm.start_peer()
    state = swarm.wait_state(
        lambda s: s["run"]["finished"] and s["history"] and len(s["history"][-1]["state_hashes"]) == 4
        and s["history"][-1]["eval_loss"] is not None,
        300, "the 2x2 run to finish",
    )
    assert state["grid"]["stages"] == 2 and state["grid"]["replicas"] == 2
    hist = state["history"]
    assert [h["step"] for h in hist] == list(range(1, 6))
    for h in hist:
        if len(h["state_hashes"]) < 4:
            continue
        by_stage = stage_hashes(h)
        assert sorted(by_stage) == [0, 1]
        # replicas of a stage hold identical parameters; the two stages are different tensors
        assert all(len(v) == 1 for v in by_stage.values()), f"step {h['step']}: {by_stage}"
    start, floor = math.log(64), state["run"]["loss_floor"]
    assert hist[-1]["eval_loss"] < hist[0]["eval_loss"] < start
    assert hist[-1]["eval_loss"] < floor + 0.6 * (start - floor)
    # AC-SGD: activations cost well under fp32 once samples are revisited (64 samples, 2 per step)
    acts = sum(h["bytes"]["activations"] for h in hist)
    acts_fp32 = sum(h["bytes_fp32"]["activations"] for h in hist)
    grads, grads_fp32 = sum(h["bytes"]["gradients"] for h in hist), sum(h["bytes_fp32"]["gradients"] for h in hist)
    assert 0 < acts < 0.3 * acts_fp32
    assert 0 < grads < 0.3 * grads_fp32
    for proc in swarm.peers:
        proc.wait(timeout=60)
        assert proc.returncode == 0


def test_a_send_that_can_never_succeed_reaches_the_page_within_two_deadlines(swarm) -> None:  # type: ignore[no-untyped-def]
    """One peer's first pipeline message goes out with a piece over gRPC's cap (a fault): no retry loop. The
    peer stops with exit code 3, and the page's events and waiting reason say why, within two deadlines."""
    timeout = 10.0
    swarm.start_coordinator({**GRID, "membership.min_peers": 2, "pipeline.pipe_timeout_s": timeout})
    broken = swarm.start_peer(env={**os.environ, "POTLUCK_FAULTS": "pipe.send@1:oversize"})
    swarm.start_peer()
    state = swarm.wait_state(lambda s: any(e["kind"] == "failed" and e["peer"] for e in s["events"])
                             and "stopped on an error" in (s["run"]["waiting_reason"] or ""),
                             120, "the failed peer on the page")
    event = next(e for e in state["events"] if e["kind"] == "failed" and e["peer"])
    assert "RESOURCE_EXHAUSTED" in event["message"], event
    assert "RESOURCE_EXHAUSTED" in state["run"]["waiting_reason"]
    row = next(p for p in state["peers"] if p["id"] == event["peer"])
    assert row["state"] == "failed" and "RESOURCE_EXHAUSTED" in row["error"]
    decided = next(e["t"] for e in state["events"] if e["kind"] == "round")  # round 1, the first decided
    assert event["t"] - decided < 2 * timeout, (event, decided)
    assert broken.wait(timeout=30) == 3


def test_streaming_outer_steps_keep_each_stages_replicas_identical(swarm) -> None:  # type: ignore[no-untyped-def]
    """``sync.fragments = 2`` with int4 outer gradients on the 2 x 2 grid, one peer at half speed: each stage's
    vector is cut into its own fragments (the stages hold different tensors), each outer step syncs one of them
    in both stages, and after every step a stage's replicas hold the same bits; each step sends about half the
    outer bytes of a whole stage's."""
    swarm.start_coordinator({**GRID, "diloco.outer_steps": 4, "diloco.inner_steps": 6, "sync.fragments": 2,
                             "sync.codec": "int4"})
    swarm.start_peer(env={**os.environ, "POTLUCK_FAULTS": "inner.step@*:slow=2"}, name="slow")
    for _ in range(3):
        swarm.start_peer()
    state = swarm.wait_state(
        lambda s: s["run"]["finished"] and s["history"] and len(s["history"][-1]["state_hashes"]) == 4,
        300, "the 2x2 run with fragments to finish",
    )
    assert state["config"]["fragments"] == 2 and state["config"]["outer_codec"] == "int4"
    hist = state["history"]
    assert [h["step"] for h in hist] == list(range(1, 5))
    assert all(len(h["state_hashes"]) == 4 for h in hist), [h["members"] for h in hist]
    for h in hist:
        by_stage = stage_hashes(h)
        assert sorted(by_stage) == [0, 1] and all(len(v) == 1 for v in by_stage.values()), f"step {h['step']}: {by_stage}"
    # a stage syncs half its vector a step, in 4 bits: about a quarter of int8's whole-stage bytes (fp32 / 16)
    outer = sum(h["bytes"]["outer"] for h in hist)
    outer_fp32 = sum(h["bytes_fp32"]["outer"] for h in hist)
    assert 0 < outer < 0.2 * outer_fp32, (outer, outer_fp32)
