"""The run's status snapshot in the Prometheus text exposition format (version 0.0.4).

Written by hand rather than with ``prometheus_client`` so the coordinator needs no extra runtime
dependency: the format is a few lines per family, and the tests parse our output with
``prometheus_client``'s own parser. Every value comes from the same snapshot the page and
``/api/v1/state`` show, so the three never disagree. Names follow Prometheus conventions: base
units (seconds, bytes), ``_total`` for counters, one ``potluck_`` prefix; per-peer series are
labelled with the full peer id (``peer``), and ``potluck_peer_info`` carries the descriptive labels
so the numeric series stay narrow.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

PEER_STATES = ("joining", "waiting", "recovering", "training", "syncing", "finished", "left", "failed", "refused", "lost")


@dataclass
class Family:
    name: str
    kind: str  # "gauge" | "counter"
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def add(self, value: Any, **labels: Any) -> None:
        """Add one sample; a missing value (None, or not a number) is left out rather than faked as 0."""
        if value is None:
            return
        try:
            number = float(value)
        except (TypeError, ValueError):
            return
        self.samples.append(({k: "" if v is None else str(v) for k, v in labels.items()}, number))


def escape_label(value: str) -> str:
    """Label values escape backslash, double quote and newline (the exposition format's only rules)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(v)


def exposition(families: Iterable[Family]) -> str:
    lines: list[str] = []
    for fam in families:
        lines.append(f"# HELP {fam.name} {_escape_help(fam.help)}")
        lines.append(f"# TYPE {fam.name} {fam.kind}")
        for labels, value in fam.samples:
            if labels:
                inner = ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items())
                lines.append(f"{fam.name}{{{inner}}} {format_value(value)}")
            else:
                lines.append(f"{fam.name} {format_value(value)}")
    return "\n".join(lines) + "\n"


