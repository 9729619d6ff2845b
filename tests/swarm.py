"""A real swarm on 127.0.0.1 for integration tests: a coordinator and peers as OS processes.

Everything is started through a :class:`ProcessGroup`, so the ``procs`` fixture reaps it. Tests
wait on conditions with deadlines (:meth:`LocalSwarm.wait_for`), never on fixed sleeps.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from potluck.procs import ProcessGroup
from potluck.protos.config import RunConfig, apply_overrides, dump_toml

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
    "coordinator.host": "127.0.0.1",
    "coordinator.tick_s": 0.1,
    "coordinator.checkpoint_every": 0,
}


class LocalSwarm:
    def __init__(self, procs: ProcessGroup, workdir: Path) -> None:
        self.procs, self.workdir = procs, workdir
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.peers: list[subprocess.Popen] = []
        self.coordinator: subprocess.Popen | None = None
        self.ready: dict[str, Any] = {}
        self.config: RunConfig | None = None

    def start_coordinator(self, overrides: dict[str, Any] | None = None, journal: str = "journal") -> dict[str, Any]:
        cfg = apply_overrides(RunConfig(), {**TEST_CONFIG, "coordinator.journal_dir": str(self.workdir / journal), **(overrides or {})})
        self.config = cfg
        run_file = self.workdir / "run.toml"
        run_file.write_text(dump_toml(cfg))
        ready = self.workdir / "ready.json"
        ready.unlink(missing_ok=True)
        self.coordinator = self.procs.spawn_potluck(
            ["coordinator", "--config", str(run_file), "--ready-file", str(ready)], self.logs / "coordinator.log"
        )
        coord = self.coordinator
        self.wait_for(lambda: ready.exists() or coord.poll() is not None, 90, "coordinator ready file")
        assert coord.poll() is None, f"coordinator exited: {self.tail('coordinator')}"
        self.ready = json.loads(ready.read_text())
        return self.ready

    def start_peer(self, *extra: str, name: str | None = None) -> subprocess.Popen:
        idx = len(self.peers)
        proc = self.procs.spawn_potluck(
            ["peer", "--join", self.ready["join"], "--host", "127.0.0.1", "--threads", "1",
             "--name", name or f"peer-{idx}", *extra],
            self.logs / f"peer-{idx}.log",
        )
        self.peers.append(proc)
        return proc

    def state(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.ready["status_url"] + "api/v1/state", timeout=5) as resp:
            return json.loads(resp.read())

    def try_state(self) -> dict[str, Any] | None:
        try:
            return self.state()
        except OSError:
            return None

    @staticmethod
    def wait_for(cond: Callable[[], Any], timeout: float, what: str, poll: float = 0.1) -> Any:
        """Return ``cond()`` once it is truthy; fail the test after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            value = cond()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(poll)

    def wait_state(self, pred: Callable[[dict[str, Any]], Any], timeout: float, what: str) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            s = self.try_state()
            return s if s is not None and pred(s) else None

        return self.wait_for(check, timeout, what)

    def tail(self, name: str, lines: int = 40) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"

    def dump_logs(self) -> None:
        for path in sorted(self.logs.glob("*.log")):
            print(f"===== {path.name} =====\n{self.tail(path.stem, 80)}")
