"""What the experiment trackers wrote, read back with each tool's own reader (no network).

* TensorBoard: its event files, through ``tensorboard``'s ``EventAccumulator``;
* W&B: an offline run's ``.wandb`` transaction log, through the installed ``wandb`` CLI's ``leet inspect --json``
  (wandb 0.31 reads the log in its Go core; the Python reader of older versions is gone);
* MLflow: the local store, through ``MlflowClient``.

Each returns ``{step: value}`` of one metric (the last value logged at a step: a step trained again after a
rollback is logged again) and the events (kind, text) it holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def tensorboard_scalars(folder: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def tensorboard_texts(folder: Path) -> dict[str, list[tuple[int, str]]]:
    """Every text summary, by tag (``config``, ``events/rollback``...): (step, text)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    out: dict[str, list[tuple[int, str]]] = {}
    for tag in acc.Tags()["tensors"]:
        for e in acc.Tensors(tag):
            text = b"".join(e.tensor_proto.string_val).decode()
            out.setdefault(tag.removesuffix("/text_summary"), []).append((e.step, text))
    return out


def wandb_records(folder: Path) -> list[dict[str, Any]]:
    """The records of the one offline run in ``folder`` (``wandb`` of W&B's ``dir``)."""
    logs = sorted(folder.glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1, f"one offline W&B run expected under {folder}: {logs}"
    # (the interpreter's own wandb, whichever environment it was installed into)
    done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(logs[0])], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "WANDB_SILENT": "true"})
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def wandb_history(records: list[dict[str, Any]], key: str) -> dict[int, float]:
    out = {}
    for r in records:
        item = r.get("history", {}).get("item", {}) if r.get("type") == "history" else {}
        if key in item:
            out[int(item["outer_step"])] = float(item[key])
    return out


def wandb_alerts(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(r["alert"]["title"], r["alert"]["text"]) for r in records if r.get("type") == "alert"]


def wandb_config(records: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in records:
        if r.get("type") == "config":
            out.update(r["config"].get("update", {}))
        elif r.get("type") == "run":
            out.update(r["run"].get("config", {}).get("update", {}))
    return out


def mlflow_run(store: Path, experiment: str = "potluck") -> tuple[Any, Any]:
    """The client of the local store at ``store`` and the one run of ``experiment`` in it."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # (MLflow 3 keeps the file store for those who ask)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r} in {store}"
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, runs
    return client, runs[0]


def mlflow_metric(client: Any, run: Any, key: str) -> dict[int, float]:
    return {m.step: m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp)}
