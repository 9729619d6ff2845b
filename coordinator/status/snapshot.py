"""The status page's data: one pure fold of the coordinator's state into ``/api/v1/state``.

:func:`build` turns what the coordinator knows (peers, rounds, history, events, links) into the
versioned JSON document that ``docs/status-api.md`` and ``static/state.schema.json`` describe. It
reads, never writes; the coordinator rebuilds it once per tick and the status server hands the same
encoded copy to every client until the next one.
"""

from __future__ import annotations

import math
import operator
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from potluck.coordinator.health import Health
from potluck.coordinator.rounds.history import KEEP_DETAIL, public
from potluck.coordinator.rounds.perround import PerRound
from potluck.coordinator.rounds.rounds import Rounds
from potluck.coordinator.status.horizons import horizon
from potluck.coordinator.status.status import API
from potluck.coordinator.swarm.membership import PeerView
from potluck.models import entry_costs
from potluck.protos.config.runconfig import ModelConfig, RunConfig
from potluck.protos.net.relay import VIA
from potluck.protos.net.swarm import LinkReport
from potluck.protos.runtime.log import short_id
from potluck.protos.wire.records import PeerRecord, Round
from potluck.protos.wire.states import ABSENT, SAID_GOODBYE, PeerState

_SILENT = SAID_GOODBYE | {PeerState.LOST, PeerState.REFUSED}  # (a failed peer still shows its error among the live ones)
PEERS_INLINE = 200  # past this many known peers, `peers` holds the most telling ones; /api/v1/peers pages through all
LINKS_PEERS = 64  # the links matrix covers at most this many peers (the first by tasklet): N x N does not scale
# which peers an operator looks at first when not all fit (lower first): the ones that stopped, then the ones
# the run counts on, then the ones that said goodbye
_ROUND_JSON = PerRound(lambda r: r.model_dump(mode="json"))  # (the latest round's, see round_json)
# each member's tasklet, and the grid's cells: made once per round (at 1,000 members these were a fifth of a build,
# and the cells made anew at each build a seventh); the tasklet dicts are shared by the rows of every snapshot of the
# round, never changed, and a build sets each cell's state in place (see grid_cells)
_TASKLETS = PerRound(lambda r: {m.peer_id: {"stage": m.stage, "replica": m.replica} for m in r.members})
_CELLS: PerRound[list[dict[str, Any]]] = PerRound(lambda r: [
    {"stage": m.stage, "replica": m.replica, "peer": m.peer_id, "state": PeerState.LOST} for m in r.members])
_WAITING = (PeerState.WAITING, PeerState.JOINING)  # (rows that may wait for a place)
_ATTENTION = {PeerState.FAILED: 0, PeerState.LOST: 1, PeerState.REFUSED: 2, PeerState.LEFT: 3, PeerState.FINISHED: 3}


@dataclass
class RunInfo:
    run_id: str
    coordinator: str
    join_address: str
    status_url: str
    started_at: float
    finished: bool
    fingerprint: str = ""  # SHA-256 of the status page's TLS certificate, if it has one
    samples: int = 0  # training samples of the run's data (the manifest's), for the data epoch
    checkpoint_version: int = 0  # the newest checkpoint the coordinator holds (0: none)


@dataclass
class Series:
    """The swarm's throughput and size, sampled at most every ``every_s`` seconds."""

    every_s: float = 2.0
    samples: deque = field(default_factory=lambda: deque(maxlen=1800))

    def sample(self, peers: Sequence[dict[str, Any]], now: float) -> None:
        if self.samples and now - self.samples[-1]["t"] < self.every_s:
            return
        live = [p for p in peers if p["state"] not in _SILENT]
        tps = sum(p["tokens_per_s"] for p in live if p["state"] == PeerState.TRAINING)
        self.samples.append({"t": now, "tokens_per_s": tps, "live_peers": len(live)})


