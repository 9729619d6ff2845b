"""A coordinator stopped (Ctrl+C) before its run's first committed step and started again: with the same command it
is back at the same join address, and moved to new ports by its operator its peers find it anyway; either way they
are in its swarm and training again within 3 heartbeat timeouts, one state per step (real processes, a real DHT)."""

from __future__ import annotations

import os
import signal
import socket

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RUN = {"diloco.outer_steps": 4, "diloco.inner_steps": 200, "membership.min_peers": 2, "model.d_model": 64,
       "model.n_layers": 2, "data.eval_every": 0}
TIMEOUT = 4.0  # membership.heartbeat_timeout_s of the tests' run file


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ctrl_c(swarm) -> None:  # type: ignore[no-untyped-def]
    """What Ctrl+C in its terminal does: SIGINT to the coordinator's whole process group; it stops in order."""
    os.killpg(swarm.coordinator.pid, signal.SIGINT)
    assert swarm.coordinator.wait(timeout=60) == 0


@pytest.mark.parametrize("moved", [False, True])
def test_a_coordinator_restarted_before_its_first_step_finds_its_swarm(swarm, moved: bool) -> None:  # type: ignore[no-untyped-def]
    first = swarm.start_coordinator(RUN)
    swarm.start_peer()
    swarm.start_peer(env={**os.environ, "POTLUCK_FAULTS": "inner.step@1+:slow=3"})  # (volunteers are never alike)
    swarm.wait_state(lambda s: s["round"] is not None and s["run"]["outer_step"] == 0
                     and s["peers_summary"]["live"] == 2, 120, "the first round decided, nothing committed")
    ctrl_c(swarm)
    ports = {"coordinator.dht_port": free_port(), "coordinator.grpc_port": free_port(),
             "coordinator.status_port": free_port()} if moved else {}
    again = swarm.start_coordinator({**RUN, **ports})
    assert (again["join"] == first["join"]) != moved, (first, again)  # the same address, unless the operator moved it
    back = swarm.wait_state(lambda s: s["peers_summary"]["live"] == 2, 3 * TIMEOUT + 10,
                            "both peers back in the restarted coordinator's swarm")
    assert {p["state"] for p in back["peers"]} <= {"training", "syncing", "waiting", "recovering", "finished"}, back["peers"]
    done = swarm.wait_state(lambda s: s["run"]["finished"] and len(s["history"]) == RUN["diloco.outer_steps"], 300,
                            "the run to finish")
    assert all(len(set(h["state_hashes"].values())) == 1 and len(h["state_hashes"]) == 2 for h in done["history"])
    assert [h["step"] for h in done["history"]] == [1, 2, 3, 4]
