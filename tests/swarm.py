"""The tests' local swarm: potluck's own launcher with a tiny, fast run config.

Everything is started through the ``procs`` fixture's :class:`ProcessGroup`, so it is reaped even
when a test fails. Tests wait on conditions with deadlines (``wait_for``, ``wait_state``), never on
fixed sleeps.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from potluck import local
from potluck.procs import ProcessGroup
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig

TEST_CONFIG = {
    "run_id": "test",
    "model.d_model": 32,
    "model.n_layers": 1,
    "model.n_heads": 2,
    "model.seq_len": 32,
    "train.batch_size": 8,
    "diloco.inner_steps": 10,
    "diloco.outer_steps": 6,
    "sync.block_size": 256,
    "sync.deadline_floor_s": 4.0,
    "membership.heartbeat_s": 0.5,
    "membership.heartbeat_timeout_s": 4.0,
    "membership.round_timeout_floor_s": 20.0,
    "coordinator.host": "127.0.0.1",
    "coordinator.tick_s": 0.1,
    "coordinator.checkpoint_every": 0,
}


def run_config(overrides: dict[str, Any] | None = None, journal: Path | None = None) -> RunConfig:
    extra = {"coordinator.journal_dir": str(journal)} if journal is not None else {}
    return apply_overrides(RunConfig(), {**TEST_CONFIG, **extra, **(overrides or {})})


class LocalSwarm(local.LocalSwarm):
    def __init__(self, procs: ProcessGroup, workdir: Path) -> None:
        super().__init__(workdir, procs)

    def start_coordinator(self, overrides: dict[str, Any] | None = None, journal: str = "journal",  # type: ignore[override]
                          env: dict[str, str] | None = None) -> dict[str, Any]:
        return super().start_coordinator(run_config(overrides, self.workdir / journal), env=env)


ALARMING = re.compile(r"\b(WARN|WARNING|ERROR|CRITICAL|FATAL)\b|Traceback")  # potluck's, hivemind's and p2pd's levels


def alarming(logs: Path) -> list[str]:
    """Every line at WARN or above (or a traceback) in a swarm's logs: coordinator, peers and their DHT
    processes and p2pd daemons, whose lines land in the same files."""
    return [f"{path.name}: {line}" for path in sorted(logs.glob("*.log"))
            for line in path.read_text(errors="replace").splitlines() if ALARMING.search(line)]
