"""The experiment trackers' layer: what it logs from a status snapshot (pure, with a fake clock), and the
trackers themselves fed snapshots for real (TensorBoard's event files, an offline W&B run, a local MLflow store),
read back with each tool's own reader. A real run's series against its ``/api/v1/state``: ``test_trackers_swarm``.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from fake_state import make_state
from swarm import run_config
from trackers_read import (
    mlflow_metric,
    mlflow_run,
    tensorboard_scalars,
    tensorboard_texts,
    wandb_alerts,
    wandb_config,
    wandb_history,
    wandb_records,
)

from potluck.coordinator.preflight import preflight
from potluck.coordinator.trackers.backends import TensorBoard, Tracker, TrackerError, wandb_id
from potluck.coordinator.trackers.feed import Trackers, tracker_dir
from potluck.coordinator.trackers.points import SETTLE_S, Cursor, Event, Step, config_values, due
from potluck.protos.config.files import apply_overrides, parse_config
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.config.section import ConfigError

BYTES = {"activations": 0, "gradients": 0, "outer": 4096}


def entry(step: int, epoch: int = 0, loss: float | None = None, **extra: Any) -> dict[str, Any]:
    """A history entry as ``/api/v1/state`` has it."""
    return {"step": step, "t": 1000.0 + 10 * step + epoch, "epoch": epoch, "members": 2,
            "loss": 5.0 - 0.25 * step - 0.01 * epoch if loss is None else loss, "eval_loss": 4.9 - 0.25 * step,
            "outer_s": 2.0, "allreduce_s": 0.5, "window_s": 8.0, "tokens": 5120, "tokens_per_s": 512.0,
            "bytes": dict(BYTES), **extra}


def snapshot(history: list[dict[str, Any]], committed: int | None = None, finished: bool = False,
             events: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"run": {"outer_step": history[-1]["step"] if committed is None else committed, "finished": finished,
                    "tokens_trained": 40960},
            "history": history, "events": events or [], "peers_summary": {"live": 3},
            "_peers": [{"bytes_sent": {"outer": 100, "activations": 7}}, {"bytes_sent": {"outer": 50}}]}


def steps(points: list[Step | Event]) -> list[int]:
    return [p.step for p in points if isinstance(p, Step)]


# ---------------------------------------------------------------------- what is logged, and when (pure)


def test_a_step_is_logged_once_a_later_one_commits_and_the_last_once_the_run_settled() -> None:
    cursor, points = due(snapshot([entry(1), entry(2), entry(3)]), Cursor(), now=0.0)
    assert steps(points) == [1, 2]  # (3's reports may still come: its eval loss, a slow member's)
    cursor, points = due(snapshot([entry(1), entry(2), entry(3)]), cursor, now=1.0)
    assert points == []  # logged once
    history = [entry(s) for s in range(1, 5)]
    cursor, points = due(snapshot(history), cursor, now=2.0)
    assert steps(points) == [3]
    cursor, points = due(snapshot(history, finished=True), cursor, now=3.0)
    assert points == []  # finished, its last reports folding in
    cursor, points = due(snapshot(history, finished=True), cursor, now=3.0 + SETTLE_S)
    assert steps(points) == [4]
    assert due(snapshot(history, finished=True), cursor, now=100.0)[1] == []


def test_a_stopping_coordinator_logs_every_step_it_has() -> None:
    cursor, points = due(snapshot([entry(1), entry(2)]), Cursor(), now=0.0, final=True)
    assert steps(points) == [1, 2] and cursor.logged == 2


def test_a_restarted_coordinator_logs_from_the_step_its_journal_held() -> None:
    history = [entry(s) for s in range(1, 7)]
    assert steps(due(snapshot(history), Cursor(logged=4), now=0.0)[1]) == [5]


def test_a_step_carries_what_the_page_shows() -> None:
    state = make_state(peers=8, steps=12, seed=3)
    h = next(h for h in state["history"] if h["step"] == 5)
    h.setdefault("allreduce_s", h["outer_s"] / 4)  # (fake_state's entries are of before it was reported)
    point = next(p for p in due(state, Cursor(logged=4, epoch=9), now=0.0, final=True)[1] if isinstance(p, Step))
    m = point.metrics
    assert point.step == 5 and point.t == h["t"]
    assert m["loss/train"] == h["loss"] and m["peers/members"] == h["members"]
    assert m["throughput/tokens_trained"] == state["run"]["tokens_trained"]
    assert m["peers/live"] == state["peers_summary"]["live"]
    assert m["time/outer_step_s"] == h["outer_s"] and m["time/allreduce_share"] == h["allreduce_s"] / h["outer_s"]
    assert {k: v for k, v in m.items() if k.startswith("bytes/")} == {f"bytes/{k}": v for k, v in h["bytes"].items()}
    total = sum((p["bytes_sent"] or {}).get("outer", 0) for p in state.get("_peers") or state["peers"])
    assert m["bytes_total/outer"] == total
    assert all(isinstance(v, float) for v in m.values())


def test_a_figure_the_run_does_not_have_is_left_out_not_logged_as_zero() -> None:
    first = entry(1, loss=None, tokens_per_s=None)
    first["loss"], first["eval_loss"], first["allreduce_s"] = None, float("nan"), None
    point = due(snapshot([first]), Cursor(), now=0.0, final=True)[1][0]
    assert isinstance(point, Step)
    assert not {"loss/train", "loss/eval", "throughput/tokens_per_s", "time/allreduce_s",
                "time/allreduce_share"} & point.metrics.keys()
    assert point.metrics["time/outer_step_s"] == 2.0


def test_a_rollback_is_an_event_and_the_steps_trained_again_are_logged_again() -> None:
    cursor, _ = due(snapshot([entry(s) for s in range(1, 6)]), Cursor(), now=0.0)
    assert cursor.logged == 4
    rolled = {"t": 2000.0, "kind": "rollback", "peer": "", "message": "rolled back from step 6 to v3 (checkpoint)"}
    failed = {"t": 1999.0, "kind": "failed", "peer": "", "message": "round 6 (epoch 0) failed: no member left"}
    joined = {"t": 1998.0, "kind": "joined", "peer": "12D3KooWx", "message": "joined"}
    history = [entry(1), entry(2), entry(3), entry(4, epoch=1), entry(5, epoch=1)]
    cursor, points = due(snapshot(history, events=[joined, failed, rolled]), cursor, now=1.0)
    assert [(p.kind, p.step) for p in points if isinstance(p, Event)] == [("failed", 5), ("rollback", 5)]
    assert steps(points) == [4]  # v4 of epoch 1; v5 is the newest
    redone = next(p for p in points if isinstance(p, Step))
    assert redone.metrics["loss/train"] == history[3]["loss"] and redone.metrics["run/epoch"] == 1
    assert redone.metrics["events/rollbacks"] == 1 and redone.metrics["events/failed"] == 1
    cursor, points = due(snapshot([*history, entry(6, epoch=1)], events=[joined, failed, rolled]), cursor, now=2.0)
    assert steps(points) == [5] and not [p for p in points if isinstance(p, Event)]  # (each event once)


def test_each_event_is_logged_once_also_two_of_the_same_second() -> None:
    a = {"t": 50.0, "kind": "evicted", "peer": "12D3KooWa", "message": "evicted: clipped in 3 of its last 5 steps"}
    b = {"t": 50.0, "kind": "evicted", "peer": "12D3KooWb", "message": "evicted: clipped in 3 of its last 5 steps"}
    cursor, points = due(snapshot([entry(1)], events=[a]), Cursor(), now=0.0)
    assert [p.peer for p in points if isinstance(p, Event)] == ["12D3KooWa"]
    cursor, points = due(snapshot([entry(1)], events=[a, b]), cursor, now=0.0)
    assert [p.peer for p in points if isinstance(p, Event)] == ["12D3KooWb"]
    assert due(snapshot([entry(1)], events=[a, b]), cursor, now=0.0)[1] == []
    assert cursor.counts == {"evictions": 2}


def test_the_config_logged_is_what_peers_train_by_flattened() -> None:
    cfg = run_config({"coordinator.trackers": ["tensorboard"]})
    values = config_values(cfg, "test")
    assert values["run_id"] == "test" and values["diloco.inner_steps"] == cfg.diloco.inner_steps
    assert not [k for k in values if k.startswith(("coordinator.", "admission."))]  # (the operator's, not the run's)


# ---------------------------------------------------------------------- the config


@pytest.mark.parametrize(("trackers", "said"), [
    (["neptune"], "coordinator.trackers.0: Input should be 'tensorboard', 'wandb' or 'mlflow'"),
    ("tensorboard,comet", "coordinator.trackers.1: Input should be"),
    (["wandb", "wandb"], "coordinator.trackers: ['wandb', 'wandb']: each tracker is named once"),
])
def test_a_tracker_potluck_does_not_know_is_refused_at_config_load(trackers: Any, said: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"coordinator": {"trackers": trackers}})
    assert said in str(err.value)


def test_trackers_on_the_command_line_and_where_their_files_go(tmp_path: Path) -> None:
    cfg = apply_overrides(RunConfig(), {"coordinator.trackers": "tensorboard,mlflow",
                                        "coordinator.journal_dir": str(tmp_path / "j")})
    assert cfg.coordinator.trackers == ["tensorboard", "mlflow"] and RunConfig().coordinator.trackers == []
    assert tracker_dir(cfg) == tmp_path / "j" / "trackers"
    assert tracker_dir(apply_overrides(cfg, {"coordinator.tracker_dir": str(tmp_path / "t")})) == tmp_path / "t"
    preflight(cfg)  # (installed here: the run passes; a tracker not installed is refused there, naming the extra)


def test_a_wandb_run_id_is_potlucks_run_id() -> None:
    assert wandb_id("first-run.2") == "first-run.2" and len(wandb_id("x" * 300)) == 128


# ---------------------------------------------------------------------- the trackers, for real


def run_of(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The snapshots a coordinator would build over a run of these entries: one per commit, then the end."""
    states = [snapshot(history[:i]) for i in range(1, len(history) + 1)]
    ev = {"t": 5000.0, "kind": "evicted", "peer": "12D3KooWz", "message": "evicted: its result of v2 was false"}
    return [*states, snapshot(history, finished=True, events=[ev])]


