"""Every start-up path of the coordinator's DHT node is bounded by ``coordinator.startup_timeout_s``.

hivemind waits for its DHT process to be ready without a bound; a process that hangs on the way (seen
on a loaded box, the second start after a failed rejoin of the journal's peers) held the coordinator for
minutes. Here the DHT start hangs on purpose (``POTLUCK_FAULTS=dht.start@N:hang``, inside the real DHT
process) and the coordinator must end with one line within the start-up timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from hivemind.utils.mpfuture import MPFuture
from swarm import LocalSwarm

from potluck.coordinator import bootstrap
from potluck.protos.config.runconfig import CoordinatorConfig
from potluck.protos.net.dhtprocess import dht_starts, free_locks_of_the_dead
from potluck.protos.net.identity import Identity
from potluck.protos.net.swarm import JoinError, SwarmNode
from potluck.protos.testkit import faults

GONE = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWQd1pWYU4h2xEZJ8dygHJQKu5bR1R2CDX5s8cCyGaVyF6"  # nobody listens on port 9


def _identity(folder: Path) -> tuple[Identity, Path]:
    identity, path = Identity.generate(), folder / "identity.key"
    identity.save(path)  # (the coordinator keeps its key in the journal before it starts its node)
    return identity, path


def _hang_start(monkeypatch: pytest.MonkeyPatch, nth: int) -> None:
    """Make the ``nth`` next DHT start of this process hang (the DHT process is forked: it inherits this)."""
    monkeypatch.setattr(faults, "_pending", faults.parse(f"dht.start@{dht_starts() + nth}:hang"))


@pytest.mark.slow
def test_a_start_after_a_failed_rejoin_that_hangs_is_a_join_error_within_the_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _hang_start(monkeypatch, 2)  # the rejoin (start 1) fails on its own; the new swarm's start (2) hangs
    c = CoordinatorConfig(host="127.0.0.1", startup_timeout_s=8.0)
    t0 = time.monotonic()
    with pytest.raises(JoinError, match=r"not ready within|within coordinator.startup_timeout_s"):
        bootstrap.start_node(*_identity(tmp_path), c, [GONE])
    took = time.monotonic() - t0
    assert took < c.startup_timeout_s + 3.0, f"start-up took {took:.1f} s against a bound of {c.startup_timeout_s} s"


def test_without_the_fault_the_same_path_starts_a_new_swarm(tmp_path: Path) -> None:
    c = CoordinatorConfig(host="127.0.0.1", startup_timeout_s=30.0)
    node = bootstrap.start_node(*_identity(tmp_path), c, [GONE])
    try:
        assert node.maddrs
    finally:
        node.shutdown()


@pytest.mark.slow
def test_a_coordinator_whose_dht_start_hangs_exits_with_one_line(swarm: LocalSwarm) -> None:
    """The real process: its DHT start hangs (inside the DHT process); it exits 2 with one ERROR line, no
    traceback, within its start-up bound (the start after a failed rejoin is the in-process test above)."""
    timeout_s = 10.0
    t0 = time.monotonic()
    with pytest.raises(Exception, match="exited with code 2"):
        swarm.start_coordinator({"coordinator.startup_timeout_s": timeout_s}, env={faults.ENV: "dht.start@1:hang"})
    took = time.monotonic() - t0
    assert took < timeout_s + 20.0, f"the coordinator took {took:.1f} s to give up (start-up bound {timeout_s} s)"
    log = (swarm.workdir / "logs" / "coordinator.log").read_text()
    errors = [line for line in log.splitlines() if line[9:14] == "ERROR"]  # "HH:MM:SS ERROR ..."
    assert len(errors) == 1 and "not ready within" in errors[0], log[-3000:]
    assert "Traceback" not in log


def _hold_and_wait(lock: object, held: object) -> None:
    lock.acquire()  # type: ignore[attr-defined]
    held.set()  # type: ignore[attr-defined]
    threading.Event().wait()


def test_a_process_killed_holding_hiveminds_future_lock_does_not_hang_the_next_start(tmp_path: Path) -> None:
    """The cause of the hang seen after a failed rejoin: the failed DHT process, killed right after it handed
    over its error, still held the lock every process forked from this one shares to send a future's result."""
    held = mp.get_context("fork").Event()
    holder = mp.get_context("fork").Process(target=_hold_and_wait, args=(MPFuture._update_lock, held), daemon=True)
    holder.start()
    try:
        assert held.wait(30), "the holder never took the lock"
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
    free_locks_of_the_dead()  # what SwarmNode.shutdown does after it had to kill its DHT process
    identity, path = _identity(tmp_path)
    node = SwarmNode(identity, coordinator=identity.peer_id, host="127.0.0.1", startup_timeout=30.0, identity_path=path)
    node.shutdown()
