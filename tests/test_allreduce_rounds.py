"""A round of the all-reduce is a value: nothing a past round's threads do can change a newer round."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch
from test_allreduce import BASE, Member, random_deltas, round_for, run_all

from potluck.peer.reduce.allreduce import IncompleteRound
from potluck.protos import potluck_pb2 as pb


class GatedPings(Member):
    """A member whose first ping to one peer hangs until ``gate`` opens, then says that peer is at version 1
    (the later ones are answered as usual: one held probe, not a pool of them)."""

    def __init__(self) -> None:
        super().__init__()
        self.slow, self.gate, self.cond = "", threading.Event(), threading.Condition()
        self.held = self.answered = 0

    def _ping(self, peer_id: str, timeout: float) -> pb.PingReply:
        with self.cond:
            hold = peer_id == self.slow and not self.held
            self.held += hold
            self.cond.notify_all()
        if not hold:
            return super()._ping(peer_id, timeout)
        self.gate.wait(60)
        with self.cond:
            self.answered += 1
            self.cond.notify_all()
        return pb.PingReply(peer_id=peer_id, state="training", version=1)


def test_a_probe_of_a_past_round_answering_late_changes_nothing_in_the_next() -> None:
    """A probe of step 1 that answers while step 2 runs, saying the peer is at version 1 (past step 1, and
    just where it should be for step 2), must not make step 2 stop waiting for that peer (issue 31: it went
    into the newer round's "already past this step" list, and step 2 was reduced without it)."""
    a, b, c = ms = [GatedPings(), Member(), Member()]
    try:
        a.slow = c.id
        deltas = random_deltas(ms, seed=11)
        first: dict[str, object] = {}
        early = threading.Thread(target=lambda: first.update(run_all(ms, deltas, wait_s=30, skip={c.id})))
        early.start()
        with a.cond:  # a waits for c's contribution to its shard and probes c: that probe hangs
            assert a.cond.wait_for(lambda: a.held >= 1, timeout=30)
        mc = c.ar.run(round_for(ms, c), deltas[c.id], wait_s=30, grace_s=1.0)
        early.join(timeout=60)
        assert mc[1].contributors == {0: 3, 1: 3, 2: 3}
        for m in ms:
            m.ar.expect(2, BASE)
            m.version = 1
        second: dict[str, object] = {}
        step2 = threading.Thread(target=lambda: second.update(run_all(ms, deltas, wait_s=30, skip={c.id}, step=2)))
        step2.start()
        deadline = time.monotonic() + 30
        while a.ar.inbox.pending_contributions() < 2 and time.monotonic() < deadline:  # a runs step 2, waiting for c
            time.sleep(0.01)
        with a.cond:  # now the probes of step 1 answer
            a.gate.set()
            assert a.cond.wait_for(lambda: a.answered == a.held, timeout=30)
        late = c.ar.run(round_for(ms, c, step=2), deltas[c.id], wait_s=30, grace_s=1.0)
        step2.join(timeout=60)
        assert not any(isinstance(v, Exception) for v in second.values()), second
        assert torch.equal(second[a.id][0], late[0]) and torch.equal(second[b.id][0], late[0])
        assert late[1].contributors == {0: 3, 1: 3, 2: 3} and not second[a.id][1].dropped
    finally:
        a.gate.set()
        for m in ms:
            m.close()


class Epochs(Member):
    """A member whose pings also say the epoch its state was made in."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch = 0

    def ping(self, request: pb.PingRequest) -> pb.PingReply:
        reply = super().ping(request)
        reply.epoch = self.epoch
        return reply


def test_a_rollback_stops_an_abandoned_epochs_all_reduce_at_once() -> None:
    """Two members wait (30 s) for a third's contribution to step 1 of epoch 0; the plan then names epoch 1 (the
    run rolled back past it): both stop within seconds, not at the deadline (CI: a lying owner's run held up
    its rerun 6 s, and the member that learned of the rollback first was dropped from it)."""
    ms = [Member() for _ in range(3)]
    try:
        deltas = random_deltas(ms, seed=5)
        done: dict[str, object] = {}
        t0 = time.monotonic()
        runner = threading.Thread(target=lambda: done.update(run_all(ms, deltas, wait_s=30, skip={ms[2].id})))
        runner.start()
        while sum(m.ar.inbox.pending_contributions() for m in ms[:2]) < 2 and time.monotonic() < t0 + 30:
            time.sleep(0.01)  # (until each holds the other's contribution: both are in the step, waiting)
        for m in ms[:2]:
            m.ar.supersede(0, 0)  # (the plan's epoch as it was: nothing to stop)
            m.ar.supersede(1, 2)  # (a round after this step failed, and epoch 1 starts at step 2: this one stands)
        assert not any(m.ar.abandoned(round_for(ms, m)) for m in ms[:2]) and runner.is_alive()
        for m in ms[:2]:
            m.ar.supersede(2, 1)  # (the run went back to before this step)
        runner.join(timeout=30)
        assert time.monotonic() - t0 < 15
        assert all(isinstance(done[m.id], IncompleteRound) and "rolled back (epoch 2)" in str(done[m.id])
                   for m in ms[:2]), done
    finally:
        for m in ms:
            m.close()


@pytest.mark.parametrize("early", [0, 2])
def test_the_member_that_learns_of_a_rollback_first_waits_for_the_others_to_roll_back(early: int) -> None:
    """Epoch 0 went to step 3 before the run rolled back to v0 (epoch 1). One member learns of it first and runs
    step 1 of epoch 1 while the other two are still at step 3 of epoch 0 (for twice its 1 s grace): they are
    behind, not past it. Its sends are refused as WRONG_EPOCH, not WRONG_STEP (at step 3 > 1 it took them for
    members that went on without it and gave up), and its probes see a state from epoch 0 past the rerun's base
    (which it took for "committed this step already"). Once they roll back, all three average all three."""
    ms = [Epochs() for _ in range(3)]
    first = ms[early]
    try:
        deltas = random_deltas(ms, seed=9)
        for m in ms:
            m.ar.expect(3, BASE, epoch=0)
            m.version = 2
        first.ar.expect(1, BASE, epoch=1)
        first.version, first.epoch = 0, 0  # (theta_0, rebuilt from the seed, is from epoch 0 like any v0)
        out: dict[str, object] = {}

        def go(m: Epochs) -> None:
            try:
                out[m.id] = m.ar.run(replace(round_for(ms, m), epoch=1), deltas[m.id], wait_s=30, grace_s=1.0)
            except Exception as err:
                out[m.id] = err

        alone = threading.Thread(target=go, args=(first,))
        t0 = time.monotonic()
        alone.start()
        while time.monotonic() < t0 + 2.0 and alone.is_alive():
            time.sleep(0.05)  # (the others stay behind past the grace: this is the scenario, not a sync)
        assert alone.is_alive(), out
        rest = [m for m in ms if m is not first]
        for m in rest:
            m.ar.expect(1, BASE, epoch=1)
            m.version = 0
        others = [threading.Thread(target=go, args=(m,)) for m in rest]
        for t in others:
            t.start()
        for t in [alone, *others]:
            t.join(timeout=60)
        assert not any(isinstance(v, Exception) for v in out.values()), out
        means = [out[m.id][0] for m in ms]
        assert all(torch.equal(means[0], x) for x in means[1:])
        assert out[first.id][1].contributors == {0: 3, 1: 3, 2: 3} and not out[first.id][1].dropped
    finally:
        for m in ms:
            m.close()