def peer_rows(views: Sequence[PeerView], tasklet_of: Mapping[str, dict[str, int]], now: float,
              history: Sequence[dict[str, Any]] = (), totals: list[Any] | None = None,
              ) -> list[dict[str, Any]]:
    """Every peer's row, in the order they first showed up. ``totals`` (given): [compute_s, sync_s, tokens trained]
    of all their records added to it (tokens enter the model at stage 0: counted once per pipeline), and the first
    loss floor a record gives (None: none does) set as its fourth."""
    clipped, rejected = flag_counts(history)
    worked = {h.get("step"): h.get("samples") for h in history[-KEEP_DETAIL:]}  # step -> its contributions' samples
    rows = []
    compute = sync = 0.0
    tokens, floor = 0, None
    for view in sorted(views, key=_FIRST_SEEN):
        # (a row, its totals and what they were made of are kept until the record or the peer's place changes; the
        # record itself is not read otherwise: at 1,000 peers and as many gone, reading every record's fields at
        # each build, objects spread over the heap, cost a build several times what it cost in a fresh process)
        r, kept = view.record, view.page_row
        pid = kept[4]["id"] if kept is not None else r.peer_id  # (a view's peer never changes)
        tasklet = tasklet_of.get(pid)
        if kept is None or kept[0] is not r or kept[1] is not view.lost or kept[2] is not view.left \
                or (kept[3] is not tasklet and kept[3] != tasklet):  # (a new round's tasklets: the same, mostly)
            kept = view.page_row = (r, view.lost, view.left, tasklet, _row(r, view, tasklet), r.compute_s, r.sync_s,
                                    r.tokens_total if r.stage == 0 else 0, r.loss_floor)
        # the kept row itself, its three changing values set in place: a copy of each of 1,000 rows of 28 keys was a
        # quarter of a build; a snapshot still being encoded on the status server's thread may show the newer values
        # (its keys stay the same ones, so its dicts never change size under the encoder)
        row = kept[4]
        row["last_seen_s"] = round(now - view.last_seen, 2)
        row["work_share"] = work_share(r, worked)
        if clipped or row["clipped"]:
            row["clipped"] = clipped.get(pid, 0)
        if rejected or row["rejected"]:
            row["rejected"] = rejected.get(pid, 0)
        rows.append(row)
        compute, sync, tokens = compute + kept[5], sync + kept[6], tokens + kept[7]
        if floor is None:
            floor = kept[8]
    if totals is not None:
        totals[:] = [totals[0] + compute, totals[1] + sync, totals[2] + tokens, floor]
    return rows


_FIRST_SEEN = operator.attrgetter("first_seen")


def work_share(r: PeerRecord, worked: Mapping[int | None, int | None]) -> float | None:
    """The share of the newest committed step it reported that its own contribution was trained on (stage 0)."""
    for report in reversed(r.recent):
        total = worked.get(report.step)
        if total:
            return round(report.trained / total, 4) if report.stage == 0 else None
    return None


def flag_counts(history: Sequence[dict[str, Any]]) -> tuple[dict[str, int], dict[str, int]]:
    """How often owners bounded (clipped) or left out (rejected) each peer's update, over the history (robust
    aggregation). The entries past the detail window no longer change: their counts are kept between builds (a
    long run's 2,000 entries were a pass of each build)."""
    final = len(history) - KEEP_DETAIL
    key = (final, history[0], history[final - 1]) if final > 0 else None
    kept = _FLAGS.get("final")
    if key is not None and (kept is None or kept[0][0] != final or kept[0][1] is not key[1] or kept[0][2] is not key[2]):
        _FLAGS["final"] = kept = (key, _count_flags(history[:final]))
    base = kept[1] if key is not None and kept is not None else ({}, {})
    recent = _count_flags(history[max(0, final):])
    if not any(recent) and not any(base):
        return {}, {}
    return _added(base[0], recent[0]), _added(base[1], recent[1])


