"""The trackers themselves: TensorBoard, Weights & Biases and MLflow, each behind the same four calls.

A :class:`Tracker` is opened once (:meth:`Tracker.open`, at the coordinator's start: a failure there stops the
start with its reason), then told the run's config, its steps and its events, then closed; all but ``open`` are
called on the trackers' own thread (:mod:`potluck.coordinator.trackers.feed`), never on the coordinator's loop.
Each library is an extra (``pip install 'potluck[wandb]'``), imported only when its tracker is asked for;
:func:`missing` names the ones not installed, so the coordinator refuses the run before it loads anything.

Each is logged where that tool puts things naturally:

* TensorBoard: scalars by step, the config and every event as text summaries (``config``, ``events/<kind>``),
  event files in ``tracker_dir/tensorboard``;
* W&B: one run (id: the run id, resumed by a restarted coordinator; mode from ``WANDB_MODE``), its config, a
  history row per step with ``outer_step`` as every metric's x axis, each event an alert;
* MLflow: a run of experiment ``tracker_project`` tagged with the run id (found again on a restart), the config
  as params (and ``config.json``), metrics by step, each event a tag ``potluck.event.<kind>`` and a line of the
  artifact ``events.txt``; the store is ``MLFLOW_TRACKING_URI``, or a ``file:`` store in ``tracker_dir/mlruns``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from potluck.coordinator.trackers.points import Event, Step

NAMES = ("tensorboard", "wandb", "mlflow")
MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # (what each extra installs)
KEEP_EVENTS = 1000  # the events MLflow's events.txt holds (rewritten whole: an artifact cannot be appended to)
MLFLOW_BATCH = 100  # params in one MLflow call (its limit)
MLFLOW_PARAM_CHARS = 500  # a param's value at most (its limit)
WARN = ("failed", "rollback", "evicted", "proven")  # events W&B raises as warnings (the others: info)


class TrackerError(RuntimeError):
    """A tracker that could not start: the run is not started (the message names the tracker and the fix)."""


def missing(names: Sequence[str]) -> list[str]:
    """The trackers of ``names`` whose library is not installed."""
    return [n for n in names if importlib.util.find_spec(MODULES[n]) is None]


class Tracker:
    """One tracker; ``folder`` is its own under the coordinator's ``tracker_dir``."""

    name = ""

    def __init__(self, folder: Path, project: str, run_name: str, run_id: str) -> None:
        self.folder, self.project, self.run_name, self.run_id = folder, project, run_name, run_id

    def open(self, config: dict[str, Any], step: int) -> None:
        """Start (and log ``config`` at ``step``, the step the coordinator starts at)."""
        raise NotImplementedError

    def step(self, point: Step) -> None:
        raise NotImplementedError

    def event(self, point: Event) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class TensorBoard(Tracker):
    name = "tensorboard"

    def __init__(self, folder: Path, project: str, run_name: str, run_id: str) -> None:
        super().__init__(folder, project, run_name, run_id)
        self.writer: Any = None

    def open(self, config: dict[str, Any], step: int) -> None:
        importlib.import_module("tensorboard")  # (torch's writer needs it: its absence is told here, by name)
        writer = importlib.import_module("torch.utils.tensorboard").SummaryWriter
        self.writer = writer(log_dir=str(self.folder), flush_secs=10)
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, sort_keys=True, default=str) + "\n```",
                             step)
        self.writer.flush()

    def step(self, point: Step) -> None:
        for name, value in point.metrics.items():
            self.writer.add_scalar(name, value, point.step, walltime=point.t or None)
        self.writer.flush()

    def event(self, point: Event) -> None:
        self.writer.add_text(f"events/{point.kind}", point.message + (f" (peer {point.peer})" if point.peer else ""),
                             point.step, walltime=point.t or None)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandB(Tracker):
    name = "wandb"

    def __init__(self, folder: Path, project: str, run_name: str, run_id: str) -> None:
        super().__init__(folder, project, run_name, run_id)
        self.wandb: Any = None
        self.run: Any = None

    def open(self, config: dict[str, Any], step: int) -> None:
        self.wandb = importlib.import_module("wandb")
        self.folder.parent.mkdir(parents=True, exist_ok=True)  # (W&B keeps its runs in a folder "wandb" of ``dir``)
        settings = self.wandb.Settings(console="off", disable_git=True, disable_code=True, quiet=True)
        self.run = self.wandb.init(project=self.project, name=self.run_name, id=wandb_id(self.run_id),
                                   dir=str(self.folder.parent), resume="allow", settings=settings)
        self.run.config.update(config, allow_val_change=True)  # (a resumed run's: the config it runs with now)
        self.run.define_metric("outer_step")
        self.run.define_metric("*", step_metric="outer_step")  # (a step trained again after a rollback goes back)

    def step(self, point: Step) -> None:
        self.run.log({**point.metrics, "outer_step": point.step})

    def event(self, point: Event) -> None:
        level = self.wandb.AlertLevel.WARN if point.kind in WARN else self.wandb.AlertLevel.INFO
        self.run.alert(title=f"{self.run_name}: {point.kind} at outer step {point.step}",
                       text=point.message + (f" (peer {point.peer})" if point.peer else ""), level=level,
                       wait_duration=0)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
        if self.wandb is not None:
            self.wandb.teardown()  # (its service process ends with the run, not with the coordinator)


