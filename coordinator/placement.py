"""Placing live peers on the S x R tasklet grid from their measured links (DT-FM's scheduler).

At each outer boundary the coordinator turns the peers' signed link reports into a
:class:`~potluck.coordinator.costmodel.Topology` (delay = RTT / 2, bandwidth as measured; a link
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

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from potluck.coordinator.costmodel import CostModel, Topology, TopologyError
from potluck.coordinator.membership import PeerTable, sticky_placement
from potluck.coordinator.scheduler import evolutionary_search
from potluck.protos.config import RunConfig
from potluck.protos.log import get_logger
from potluck.protos.swarm import LinkReport

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


def make_placer(cfg: RunConfig, reports: Callable[[], Mapping[str, LinkReport]], parameters: Callable[[], int],
                budget_s: float = 1.0, migration_weight: float | None = None,
                on_replan: Callable[[Replan], None] | None = None) -> Callable:
    """A :data:`~potluck.coordinator.membership.Placer` for :meth:`PeerTable.decide`."""

    def place(ids: list[str], stages: int, replicas: int, before: dict[str, tuple[int, int]],
              table: PeerTable) -> dict[str, tuple[int, int]]:
        kept = sticky_placement(ids, stages, replicas, before, table)
        if replicas < 2 and stages < 2:
            return kept
        rep = reports()
        delay, gbps, measured = link_matrices(ids, rep)
        if measured < len(ids) * (len(ids) - 1) // 2:
            return kept  # too little measured yet to beat the sticky grid
        c_pp, c_dp = payloads_gb(cfg, parameters())
        try:
            topo = Topology(delay_ms=delay.tolist(), bandwidth_gbps=gbps.tolist(), stages=stages, replicas=replicas,
                            activation_gb=c_pp, gradient_gb=c_dp, outer_every=cfg.diloco.inner_steps)
        except TopologyError as err:
            log.warning("cannot plan from the measured links: %s", err)
            return kept
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
        kept_cost = model.plan(previous).cost
        chosen = result.plan
        if chosen.cost >= kept_cost - 1e-9:
            if on_replan:
                on_replan(Replan(kept_cost, kept_cost, 0, time.monotonic() - t0, result.evaluations))
            return kept
        grid = {ids[dev]: (s, r) for r, pipe in enumerate(chosen.pipelines) for s, dev in enumerate(pipe)}
        moved = sum(1 for pid, cell in grid.items() if kept.get(pid) != cell)
        if on_replan:
            on_replan(Replan(chosen.cost, kept_cost, moved, time.monotonic() - t0, result.evaluations))
        return grid

    return place


def _as_array(grid: Mapping[str, tuple[int, int]], index: Mapping[str, int], stages: int, replicas: int) -> np.ndarray:
    out = np.zeros((stages, replicas), dtype=int)
    for pid, (s, r) in grid.items():
        out[s, r] = index[pid]
    return out
