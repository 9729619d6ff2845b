"""A whole swarm on this machine: a coordinator and peers as OS processes, on 127.0.0.1.

``potluck demo``, the integration tests and the benchmarks all start their swarms through
:class:`LocalSwarm`: it writes the run file, starts the coordinator and waits for its ready file,
starts peers with their logs in ``workdir/logs``, and reads the run's state through the
coordinator's status API. Every process goes through a :class:`~potluck.procs.ProcessGroup`, so
it is stopped on every exit path (and dies with us even if we are killed).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from potluck.procs import ProcessGroup
from potluck.protos.config.files import dump_toml
from potluck.protos.config.runconfig import RunConfig


class SwarmError(RuntimeError):
    """A local swarm did not do what it was asked to in time; the message says what and where to look."""


def get_state(url: str, timeout: float = 2.0) -> dict[str, Any] | None:
    """The coordinator's ``/api/v1/state`` at status page ``url``, or None (not serving yet)."""
    try:
        with urllib.request.urlopen(url + "api/v1/state", timeout=timeout) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, json.JSONDecodeError):
        return None


def wait_for(cond: Callable[[], Any], timeout: float, what: str, poll: float = 0.1) -> Any:
    """Return ``cond()`` once it is truthy; raise :class:`SwarmError` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SwarmError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


class LocalSwarm:
    def __init__(self, workdir: Path, procs: ProcessGroup | None = None, *, logs: bool = True, threads: int = 1) -> None:
        self.workdir = Path(workdir)
        self.procs = procs or ProcessGroup()
        self.logs = self.workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.log_to_files, self.threads = logs, threads
        self.peers: list[subprocess.Popen] = []
        self.coordinator: subprocess.Popen | None = None
        self.ready: dict[str, Any] = {}
        self.config: RunConfig | None = None

    def start_coordinator(self, cfg: RunConfig, timeout: float = 120.0, env: dict[str, str] | None = None) -> dict[str, Any]:
        """Write ``cfg`` as the run file, start the coordinator, and return its ready info
        (``join`` address, ``status_url``, ...) once it serves."""
        self.config = cfg
        run_file, ready = self.workdir / "run.toml", self.workdir / "ready.json"
        run_file.write_text(dump_toml(cfg))
        ready.unlink(missing_ok=True)
        coord = self.coordinator = self.procs.spawn_potluck(
            ["coordinator", "--config", str(run_file), "--ready-file", str(ready)], self._log("coordinator"), env)
        wait_for(lambda: ready.exists() or coord.poll() is not None, timeout, "the coordinator's ready file")
        if coord.poll() is not None:
            raise SwarmError(f"the coordinator exited with code {coord.returncode} before it was ready"
                             + (f":\n{self.tail('coordinator')}" if self.log_to_files else ""))
        self.ready = json.loads(ready.read_text())
        return self.ready

    def start_peer(self, *extra: str, name: str | None = None, env: dict[str, str] | None = None,
                   identity: Path | None = None) -> subprocess.Popen:
        """Start a peer joining this swarm; its log is ``logs/peer-<n>.log`` (n in start order). Its key is
        ``identity`` (a restart), or one of its own (peers on one machine each need their own identity)."""
        idx = len(self.peers)
        key = identity or self.key(idx)
        args = ["peer", "--join", self.ready["join"], "--host", "127.0.0.1", "--threads", str(self.threads),
                "--name", name or f"peer-{idx}", "--identity", str(key), *extra]
        proc = self.procs.spawn_potluck(args, self._log(f"peer-{idx}"), env)
        self.peers.append(proc)
        return proc

    def run_to_end(self, cfg: RunConfig, peers: int, done: Callable[[dict[str, Any]], Any], timeout: float,
                   what: str) -> tuple[dict[str, Any], float]:
        """A whole run (the benchmarks'): the coordinator, ``peers`` peers, the state once ``done`` holds, every
        process stopped whatever happened; the state and the seconds from the first peer's start."""
        try:
            self.start_coordinator(cfg)
            t0 = time.monotonic()
            for _ in range(peers):
                self.start_peer()
            state = self.wait_state(done, timeout, what)
            return state, time.monotonic() - t0
        finally:
            self.stop()

    def key(self, idx: int) -> Path:
        """The identity file of the ``idx``-th peer started (``keys/peer-<idx>.key``)."""
        return self.workdir / "keys" / f"peer-{idx}.key"

    def _log(self, name: str) -> Path | None:
        return self.logs / f"{name}.log" if self.log_to_files else None

    # ------------------------------------------------------------------ watching the run

    def state(self) -> dict[str, Any]:
        state = get_state(self.ready["status_url"], timeout=5.0)
        if state is None:
            raise SwarmError(f"no state from {self.ready['status_url']}")
        return state

    def try_state(self) -> dict[str, Any] | None:
        return get_state(self.ready["status_url"], timeout=5.0)

    wait_for = staticmethod(wait_for)

    def wait_state(self, pred: Callable[[dict[str, Any]], Any], timeout: float, what: str) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            s = self.try_state()
            return s if s is not None and pred(s) else None

        return wait_for(check, timeout, what)

    def alive(self, procs: Sequence[subprocess.Popen] | None = None) -> list[subprocess.Popen]:
        return [p for p in (self.peers if procs is None else procs) if p.poll() is None]

    def tail(self, name: str, lines: int = 40) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"

    def dump_logs(self, lines: int = 120) -> None:
        """Stop the swarm, then print each log's tail: a process still wedged past its grace period
        writes where each of its threads was into its log first (a failed test's best clue)."""
        self.stop()
        for path in sorted(self.logs.glob("*.log")):
            print(f"===== {path.name} =====\n{self.tail(path.stem, lines)}")

    def stop(self) -> None:
        self.procs.stop()
