"""Placing live peers on the S x R tasklet grid from their measured links (DT-FM's scheduler).

At each outer boundary the coordinator turns the peers' signed link reports into a
:class:`~potluck.coordinator.placement.costmodel.Topology` (delay = RTT / 2, bandwidth as measured; a link
nobody measured yet is assumed slow, ``UNKNOWN_DELAY_MS`` / ``UNKNOWN_GBPS``, so the search avoids
putting a pipeline hop on it), runs the evolutionary search for a short budget with a migration
cost against the current grid (a moved peer downloads its new stage and warms its AC-SGD buffers),
and keeps the current grid unless the new plan is predicted to be cheaper.

Payloads per inner step, from the run config: a stage boundary carries the batch's activations
(``batch x seq x d_model`` at the configured bits) forward and their gradients back; a stage's
outer all-reduce moves its int8 pseudo-gradient (1 byte per parameter, estimated per stage as
the model's parameters / S).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from potluck.coordinator.placement.costmodel import CostModel, Topology, TopologyError
from potluck.coordinator.placement.scheduler import evolutionary_search
from potluck.models import entry_costs, stage_bounds
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.swarm import LinkReport
from potluck.protos.runtime.log import get_logger
from potluck.protos.testkit.faults import fault
from potluck.protos.wire.records import Member, PeerRecord

log = get_logger(__name__)

UNKNOWN_DELAY_MS = 100.0
UNKNOWN_GBPS = 0.05
MIGRATION_AMORTIZE_OUTER = 20


@dataclass
class Replan:
    """What the last placement decided, for the status page's events."""

    cost: float
    kept_cost: float | None
    moved: int
    seconds: float
    evaluations: int

    def describe(self) -> str:
        return (f"moved {self.moved} tasklets: predicted {self.cost:.3f} s vs {self.kept_cost or 0:.3f} s kept "
                f"({self.evaluations} plans in {self.seconds:.1f} s)")


def payloads_gb(cfg: RunConfig, parameters: int) -> tuple[float, float]:
    """(c_pp, c_dp) in gigabytes: boundary traffic per inner step and a stage's all-reduce."""
    m, p = cfg.model, cfg.pipeline
    tokens = cfg.train.batch_size * m.seq_len
    act_bits = {"none": 32, "fp16": 16, "direct": p.bits, "acsgd": p.bits}[p.compression]
    grad_bits = p.grad_bits or 32
    c_pp = tokens * m.d_model * (act_bits + grad_bits) / 8 / 2 / 1e9  # the model doubles PP for fwd + bwd
    c_dp = max(parameters, 1) / p.stages / 1e9  # int8
    return c_pp, c_dp


def link_matrices(ids: list[str], reports: Mapping[str, LinkReport]) -> tuple[np.ndarray, np.ndarray, int]:
    """Delay (ms) and bandwidth (Gbps) between ``ids`` from reports; also how many links were measured."""
    n = len(ids)
    delay = np.full((n, n), UNKNOWN_DELAY_MS)
    gbps = np.full((n, n), UNKNOWN_GBPS)
    np.fill_diagonal(delay, 0.0)
    np.fill_diagonal(gbps, 1e3)
    measured = 0
    for i, a in enumerate(ids):
        for j, b in enumerate(ids):
            if i == j:
                continue
            stat = reports[a].links.get(b) if a in reports else None
            back = reports[b].links.get(a) if b in reports else None
            rtt = next((s.rtt_ms for s in (stat, back) if s is not None and s.rtt_ms is not None), None)
            bw = next((s.bandwidth_mbps for s in (stat, back) if s is not None and s.bandwidth_mbps), None)
            if rtt is not None:
                delay[i, j] = rtt / 2
            if bw is not None:
                gbps[i, j] = bw / 1e3
            measured += rtt is not None and bw is not None
    return delay, gbps, measured


Grid = dict[str, tuple[int, int]]  # peer id -> (stage, replica)


