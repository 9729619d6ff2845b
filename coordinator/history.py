"""The run's history: one entry per committed outer step, folded from what the members reported.

Every heartbeat carries the peer's last few :class:`~potluck.protos.wire.records.StepReport`\\ s, so an
entry fills in from the members' own accounts of the step -- also for steps committed while the
coordinator was away. :func:`fold` is pure and idempotent: folding the same reports twice changes
nothing, and a member counts once per step however often it repeats itself.

Only a member of the round that produced a step, in that round's epoch, speaks for it. When a
rollback undoes steps, :func:`roll_back` moves their entries out of the history (into the journal's
``rolled_back`` list, marked), so the history holds exactly one outcome per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from potluck.protos.wire.records import PeerRecord, Round, StepReport

KEEP_ENTRIES = 2000
KEEP_DETAIL = 16  # entries that keep each member's report (older ones only need their totals)
KINDS = ("activations", "gradients", "outer")


def new_entry(step: int, rnd: Round | None, now: float | None = None) -> dict[str, Any]:
    return {
        "step": step, "t": time.time() if now is None else now, "epoch": rnd.epoch if rnd else 0,
        "members": len(rnd.members) if rnd else 0, "loss": None, "eval_loss": None, "outer_s": None, "allreduce_s": None,
        "state_hashes": {}, "stages": {}, "tasklets": {}, "dropped": [], "clipped": [], "rejected": [],
        "contributors": None,
        "bytes": dict.fromkeys(KINDS, 0), "bytes_fp32": dict.fromkeys(KINDS, 0), "_peers": {},
    }


def fold(history: list[dict[str, Any]], records: Iterable[PeerRecord], round_at: Callable[[int], Round | None],
         committed: int, now: float | None = None) -> tuple[list[dict[str, Any]], bool]:
    """The history with the members' step reports folded in; also whether an entry was added."""
    by_step = {h["step"]: h for h in history}
    start = max(1, max(by_step, default=0) + 1)
    added = False
    for step in range(start, committed + 1):
        by_step[step] = new_entry(step, round_at(step), now)
        added = True
    touched: set[int] = set()
    for rec in records:
        for report in rec.recent:
            entry = by_step.get(report.step)
            rnd = round_at(report.step)
            if entry is None or report.step > committed or rnd is None or report.epoch != rnd.epoch:
                continue
            member = rnd.member(rec.peer_id)
            if member is None or "_peers" not in entry:
                continue
            entry["_peers"][rec.peer_id] = {**report.model_dump(mode="json"), "parameters": rec.parameters,
                                            "n": len(rnd.group_members(member.stage, member.group))}
            touched.add(report.step)
    for step in touched:
        _aggregate(by_step[step])
    out = sorted(by_step.values(), key=lambda h: h["step"])[-KEEP_ENTRIES:]
    for h in out[:-KEEP_DETAIL]:
        h.pop("_peers", None)
    return out, added


def _aggregate(entry: dict[str, Any]) -> None:
    """Recompute an entry's totals from its members' reports (so repeating a report is harmless)."""
    peers: dict[str, dict[str, Any]] = entry["_peers"]
    reports = {pid: StepReport.model_validate(p) for pid, p in peers.items()}
    entry["state_hashes"] = {pid: r.state_hash for pid, r in reports.items()}
    entry["stages"] = {pid: r.stage for pid, r in reports.items()}
    entry["tasklets"] = {pid: [r.stage, r.replica] for pid, r in reports.items()}
    losses = [r.loss for r in reports.values() if r.loss is not None]
    entry["loss"] = sum(losses) / len(losses) if losses else None
    entry["eval_loss"] = next((r.eval_loss for r in reports.values() if r.eval_loss is not None), None)
    entry["outer_s"] = max((r.outer_s for r in reports.values()), default=None)
    entry["allreduce_s"] = max((r.allreduce_s for r in reports.values()), default=None)
    entry["dropped"] = sorted({d for r in reports.values() for d in r.dropped})
    entry["clipped"] = sorted({d for r in reports.values() for d in r.clipped})
    entry["rejected"] = sorted({d for r in reports.values() for d in r.rejected})
    entry["contributors"] = min((r.contributors for r in reports.values()), default=None)
    entry["bytes"] = dict.fromkeys(KINDS, 0)
    entry["bytes_fp32"] = dict.fromkeys(KINDS, 0)
    by_stage: dict[str, dict[str, Any]] = {}
    for pid, r in reports.items():
        entry["bytes"]["outer"] += r.outer_bytes
        n, params = peers[pid].get("n", 1), peers[pid].get("parameters", 0)
        if n > 1:  # what a ring all-reduce of fp32 would have sent from this member
            entry["bytes_fp32"]["outer"] += int(2 * (n - 1) / n * 4 * params)
        if not r.pipe:
            continue
        per = by_stage.setdefault(str(r.stage), {"activations": 0, "activations_fp32": 0, "gradients": 0,
                                                 "gradients_fp32": 0, "losses": []})
        if r.loss is not None:
            per["losses"].append(r.loss)
        for kind in ("activations", "gradients"):
            sent, fp32 = int(r.pipe.get(kind, 0)), int(r.pipe.get(kind + "_fp32", 0))
            entry["bytes"][kind] += sent
            entry["bytes_fp32"][kind] += fp32
            per[kind] += sent
            per[kind + "_fp32"] += fp32
    if by_stage:
        entry["by_stage"] = by_stage


def roll_back(history: list[dict[str, Any]], to_version: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split the history at ``to_version``: the entries kept, and those undone (marked rolled back)."""
    kept = [h for h in history if h["step"] <= to_version]
    undone = [{**h, "rolled_back": True} for h in history if h["step"] > to_version]
    for h in undone:
        h.pop("_peers", None)
    return kept, undone


def public(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry as the status page shows it (private bookkeeping dropped)."""
    return {k: v for k, v in entry.items() if not k.startswith("_")}
