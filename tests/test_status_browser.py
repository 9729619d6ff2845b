"""The status page in headless Chromium, against a real StatusServer serving fake snapshots.

Selectors used here are the page's test hooks (documented in docs/status-api.md). Screenshots go to
``$POTLUCK_ARTIFACTS/status`` when that is set, else to the test's tmp_path.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_state import make_state

from potluck.coordinator.status.status import StatusServer

CHROMIUM = "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} not found (apt-get install -y chromium)", allow_module_level=True)

from playwright.sync_api import Browser, ConsoleMessage, Page, sync_playwright  # noqa: E402

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            warm = b.new_page()  # the browser's first navigation pays its own start-up; not the page's cost
            warm.goto("about:blank")
            warm.close()
            yield b
        finally:
            b.close()


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    root = os.environ.get("POTLUCK_ARTIFACTS")
    path = Path(root) / "status" if root else tmp_path
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def errors() -> list[str]:
    """Script errors and console errors (CSP violations among them) of the test's page."""
    return []


@pytest.fixture
def page(browser: Browser, errors: list[str]) -> Iterator[Page]:
    pg = browser.new_page(viewport={"width": 1400, "height": 900})

    def console(m: ConsoleMessage) -> None:
        if m.type == "error":
            errors.append(f"console: {m.text} ({m.location.get('url', '')})")

    pg.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    pg.on("console", console)
    try:
        yield pg
    finally:
        pg.close()


def serve(state: dict[str, Any], **kw: Any) -> StatusServer:
    return StatusServer("127.0.0.1", 0, lambda: state, **kw)


def until(page: Page, expression: str, timeout_s: float = 30.0) -> None:
    """Wait until ``expression`` is true in the page, asked from here. (Playwright's ``wait_for_function`` polls inside
    the page with ``new Function``, which the page's CSP forbids: it failed whenever the condition was not already
    true at its first look, on a loaded box.)"""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"not true within {timeout_s:.0f} s: {expression}"
        page.wait_for_timeout(50)


def load_timing(page: Page, url: str) -> dict[str, float]:
    """Navigate and return the page's own marks (ms after navigation start) plus the test's wall time."""
    t0 = time.perf_counter()
    page.goto(url)
    page.wait_for_selector("[data-testid=peer-row]")
    wall_ms = (time.perf_counter() - t0) * 1000
    until(page, "window.potluck.firstRenderMs !== null")
    timing: dict[str, float] = page.evaluate(
        "({message: potluck.firstMessageMs, table: potluck.firstTableMs, all: potluck.firstRenderMs, render: potluck.renderMs})")
    return {**timing, "wall": wall_ms}


def test_thousand_peers_render_fast_and_paginate(page: Page, errors: list[str], artifacts: Path) -> None:
    """1,000 peers: the table is filled in under 1 s after navigation starts.

    The machine running the tests is shared, so a load may be slowed by a neighbour: the best of up
    to three loads counts (each one is a full navigation with the page's own performance.now marks).
    """
    state = make_state(1000, stages=4, steps=120, hole=True, links=True)
    srv = serve(state)
    try:
        page.goto(srv.url + "healthz")  # the renderer process for this origin starts here, outside the timing
        loads = []
        for _ in range(3):
            loads.append(load_timing(page, srv.url))
            if loads[-1]["table"] < 1000:
                break
        (artifacts / "thousand_peers_timing.json").write_text(json.dumps(loads))
        for t in loads:
            print(f"\n1000 peers, ms after navigation start: state arrived {t['message']:.0f}, table populated "
                  f"{t['table']:.0f}, everything drawn {t['all']:.0f} (drawing took {t['render']:.0f}); "
                  f"wall time until the test saw a row {t['wall']:.0f}")
        assert min(t["table"] for t in loads) < 1000, loads

        rows = page.locator("[data-testid=peer-row]")
        assert rows.count() == 50
        info = page.locator("[data-testid=page-info]")
        assert info.get_attribute("data-pages") == "20" and "of 1000 peers" in info.inner_text()
        first_page = rows.first.get_attribute("data-peer-id")
        page.click("[data-testid=page-next]")
        assert info.get_attribute("data-page") == "2"
        until(page, f"document.querySelector('[data-testid=peer-row]').dataset.peerId === '{state['_peers'][50]['id']}'")
        assert rows.first.get_attribute("data-peer-id") == state["_peers"][50]["id"] != first_page

        cells = page.locator("[data-testid=grid-cell]")
        assert cells.count() == 4 * state["grid"]["replicas"]
        assert page.locator("[data-testid=grid-cell][data-state=empty]").count() == 1  # the hole
        chart = page.locator("[data-testid=loss-chart]")
        drawn = sum(h["loss"] is not None for h in state["history"]) + sum(h["eval_loss"] is not None for h in state["history"])
        assert int(chart.get_attribute("data-points") or -1) == drawn
        assert page.locator("[data-testid=links-heatmap]").is_visible()
        page.screenshot(path=str(artifacts / "thousand_peers.png"), full_page=True)
        assert errors == []
    finally:
        srv.stop()


