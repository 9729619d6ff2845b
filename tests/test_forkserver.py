"""The fork server the tests start potluck processes from (potluck/forkserver.py): a forked process is what
``python -P -m potluck ARGS`` would be -- its arguments, environment, working directory, log, session and
exit status -- and nothing outlives the server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from swarm import run_config

from potluck.forkserver import Forked, ForkServer
from potluck.local import wait_for
from potluck.procs import ProcessGroup, group_alive
from potluck.protos.config.files import dump_toml

pytestmark = pytest.mark.timeout(180)


def coordinator_args(tmp_path: Path) -> list[str]:
    run_file = tmp_path / "run.toml"
    run_file.write_text(dump_toml(run_config(journal=tmp_path / "journal")))
    return ["coordinator", "--config", str(run_file), "--ready-file", str(tmp_path / "ready.json")]


@pytest.mark.slow
def test_a_forked_process_is_potluck_with_its_own_arguments_environment_directory_log_and_session(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with ProcessGroup(fork=True) as procs:
        version = procs.spawn_potluck(["--version"], tmp_path / "version.log")
        assert isinstance(version, Forked) and version.wait(60) == 0
        assert "potluck 0.1.0" in (tmp_path / "version.log").read_text()
        usage = procs.spawn_potluck(["peer", "--threads", "many"], tmp_path / "usage.log")
        assert usage.wait(60) == 2 and "invalid int value: 'many'" in (tmp_path / "usage.log").read_text()

        coord = procs.spawn_potluck(coordinator_args(tmp_path), tmp_path / "coordinator.log",
                                    {"POTLUCK_FAULTS": "shutdown.start@*:sleep=0.1"})  # (read by potluck at import)
        wait_for(lambda: (tmp_path / "ready.json").exists() or coord.poll() is not None, 90, "the ready file")
        assert coord.poll() is None, (tmp_path / "coordinator.log").read_text()
        assert os.readlink(f"/proc/{coord.pid}/cwd") == str(tmp_path)
        assert os.getsid(coord.pid) == coord.pid == os.getpgid(coord.pid)  # a session of its own, as Popen's
        assert json.loads((tmp_path / "ready.json").read_text())["join"].startswith("/ip4/127.0.0.1/")
        coord.terminate()
        assert coord.wait(30) == 0  # a clean stop
        log = (tmp_path / "coordinator.log").read_text()
        assert "coordinator 0.1.0 serving run test" in log and "fault injected at shutdown.start" in log, log
        wait_for(lambda: not group_alive(coord.pid), 20, "the coordinator's DHT process and p2pd to go")


@pytest.mark.slow
def test_a_killed_child_reports_its_signal_and_a_killed_server_takes_its_children_along(tmp_path: Path) -> None:
    server = ForkServer()
    try:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        (tmp_path / "a").mkdir()
        first = server.spawn(coordinator_args(tmp_path / "a"), tmp_path / "a.log", env)
        wait_for(lambda: (tmp_path / "a" / "ready.json").exists(), 90, "the first coordinator")
        os.killpg(first.pid, signal.SIGKILL)
        assert first.wait(20) == -signal.SIGKILL
        wait_for(lambda: not group_alive(first.pid), 20, "the killed coordinator's group to go")

        (tmp_path / "b").mkdir()
        second = server.spawn(coordinator_args(tmp_path / "b"), tmp_path / "b.log", env)
        wait_for(lambda: (tmp_path / "b" / "ready.json").exists(), 90, "the second coordinator")
        server.proc.kill()  # the server dies: its child gets SIGTERM from the kernel and stops
        assert second.wait(30) == -signal.SIGTERM  # (what the launcher can know once its status line is gone)
        wait_for(lambda: not group_alive(second.pid), 30, "the orphaned coordinator's group to go")
    finally:
        server.stop()


@pytest.mark.slow
def test_a_malformed_request_is_refused_and_the_server_serves_the_next(tmp_path: Path) -> None:
    server = ForkServer()
    try:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        warm = server.spawn(["--version"], tmp_path / "warm.log", env)  # (waits for the server's imports)
        assert warm.wait(60) == 0
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(server.path)
            raw.sendall(b"{not json\n")
            raw.settimeout(10)
            assert raw.recv(4096).startswith(b"error:")
        with pytest.raises(OSError, match="could not start"):
            server.spawn(["--version"], tmp_path / "no-such-dir" / "x.log", env)  # the child cannot open its log
        again = server.spawn(["--version"], tmp_path / "again.log", env)
        assert again.wait(60) == 0 and "potluck 0.1.0" in (tmp_path / "again.log").read_text()
    finally:
        server.stop()


@pytest.mark.slow
def test_the_fork_server_can_be_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POTLUCK_FORKSERVER", "0")
    with ProcessGroup(fork=True) as procs:
        plain = procs.spawn_potluck(["--version"], tmp_path / "plain.log")
        assert not isinstance(plain, Forked) and plain.wait(60) == 0


LOCKS = """
from hivemind.utils.asyncio import _AsyncContextWrapper
from hivemind.utils.mpfuture import MPFuture, SharedBytes
from potluck.forkserver import own_locks

def locks():
    return MPFuture._update_lock, MPFuture._initialization_lock, SharedBytes._lock, _AsyncContextWrapper.EXECUTOR_LOCK

before = locks()
before[0].acquire()  # (as a sibling that died holding it would)
own_locks()
after = locks()
assert all(a is not b for a, b in zip(after, before, strict=True)), (before, after)
assert after[0].acquire(timeout=0)
print("own locks")
"""


@pytest.mark.slow
def test_a_forked_process_owns_hivemind_s_locks() -> None:
    """hivemind makes its process-wide multiprocessing locks at import: every fork of the server would share the
    server's, and a peer SIGKILLed while it held one hung the DHT start of the next coordinator (3 failures in
    one full run). A child takes new ones (``forkserver._child`` calls ``own_locks`` before potluck's main);
    checked in a process of its own, as resetting hivemind's futures would break this one's."""
    done = subprocess.run([sys.executable, "-c", LOCKS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "own locks" in done.stdout, done.stderr[-2000:]