def sticky_placement(ids: list[str], stages: int, replicas: int, before: Mapping[str, tuple[int, int]],
                     held: Mapping[str, int] | None = None) -> Grid:
    """Fill an S x R grid with ``ids``, keeping every peer that can on its previous tasklet.

    A peer keeps (stage, replica) if both fit the new grid; then peers that held the stage's state
    (same stage, another replica) take free replicas of that stage; then peers whose state is of a
    stage (``held``: peer -> the stage of the state it holds) do; newcomers and spares fill what is
    left, in id order. Fewest moves means fewest state transfers and AC-SGD buffer warm-ups.
    """
    held = held or {}
    grid: Grid = {}
    taken: set[tuple[int, int]] = set()
    for pid in ids:
        cell = before.get(pid)
        if cell is not None and cell[0] < stages and cell[1] < replicas and cell not in taken:
            grid[pid] = cell
            taken.add(cell)
    free = [(s, r) for s in range(stages) for r in range(replicas) if (s, r) not in taken]
    for pid in ids:  # same stage as before, another replica: no state transfer needed
        if pid in grid:
            continue
        s = before[pid][0] if pid in before else held.get(pid)
        cell = next((c for c in free if c[0] == s), None)
        if cell is not None:
            grid[pid] = cell
            free.remove(cell)
    for pid in ids:
        if pid not in grid and free:
            grid[pid] = free.pop(0)
    return grid


@dataclass(frozen=True)
class Request:
    """One placement to compute: the peers of the coming round and what is known of their links.

    It holds a copy of the mappings it is given, and its :attr:`key` is fixed when it is made: the
    caller's link records are the link feed's own dict, which the coordinator's loop updates while a
    search runs (a request that read through to it saw every later measurement as its own, so a
    "not all measured yet" answer matched every later request and no search ever ran again)."""

    ids: tuple[str, ...]
    stages: int
    replicas: int
    before: Mapping[str, tuple[int, int]]
    held: Mapping[str, int]
    reports: Mapping[str, LinkReport]
    parameters: int
    speeds: Mapping[str, float] = field(default_factory=dict)  # measured: stages' FLOPs per second of compute
    key: tuple = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("before", "held", "reports", "speeds"):
            object.__setattr__(self, name, dict(getattr(self, name)))
        object.__setattr__(self, "key", self._key())

    def _key(self) -> tuple:
        """What the plan depends on: the peers, the grid's shape, where they are, and their links and
        speeds as measured to within a factor of two (a link measured since the last search, one whose
        RTT or bandwidth has since doubled or halved, or a device that did, is worth a new search; noise
        is not)."""
        peers = set(self.ids)
        links = tuple(sorted(
            (p, q, round(math.log2(max(stat.rtt_ms, 1e-3))), round(math.log2(stat.bandwidth_mbps)))
            for p in self.ids if p in self.reports for q, stat in self.reports[p].links.items()
            if q in peers and stat.rtt_ms is not None and stat.bandwidth_mbps))
        speeds = tuple(sorted((p, round(math.log2(v))) for p, v in self.speeds.items() if p in peers and v > 0))
        return self.ids, self.stages, self.replicas, tuple(sorted(self.before.items())), links, speeds


def compute_speeds(cfg: RunConfig, records: Sequence[PeerRecord], stages: int) -> dict[str, float]:
    """Each peer's measured speed: the FLOPs of the stage it ran over the seconds one inner step of it computed
    (``busy_s``: a pipeline's waits for its neighbours left out), so devices that ran different stages compare."""
    flops = entry_costs(cfg.model, "flops")
    bounds = stage_bounds(cfg.model, cfg.pipeline) if cfg.pipeline.stages == stages else None
    cost = [sum(flops[a:b]) for a, b in bounds] if bounds is not None else [sum(flops) / stages] * stages
    return {r.peer_id: cost[r.stage] / r.busy_s for r in records if r.busy_s > 0 and r.stage < stages}