def test_page_shows_lost_contact_when_the_server_stops_and_recovers(page: Page, artifacts: Path) -> None:
    state = make_state(8, steps=10)
    srv = serve(state)
    port = srv.port
    try:
        page.goto(srv.url)
        page.wait_for_selector("[data-testid=peer-row]")
        assert page.locator("[data-testid=banner]").is_hidden()
        assert page.locator("[data-testid=insecure-badge]").is_hidden()  # mutual TLS: nothing to warn about
        assert "updated" in page.inner_text("[data-testid=freshness]")
    finally:
        srv.stop()
    banner = page.locator("[data-testid=banner][data-kind=lost]")
    banner.wait_for(state="visible", timeout=10_000)
    assert "Lost contact with the coordinator since" in banner.inner_text()
    assert page.locator("[data-testid=peer-row]").count() == 8  # the last state stays visible underneath
    page.screenshot(path=str(artifacts / "lost_contact.png"))

    srv = StatusServer("127.0.0.1", port, lambda: state)  # the coordinator comes back on the same port
    try:
        page.locator("[data-testid=banner]").wait_for(state="hidden", timeout=10_000)
    finally:
        srv.stop()


def test_details_polling_fallback_and_untrusted_names(page: Page, errors: list[str], artifacts: Path) -> None:
    state = make_state(8, steps=6, hole=True, waiting_reason="waiting for peers: 1 of 2 needed to start",
                       security="insecure")
    evil = '<img src=x onerror="window.pwned=1">'
    state["peers"][0]["name"] = evil
    lost = next(p for p in state["peers"] if p["state"] == "lost")
    srv = serve(state, max_streams=0)  # every live stream is refused: the page must poll
    try:
        page.goto(srv.url)
        page.wait_for_selector("[data-testid=peer-row]")
        until(page, "window.potluck.mode === 'polling'")
        assert page.inner_text("[data-testid=waiting-reason]") == "Waiting: waiting for peers: 1 of 2 needed to start"
        assert page.locator("[data-testid=finished-badge]").is_hidden()
        assert page.locator("[data-testid=insecure-badge]").is_visible()  # plaintext gRPC: said at the top
        assert page.inner_text("[data-testid=links-empty]") == "no link measurements yet"

        row = page.locator(f"[data-testid=peer-row][data-peer-id='{lost['id']}']")
        assert row.get_attribute("data-state") == "lost" and row.get_attribute("data-stale") == "true"
        assert "stale" in (row.locator("td[data-col=last_seen_s]").get_attribute("class") or "")
        assert (row.locator("td[data-col=short_id]").get_attribute("title") or "").startswith(lost["id"])
        first = page.locator(f"[data-testid=peer-row][data-peer-id='{state['peers'][0]['id']}'] td[data-col=name]")
        assert first.inner_text() == evil and page.evaluate("window.pwned") is None

        page.click("[data-testid=sort-last_seen_s]")
        page.click("[data-testid=sort-last_seen_s]")  # descending: the stalest first
        assert page.locator("[data-testid=peer-row]").first.get_attribute("data-stale") == "true"

        page.fill("[data-testid=peer-filter]", lost["id"])
        assert page.locator("[data-testid=peer-row]").count() == 1
        page.screenshot(path=str(artifacts / "details.png"), full_page=True)
        assert not [e for e in errors if "api/v1/events" not in e]  # the refused streams log errors; nothing else may
    finally:
        srv.stop()


def test_join_address_model_export_finished_peers_and_throughput_per_step(page: Page, errors: list[str],
                                                                           artifacts: Path) -> None:
    """Issue 27: the join address was only a tooltip; a finished run did not say how to get the model;
    finished peers showed "last seen 28 s ago" in red; throughput was instantaneous samples falling to 0
    at every sync (now one point per outer step); axes said v5 and v7 · 0 without saying what they count."""
    running = make_state(6, steps=12)
    done = make_state(3, steps=40, finished=True)
    for p in done["peers"]:  # they said goodbye a while ago: longer than the heartbeat timeout
        p.update(state="finished", last_seen_s=done["config"]["heartbeat_timeout_s"] + 20)
    shown = [running]
    srv = StatusServer("127.0.0.1", 0, lambda: shown[0])
    try:
        page.goto(srv.url)
        page.wait_for_selector("[data-testid=peer-row]")
        join = page.locator("[data-testid=join-address]")
        assert join.is_visible() and f"potluck peer --join {running['run']['join_address']}" in join.inner_text()
        assert page.locator("[data-testid=model-howto]").is_hidden()
        per_step = sum(h["tokens_per_s"] is not None for h in running["history"])
        assert int(page.locator("[data-testid=tokens-chart]").get_attribute("data-points") or -1) == per_step == 11
        assert page.locator("th[data-sort=version]").inner_text() == "version · inner step"
        trainer = next(p for p in running["peers"] if p["state"] == "training")
        cell = page.locator(f"[data-testid=peer-row][data-peer-id='{trainer['id']}'] td[data-col=version]")
        assert cell.inner_text() == f"v{trainer['version']} · {trainer['inner_step']}/30"
        assert "the model after" in (cell.get_attribute("title") or "")

        shown[0] = done
        page.goto(srv.url)
        page.wait_for_selector("[data-testid=peer-row]")
        howto = page.locator("[data-testid=model-howto]")
        assert howto.is_visible() and page.locator("[data-testid=join-address]").is_hidden()
        assert "The run is finished. Get its model (v100" in howto.inner_text()
        assert page.inner_text("[data-testid=model-command]") == done["run"]["model_export"]["command"]
        rows = page.locator("[data-testid=peer-row]")
        assert rows.count() == 3 and all(rows.nth(i).get_attribute("data-stale") == "false" for i in range(3))
        assert page.locator("td.stale").count() == 0
        page.screenshot(path=str(artifacts / "finished.png"), full_page=True)
        assert errors == []
    finally:
        srv.stop()