def families(state: Mapping[str, Any]) -> list[Family]:
    """Every ``potluck_*`` family for one snapshot (see docs/status-api.md for the list)."""
    run = state.get("run") or {}
    model = run.get("model") or {}
    peers = state.get("_peers") or state.get("peers") or []  # every peer, also past the page's inline rows
    grid = state.get("grid") or {}
    history = state.get("history") or []
    out: list[Family] = []

    def gauge(name: str, help_: str, value: Any = None, kind: str = "gauge") -> Family:
        fam = Family(name, kind, help_)
        fam.add(value)
        out.append(fam)
        return fam

    info = gauge("potluck_info", "the run this coordinator serves (value is always 1)")
    info.add(1, run_id=run.get("run_id", ""), coordinator=run.get("coordinator", ""), api=state.get("api", ""),
             outer_codec=str((state.get("config") or {}).get("outer_codec", "")),
             fragments=str((state.get("config") or {}).get("fragments", "")))
    gauge("potluck_state_generated_timestamp_seconds", "unix time the coordinator built this snapshot",
          state.get("generated_at"))
    gauge("potluck_finished", "1 once all outer steps are committed", int(bool(run.get("finished"))))
    gauge("potluck_outer_step", "committed outer steps (the version of theta_global)", run.get("outer_step"))
    gauge("potluck_outer_steps_planned", "outer steps the run trains in all", run.get("outer_steps_total"))
    gauge("potluck_inner_step", "inner step of the slowest training peer in the current outer step",
          run.get("inner_step"))
    gauge("potluck_inner_steps_per_outer", "H, inner steps between outer synchronisations",
          run.get("inner_steps_per_outer"))
    gauge("potluck_model_parameters", "parameters of the model being trained", model.get("parameters"))
    gauge("potluck_stages", "pipeline stages S of the tasklet grid", run.get("stages"))
    gauge("potluck_replicas", "replicas R of the tasklet grid", run.get("replicas"))
    gauge("potluck_tokens_total", "tokens trained by all peers", run.get("tokens_trained"), kind="counter")
    gauge("potluck_tokens_per_second", "tokens per second of the peers now training", run.get("tokens_per_s"))
    gauge("potluck_loss", "mean training loss reported for the latest outer step", run.get("loss"))
    gauge("potluck_eval_loss", "held-out loss of theta_global at the latest evaluated step", run.get("eval_loss"))
    gauge("potluck_loss_floor", "best achievable loss on the run's data, if known", run.get("loss_floor"))
    gauge("potluck_compute_utilization", "share of peers' time spent computing rather than syncing (0-1)",
          run.get("compute_utilization"))
    gauge("potluck_last_outer_timestamp_seconds", "unix time the latest outer step was recorded",
          run.get("last_outer_at"))
    gauge("potluck_round_window_seconds", "the newest committed step's window: its longest member inner phase",
          run.get("window_s"))
    gauge("potluck_last_allreduce_seconds", "wall time of the slowest member in the latest outer step",
          run.get("last_allreduce_s"))
    gauge("potluck_waiting", "1 while the run is waiting (see waiting_reason in /api/v1/state)",
          int(bool(run.get("waiting_reason"))))

    health = state.get("coordinator") or {}
    ticks = gauge("potluck_coordinator_tick_seconds", "a tick of the coordinator's loop, over its latest 1,000")
    for q, key in (("0.5", "p50"), ("0.99", "p99"), ("1", "max")):
        ticks.add((health.get("tick_s") or {}).get(key), quantile=q)
    gauge("potluck_coordinator_decide_seconds", "the latest decision of a round (pings, placement, publishing)",
          (health.get("decide_s") or {}).get("last"))
    gauge("potluck_coordinator_resident_memory_bytes", "resident memory of the coordinator's main process",
          health.get("rss_bytes"))

    by_state = gauge("potluck_peers", "known peers by state")
    counts = {s: 0 for s in PEER_STATES}
    for p in peers:
        counts[str(p.get("state", ""))] = counts.get(str(p.get("state", "")), 0) + 1
    for s, n in counts.items():
        by_state.add(n, state=s)

    cells = gauge("potluck_grid_cells", "tasklets of the grid by the state of their peer ('empty': a hole)")
    cell_counts: dict[str, int] = {}
    taken = set()
    for c in grid.get("cells") or []:
        taken.add((c.get("stage"), c.get("replica")))
        key = str(c.get("state") or "empty") if c.get("peer") else "empty"
        cell_counts[key] = cell_counts.get(key, 0) + 1
    holes = sum(1 for s in range(int(grid.get("stages") or 0)) for r in range(int(grid.get("replicas") or 0))
                if (s, r) not in taken)
    if holes:
        cell_counts["empty"] = cell_counts.get("empty", 0) + holes
    for s, n in sorted(cell_counts.items()):
        cells.add(n, state=s)

    sent_by_kind: dict[str, int] = {}
    for p in peers:
        for kind, n in (p.get("bytes_sent") or {}).items():
            sent_by_kind[kind] = sent_by_kind.get(kind, 0) + n
    total = gauge("potluck_bytes_total", "bytes sent by all known peers, by kind", kind="counter")
    for kind, n in sorted(sent_by_kind.items()):
        total.add(n, kind=kind)

    last = next((h for h in reversed(history) if any((h.get("bytes") or {}).values())), None)
    step_bytes = gauge("potluck_outer_step_bytes", "bytes sent in the latest outer step, by kind")
    step_fp32 = gauge("potluck_outer_step_bytes_fp32", "what the latest outer step would have sent in fp32, by kind")
    if last is not None:
        for kind, n in sorted((last.get("bytes") or {}).items()):
            step_bytes.add(n, kind=kind)
        for kind, n in sorted((last.get("bytes_fp32") or {}).items()):
            step_fp32.add(n, kind=kind)

    out.extend(_peer_families(peers))
    out.extend(_link_families(state.get("links") or {}))
    return out


