"""A real 2-stage pipeline whose every message is 4x the 8 MiB a gRPC message may hold, or more.

Before messages were cut into pieces, such a run retried its first micro-batch forever. Here it trains
its outer steps, evaluates every version through the pipeline, and ends bit-identical to the same run
(same seed) sending every message's body whole (the knobs of potluck.protos.wire.limits raise the cap for
that reference run alone): cutting a message into pieces changes no bit, compressed or not.

The model is as wide as the llama-1b preset (d_model 2048) and 1024 tokens long, with no blocks (an
embedding on stage 0, the head on stage 1): what crosses the boundary is a 1B model's micro-batch,
what is computed is small enough for CI's two cores.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from potluck.protos.wire.limits import CHUNK_ENV, MAX_ENV, MAX_MESSAGE_BYTES

pytestmark = pytest.mark.slow

WIDE = {
    "model.n_layers": 0, "model.d_model": 2048, "model.n_heads": 16, "model.seq_len": 1024,
    "train.batch_size": 8, "pipeline.stages": 2, "pipeline.micro_batches": 1, "pipeline.pipe_timeout_s": 60.0,
    "data.num_samples": 16, "data.eval_samples": 8, "membership.min_peers": 2,
    "diloco.outer_steps": 2, "diloco.inner_steps": 2, "train.warmup_steps": 0,
}
WHOLE = {MAX_ENV: str(256 << 20), CHUNK_ENV: str(200 << 20)}  # every body in one piece


def run(swarm, compression: str, env: dict[str, str] | None) -> list[dict]:  # type: ignore[no-untyped-def]
    swarm.start_coordinator({**WIDE, "pipeline.compression": compression}, env=env)
    for _ in range(2):
        swarm.start_peer(env=env)
    state = swarm.wait_state(
        lambda s: s["run"]["finished"] and len(s["history"]) == WIDE["diloco.outer_steps"]
        and all(h["eval_loss"] is not None and len(h["state_hashes"]) == 2 for h in s["history"]),
        300, f"the wide {compression} pipeline to train, evaluate every version and finish")
    for proc in swarm.peers:
        proc.wait(timeout=60)
        assert proc.returncode == 0
    swarm.stop()
    return state["history"]


def by_stage(entry: dict) -> dict[int, set[str]]:
    out: dict[int, set[str]] = defaultdict(set)
    for pid, h in entry["state_hashes"].items():
        out[entry["stages"][pid]].add(h)
    return dict(out)


@pytest.mark.parametrize("compression", ["acsgd", "none"])
def test_messages_4x_the_cap_train_evaluate_and_end_as_if_sent_whole(swarm, tmp_path, compression: str) -> None:  # type: ignore[no-untyped-def]
    pieces = run(swarm, compression, None)
    # step 1 sees every sample for the first time: fp16 (AC-SGD) or fp32 messages of 4x / 8x the cap
    first_step = pieces[0]["bytes"]["activations"] / WIDE["diloco.inner_steps"]
    assert first_step >= (4 if compression == "acsgd" else 8) * MAX_MESSAGE_BYTES * 0.99, first_step
    swarm.__init__(swarm.procs, tmp_path / "whole")
    whole = run(swarm, compression, WHOLE)
    assert [by_stage(h) for h in pieces] == [by_stage(h) for h in whole]
    assert [h["eval_loss"] for h in pieces] == [h["eval_loss"] for h in whole]
    assert all(len(hashes) == 1 for h in pieces for hashes in by_stage(h).values())