def test_each_tracker_logs_the_runs_series_and_events_read_back_by_its_own_reader(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = run_config({"coordinator.trackers": ["tensorboard", "wandb", "mlflow"]}, tmp_path / "journal")
    history = [entry(s) for s in range(1, 6)]
    trackers = Trackers(cfg, "test")
    try:
        trackers.start(0, 0)
        for i, state in enumerate(run_of(history)):
            trackers.offer(state, now=float(i))
    finally:
        trackers.close(run_of(history)[-1], now=99.0)
    assert trackers.logged == 6 and trackers.dropped == 0 and trackers.failed == dict.fromkeys(trackers.failed, 0)
    want = {h["step"]: h["loss"] for h in history}
    folder = tmp_path / "journal" / "trackers"

    assert tensorboard_scalars(folder / "tensorboard", "loss/train") == pytest.approx(want, rel=1e-6)  # (float32)
    texts = tensorboard_texts(folder / "tensorboard")
    assert texts["events/evicted"] == [(5, "evicted: its result of v2 was false (peer 12D3KooWz)")]
    assert '"diloco.inner_steps": 10' in texts["config"][0][1]

    records = wandb_records(folder / "wandb")
    assert wandb_history(records, "loss/train") == want
    assert wandb_history(records, "events/evictions") == {5: 1.0}
    assert [text for _, text in wandb_alerts(records)] == ["evicted: its result of v2 was false (peer 12D3KooWz)"]
    assert wandb_config(records)["diloco.inner_steps"] == 10

    client, run = mlflow_run(folder / "mlflow")
    assert mlflow_metric(client, run, "loss/train") == want
    assert run.data.params["diloco.inner_steps"] == "10" and run.data.tags["potluck.run_id"] == "test"
    assert run.data.tags["potluck.event.evicted"].endswith("evicted: its result of v2 was false (peer 12D3KooWz)")
    assert run.info.status == "FINISHED"


class Stuck(Tracker):
    """A tracker whose every call waits until the test lets it go: a network that hangs."""

    name = "tensorboard"
    gate = threading.Event()

    def open(self, config: dict[str, Any], step: int) -> None:
        pass

    def step(self, point: Step) -> None:
        self.gate.wait(30)

    def event(self, point: Event) -> None:
        self.gate.wait(30)

    def close(self) -> None:
        pass


def test_a_tracker_that_hangs_costs_its_points_never_the_loop(tmp_path: Path) -> None:
    cfg = run_config({"coordinator.trackers": ["tensorboard"]}, tmp_path / "journal")
    trackers = Trackers(cfg, "test", queue_size=2, kinds={"tensorboard": Stuck})
    trackers.start(0, 0)
    try:
        history = [entry(s) for s in range(1, 12)]
        trackers.offer(snapshot(history), now=0.0)  # 10 steps due: one taken by the stuck thread, 2 queued, 7 dropped
        assert trackers.dropped >= 7 and trackers.cursor.logged == 10  # (offer returned: the loop goes on)
    finally:
        Stuck.gate.set()
        trackers.close(None, now=1.0)
    assert trackers.logged + trackers.dropped == 10


def test_a_tracker_that_fails_later_is_counted_and_the_others_go_on(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = run_config({"coordinator.trackers": ["tensorboard", "mlflow"]}, tmp_path / "journal")
    trackers = Trackers(cfg, "test")
    trackers.start(0, 0)
    try:
        shutil.rmtree(tmp_path / "journal" / "trackers" / "mlflow")  # (its store gone from under it)
        trackers.offer(snapshot([entry(s) for s in range(1, 4)]), now=0.0)
    finally:
        trackers.close(None, now=1.0)
    assert trackers.failed["mlflow"] >= 2 and trackers.failed["tensorboard"] == 0
    assert list(tensorboard_scalars(tmp_path / "journal" / "trackers" / "tensorboard", "loss/train")) == [1, 2]


def test_a_tracker_that_cannot_start_stops_the_start_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "store").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")  # (MLflow 3 then refuses a file store)
    cfg = run_config({"coordinator.trackers": ["tensorboard", "mlflow"]}, tmp_path / "journal")
    trackers = Trackers(cfg, "test")
    with pytest.raises(TrackerError, match="the mlflow tracker could not start: MlflowException: The filesystem"):
        trackers.start(0, 0)
    assert isinstance(trackers.trackers[0], TensorBoard)  # (opened first, and closed again: its config is on disk)
    assert "config" in tensorboard_texts(tmp_path / "journal" / "trackers" / "tensorboard")