def wandb_id(run_id: str) -> str:
    """A W&B run id for potluck's (W&B refuses a few characters potluck's run ids never hold; 128 at most)."""
    return re.sub(r"[^\w.-]", "-", run_id)[:128]


class MLflow(Tracker):
    name = "mlflow"

    def __init__(self, folder: Path, project: str, run_name: str, run_id: str) -> None:
        super().__init__(folder, project, run_name, run_id)
        self.client: Any = None
        self.mlflow: Any = None
        self.id = ""  # MLflow's id of the run
        self.events: list[str] = []

    def open(self, config: dict[str, Any], step: int) -> None:
        uri = tracking_uri(self.folder)
        if uri.startswith("file:"):  # (MLflow 3 keeps its file store only for those who ask for it)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.mlflow = importlib.import_module("mlflow")
        self.client = self.mlflow.tracking.MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(self.project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(self.project)
        runs = self.client.search_runs([exp_id], filter_string=f"tags.`potluck.run_id` = '{self.run_id}'",
                                       max_results=1)
        if runs:  # (a restarted coordinator: the same run goes on; its params were logged)
            self.id = runs[0].info.run_id
            self.client.update_run(self.id, status="RUNNING")
        else:
            self.id = self.client.create_run(exp_id, run_name=self.run_name, tags={"potluck.run_id": self.run_id}).info.run_id
            params = [self.mlflow.entities.Param(k, str(v)[:MLFLOW_PARAM_CHARS]) for k, v in config.items()]
            for i in range(0, len(params), MLFLOW_BATCH):
                self.client.log_batch(self.id, params=params[i:i + MLFLOW_BATCH])
        self.client.log_text(self.id, json.dumps(config, indent=1, sort_keys=True, default=str), "config.json")

    def step(self, point: Step) -> None:
        at = int((point.t or time.time()) * 1000)
        metrics = [self.mlflow.entities.Metric(k, v, at, point.step) for k, v in point.metrics.items()]
        self.client.log_batch(self.id, metrics=metrics)

    def event(self, point: Event) -> None:
        line = (f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(point.t))} step {point.step} {point.kind}: "
                f"{point.message}" + (f" (peer {point.peer})" if point.peer else ""))
        self.events = [*self.events, line][-KEEP_EVENTS:]
        self.client.set_tag(self.id, f"potluck.event.{point.kind}", line[:MLFLOW_PARAM_CHARS])
        self.client.log_text(self.id, "\n".join(self.events) + "\n", "events.txt")

    def close(self) -> None:
        if self.id:
            self.client.set_terminated(self.id, "FINISHED")


def tracking_uri(folder: Path) -> str:
    """``MLFLOW_TRACKING_URI``, else a local file store in ``folder``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or folder.resolve().as_uri()


KINDS: dict[str, Callable[[Path, str, str, str], Tracker]] = {"tensorboard": TensorBoard, "wandb": WandB,
                                                             "mlflow": MLflow}
