"""The status page of a real run, in headless Chromium: a real coordinator, real peers, a killed peer."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} not found (apt-get install -y chromium)", allow_module_level=True)

from playwright.sync_api import expect, sync_playwright  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def test_page_shows_every_peer_and_a_killed_one_turns_lost(swarm, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    artifacts = Path(os.environ["POTLUCK_ARTIFACTS"]) / "status" if os.environ.get("POTLUCK_ARTIFACTS") else tmp_path
    artifacts.mkdir(parents=True, exist_ok=True)
    ready = swarm.start_coordinator({"diloco.outer_steps": 200, "diloco.inner_steps": 10, "membership.min_peers": 3})
    for _ in range(3):
        swarm.start_peer()
    state = swarm.wait_state(lambda s: s["run"]["outer_step"] >= 2 and len(s["round"]["members"]) == 3, 180,
                             "two outer steps with three members")
    ids = [m["peer_id"] for m in state["round"]["members"]]
    h = state["run"]["horizon"]  # (issue 45: the next step and the run's end, from the steps measured)
    assert h["outer_step_s"] > 0 and h["end_in_s"] >= h["next_step_in_s"] >= 0, h
    assert state["coordinator"]["gc"]["frozen"] > 100_000  # its start's objects: no full collection walks them again
    timeout_s = state["config"]["heartbeat_timeout_s"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(ready["status_url"])
            for pid in ids:
                expect(page.locator(f'[data-testid=peer-row][data-peer-id="{pid}"]')).to_have_count(1, timeout=15_000)
                expect(page.locator(f'[data-testid=grid-cell][data-peer-id="{pid}"]')).to_have_count(1)
            # (asked from here: Playwright's wait_for_function polls with new Function, which the page's CSP forbids)
            swarm.wait_for(lambda: page.evaluate(
                "Number(document.querySelector('[data-testid=loss-chart]').dataset.points) >= 2"), 15, "2 points in the loss chart")
            expect(page.locator("[data-testid=stat-horizon]")).to_contain_text("run ends in ~")
            page.screenshot(path=str(artifacts / "swarm-running.png"), full_page=True)

            victim = next(i for i, proc in enumerate(swarm.peers) if proc.poll() is None)
            row_id = _peer_id_of(swarm, victim, ids)
            os.killpg(swarm.peers[victim].pid, signal.SIGKILL)
            row = page.locator(f'[data-testid=peer-row][data-peer-id="{row_id}"]')
            # lost once the coordinator's heartbeat timeout passes, plus a refresh or two of the page
            expect(row).to_have_attribute("data-state", "lost", timeout=(timeout_s + 10) * 1000)
            page.screenshot(path=str(artifacts / "swarm-peer-lost.png"), full_page=True)
        finally:
            browser.close()


def _peer_id_of(swarm, index: int, ids: list[str]) -> str:  # type: ignore[no-untyped-def]
    """The peer id of swarm.peers[index], from its name on the status page (peer-<index>)."""
    state = swarm.state()
    return next(p["id"] for p in state["peers"] if p["name"] == f"peer-{index}" and p["id"] in ids)
