"""The placement worker: rounds never wait for a search, a finished plan is taken at the next boundary,
and newly measured links are worth a new search (the coordinator's loop side of issue #15)."""

from __future__ import annotations

import threading

import pytest

from potluck.coordinator import placement
from potluck.coordinator.placement import PlacementWorker, Request, grid_for
from potluck.protos.config import RunConfig, apply_overrides
from potluck.protos.records import PeerRecord
from potluck.protos.swarm import LinkReport, LinkStat

IDS = ["a" * 8, "b" * 8, "c" * 8, "d" * 8]


def records() -> list[PeerRecord]:
    return [PeerRecord(peer_id=p, address=f"127.0.0.1:{5000 + i}") for i, p in enumerate(IDS)]


def links(measured: int) -> dict[str, LinkReport]:
    """Reports in which the first ``measured`` ordered pairs have RTT and bandwidth."""
    pairs = [(a, b) for a in IDS for b in IDS if a != b][:measured]
    out: dict[str, LinkReport] = {}
    for a, b in pairs:
        out.setdefault(a, LinkReport(peer_id=a)).links[b] = LinkStat(rtt_ms=2.0, bandwidth_mbps=100.0)
    return out


def test_rounds_go_on_on_the_current_grid_until_the_plan_is_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = apply_overrides(RunConfig(), {"pipeline.stages": 2})
    release, calls = threading.Event(), []
    planned = {IDS[0]: (1, 1), IDS[1]: (0, 0), IDS[2]: (1, 0), IDS[3]: (0, 1)}

    def slow_place(cfg: RunConfig, req: Request, budget_s: float) -> tuple[dict, None]:
        calls.append(req.key)
        release.wait(10)
        return planned, None

    monkeypatch.setattr(placement, "place", slow_place)
    worker = PlacementWorker(cfg, budget_s=30.0)
    before = {IDS[0]: (0, 0), IDS[1]: (0, 1), IDS[2]: (1, 0), IDS[3]: (1, 1)}
    grid, replan = grid_for(cfg, records(), 2, before, links(12), worker)  # type: ignore[misc]
    assert grid == before and replan is None  # the search runs; this round keeps everyone where they are
    assert grid_for(cfg, records(), 2, before, links(12), worker) == (before, None)
    release.set()
    worker.stop(5)
    assert grid_for(cfg, records(), 2, before, links(12), worker) == (planned, None)  # taken once ready
    assert len(calls) == 1  # the same request is not searched twice
    assert grid_for(cfg, records(), 2, before, links(11), worker) == (before, None)  # other links: search again
    worker.stop(5)
    assert len(calls) == 2 and calls[0] != calls[1]


def test_the_request_key_counts_only_measured_links_among_the_peers() -> None:
    reports = links(12)
    reports[IDS[0]].links["stranger"] = LinkStat(rtt_ms=1.0, bandwidth_mbps=10.0)  # not in this round
    reports[IDS[1]].links[IDS[3]] = LinkStat(rtt_ms=1.0)  # no bandwidth yet: not measured
    key = Request(tuple(IDS), 2, 2, {}, {}, reports, 0).key
    assert key[-1] == 11
