"""The placement worker: rounds never wait for a search, a finished plan is taken at the next boundary,
and newly measured links are worth a new search (the coordinator's loop side of issue #15)."""

from __future__ import annotations

import threading

import pytest

from potluck.coordinator.placement import placement
from potluck.coordinator.placement.placement import PlacementWorker, Request, grid_for
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.swarm import LinkReport, LinkStat
from potluck.protos.wire.records import PeerRecord

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


def test_the_request_key_changes_with_new_links_and_real_drift_only() -> None:
    def key(reports: dict[str, LinkReport]) -> tuple:
        return Request(tuple(IDS), 2, 2, {}, {}, reports, 0).key

    base = key(links(12))
    reports = links(12)
    reports[IDS[0]].links["stranger"] = LinkStat(rtt_ms=1.0, bandwidth_mbps=10.0)  # not in this round
    reports[IDS[1]].links[IDS[3]] = LinkStat(rtt_ms=2.0, bandwidth_mbps=100.0, samples=9)  # same figures
    reports[IDS[2]].links[IDS[0]] = LinkStat(rtt_ms=2.2, bandwidth_mbps=93.0)  # measurement noise
    assert key(reports) == base
    reports[IDS[1]].links[IDS[3]] = LinkStat(rtt_ms=2.0)  # no bandwidth yet: not measured
    assert key(reports) != base
    slower = links(12)
    slower[IDS[0]].links[IDS[1]] = LinkStat(rtt_ms=2.0, bandwidth_mbps=40.0)  # bandwidth fell 2.5x
    assert key(slower) != base
    farther = links(12)
    farther[IDS[3]].links[IDS[2]] = LinkStat(rtt_ms=9.0, bandwidth_mbps=100.0)  # RTT 4.5x
    assert key(farther) != base


