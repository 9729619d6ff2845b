"""A volunteer's everyday, with real processes: stop a peer every way there is and start it again with
its key, and copy the key to a second machine (issue 27).

One swarm of two peers, one run: a copy of the first peer's key is refused in one line while the first
peer trains on unharmed; then the second peer is stopped with Ctrl+C (SIGINT to its process group, as
a terminal sends it), SIGTERM and SIGKILL, and each time started again with the same ``--identity``:
it must contribute to a committed outer step again, and soon. (Before, after a goodbye the coordinator
kept the id as gone for good: the restarted peer waited to be admitted for the rest of the run, and a
copied key trained beside the original, both under one id.)
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BACK_S = 60.0  # from the restart to a committed step the restarted peer contributed to


def peer_id(swarm, name: str) -> str:  # type: ignore[no-untyped-def]
    state = swarm.wait_state(lambda s: any(p["name"] == name for p in s["peers"]), 60, f"{name} on the page")
    return next(p["id"] for p in state["peers"] if p["name"] == name)


def contributes_after(swarm, pid: str, step: int, timeout: float, what: str) -> dict:  # type: ignore[no-untyped-def]
    """The first committed step after ``step`` whose members' hashes include ``pid``'s."""
    state = swarm.wait_state(lambda s: any(h["step"] > step and pid in h["state_hashes"] for h in s["history"]),
                             timeout, what)
    return next(h for h in state["history"] if h["step"] > step and pid in h["state_hashes"])


def test_a_restarted_peer_trains_again_and_a_copied_key_is_refused(swarm) -> None:  # type: ignore[no-untyped-def]
    swarm.start_coordinator({"diloco.outer_steps": 200, "membership.min_peers": 2})
    swarm.start_peer(name="first")
    second = swarm.start_peer(name="second")
    first_id, second_id = peer_id(swarm, "first"), peer_id(swarm, "second")
    swarm.wait_state(lambda s: s["run"]["outer_step"] >= 2, 120, "two outer steps")

    # the first peer's key copied to another machine (another path: no lock file shared)
    copied = swarm.workdir / "elsewhere" / "peer.key"
    copied.parent.mkdir()
    shutil.copy(swarm.key(0), copied)
    copy = swarm.start_peer(name="copy", identity=copied)
    rc = copy.wait(timeout=120)
    log = (swarm.logs / "peer-2.log").read_text()
    refusal = [line for line in log.splitlines() if "already running with this identity" in line]
    assert rc == 2 and len(refusal) == 1 and "--identity FILE" in refusal[0], f"exit code {rc}:\n{log}"
    print(refusal[0])
    at = swarm.state()["run"]["outer_step"]
    contributes_after(swarm, first_id, at, 60, "the first peer to go on training after the copy was refused")
    state = swarm.state()
    assert not [e for e in state["events"] if e["peer"] == first_id and e["kind"] in ("left", "lost")], state["events"]
    assert [p["name"] for p in state["peers"] if p["id"] == first_id] == ["first"]

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        if sig == signal.SIGINT:
            os.killpg(second.pid, sig)  # a terminal's Ctrl+C reaches the whole foreground process group
        else:
            os.kill(second.pid, sig)
        second.wait(timeout=30)
        at = swarm.state()["run"]["outer_step"]
        t0 = time.monotonic()
        second = swarm.start_peer(name="second", identity=swarm.key(1))
        back = contributes_after(swarm, second_id, at, BACK_S, f"the second peer, restarted after {sig.name}, "
                                 "in a committed step")
        print(f"after {sig.name} at step {at}: back in step {back['step']}, {time.monotonic() - t0:.1f} s after the "
              "restart")
    events = swarm.state()["events"]
    assert sum(e["kind"] == "back" and e["peer"] == second_id for e in events) >= 2, events  # after the goodbyes too
