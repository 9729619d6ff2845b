"""A real run logged to all three experiment trackers at once: a coordinator and two peers, then each tracker's
files read back with its own reader (TensorBoard's EventAccumulator, the offline W&B run's transaction log,
MLflow's client over its local store) and their loss series compared with the run's ``/api/v1/state`` history."""

from __future__ import annotations

import os
import signal

import pytest
from trackers_read import (
    mlflow_metric,
    mlflow_run,
    tensorboard_scalars,
    tensorboard_texts,
    wandb_config,
    wandb_history,
    wandb_records,
)

pytestmark = pytest.mark.slow

STEPS = 4


def test_a_real_runs_series_in_each_tracker_are_its_status_pages(swarm) -> None:  # type: ignore[no-untyped-def]
    env = {"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": ""}  # (no network: W&B offline, MLflow's local store)
    swarm.start_coordinator({"coordinator.trackers": ["tensorboard", "wandb", "mlflow"], "diloco.outer_steps": STEPS,
                             "membership.min_peers": 2}, env=env)
    for _ in range(2):
        swarm.start_peer()
    state = swarm.wait_state(lambda s: s["run"]["finished"] and len(s["history"]) == STEPS and all(
        h["loss"] is not None and h["eval_loss"] is not None for h in s["history"]), 240, "the run's end")
    swarm.wait_for(lambda: all(p.poll() is not None for p in swarm.peers), 60, "the peers to finish")
    state = swarm.state()  # (the last reports folded in)
    os.kill(swarm.coordinator.pid, signal.SIGTERM)  # (its stop logs what the last snapshot holds, then closes them)
    assert swarm.coordinator.wait(timeout=30) == 0
    log = (swarm.logs / "coordinator.log").read_text()
    assert "logging the run to tensorboard, wandb, mlflow" in log and " 0 dropped" in log, log[-3000:]
    assert "tracker failed" not in log and "did not close cleanly" not in log, log[-3000:]

    loss = {h["step"]: h["loss"] for h in state["history"]}
    evals = {h["step"]: h["eval_loss"] for h in state["history"]}
    assert sorted(loss) == list(range(1, STEPS + 1))
    folder = swarm.workdir / "journal" / "trackers"

    assert tensorboard_scalars(folder / "tensorboard", "loss/train") == pytest.approx(loss, rel=1e-6)  # (float32)
    assert tensorboard_scalars(folder / "tensorboard", "loss/eval") == pytest.approx(evals, rel=1e-6)
    assert [step for step, _ in tensorboard_texts(folder / "tensorboard")["config"]] == [0]
    records = wandb_records(folder / "wandb")
    assert wandb_history(records, "loss/train") == loss and wandb_history(records, "loss/eval") == evals
    assert wandb_config(records)["run_id"] == "test"
    client, run = mlflow_run(folder / "mlflow")
    assert mlflow_metric(client, run, "loss/train") == loss and mlflow_metric(client, run, "loss/eval") == evals
    assert run.info.run_name == "test" and run.info.status == "FINISHED"
