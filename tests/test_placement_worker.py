"""A long placement search runs beside the coordinator's loop, never in it (issue #15).

The coordinator is given a 20 s search budget (more than twice the heartbeat timeout), and its placement
worker is made to keep its thread busy in Python for those 20 s (``placement.search@*:spin=20``: CPU-bound and holding the GIL as a
search does; a real search on a handful of peers stalls in milliseconds). Meanwhile rounds must go on
being decided on the current grid, heartbeats must keep every peer live, and the status snapshot must
stay fresh: ``generated_at`` under 2 s old at every look.
"""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SPIN_S = 20.0
GRID = {"pipeline.stages": 2, "pipeline.micro_batches": 2, "model.n_layers": 2, "membership.min_peers": 2,
        "diloco.outer_steps": 60, "diloco.inner_steps": 4, "links.placement": "scheduler",
        "links.search_budget_s": SPIN_S, "links.probe_period_s": 2.0}


def test_a_20_s_search_does_not_delay_rounds_heartbeats_or_the_status_page(swarm) -> None:  # type: ignore[no-untyped-def]
    swarm.start_coordinator(GRID, env={"POTLUCK_FAULTS": f"placement.search@*:spin={SPIN_S:g}"})
    for _ in range(2):
        swarm.start_peer()
    log = swarm.logs / "coordinator.log"
    swarm.wait_for(lambda: "fault injected at placement.search" in log.read_text(errors="replace"), 180,
                   "the placement worker to start its search")
    started = time.monotonic()
    first = swarm.state()
    steps, ages, lost = [first["run"]["outer_step"]], [], set()
    while time.monotonic() - started < SPIN_S - 2.0:  # look throughout the search, as a viewer would
        state = swarm.state()
        ages.append(time.time() - state["generated_at"])
        steps.append(state["run"]["outer_step"])
        lost |= {p["name"] for p in state["peers"] if p["state"] in ("lost", "left")}
        time.sleep(0.25)  # a viewer's polling rate, not a synchronisation
    assert "fault injected at placement.search" in log.read_text(errors="replace")
    assert len(ages) > 1.5 * SPIN_S, f"only {len(ages)} looks at the status page in {SPIN_S:g} s"
    assert max(ages) < 2.0, f"the status snapshot was {max(ages):.1f} s old during the search"
    assert not lost, f"peers marked lost while the coordinator searched: {sorted(lost)}"
    assert steps[-1] >= steps[0] + 2, f"rounds stalled during the search: outer step {steps[0]} -> {steps[-1]}"
    assert swarm.coordinator.poll() is None