def place(cfg: RunConfig, req: Request, budget_s: float = 1.0,
          migration_weight: float | None = None) -> tuple[Grid, Replan | None]:
    """The grid for ``req``: the scheduler's plan if it is predicted cheaper than keeping tasklets."""
    ids, stages, replicas = list(req.ids), req.stages, req.replicas
    kept = sticky_placement(ids, stages, replicas, req.before, req.held)
    if replicas < 2 and stages < 2:
        return kept, None
    delay, gbps, measured = link_matrices(ids, req.reports)
    if measured < len(ids) * (len(ids) - 1) // 2:
        return kept, None  # too little measured yet to beat the sticky grid
    c_pp, c_dp = payloads_gb(cfg, req.parameters)
    compute, stage_seconds = relative_speeds(cfg, ids, req.speeds, stages)
    try:
        topo = Topology(delay_ms=delay.tolist(), bandwidth_gbps=gbps.tolist(), stages=stages, replicas=replicas,
                        activation_gb=c_pp, gradient_gb=c_dp, outer_every=cfg.diloco.inner_steps,
                        compute=None if compute is None else np.asarray(compute, dtype=np.float64),
                        stage_seconds=stage_seconds)
    except TopologyError as err:
        log.warning("cannot plan from the measured links: %s", err)
        return kept, None
    index = {pid: i for i, pid in enumerate(ids)}
    previous = _as_array(kept, index, stages, replicas)
    # A moved peer downloads its new stage (c_dp at int8 -> ~4x that in fp32 theta + momentum) and
    # re-warms its AC-SGD buffers, once: about a second plus the transfer, amortized over the
    # next MIGRATION_AMORTIZE_OUTER outer steps' inner steps (the objective is per inner step).
    transfer_s = 8 * 8 * c_dp / float(np.median(gbps[gbps < 1e3])) if (gbps < 1e3).any() else 0.0
    weight = migration_weight if migration_weight is not None else (
        (1.0 + transfer_s) / (MIGRATION_AMORTIZE_OUTER * cfg.diloco.inner_steps))
    model = CostModel(topo, previous=previous, migration_weight=weight)
    t0 = time.monotonic()
    result = evolutionary_search(topo, seed=len(ids), budget_seconds=budget_s, model=model)
    kept_plan = model.plan(previous)
    kept_cost, chosen = kept_plan.cost, result.plan
    if chosen.cost >= kept_cost - 1e-9:
        # Keep every peer on its stage, but wire the replicas as the cost model priced them: its
        # cost assumes the best matching between consecutive stages, which the sticky grid's
        # replica numbers need not follow (two pipelines could cross a slow link both predicted
        # to avoid). Same stage, no state to move: only who sends activations to whom changes.
        chosen = kept_plan
    grid = {ids[dev]: (s, r) for r, pipe in enumerate(chosen.pipelines) for s, dev in enumerate(pipe)}
    moved = sum(1 for pid, cell in grid.items() if kept.get(pid) != cell)
    return grid, Replan(chosen.cost, kept_cost, moved, time.monotonic() - t0, result.evaluations)


def grid_for(cfg: RunConfig, records: list[PeerRecord], stages: int, before: Mapping[str, tuple[int, int]],
             links: Mapping[str, LinkReport], worker: PlacementWorker) -> tuple[Grid, Replan | None] | None:
    """The grid of the coming round for these (live, reachable) peers; None while there is not one
    whole pipeline yet. While the worker still searches, the current grid (sticky): rounds never wait
    for a search, and its plan is taken at the first boundary after it is ready."""
    ids = sorted(r.peer_id for r in records)
    replicas = len(ids) // stages
    if not replicas:
        return None
    held = {r.peer_id: r.stage for r in records if r.version > 0}
    if stages > 1 and cfg.links.placement == "scheduler":
        params = sum({r.stage: r.parameters for r in records}.values())
        placed = worker.poll(Request(tuple(ids), stages, replicas, before, held, links, params,
                                     compute_speeds(cfg, records, stages)))
        if placed is not None:
            return placed
    return sticky_placement(ids, stages, replicas, before, held), None


