"""Realistic status snapshots (the shape ``Coordinator._build_state`` returns) without a swarm.

    make_state(peers=1000, stages=4, replicas=8, steps=120, hole=True)

Peers fill the grid first (stage-major), the rest wait, a few are lost or gone; history, series,
events and links look like a run that has trained ``steps`` outer steps. A run of 10 steps or more
has lived through one failed round: two steps were rolled back and re-run in epoch 1. Owners clip
or reject a member's update now and then, and the peers' ``clipped``/``rejected`` counts agree with
the history. Per-member maps (``state_hashes``, ``stages``, ``tasklets``) fill only the newest
``detail`` entries of steps of at most 64 members (the coordinator's rule: no step of more), and
every entry has ``hash_counts``. Past 200 peers, ``peers`` holds the most telling 200 and ``_peers``
all of them, as the coordinator's snapshot does (``/api/v1/peers`` pages through ``_peers``).
Deterministic per seed.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

from potluck.coordinator.status.horizons import horizon
from potluck.coordinator.status.snapshot import inline_peers, peers_summary

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
KINDS = ("activations", "gradients", "outer")


def peer_id(rng: random.Random) -> str:
    return "12D3KooW" + "".join(rng.choice(_B58) for _ in range(44))


def make_state(
    peers: int = 8,
    stages: int = 1,
    replicas: int | None = None,
    steps: int = 20,
    *,
    seed: int = 0,
    hole: bool = False,
    finished: bool = False,
    links: bool = False,
    waiting_reason: str = "",
    now: float | None = None,
    heartbeat_timeout_s: float = 10.0,
    parameters: int = 1_234_567,
    inner_steps: int = 30,
    outer_steps: int | None = None,
    security: str = "mtls",
    admission: str = "open",
    detail: int = 16,
) -> dict[str, Any]:
    rng = random.Random(seed)
    aux = random.Random(seed + 1)  # for the fields added later: the figures above stay what they were
    outer_steps = max(100, steps) if outer_steps is None else outer_steps
    now = time.time() if now is None else now
    started = now - 60.0 - 5.0 * steps
    if replicas is None:
        replicas = max(1, peers * 9 // 10 // stages)
    floor = 2.9
    ids = [peer_id(rng) for _ in range(peers)]

    places = [(s, r) for s in range(stages) for r in range(replicas)]
    if hole and places:
        places.pop(len(places) // 2 if len(places) > 1 else 0)
    table: list[dict[str, Any]] = []
    cells: list[dict[str, Any]] = []
    seat = iter(places)
    for i, pid in enumerate(ids):
        place = next(seat, None) if i % 17 != 5 else None
        if place is not None:
            state = "syncing" if i % 7 == 3 else "recovering" if i % 23 == 11 else "training"
        else:
            state = ("waiting", "joining", "lost", "left", "waiting", "finished")[i % 6]
        if place is not None and i % 29 == 9:
            state = "lost"
        seen = round(rng.uniform(0.1, 2.0) if state != "lost" else heartbeat_timeout_s + rng.uniform(1, 60), 2)
        gpu = i % 3 != 2
        sent = {"outer": rng.randint(10**6, 10**9), "probe": rng.randint(10**3, 10**5)}
        if stages > 1:
            sent.update(activations=rng.randint(10**6, 10**9), gradients=rng.randint(10**6, 10**9))
        training = state in ("training", "syncing")
        table.append({
            "id": pid, "short_id": pid[-6:], "name": ("" if i % 4 == 1 else f"volunteer-{i}"), "state": state,
            "address": f"10.0.{i // 250}.{i % 250 + 1}:{40000 + i}",
            "device": "cuda" if gpu else "cpu",
            "device_name": ("NVIDIA H100 80GB HBM3" if i % 2 else "NVIDIA GeForce RTX 4090") if gpu else "cpu x16",
            "memory_gb": (79.1 if i % 2 else 23.6) if gpu else 0.0,
            "tasklet": {"stage": place[0], "replica": place[1]} if place is not None else None,
            "version": steps if training else max(0, steps - 1 - i % 3),
            "inner_step": rng.randint(0, inner_steps - 1) if state == "training" else 0,
            "loss": round(floor + 7.5 * math.exp(-steps / 25) + rng.uniform(0, 0.2), 4) if training else None,
            "eval_loss": round(floor + 7.6 * math.exp(-steps / 25), 4) if training else None,
            "tokens_per_s": round(rng.uniform(800, 25000), 1) if state == "training" else 0.0,
            "tokens_total": rng.randint(10**5, 10**8),
            "bytes_sent": sent,
            "bytes_received": {k: int(v * rng.uniform(0.9, 1.1)) for k, v in sent.items()},
            "send_bps": float(sum(sent.values()) // 3600), "peak_send_bps": float(sum(v // 60 for v in sent.values())),
            "peak_send_kinds": {k: v // 60 for k, v in sent.items()},
            "last_seen_s": seen, "software": "potluck 0.1.0", "state_hash": f"{rng.getrandbits(64):016x}",
            "compute_s": round(rng.uniform(100, 1000), 2), "sync_s": round(rng.uniform(5, 60), 2), "hidden_s": 0.0, "relayed": False, "error": "",
            "round_steps": rng.randint(1, 50), "step_s": round(rng.uniform(0.05, 2.0), 3),
            "window_s": round(rng.uniform(5, 60), 2) if rng.random() < 0.7 else None,
            "work_share": round(rng.uniform(0.01, 1.0), 4) if rng.random() < 0.8 else None,
            "too_slow": "this peer is too slow for the round: ..." if rng.random() < 0.05 else "",
            "place_in_s": None,  # (set below, from the run's horizon)
        })
        if place is not None:
            cells.append({"stage": place[0], "replica": place[1], "peer": pid, "state": state})

    if len(table) >= 3 and not any(p["state"] == "lost" for p in table):
        gone = table[-1]  # every fake run has lost someone: pages and tests need one to show
        gone.update(state="lost", last_seen_s=round(heartbeat_timeout_s + 12.5, 2), tokens_per_s=0.0, loss=None)
        for c in cells:
            if c["peer"] == gone["id"]:
                c["state"] = "lost"

    n_members = max(1, replicas)
    # one failed round in a run long enough: steps base+1 and base+2 were undone and re-run in epoch 1
    base = steps // 2 - 2 if steps >= 10 else None
    history = []
    for v in range(1, steps + 1):
        outer = int(2 * (n_members - 1) / n_members * parameters / stages) * n_members if n_members > 1 else 0
        act = rng.randint(10**6, 10**7) if stages > 1 else 0
        grad = rng.randint(10**6, 10**7) if stages > 1 else 0
        entry = {
            "step": v, "t": started + 60.0 + 5.0 * v, "members": n_members * stages,
            "loss": round(floor + 7.5 * math.exp(-v / 25) + rng.uniform(0, 0.15), 4),
            "eval_loss": round(floor + 7.6 * math.exp(-v / 25), 4) if v % 2 == 0 else None,
            "outer_s": round(rng.uniform(0.2, 3.0), 3),
            "bytes": {"activations": act, "gradients": grad, "outer": outer},
            "bytes_fp32": {"activations": act * 8, "gradients": grad * 4, "outer": outer * 4},
            "tokens": n_members * inner_steps * 16 * 128,
            "tokens_per_s": None if v == 1 else round(n_members * inner_steps * 16 * 128 / rng.uniform(4.0, 6.0), 1),
        }
        epoch = 1 if base is not None and v > base else 0
        history.append(_robust(entry, epoch, cells, stages, aux, detail=v > steps - detail))
    rolled_back, failed_rounds = [], []
    if base is not None:  # the first tries of base+1 and base+2, before the round of base+3 failed
        t_base = started + 60.0 + 5.0 * base
        for v in (base + 1, base + 2):
            undone = _robust({**history[v - 1], "t": t_base + 1.5 * (v - base)}, 0, cells, stages, aux, detail=False)
            rolled_back.append({**undone, "rolled_back": True})
        failed_rounds.append({"step": base + 3, "epoch": 0, "reason": "no member made progress for 60 s",
                              "members": n_members * stages, "rolled_back_to": base, "t": t_base + 4.0})
    flagged = {kind: [pid for h in history for pid in h[kind]] for kind in ("clipped", "rejected")}
    for p in table:
        p["clipped"], p["rejected"] = flagged["clipped"].count(p["id"]), flagged["rejected"].count(p["id"])
    n_live = sum(1 for p in table if p["state"] not in ("lost", "left", "finished"))
    series = [
        {"t": now - 2.0 * k, "tokens_per_s": round(rng.uniform(0.8, 1.0) * 9000 * n_live, 1),
         "live_peers": max(0, n_live - (k % 40 == 0) - (k > 120) * 2)}
        for k in range(150, -1, -1)
    ] if peers else []
    kinds = ("joined", "round", "lost", "checkpoint", "back", "left")
    events = [
        {"t": started + 3.0 * k, "kind": kinds[k % len(kinds)], "peer": ids[k % len(ids)] if ids and k % 6 != 1 else "",
         "message": f"event number {k}"}
        for k in range(min(200, 20 + steps))
    ]
    link_ids = [p["id"] for p in table if p["state"] not in ("lost", "left", "finished")][:12] if links else []
    rtt = [[None if i == j else round(rng.uniform(1, 250), 1) for j in range(len(link_ids))] for i in range(len(link_ids))]
    bw = [[None if i == j else round(rng.uniform(10, 10000), 1) for j in range(len(link_ids))] for i in range(len(link_ids))]
    if len(link_ids) > 2:
        rtt[0][2] = bw[0][2] = None  # not measured yet

    live = [p for p in table if p["state"] not in ("lost", "left", "finished")]
    trainers = [p for p in live if p["state"] == "training"]
    compute = sum(p["compute_s"] for p in table)
    sync = sum(p["sync_s"] for p in table)
    by_id = {p["id"]: p for p in table}
    horizons = horizon(history, steps, outer_steps, now, started, finished)
    for p in table:
        p["place_in_s"] = horizons["next_step_in_s"] if p["tasklet"] is None and p["state"] in ("waiting", "joining") else None
    return {
        "api": "potluck.status/v1",
        "generated_at": now,
        "run": {
            "run_id": f"run-{seed:06x}", "coordinator": "12D3KooWCoordinator" + "x" * 33,
            "join_address": "/ip4/10.0.0.1/tcp/31337/p2p/12D3KooWCoordinator",
            "status_url": "http://10.0.0.1:8080/", "finished": finished, "started_at": started,
            "security": security, "admission": admission,
            "outer_step": outer_steps if finished else steps, "outer_steps_total": outer_steps,
            "inner_steps_per_outer": inner_steps, "epoch": len(failed_rounds),
            "inner_step": min((p["inner_step"] for p in trainers), default=0),
            "model": {"parameters": parameters, "d_model": 256, "n_layers": 4, "n_heads": 4, "vocab_size": 256,
                      "seq_len": 128},
            "stages": stages, "replicas": replicas,
            "tokens_trained": sum(p["tokens_total"] for p in table),
            "tokens_per_s": round(sum(p["tokens_per_s"] for p in trainers), 1),
            "loss": history[-1]["loss"] if history else None,
            "eval_loss": next((h["eval_loss"] for h in reversed(history) if h["eval_loss"] is not None), None),
            "loss_floor": floor,
            "compute_utilization": compute / (compute + sync) if compute + sync else None,
            "last_outer_at": history[-1]["t"] if history else None,
            "window_s": round(rng.uniform(5, 60), 2) if history else None,
            "horizon": horizons,
            "last_allreduce_s": history[-1]["outer_s"] if history else None,
            "waiting_reason": "" if finished else waiting_reason,
            "model_export": {"version": (outer_steps if finished else steps // 5 * 5) or None,
                             "command": "potluck export --journal-dir potluck-run --out model.pt"},
            "eval_perplexity": None,
            "data": {"source": "markov", "samples": 65536, "frontier": steps * replicas * inner_steps * 16,
                     "pool": 16 * inner_steps if failed_rounds else 0, "trained": steps * replicas * inner_steps * 16,
                     "returned": 0, "repeats": 0, "epoch": steps * replicas * inner_steps * 16 / 65536},
        },
        "grid": {"stages": stages, "replicas": replicas, "cells": cells},
        "round": {
            "step": steps + 1, "base_hash": "ab" * 8, "decided_at": now - 3.0, "stages": stages,
            "base_hashes": [f"{s:02x}" * 8 for s in range(stages)] if stages > 1 else [], "epoch": len(failed_rounds),
            "members": [{"peer_id": c["peer"], "address": by_id[c["peer"]]["address"], "stage": c["stage"],
                         "replica": c["replica"]} for c in cells],
        } if cells else None,
        "history": history,
        "rolled_back": rolled_back,
        "failed_rounds": failed_rounds,
        "series": series,
        "peers": (shown := inline_peers(table)),
        "peers_summary": peers_summary(table, len(shown)),
        "links": {"peers": link_ids, "rtt_ms": rtt, "bandwidth_mbps": bw},
        "events": events,
        "config": {"heartbeat_timeout_s": heartbeat_timeout_s, "heartbeat_s": 1.0},
        "coordinator": {
            "ticks": 5000 + 7 * steps, "tick_s": {"p50": 0.004, "p99": 0.021, "max": 0.05, "window": 1000},
            "tick_cpu_s": {"p50": 0.003, "p99": 0.015, "max": 0.04, "window": 1000},
            "decide_s": {"last": 0.12, "max": 0.31, "window": min(16, steps), "count": steps} if steps else
            {"last": None, "max": None, "window": 0, "count": 0},
            "rss_bytes": 180_000_000 + 40_000 * peers, "peers_held": peers,
            "gc": {"frozen": 230_000, "every_s": 30.0, "whole_every_s": 600.0, "collections": steps // 3, "last_s": 0.02 + peers / 10_000,
                   "max_s": 0.03 + peers / 10_000, "freed": 0, "trimmed": 0},
            "reads": {"peers": {"records": n_live, "changed": n_live // 5, "read_s": 0.03},
                      "admission": {"records": n_live, "changed": 0, "read_s": 0.01},
                      "links": {"records": len(link_ids), "changed": 0, "read_s": 0.01}},
        },
        **({"_peers": table} if len(shown) < len(table) else {}),
    }


def _robust(entry: dict[str, Any], epoch: int, cells: list[dict[str, Any]], stages: int, rng: random.Random,
            detail: bool) -> dict[str, Any]:
    """``entry`` with what its members reported besides losses and bytes: epoch, per-member maps (when
    ``detail``), the members an all-reduce went on without, and the updates owners clipped or rejected."""
    ids = [c["peer"] for c in cells]
    v = entry["step"]
    dropped, clipped, rejected = ([rng.choice(ids)] if ids and v % k == 0 else [] for k in (11, 7, 13))
    per_stage = len(cells) // max(1, stages)
    out = {**entry, "epoch": epoch, "dropped": dropped, "clipped": clipped, "rejected": rejected,
           "contributors": max(1, per_stage - len(dropped) - len(rejected)) if cells else None,
           "state_hashes": {}, "stages": {}, "tasklets": {},
           "hash_counts": {str(st): {f"{v:04x}{st:04x}" * 2: sum(c["stage"] == st for c in cells)}
                           for st in sorted({c["stage"] for c in cells})}}
    if detail and len(cells) <= 64:
        out["state_hashes"] = {c["peer"]: f"{v:04x}{c['stage']:04x}" * 2 for c in cells}
        out["stages"] = {c["peer"]: c["stage"] for c in cells}
        out["tasklets"] = {c["peer"]: [c["stage"], c["replica"]] for c in cells}
    if stages > 1:
        b, f = entry["bytes"], entry["bytes_fp32"]
        out["by_stage"] = {str(s): {
            "activations": b["activations"] // stages, "activations_fp32": f["activations"] // stages,
            "gradients": b["gradients"] // stages, "gradients_fp32": f["gradients"] // stages,
            "losses": [entry["loss"]] * per_stage if s == stages - 1 and entry["loss"] is not None else [],
        } for s in range(stages)}
    return out


def fresh_state(now: float | None = None) -> dict[str, Any]:
    """A run that has just started: no peers, no history, nothing measured."""
    s = make_state(peers=0, steps=0, replicas=0, now=now, waiting_reason="waiting for peers: 0 of 2 needed to start")
    s["run"].update(compute_utilization=None, loss_floor=None, tokens_per_s=0.0)
    s["series"] = []
    s["events"] = [{"t": s["generated_at"], "kind": "started", "peer": "", "message": "coordinator 0.1.0 serving run"}]
    return s
