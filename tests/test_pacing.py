"""Paced sends (``sync.pace``, :mod:`potluck.peer.reduce.pacing`): the shared virtual clock's arithmetic on a fake clock,
the waits it asks for, the config's refusals, and a real overlapped, streamed swarm whose outer steps are paced."""

from __future__ import annotations

import re
import threading

import pytest
from test_progress import Clock  # (a fake clock at 1000.0 s)

from potluck.peer.reduce.pacing import Pacer, Pacing, pace_seconds, paced, round_bytes
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig


class Stopping(threading.Event):
    """Records each wait instead of sleeping, and moves the fake clock on by it."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock, self.waits = clock, []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        self.clock.now += timeout or 0.0
        return False


class Chunk:
    def __init__(self, n: int) -> None:
        self.n = n

    def ByteSize(self) -> int:  # noqa: N802
        return self.n


def test_chunks_go_at_the_rate_shared_by_every_stream() -> None:
    clock = Clock()
    pacer = Pacer(1000.0, threading.Event(), clock)
    assert pacer.slot(500) == 1000.0  # the first goes at once
    assert pacer.slot(500) == 1000.5  # the next when the first's 500 bytes have had their half second
    assert pacer.slot(250) == 1001.0  # (another stream's chunk: the same clock)
    clock.now = 1005.0  # idle since: no credit saved up beyond now, the next goes at once
    assert pacer.slot(1000) == 1005.0 and pacer.slot(1) == 1006.0


def test_eta_counts_the_bytes_booked_before_and_the_new_ones() -> None:
    clock = Clock()
    pacer = Pacer(1000.0, threading.Event(), clock)
    assert pacer.eta(500) == 0.5  # (nothing booked: its own half second)
    pacer.slot(2000)  # booked until 1002.0
    clock.now = 1000.5
    assert pacer.eta(500) == 2.0  # 1.5 s of the bytes before it, then its own 0.5 s
    clock.now = 1010.0
    assert pacer.eta(250) == 0.25 and pacer.slot(1) == 1010.0  # (asking books nothing)


def test_paced_waits_out_each_chunks_turn_and_counts_the_wait() -> None:
    clock = Clock()
    stopping = Stopping(clock)
    pacer = Pacer(1000.0, stopping, clock)
    sent = list(paced(iter([Chunk(200), Chunk(200), Chunk(600)]), pacer))
    assert [c.n for c in sent] == [200, 200, 600]
    assert stopping.waits == pytest.approx([0.2, 0.2]) and pacer.waited_s == pytest.approx(0.4)
    assert [c.n for c in paced(iter([Chunk(5)]), None)] == [5]  # no pacer: as they come


def test_the_pace_is_a_share_of_the_median_phase_and_never_past_half_the_rpc_timeout() -> None:
    assert pace_seconds(0.5, [4.0, 1.0, 5.0], 30.0) == 2.0  # (the median phase, 4 s: not the short one)
    assert pace_seconds(0.0, [4.0], 30.0) == 0.0 and pace_seconds(0.5, [], 30.0) == 0.0
    # phases 4x what the cap guards (a stream paced past the RPC timeout would be cut off): held to half of it
    assert pace_seconds(0.5, [4 * 30.0 / 0.5] * 3, 30.0) == 15.0


def test_pacing_holds_one_clock_across_rounds_and_none_while_unpaced() -> None:
    pacing = Pacing(threading.Event(), chunk_bytes=1 << 20)
    pacing.begin(1000.0, 0.0)
    assert pacing.round is None and pacing.clock is None and pacing.contribution_chunk() == 1 << 20
    assert pacing.held_back() == (0.0, 0.0)
    pacing.begin(2_000_000.0, 2.0)
    clock = pacing.clock
    assert pacing.round is clock and clock is not None and clock.rate == 1_000_000.0
    assert pacing.contribution_chunk() == 50_000  # 50 ms of the rate
    pacing.end()
    assert pacing.round is None and pacing.clock is clock  # (kept: what is served for audits goes at its pace)
    pacing.begin(1000.0, 10.0)
    assert pacing.clock is clock and clock.rate == 100.0 and pacing.contribution_chunk() == 4096  # (the floor)


def reference_round_bytes(numel: int, owners: list[bool], me: int, bpe: float, share: float) -> float:
    """Counted message by message: each member's slice of each shard to its owner, each owner's result to every
    other member, and each of its auditors (every other member in turn, ``share`` of them a step) fetching the
    inputs of everyone but itself."""
    shard = numel * bpe / sum(owners)
    members = len(owners)
    sent = sum(shard for j, own in enumerate(owners) if own and j != me)  # my slices of the others' shards
    if owners[me]:
        sent += shard * (members - 1)  # my result to each other member
        audits = [shard * (members - 1) for auditor in range(members) if auditor != me]  # (an auditor's own slice
        sent += share * sum(audits) / len(audits)  # is not fetched), share of an audit a step, any other auditor
    return sent


@pytest.mark.parametrize("owners,me", [
    ([True] * 4, 0),  # the usual: every member owns a shard
    ([True, True, True, False], 3),  # a fresh key on probation: it owns none
    ([True, True, False, False, False, False, False, False], 1),  # a big stage: more members than owners
    ([True] * 2, 1),
])
def test_a_paced_round_budgets_its_slices_its_results_and_the_evidence_auditors_fetch(owners, me) -> None:  # type: ignore[no-untyped-def]
    for share in (0.0, 1.25):
        want = reference_round_bytes(1000, owners, me, 1.0, share)
        got = round_bytes(1000, len(owners), sum(owners), 1.0, owns=owners[me], evidence_share=share)
        assert got == pytest.approx(want), (owners, me, share)
    # 4 members, 1,000 int8 values, every one an owner: 3/4 of the vector out as slices, 3/4 as results, and
    # 1.25 audits a step of the 3/4 of its shard's inputs an auditor lacks
    assert round_bytes(1000, 4, 4, 1.0, owns=True, evidence_share=1.25) == 750 + 750 + 937.5
    assert round_bytes(1000, 4, 3, 1.0, owns=False, evidence_share=1.25) == 1000.0  # (probation: all slices out)
    assert round_bytes(1000, 1, 1, 0.5, owns=True, evidence_share=0.0) == 0.0  # (alone: nothing to send)


def test_a_pacer_needs_a_positive_rate() -> None:
    with pytest.raises(ValueError, match="positive rate"):
        Pacer(0.0, threading.Event())


@pytest.mark.parametrize(("over", "match"), [
    ({"sync.pace": 0.3}, "needs diloco.overlap = true"),
    ({"sync.pace": 0.5, "diloco.overlap": True}, r"must be under sync.deadline_factor = 0.5"),
    ({"sync.pace": 1.0, "diloco.overlap": True}, "pace"),
])
def test_a_pace_the_round_cannot_keep_is_refused(over: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        apply_overrides(RunConfig(), over)
    apply_overrides(RunConfig(), {"sync.pace": 0.3, "diloco.overlap": True})  # (this one is fine)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_overlapped_streamed_swarm_paces_its_outer_steps(swarm) -> None:  # type: ignore[no-untyped-def]
    """Three peers, one at half speed, overlapped outer steps of 2 fragments each paced over 0.3 of the inner phase:
    every step commits with every member, the same state everywhere, and the sends were held back to the pace. The
    model is big enough that a paced contribution goes in several messages where an unpaced one would go in one,
    and every result is audited: paced sends are nothing an auditor could take for a lie."""
    from test_swarm import hashes_agree

    swarm.start_coordinator({"diloco.outer_steps": 4, "diloco.inner_steps": 10, "membership.min_peers": 3,
                             "diloco.overlap": True, "sync.fragments": 2, "sync.pace": 0.3, "diloco.rounds": "fixed",
                             "model.d_model": 128, "model.n_heads": 4, "model.n_layers": 2, "sync.audit_fraction": 1.0})
    swarm.start_peer(env={"POTLUCK_FAULTS": "inner.step@*:slow=2"}, name="slow")
    for _ in range(2):
        swarm.start_peer()
    state = swarm.wait_state(lambda s: s["run"]["finished"] and s["history"] and len(s["history"][-1]["state_hashes"]) == 3,
                             240, "the run to finish")
    hist = state["history"]
    assert [h["step"] for h in hist] == [1, 2, 3, 4] and hashes_agree(state) == []
    assert all(h["contributors"] == 3 and not h["dropped"] for h in hist), hist
    logs = "".join((swarm.logs / f"peer-{i}.log").read_text() for i in range(3))
    held = [float(m) for m in re.findall(r"paced at [0-9]+ kB/s: sends held back ([0-9.]+) s", logs)]
    assert held and max(held) > 0, "no outer step was paced"
    assert re.search(r"audit of shard \d+ of step \d+ .*: ok", logs), "no result was audited"
    assert "proven" not in (swarm.logs / "coordinator.log").read_text()
