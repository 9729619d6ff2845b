"""The run's history: one entry per committed outer step, folded from what the members reported.

Every heartbeat carries the peer's last few :class:`~potluck.protos.wire.records.StepReport`\\ s, so an
entry fills in from the members' own accounts of the step -- also for steps committed while the
coordinator was away. :func:`fold` is pure and idempotent: folding the same reports twice changes
nothing, and a member counts once per step however often it repeats itself.

Only a member of the round that produced a step, in that round's epoch, speaks for it. When a
rollback undoes steps, :func:`roll_back` moves their entries out of the history (into the journal's
``rolled_back`` list, marked), so the history holds exactly one outcome per step.

What a fold costs does not grow with the run's history: only the newest ``KEEP_DETAIL`` entries
still take reports (older ones are final), and a record that did not change need not be folded
again (``memo`` remembers the reports already folded, so the coordinator hands over the records
that changed since its last tick). Per-member maps (``state_hashes``, ``stages``, ``tasklets``)
are kept for steps of at most ``MAP_MEMBERS`` members; every entry has ``hash_counts``, the same
story in a size that does not grow with the swarm.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from potluck.protos.wire.records import PeerRecord, Round, StepReport

KEEP_ENTRIES = 2000
KEEP_DETAIL = 16  # entries that keep each member's report (older ones only need their totals)
MAP_MEMBERS = 64  # steps of more members keep hash_counts, not one map entry per member
AGGREGATE_S = 1.0  # an entry's totals are made again at most this often while its members' reports keep coming
KINDS = ("activations", "gradients", "outer")
Memo = dict[tuple[str, int], StepReport]  # (peer, step) -> the report last folded in
Early = dict[tuple[str, int], tuple[StepReport, "Round | None", int, dict[str, Any]]]  # ... -> (report, round, params, row)
EARLY_STEPS = 2  # reports of the next this many steps after the committed one are made into entry rows as they come
# what no total is made of: a peer's older reports drop their ``included`` lists (its record must stay small), and each
# such change made the step's totals again (at 1,000 members, once a second for a heartbeat's lag after each step)
UNUSED = {"included", "flags", "samples"}
_DEFAULTS = StepReport(step=0).model_dump(mode="json", exclude=UNUSED)


def new_entry(step: int, rnd: Round | None, now: float | None = None) -> dict[str, Any]:
    return {
        "step": step, "t": time.time() if now is None else now, "epoch": rnd.epoch if rnd else 0,
        "members": len(rnd.members) if rnd else 0, "loss": None, "eval_loss": None, "outer_s": None, "allreduce_s": None,
        "state_hashes": {}, "stages": {}, "tasklets": {}, "hash_counts": {}, "dropped": [], "clipped": [], "rejected": [],
        "contributors": None, "samples": None, "window_s": None, "inner_steps": {},
        "bytes": dict.fromkeys(KINDS, 0), "bytes_fp32": dict.fromkeys(KINDS, 0), "_peers": {},
    }


def fold(history: list[dict[str, Any]], records: Iterable[PeerRecord], round_at: Callable[[int], Round | None],
         committed: int, now: float | None = None, memo: Memo | None = None,
         everyone: Iterable[PeerRecord] | None = None, dirty: set[int] | None = None,
         early: Early | None = None) -> tuple[list[dict[str, Any]], bool]:
    """The history with the members' step reports folded in; also whether an entry was added.

    ``memo`` (the caller's, kept across calls) skips reports already folded: with it, a caller may pass
    only the records that changed since its last call, and ``everyone`` (all current records), which
    are folded instead when an entry is added -- a report that came before its step committed rides
    on a record that may never change again (a goodbye). With ``dirty`` (the caller's), the steps whose
    reports changed are added to it and their totals left to the caller (:func:`aggregate`), who makes
    those of an entry about to leave the detail window before it does. ``early`` (the caller's) keeps what a
    report of a step not committed yet will add to its entry, made as the report comes: a commit's fold then
    takes it as it is (at 1,000 members it made the entry of 1,000 reports in one tick: 10-50 ms of CPU)."""
    last = history[-1]["step"] if history else 0
    added, records = committed > last, list(records)
    pairs: Iterable[tuple[PeerRecord, StepReport]] = ((rec, report) for rec in records for report in rec.recent)
    if added:
        fresh = range(max(1, last + 1), committed + 1)
        history = history + [new_entry(step, round_at(step), now) for step in fresh]
        if everyone is not None:  # (everyone's reports of the steps just committed, not all 16 of each: a commit at
            mine = {rec.peer_id for rec in records}  # 1,000 peers looked at 16,000 reports, 60 ms of one tick)
            pairs = [*pairs, *((rec, report) for rec in everyone if rec.peer_id not in mine
                               for report in rec.recent if report.step in fresh)]
    by_step = {h["step"]: h for h in history[-KEEP_DETAIL:] if "_peers" in h}
    sizes: dict[tuple[int, int, int], int] = {}  # (round step, stage, group) -> members of that group
    touched: set[int] = set()
    for rec, report in pairs:
        entry, key = by_step.get(report.step), (rec.peer_id, report.step)
        if entry is None or report.step > committed:
            if early is not None and committed < report.step <= committed + EARLY_STEPS:
                hit = early.get(key)
                if hit is None or hit[0].__dict__ != report.__dict__ or hit[2] != rec.parameters:
                    rnd = round_at(report.step)
                    if (row := _row(rec, report, rnd, sizes)) is not None:
                        early[key] = (report, rnd, rec.parameters, row)
            continue
        seen = memo.get(key) if memo is not None else None
        if seen is not None and rec.peer_id in entry["_peers"] and seen.__dict__ == report.__dict__:
            continue  # (the fields alone, compared in C: a model's == costs several times more)
        rnd = round_at(report.step)
        hit = early.pop(key, None) if early is not None else None
        if hit is not None and hit[1] is rnd and hit[2] == rec.parameters and hit[0].__dict__ == report.__dict__:
            row = hit[3]  # (made as the report came, of the same report, round and parameters)
        elif (row := _row(rec, report, rnd, sizes)) is None:
            continue
        if memo is not None:
            memo[key] = report
        if entry["_peers"].get(rec.peer_id) == row:
            continue  # (a report changed where no total looks: its entry's totals need not be made again)
        entry["_peers"][rec.peer_id] = row
        touched.add(report.step)
    if dirty is None:
        aggregate(by_step, touched)
    else:
        dirty |= touched
    if added:
        history = history[-KEEP_ENTRIES:]
        for h in history[-KEEP_DETAIL - (committed - last):-KEEP_DETAIL]:  # the entries that just left the window
            h.pop("_peers", None)
        if early is not None:  # (the reports of the steps just committed were taken; any left are of no member)
            for k in [k for k in early if k[1] <= committed]:
                del early[k]
        if memo is not None:
            oldest = history[-KEEP_DETAIL]["step"] if len(history) >= KEEP_DETAIL else 0
            for key in [k for k in memo if k[1] < oldest]:
                del memo[key]
    return history, added


def _row(rec: PeerRecord, report: StepReport, rnd: Round | None, sizes: dict[tuple[int, int, int], int],
         ) -> dict[str, Any] | None:
    """What ``report`` adds to its step's entry; None if its author is no member of the round that made the
    step, in its epoch (only a member speaks for a step)."""
    member = rnd.member(rec.peer_id) if rnd is not None and report.epoch == rnd.epoch else None
    if rnd is None or member is None:
        return None
    size = sizes.get((rnd.step, member.stage, member.group))
    if size is None:  # (its averaging group's members: the stage's, without sync.group_size)
        size = sizes[(rnd.step, member.stage, member.group)] = len(rnd.group_members(member.stage, member.group))
    return {**report.model_dump(mode="json", exclude=UNUSED), "parameters": rec.parameters, "n": size}


class Folder:
    """:func:`fold` as the coordinator's loop calls it: with a memo and the records that changed since the last
    fold.

    * A commit's fold (every member's report of the step: 1,000 at 1,000 peers, 30-50 ms) is left to the next
      tick when ``waits("fold")`` says so (the loop's :meth:`~potluck.coordinator.health.Health.waits`: this
      tick is long already, for a few ticks running at most): with the step's judging and journal write it made
      the tick's p99. The records that changed meanwhile are folded then.
    * An entry's totals are made again from all its members' reports (:func:`aggregate`: 5-20 ms at 1,000
      members) at most every ``AGGREGATE_S`` while its reports keep coming, at once for a new entry and when
      its reports stop, and never in a long tick (``waits("aggregate")``). Made on every tick that brought a
      member's report of a step, they were most of an ordinary tick's p99 at 1,000 peers (20-60 ms of CPU).
    """

    def __init__(self) -> None:
        self.memo: Memo = {}
        self.early: Early = {}  # rows of reports of steps not committed yet (see fold)
        self.dirty: set[int] = set()  # steps with reports folded in since their entry's totals were last made
        self._unfolded: list[PeerRecord] = []
        self._aggregated = -float("inf")

    def fold(self, history: list[dict[str, Any]], changed: Iterable[PeerRecord], round_at: Callable[[int], Round | None],
             committed: int, everyone: list[PeerRecord], waits: Callable[[str], bool] = lambda what: False,
             ) -> tuple[list[dict[str, Any]], bool]:
        pending, new = [*self._unfolded, *changed], committed - (history[-1]["step"] if history else 0)
        if new > 0 and waits("fold"):  # (asked only when a commit is due)
            self._unfolded = pending
            return history, False
        self._unfolded, window = [], history[-KEEP_DETAIL:]
        touched: set[int] = set()
        if new > 0 and self.dirty:  # (the reports of the entries about to leave the window go: their totals first)
            leaving = {h["step"] for h in window[:max(0, len(window) + new - KEEP_DETAIL)]}
            aggregate({h["step"]: h for h in window}, self.dirty & leaving, self.dirty)
        history, added = fold(history, pending, round_at, committed, memo=self.memo, everyone=everyone, dirty=touched,
                               early=self.early)
        self.dirty |= touched
        now = time.monotonic()  # (not touched: no report changed since the last fold, so the totals are due)
        if self.dirty and (added or not touched or now - self._aggregated >= AGGREGATE_S) and not waits("aggregate"):
            self.flush(history)
            self._aggregated = now
        return history, added

    def flush(self, history: list[dict[str, Any]]) -> None:
        """Make every entry's totals that waits for it (its reports changed since)."""
        aggregate({h["step"]: h for h in history[-KEEP_DETAIL:] if "_peers" in h}, set(self.dirty), self.dirty)
        self.dirty.clear()


def aggregate(by_step: dict[int, dict[str, Any]], steps: Iterable[int], dirty: set[int] | None = None) -> None:
    """Make the totals of the entries of ``steps`` found in ``by_step`` again; they are then off ``dirty``."""
    for step in steps:
        if (entry := by_step.get(step)) is not None:
            _aggregate(entry)
        if dirty is not None:
            dirty.discard(step)


def _aggregate(entry: dict[str, Any]) -> None:
    """Recompute an entry's totals from its members' reports (so repeating a report is harmless)."""
    peers = {pid: {**_DEFAULTS, **r} for pid, r in entry["_peers"].items()}  # (reports journaled by older versions)
    counts: dict[str, dict[str, int]] = {}
    for r in peers.values():
        if r["state_hash"]:
            by_hash = counts.setdefault(str(r["stage"]), {})
            by_hash[r["state_hash"]] = by_hash.get(r["state_hash"], 0) + 1
    entry["hash_counts"] = counts
    small = max(entry.get("members") or 0, len(peers)) <= MAP_MEMBERS
    entry["state_hashes"] = {pid: r["state_hash"] for pid, r in peers.items()} if small else {}
    entry["stages"] = {pid: r["stage"] for pid, r in peers.items()} if small else {}
    entry["tasklets"] = {pid: [r["stage"], r["replica"]] for pid, r in peers.items()} if small else {}
    losses = [r["loss"] for r in peers.values() if r["loss"] is not None]
    entry["loss"] = math.fsum(losses) / len(losses) if losses else None  # (exact: the same whatever order they came in)
    entry["eval_loss"] = next((r["eval_loss"] for r in peers.values() if r["eval_loss"] is not None), None)
    entry["outer_s"] = max((r["outer_s"] for r in peers.values()), default=None)
    entry["allreduce_s"] = max((r["allreduce_s"] for r in peers.values()), default=None)
    for kind in ("dropped", "clipped", "rejected"):
        entry[kind] = sorted({d for r in peers.values() for d in r[kind]})
    entry["contributors"] = min((r["contributors"] for r in peers.values()), default=None)
    # the work in the step: what each stage-0 member's contribution was trained on, if it counted (None: reports from
    # before rounds were windows, each of whose replicas trained its whole share: the page counts those)
    worked = sum(r["trained"] for pid, r in peers.items() if r["stage"] == 0 and pid not in entry["rejected"])
    entry["samples"] = worked or None
    entry["window_s"] = max((r["phase_s"] for r in peers.values() if r["phase_s"]), default=None)
    entry["inner_steps"] = {pid: r["inner_steps"] for pid, r in peers.items()} if small else {}
    entry["bytes"] = dict.fromkeys(KINDS, 0)
    entry["bytes_fp32"] = dict.fromkeys(KINDS, 0)
    by_stage: dict[str, dict[str, Any]] = {}
    for r in peers.values():
        entry["bytes"]["outer"] += r["outer_bytes"]
        n, params = r.get("n", 1), r.get("parameters", 0)
        if n > 1:  # what a ring all-reduce of fp32 would have sent from this member
            entry["bytes_fp32"]["outer"] += int(2 * (n - 1) / n * 4 * params)
        if not r["pipe"]:
            continue
        per = by_stage.setdefault(str(r["stage"]), {"activations": 0, "activations_fp32": 0, "gradients": 0,
                                                    "gradients_fp32": 0, "losses": []})
        if r["loss"] is not None:
            per["losses"].append(r["loss"])
        for kind in ("activations", "gradients"):
            sent, fp32 = int(r["pipe"].get(kind, 0)), int(r["pipe"].get(kind + "_fp32", 0))
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


def journaled(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry as the journal keeps it: the members' reports of a step of more than ``MAP_MEMBERS`` members
    stay in memory only (1,000 members would make every journal write megabytes); after a restart that
    entry keeps the totals it had."""
    if "_peers" in entry and (entry.get("members") or 0) > MAP_MEMBERS:
        return {k: v for k, v in entry.items() if k != "_peers"}
    return entry