def _added(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {p: a.get(p, 0) + b.get(p, 0) for p in a.keys() | b.keys()}


def _count_flags(entries: Sequence[dict[str, Any]]) -> tuple[dict[str, int], dict[str, int]]:
    clipped: dict[str, int] = {}
    rejected: dict[str, int] = {}
    for h in entries:
        for pid in h.get("clipped") or ():
            clipped[pid] = clipped.get(pid, 0) + 1
        for pid in h.get("rejected") or ():
            rejected[pid] = rejected.get(pid, 0) + 1
    return clipped, rejected


_FLAGS: dict[str, Any] = {}  # "final": ((entries, first, last), counts) of the entries past the detail window


def _row(r: PeerRecord, view: PeerView, tasklet: dict[str, int] | None) -> dict[str, Any]:
    return {
        "id": r.peer_id, "short_id": short_id(r.peer_id), "name": r.name, "state": PeerState.LOST if view.lost and not view.left else r.state,
        "address": r.address, "device": r.device, "device_name": r.device_name, "memory_gb": r.memory_gb,
        "tasklet": tasklet, "version": r.version, "inner_step": r.inner_step, "loss": r.loss,
        "eval_loss": r.eval_loss, "tokens_per_s": r.tokens_per_s, "tokens_total": r.tokens_total,
        "bytes_sent": r.bytes_sent, "bytes_received": r.bytes_received, "send_bps": r.send_bps,
        "peak_send_bps": r.peak_send_bps, "peak_send_kinds": r.peak_send_kinds,
        "last_seen_s": None, "software": r.software, "state_hash": r.state_hash,
        "compute_s": r.compute_s, "sync_s": r.sync_s, "hidden_s": r.hidden_s, "relayed": VIA in r.address,
        "clipped": 0, "rejected": 0, "round_steps": r.round_steps, "step_s": r.step_s, "window_s": r.window_s,
        "work_share": None, "too_slow": r.too_slow, "place_in_s": None,
        "error": r.error if r.state in (PeerState.FAILED, PeerState.REFUSED) else "",
    }


def round_json(rnd: Round) -> dict[str, Any]:
    """``rnd`` as JSON, dumped once (a round is never changed in place: a new one replaces it). At 1,000 members
    the round's dump was a fifth of a snapshot's build, and the snapshot is built every second."""
    return _ROUND_JSON([rnd])[0]


def step_rates(entries: Sequence[dict[str, Any]], cfg: RunConfig) -> list[dict[str, Any]]:
    """History entries as the page shows them, each with the tokens its step trained and the rate of that:
    over the seconds since the entry before it, so the inner steps and the sync of the outer step both
    count (the instantaneous samples of ``series`` fall to 0 at every sync)."""
    per_replica = cfg.diloco.inner_steps * cfg.train.batch_size * cfg.model.seq_len
    out, prev = [], None
    for h in entries:
        entry = public(h)
        entry.setdefault("hash_counts", {})  # (entries journaled by older versions)
        if h.get("samples"):  # what the included contributions were trained on (rounds are windows: it varies)
            entry["tokens"] = h["samples"] * cfg.model.seq_len
        else:  # (an entry of a version from before that: each stage-0 replica trained its whole share)
            stage0 = sum(1 for s in (h.get("stages") or {}).values() if s == 0) or h["members"] // max(1, cfg.pipeline.stages)
            entry["tokens"] = stage0 * per_replica
        dt = h["t"] - prev["t"] if prev is not None and h["step"] == prev["step"] + 1 else 0.0
        entry["tokens_per_s"] = entry["tokens"] / dt if dt > 0 else None
        out.append(entry)
        prev = h
    return out


def model_export(cfg: RunConfig, version: int) -> dict[str, Any]:
    """How to get the model out: the newest checkpoint, and the command that writes it (a journal dir given
    as an absolute path is not shown on the public page: JOURNAL_DIR stands for it)."""
    journal = cfg.coordinator.journal_dir
    shown = "JOURNAL_DIR" if journal.startswith(("/", "~")) else journal
    return {"version": version or None, "command": export_command(cfg, shown)}


def export_command(cfg: RunConfig, journal: str) -> str:
    """The command that writes the run's model from the journal at ``journal`` (as it should be shown)."""
    return f"potluck export --journal-dir {journal} --out {'model.pt' if cfg.model.family == 'tiny' else 'model-hf'}"


def model_parameters(m: ModelConfig) -> int:
    """Parameters of the whole model, counted on the meta device (a tied head shares the embedding)."""
    total = int(sum(entry_costs(m, "params")))
    return total - m.vocab_size * m.d_model if m.tie_embeddings else total


def perplexity(loss: float | None) -> float | None:
    """exp(loss), where it is a number (a diverged run's loss overflows it)."""
    return math.exp(loss) if loss is not None and loss < 700 else None


def inline_peers(peers: list[dict[str, Any]], limit: int = PEERS_INLINE) -> list[dict[str, Any]]:
    """Every row when there are at most ``limit``; else the ``limit`` most telling (failed, lost, live, then the
    ones that left), each class in order of first appearance, and the result in that order too."""
    if len(peers) <= limit:
        return peers
    classes: list[list[int]] = [[], [], [], []]  # (each class's rows in order: no sort of every row)
    for i, p in enumerate(peers):
        classes[_ATTENTION.get(p["state"], 2)].append(i)
    chosen = [i for c in classes for i in c][:limit]
    return [peers[i] for i in sorted(chosen)]


def peers_summary(peers: Sequence[dict[str, Any]], shown: int, by_state: dict[str, int] | None = None) -> dict[str, Any]:
    """``by_state``: how many rows of each state, if counted already."""
    if by_state is None:
        by_state = {}
        for p in peers:
            by_state[p["state"]] = by_state.get(p["state"], 0) + 1
    return {"total": len(peers), "shown": shown, "truncated": shown < len(peers), "by_state": by_state,
            "live": sum(n for st, n in by_state.items() if st not in ABSENT)}


def build(run: RunInfo, cfg: RunConfig, views: Sequence[PeerView], rounds: Rounds, history: Sequence[dict[str, Any]],
          rolled_back: Sequence[dict[str, Any]], events: Sequence[dict[str, Any]], series: Series,
          links: Mapping[str, LinkReport], now: float | None = None, health: dict[str, Any] | None = None,
          ) -> dict[str, Any]:
    """The snapshot; its ``_peers`` (every peer's row, for /api/v1/peers and /metrics) is not part of the JSON."""
    now = time.monotonic() if now is None else now
    current = rounds.latest
    tasklet_of = _TASKLETS([current])[0] if current else {}
    stages = current.stages if current else cfg.pipeline.stages
    replicas = len(current.members) // stages if current else 0
    totals: list[Any] = [0.0, 0.0, 0, None]
    peers = peer_rows(views, tasklet_of, now, history, totals)
    compute, sync, tokens, floor = totals
    horizons = horizon(history, rounds.committed, cfg.diloco.outer_steps, time.time(), run.started_at, run.finished)
    place_in = horizons["next_step_in_s"]  # (a peer waiting for a place gets one at the next outer-step boundary)
    live, training, failed, by_id, by_state = [], [], [], {}, dict[str, int]()  # (one pass over every row for all)
    for p in peers:
        by_id[p["id"]], state = p, p["state"]
        by_state[state] = by_state.get(state, 0) + 1
        p["place_in_s"] = place_in if p["tasklet"] is None and state in _WAITING else None
        if state not in _SILENT:
            live.append(p)
            if state == PeerState.TRAINING:
                training.append(p)
            elif state == PeerState.FAILED:
                failed.append(p)
    series.sample(peers, time.time())
    last = next((h for h in reversed(history) if h["loss"] is not None), None)
    last_eval = next((h for h in reversed(history) if h["eval_loss"] is not None), None)
    m = cfg.model
    return {
        "api": API,
        "generated_at": time.time(),
        "run": {
            "run_id": run.run_id, "coordinator": run.coordinator, "join_address": run.join_address,
            "status_url": run.status_url, "finished": run.finished, "started_at": run.started_at,
            "security": "insecure" if cfg.coordinator.insecure else "mtls", "admission": cfg.admission.mode,
            "outer_step": rounds.committed, "outer_steps_total": cfg.diloco.outer_steps,
            "inner_steps_per_outer": cfg.diloco.inner_steps, "epoch": rounds.epoch,
            "inner_step": min((p["inner_step"] for p in training), default=0),
            "model": {"parameters": model_parameters(m), "family": m.family, "d_model": m.d_model,
                      "n_layers": m.n_layers, "n_heads": m.n_heads, "vocab_size": m.vocab_size, "seq_len": m.seq_len},
            "stages": stages, "replicas": replicas,
            "tokens_trained": tokens,
            "tokens_per_s": sum(p["tokens_per_s"] for p in training if not p["tasklet"] or p["tasklet"]["stage"] == 0),
            "loss": last["loss"] if last else None, "eval_loss": last_eval["eval_loss"] if last_eval else None,
            "eval_perplexity": perplexity(last_eval["eval_loss"]) if last_eval else None,
            "data": {"source": cfg.data.source, **rounds.data.summary(rounds.committed, run.samples or None)},
            "loss_floor": floor,
            "compute_utilization": compute / (compute + sync) if compute + sync > 0 else None,
            "last_outer_at": history[-1]["t"] if history else None,
            "window_s": history[-1].get("window_s") if history else None,
            "horizon": horizons,
            "last_allreduce_s": history[-1]["outer_s"] if history else None,
            "waiting_reason": waiting_reason(cfg, rounds, live, run.finished, peers, failed, by_id),
            "model_export": model_export(cfg, run.checkpoint_version),
        },
        "grid": {
            "stages": stages, "replicas": replicas,
            "cells": grid_cells(current, by_id) if current else [],
        },
        "round": round_json(current) if current else None,
        "history": step_rates(history[-501:], cfg)[-500:],
        "rolled_back": step_rates(rolled_back[-50:], cfg),
        "failed_rounds": [vars(o) if not isinstance(o, dict) else o for o in rounds.outcomes[-50:]],
        "series": list(series.samples),
        "peers": (shown := inline_peers(peers)),
        "peers_summary": peers_summary(peers, len(shown), by_state),
        # a finished run keeps showing the links its peers measured last
        "links": links_state(links, peers),
        "events": list(events)[-200:],
        "config": {"heartbeat_timeout_s": cfg.membership.heartbeat_timeout_s, "heartbeat_s": cfg.membership.heartbeat_s,
                   "outer_codec": cfg.sync.codec, "inner_steps": cfg.diloco.inner_steps,
                   "fragments": cfg.sync.fragments},
        "coordinator": health or Health().section({}, len(views)),
        "_peers": peers,
    }


def grid_cells(current: Round, by_id: Mapping[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The round's tasklets, each with its peer's state now (LOST: no row). Like the peer rows, the cells are kept
    between builds and set in place: a snapshot still being encoded may show the newer states."""
    cells = _CELLS([current])[0]
    for cell in cells:
        row = by_id.get(cell["peer"])
        cell["state"] = row["state"] if row is not None else PeerState.LOST
    return cells


def links_state(reports: Mapping[str, LinkReport], live: list[dict[str, Any]]) -> dict[str, Any]:
    """Measured links among ``live`` peers (rows of peers not lost and not gone are taken), ordered by tasklet (stage,
    replica) so pipelines sit together; the first ``LINKS_PEERS`` of them (a thousand peers would make two matrices of
    a million cells)."""
    live = [p for p in live if p["state"] not in (PeerState.LOST, PeerState.LEFT)] if reports else []
    if not live:  # (before the sort of every live peer)
        return {"peers": [], "rtt_ms": [], "bandwidth_mbps": []}
    ids = [p["id"] for p in sorted(live, key=lambda p: (p["tasklet"] is None, (p["tasklet"] or {}).get("stage", 0),
                                                         (p["tasklet"] or {}).get("replica", 0), p["id"]))]
    ids = ids[:LINKS_PEERS]

    def cell(a: str, b: str, name: str) -> float | None:
        stat = reports[a].links.get(b) if a in reports else None
        value = getattr(stat, name) if stat is not None else None
        return round(value, 3) if value is not None else None

    return {"peers": ids,
            "rtt_ms": [[None if a == b else cell(a, b, "rtt_ms") for b in ids] for a in ids],
            "bandwidth_mbps": [[None if a == b else cell(a, b, "bandwidth_mbps") for b in ids] for a in ids]}


def waiting_reason(cfg: RunConfig, rounds: Rounds, live: list[dict[str, Any]], finished: bool,
                   peers: Sequence[dict[str, Any]] = (), failed: list[dict[str, Any]] | None = None,
                   by_id: Mapping[str, dict[str, Any]] | None = None) -> str:
    """What the run waits for, in one line ('' when it is simply training); a peer that stopped on an error it
    cannot heal comes first, while the run waits (it is the likeliest reason). ``failed`` (the rows of failed peers)
    and ``by_id`` (every row by peer id): if the caller has them already."""
    if finished:
        return ""
    why = _waiting(cfg, rounds, live, by_id)
    failed = [p for p in peers if p["state"] == "failed"] if failed is None else failed
    current = rounds.pending()
    stuck = current is not None and any(m.peer_id == p["id"] for p in failed for m in current.members)
    if failed and (why or stuck):
        p = failed[-1]
        return f"peer {p['short_id']} stopped on an error: {p['error']}" + (f"; {why}" if why else "")
    return why


def _waiting(cfg: RunConfig, rounds: Rounds, live: list[dict[str, Any]],
             by_id: Mapping[str, dict[str, Any]] | None = None) -> str:
    need = max(cfg.membership.min_peers, cfg.pipeline.stages)
    current = rounds.pending()
    if current is None:
        if len(live) < need and (not rounds.rounds or rounds.outcomes and rounds.outcomes[-1].step > rounds.committed):
            return f"waiting for peers: {len(live)} of {need} needed to start"
        return "deciding the next round" if rounds.rounds else ""
    by_id = {p["id"]: p for p in live} if by_id is None else by_id
    members = [p if (p := by_id.get(m.peer_id)) is not None and p["state"] not in _SILENT else None
               for m in current.members]  # (a member with no live row: lost)
    syncing = [p for p in members if p and p["state"] == "syncing"]
    behind = [p for p in members if p is None or p["state"] != "syncing"]
    if syncing and behind:
        lost = sum(1 for p in members if p is None)
        extra = f" ({lost} lost)" if lost else ""
        named = [_who(p, cfg) for p in behind if p is not None][:3]
        since = f", decided {time.time() - current.decided_at:.0f} s ago" if current.decided_at else ""
        return (f"outer step {current.step}: {len(syncing)} of {len(members)} members are ready; waiting for "
                f"{len(behind)}{extra}{': ' + ', '.join(named) if named else ''}"
                f"{' and more' if len(behind) - lost > len(named) else ''}{since}")
    return ""


def _who(p: dict[str, Any], cfg: RunConfig) -> str:
    """A member the round waits for, as the page names it: its id, what it does, and whether it went silent."""
    doing = f"inner step {p['inner_step']}" if p["state"] == "training" else p["state"]
    silent = p.get("last_seen_s") or 0.0
    quiet = f", silent for {silent:.0f} s" if silent > 2 * cfg.membership.heartbeat_s else ""
    return f"{p['short_id']} ({doing}{quiet})"
