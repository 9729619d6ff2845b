"""Universal checkpoints: a run written with 2 pipeline stages resumes with 1 and with 4."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.slow

BASE = {"model.n_layers": 2, "data.num_samples": 256, "pipeline.micro_batches": 2, "pipeline.pipe_timeout_s": 15.0,
        "coordinator.checkpoint_every": 1, "diloco.inner_steps": 12}


def finish(swarm, overrides: dict, peers: int, steps: int) -> dict:  # type: ignore[no-untyped-def]
    swarm.start_coordinator({**BASE, **overrides, "diloco.outer_steps": steps, "membership.min_peers": peers})
    for _ in range(peers):
        swarm.start_peer()
    state = swarm.wait_state(
        lambda s: s["run"]["finished"] and s["history"] and s["history"][-1]["eval_loss"] is not None
        and any(e["kind"] == "checkpoint" and f"v{steps} " in e["message"] for e in s["events"]),
        300, f"{steps} outer steps and their checkpoint")
    swarm.procs.stop()
    swarm.peers.clear()
    return state


@pytest.mark.parametrize("stages,peers", [(1, 1), (4, 4)])
def test_resume_with_another_number_of_stages(swarm, stages: int, peers: int) -> None:  # type: ignore[no-untyped-def]
    first = finish(swarm, {"pipeline.stages": 2}, peers=2, steps=3)
    before = first["history"][-1]["eval_loss"]
    assert before < math.log(64) - 0.5
    resumed = finish(swarm, {"pipeline.stages": stages}, peers=peers, steps=5)
    assert any(e["kind"] == "reshard" for e in resumed["events"])
    hist = {h["step"]: h for h in resumed["history"]}
    assert sorted(hist) == [1, 2, 3, 4, 5]  # the history of the first part is kept
    after = hist[4]["eval_loss"]
    # the loss continues from where it was (an untrained model would be at log(64) = 4.16)
    assert after < before + 0.15, (before, after)
    assert hist[5]["eval_loss"] < before + 0.15


def test_export_loads_into_the_plain_model_and_matches_the_runs_eval(swarm, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    import torch

    from potluck.peer.training.data import Dataset
    from potluck.peer.training.model import TinyGPT, lm_loss
    from potluck.protos.config.runconfig import ModelConfig

    state = finish(swarm, {"pipeline.stages": 2}, peers=2, steps=3)
    out = tmp_path / "model.pt"
    proc = subprocess.run([sys.executable, "-m", "potluck", "export", "--journal", str(swarm.workdir / "journal"),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    sd = torch.load(out)
    assert sd["version"] == 3
    model = TinyGPT(ModelConfig(**sd["config"]))
    model.load_state_dict(sd["model"])
    data = Dataset(swarm.config.data, swarm.config.model)
    ids = data.eval_ids()
    with torch.no_grad():
        losses = [float(lm_loss(model(x), y)) * len(c) for c in (ids[k:k + 64] for k in range(0, len(ids), 64))
                  for x, y in [data.batch(c)]]
    assert sum(losses) / len(ids) == pytest.approx(state["history"][-1]["eval_loss"], abs=1e-4)
    # a missing journal is a clear error, not a traceback
    bad = subprocess.run([sys.executable, "-m", "potluck", "export", "--journal", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no checkpoint" in bad.stderr