def members(grid: Grid, records: list[PeerRecord]) -> list[Member]:
    """The round's members: each placed peer on its tasklet, at the address it announced; none owns a shard yet
    (:meth:`~potluck.coordinator.trust.trust.Trust.assign_owners` names the owners, at most 32 a stage; a round whose
    members own none has them all own, as on probation)."""
    address = {r.peer_id: r.address for r in records}
    return [Member(peer_id=p, address=address[p], stage=s, replica=k, owns=False) for p, (s, k) in grid.items()]


class PlacementWorker:
    """Runs the search on a thread of its own, so the coordinator's loop (heartbeats, rounds, the
    status page) never waits for it: :meth:`poll` starts a request and returns its grid once done.

    Links are measured all the time, so by the time a search is done the request that would ask
    for it again has often changed (newer links, or the grid of a round decided meanwhile). A plan
    that moves peers is still taken then, once, if it places exactly the same peers on the same
    shape: a plan on links a few seconds old beats none, and the next boundary plans again from the
    grid it made. A finished search that moved no one is not taken; the new request is searched."""

    def __init__(self, cfg: RunConfig, budget_s: float) -> None:
        self.cfg, self.budget_s = cfg, budget_s
        self._lock = threading.Lock()
        self._req: Request | None = None
        self._result: tuple[Grid, Replan | None] | None = None
        self._taken = False
        self._thread: threading.Thread | None = None

    def poll(self, req: Request) -> tuple[Grid, Replan | None] | None:
        """The placement for ``req`` if it is computed (or a fresh plan for the same peers moves some);
        otherwise start computing it and return None (the caller keeps the current grid)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return None  # a search is still running; ask again
            done, result = self._req, self._result
            if done is not None and result is not None:
                if done.key == req.key:
                    self._taken = True
                    return result
                same_peers = (done.ids, done.stages, done.replicas) == (req.ids, req.stages, req.replicas)
                if same_peers and not self._taken and result[1] is not None and result[1].moved:
                    self._taken = True
                    return result
            self._req, self._result, self._taken = req, None, False
            self._thread = threading.Thread(target=self._run, args=(req,), name="placement", daemon=True)
            self._thread.start()
            return None

    def stop(self, timeout: float = 1.0) -> None:
        """The search is bounded by its budget; wait that long at most (the thread is a daemon)."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            thread.join(timeout)

    def _run(self, req: Request) -> None:
        try:
            fault("placement.search")
            result = place(self.cfg, req, self.budget_s)
        except Exception:  # a search bug must not stop the run: keep every tasklet where it is
            log.exception("placement failed; keeping tasklets")
            result = (sticky_placement(list(req.ids), req.stages, req.replicas, req.before, req.held), None)
        replan = result[1]
        log.info("placement for %d peers: %s", len(req.ids), replan.describe() if replan is not None
                 else "not searched (links not all measured yet, or one tasklet)")
        with self._lock:
            if self._req is req:
                self._result = result


def relative_speeds(cfg: RunConfig, ids: Sequence[str], speeds: Mapping[str, float],
                    stages: int) -> tuple[list[float] | None, float]:
    """The cost model's ``compute`` (each device's speed over the median measured one; a device not measured yet
    counts as the median) and ``stage_seconds`` (a mean stage on the median device); (None, 1.0) when no device
    has been measured: placement then prices links alone."""
    known = sorted(v for p, v in speeds.items() if p in set(ids) and v > 0)
    if not known:
        return None, 1.0
    median = known[len(known) // 2]
    stage_flops = sum(entry_costs(cfg.model, "flops")) / stages
    return [speeds.get(p, median) / median for p in ids], stage_flops / median


def _as_array(grid: Mapping[str, tuple[int, int]], index: Mapping[str, int], stages: int, replicas: int) -> np.ndarray:
    out = np.zeros((stages, replicas), dtype=int)
    for pid, (s, r) in grid.items():
        out[s, r] = index[pid]
    return out