def test_a_plan_that_moves_peers_is_taken_once_even_if_links_changed_meanwhile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Links are measured all the time: a plan searched on links a few seconds old is still taken
    (once) for the same peers, else a run whose links keep changing would never adopt any plan."""
    cfg = apply_overrides(RunConfig(), {"pipeline.stages": 2})
    planned = {IDS[0]: (1, 1), IDS[1]: (0, 0), IDS[2]: (1, 0), IDS[3]: (0, 1)}
    calls: list[tuple] = []

    def place(cfg: RunConfig, req: Request, budget_s: float) -> tuple[dict, placement.Replan]:
        calls.append(req.key)
        return planned, placement.Replan(cost=1.0, kept_cost=2.0, moved=4, seconds=0.1, evaluations=10)

    monkeypatch.setattr(placement, "place", place)
    worker = PlacementWorker(cfg, budget_s=1.0)
    before = {IDS[0]: (0, 0), IDS[1]: (0, 1), IDS[2]: (1, 0), IDS[3]: (1, 1)}
    assert grid_for(cfg, records(), 2, before, links(11), worker) == (before, None)
    worker.stop(5)
    grid, replan = grid_for(cfg, records(), 2, before, links(12), worker)  # type: ignore[misc]
    assert grid == planned and replan is not None and replan.moved == 4 and len(calls) == 1
    assert grid_for(cfg, records(), 2, before, links(10), worker) == (before, None)  # taken once: search anew
    worker.stop(5)
    assert len(calls) == 2
    worker._taken = False  # as if unused: still, a plan for other peers never applies
    grid, _ = grid_for(cfg, records()[:3], 2, before, links(9), worker)  # type: ignore[misc]
    worker.stop(5)
    assert grid != planned and set(grid) <= set(IDS[:3]) and len(calls) == 3


def test_a_kept_grid_is_wired_as_the_cost_model_priced_it() -> None:
    """Two regions, 2 stages x 2 replicas, every peer already on a stage that the best plan also gives
    it, but the replica numbers cross regions (a->d, b->c). The cost model prices the best matching
    (a->c, b->d), so keeping the grid must also keep that wiring: no peer changes stage."""
    cfg = apply_overrides(RunConfig(), {"pipeline.stages": 2})
    a, b, c, d = IDS
    region = {a: "eu", c: "eu", b: "us", d: "us"}
    reports: dict[str, LinkReport] = {}
    for p in IDS:
        for q in IDS:
            if p != q:
                near = region[p] == region[q]
                reports.setdefault(p, LinkReport(peer_id=p)).links[q] = LinkStat(
                    rtt_ms=2.0 if near else 400.0, bandwidth_mbps=1000.0 if near else 10.0)
    before = {a: (0, 0), b: (0, 1), d: (1, 0), c: (1, 1)}
    grid, replan = placement.place(cfg, Request(tuple(IDS), 2, 2, before, {}, reports, 10_000), budget_s=0.5)
    assert {p: s for p, (s, _) in grid.items()} == {p: s for p, (s, _) in before.items()}  # no stage moved
    pipes: dict[int, set[str]] = {}
    for p, (_, r) in grid.items():
        pipes.setdefault(r, set()).add(region[p])
    assert all(len(regions) == 1 for regions in pipes.values()), grid
    assert replan is not None and replan.moved == 2


def test_links_measured_after_a_search_found_too_few_are_searched_again() -> None:
    """The coordinator hands the link feed's own dict, which it updates in place as reports arrive. A
    request must keep what it was given: one that read through saw the later links as its own, so the
    "not all measured yet" answer matched every later request and the run never searched again (found
    by test_placement_swarm failing 1 run in 6)."""
    cfg = apply_overrides(RunConfig(), {"pipeline.stages": 2})
    worker = PlacementWorker(cfg, budget_s=0.2)
    feed: dict[str, LinkReport] = links(2)  # too few measured to search
    before = {IDS[0]: (0, 0), IDS[1]: (0, 1), IDS[2]: (1, 0), IDS[3]: (1, 1)}
    assert grid_for(cfg, records(), 2, before, feed, worker) == (before, None)
    worker.stop(5)
    assert grid_for(cfg, records(), 2, before, feed, worker) == (before, None)  # its answer: not searched
    feed.update(links(12))  # every link measured since, in the same dict
    assert grid_for(cfg, records(), 2, before, feed, worker) == (before, None)  # a new search starts
    worker.stop(5)
    grid, replan = grid_for(cfg, records(), 2, before, feed, worker)  # type: ignore[misc]
    assert replan is not None and replan.evaluations > 0 and set(grid) == set(IDS)


# ---------------------------------------------------------------------- measured compute


def test_speeds_compare_devices_that_ran_different_stages() -> None:
    """A peer's speed is its stage's FLOPs per second of its own compute: two devices equally fast on stages of
    different sizes come out equal, and one that takes 4x as long for the same stage 4x slower."""
    cfg = apply_overrides(RunConfig(), {"pipeline.stages": 2, "pipeline.layers": [2, 2]})  # stages of different FLOPs
    flops = placement.entry_costs(cfg.model, "flops")
    cost = [sum(flops[:2]), sum(flops[2:])]
    assert cost[0] != cost[1]
    recs = [PeerRecord(peer_id=IDS[0], address="x:1", stage=0, busy_s=cost[0] / 1e9),
            PeerRecord(peer_id=IDS[1], address="x:2", stage=1, busy_s=cost[1] / 1e9),
            PeerRecord(peer_id=IDS[2], address="x:3", stage=1, busy_s=4 * cost[1] / 1e9),
            PeerRecord(peer_id=IDS[3], address="x:4", stage=1)]  # not measured yet
    speeds = placement.compute_speeds(cfg, recs, 2)
    assert speeds[IDS[0]] == pytest.approx(1e9) and speeds[IDS[1]] == pytest.approx(1e9)
    assert speeds[IDS[2]] == pytest.approx(2.5e8) and IDS[3] not in speeds
    relative, stage_s = placement.relative_speeds(cfg, IDS, speeds, 2)
    assert relative == pytest.approx([1.0, 1.0, 0.25, 1.0]) and stage_s > 0
    assert placement.relative_speeds(cfg, IDS, {}, 2) == (None, 1.0)
    base = Request(tuple(IDS), 2, 2, {}, {}, links(12), 0, speeds).key
    assert Request(tuple(IDS), 2, 2, {}, {}, links(12), 0, {**speeds, IDS[2]: 2.4e8}).key == base  # noise
    assert Request(tuple(IDS), 2, 2, {}, {}, links(12), 0, {**speeds, IDS[2]: 1e8}).key != base  # 2.5x slower


def test_a_4x_slower_device_is_placed_where_it_hurts_least() -> None:
    """Five peers for a 2 x 2 grid, one of them 4x slower: priced by their measured speed the plan leaves it out,
    and the plan the cost model gives for it is at least as good as the one that ignores compute (the figure is
    in benchmarks/scheduler_compute.py)."""
    from potluck.coordinator.placement.costmodel import CostModel, Topology

    cfg = apply_overrides(RunConfig(), {"pipeline.stages": 2, "model.d_model": 64, "model.n_layers": 2})
    ids = [c * 8 for c in "abcde"]
    reports: dict[str, LinkReport] = {}
    for a in ids:
        for b in ids:
            if a != b:
                reports.setdefault(a, LinkReport(peer_id=a)).links[b] = LinkStat(rtt_ms=20.0, bandwidth_mbps=200.0)
    speeds = {p: (2.5e8 if p == ids[2] else 1e9) for p in ids}
    before = {ids[0]: (0, 0), ids[1]: (1, 0), ids[2]: (0, 1), ids[3]: (1, 1)}  # the slow one holds a tasklet now
    aware, _ = placement.place(cfg, Request(tuple(ids), 2, 2, before, {}, reports, 10**6, speeds), budget_s=0.5)
    blind, _ = placement.place(cfg, Request(tuple(ids), 2, 2, before, {}, reports, 10**6), budget_s=0.5)
    assert ids[2] not in aware, aware
    compute, stage_s = placement.relative_speeds(cfg, ids, speeds, 2)
    delay, gbps, _ = placement.link_matrices(ids, reports)
    c_pp, c_dp = placement.payloads_gb(cfg, 10**6)
    topo = Topology(delay_ms=delay.tolist(), bandwidth_gbps=gbps.tolist(), stages=2, replicas=2, activation_gb=c_pp,
                    gradient_gb=c_dp, outer_every=cfg.diloco.inner_steps, compute=compute, stage_seconds=stage_s)
    model, index = CostModel(topo), {p: i for i, p in enumerate(ids)}

    def cost(grid: dict[str, tuple[int, int]]) -> float:
        return model.plan(placement._as_array(grid, index, 2, 2)).cost

    assert cost(aware) <= cost(blind) + 1e-9 and cost(aware) < cost(before)