def _peer_families(peers: list[Mapping[str, Any]]) -> list[Family]:
    info = Family("potluck_peer_info", "gauge", "a known peer and its description (value is always 1)")
    seen = Family("potluck_peer_last_seen_seconds", "gauge", "seconds since the peer's last heartbeat")
    version = Family("potluck_peer_version", "gauge", "committed outer steps the peer holds")
    inner = Family("potluck_peer_inner_step", "gauge", "the peer's inner step in its current outer step")
    tps = Family("potluck_peer_tokens_per_second", "gauge", "the peer's training throughput")
    steps = Family("potluck_peer_round_inner_steps", "gauge", "inner steps its last inner phase trained (at most H)")
    step_s = Family("potluck_peer_step_seconds", "gauge", "seconds one of its inner steps takes")
    share = Family("potluck_peer_work_share", "gauge", "its share of its newest committed step's work (stage 0)")
    slow = Family("potluck_peer_too_slow", "gauge", "1 while one of its inner steps is longer than the round's window")
    tokens = Family("potluck_peer_tokens_total", "counter", "tokens the peer has trained")
    loss = Family("potluck_peer_loss", "gauge", "the peer's latest training loss")
    memory = Family("potluck_peer_memory_bytes", "gauge", "accelerator memory of the peer (0 on CPU)")
    sent = Family("potluck_peer_bytes_sent_total", "counter", "bytes the peer has sent, by kind")
    received = Family("potluck_peer_bytes_received_total", "counter", "bytes the peer has received, by kind")
    rate = Family("potluck_peer_send_bytes_per_second", "gauge", "bytes per second the peer sent over its last 10 s")
    peak = Family("potluck_peer_peak_send_bytes_per_second", "gauge", "the most bytes the peer sent in one second")
    compute = Family("potluck_peer_compute_seconds_total", "counter", "seconds the peer spent in inner steps")
    sync = Family("potluck_peer_sync_seconds_total", "counter", "seconds the peer spent in outer steps")
    clipped = Family("potluck_peer_clipped_total", "counter", "outer steps in which an owner clipped the peer's update")
    rejected = Family("potluck_peer_rejected_total", "counter", "outer steps in which an owner left the peer's update out")
    for p in peers:
        pid = str(p.get("id", ""))
        t = p.get("tasklet")
        info.add(1, peer=pid, short_id=p.get("short_id", ""), name=p.get("name", ""), state=p.get("state", ""),
                 device=p.get("device", ""), device_name=p.get("device_name", ""), software=p.get("software", ""),
                 tasklet=f"{t.get('stage')}/{t.get('replica')}" if t else "")
        seen.add(p.get("last_seen_s"), peer=pid)
        version.add(p.get("version"), peer=pid)
        inner.add(p.get("inner_step"), peer=pid)
        tps.add(p.get("tokens_per_s"), peer=pid)
        steps.add(p.get("round_steps"), peer=pid)
        step_s.add(p.get("step_s"), peer=pid)
        share.add(p.get("work_share"), peer=pid)
        slow.add(1 if p.get("too_slow") else 0, peer=pid)
        tokens.add(p.get("tokens_total"), peer=pid)
        loss.add(p.get("loss"), peer=pid)
        gb = p.get("memory_gb")
        memory.add(None if gb is None else round(float(gb) * 2**30), peer=pid)
        for kind, n in sorted((p.get("bytes_sent") or {}).items()):
            sent.add(n, peer=pid, kind=kind)
        for kind, n in sorted((p.get("bytes_received") or {}).items()):
            received.add(n, peer=pid, kind=kind)
        rate.add(p.get("send_bps"), peer=pid)
        peak.add(p.get("peak_send_bps"), peer=pid)
        compute.add(p.get("compute_s"), peer=pid)
        sync.add(p.get("sync_s"), peer=pid)
        clipped.add(p.get("clipped", 0), peer=pid)
        rejected.add(p.get("rejected", 0), peer=pid)
    return [info, seen, version, inner, tps, steps, step_s, share, slow, tokens, loss, memory, sent, received, rate, peak,
            compute, sync, clipped, rejected]


def _link_families(links: Mapping[str, Any]) -> list[Family]:
    """Measured links only: a null (not yet measured) entry of the matrix produces no sample."""
    rtt = Family("potluck_link_rtt_seconds", "gauge", "measured round-trip time from peer src to peer dst")
    bw = Family("potluck_link_bandwidth_bytes_per_second", "gauge", "measured bandwidth from peer src to peer dst")
    ids = [str(p) for p in links.get("peers") or []]
    for matrix, fam, scale in ((links.get("rtt_ms") or [], rtt, 1e-3), (links.get("bandwidth_mbps") or [], bw, 1e6 / 8)):
        for i, row in enumerate(matrix[: len(ids)]):
            for j, v in enumerate((row or [])[: len(ids)]):
                if i != j and isinstance(v, int | float) and not isinstance(v, bool):
                    fam.add(v * scale, src=ids[i], dst=ids[j])
    return [rtt, bw]


def render(state: Mapping[str, Any]) -> str:
    """The whole ``/metrics`` page for one snapshot."""
    return exposition(families(state))
