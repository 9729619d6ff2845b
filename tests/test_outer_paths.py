"""The outer step as a peer takes it, blocking and overlapped, with its model on its own device.

A GPU peer moves theta through pinned vectors with asynchronous copies, an overlapped step runs on a
thread while the next phase trains from the vector it loaded, and the new state is hashed in the
background. None of it may change a bit: each committed step must be exactly what the blocking
computation (:func:`~potluck.peer.outer.outer.outer_step` on CPU vectors) gives for the same inputs. On CUDA
where there is a GPU (the same test, with the CPU as its reference), on CPU in CI.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from potluck.compression.int8 import make_codec
from potluck.compression.transfer import Snapshot
from potluck.models import stage_bounds
from potluck.peer.follower import Follower
from potluck.peer.outer.diloco import flatten_params, outer_snapshot
from potluck.peer.outer.outer import outer_step
from potluck.peer.outer.outersteps import OuterSteps
from potluck.peer.outer.states import States
from potluck.peer.reduce.allreduce import AllReduce, MemberAddr, RoundInfo
from potluck.peer.swarm.telemetry import Telemetry
from potluck.peer.tasklet import Tasklet
from potluck.peer.training.data import Dataset
from potluck.peer.training.stage import StageWorker
from potluck.peer.training.window import Pace
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.transport import PeerClient, Traffic
from potluck.protos.wire.records import Member, Plan, Round

RUN, ME = "paths", "me"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def config(overlap: bool) -> RunConfig:
    return apply_overrides(RunConfig(), {
        "run_id": RUN, "model.d_model": 32, "model.n_heads": 2, "model.n_layers": 2, "model.seq_len": 16,
        "train.batch_size": 4, "diloco.inner_steps": 2, "diloco.outer_steps": 2, "diloco.overlap": overlap,
        "data.eval_every": 0, "sync.chunk_bytes": 1 << 12,
    })


def allreduce(rc: RunConfig, numel: int, pinned: bool = False) -> AllReduce:
    """A one-member all-reduce: its own shard, re-quantized once, as in every round (no network)."""
    return AllReduce(run_id=RUN, me=ME, numel=numel, codec=make_codec(rc.sync.codec, rc.sync.block_size),
                     client=PeerClient(Traffic()), chunk_bytes=rc.sync.chunk_bytes, rpc_timeout=5.0,
                     ping=lambda peer, timeout: None, pinned=pinned)  # type: ignore[arg-type,return-value]


def session(rc: RunConfig, device: str) -> SimpleNamespace:
    """What :class:`OuterSteps` reads of a peer's session, with a real tasklet (worker, all-reduce, states)."""
    bounds = stage_bounds(rc.model, rc.pipeline)[0]
    worker = StageWorker(rc, 0, bounds, torch.device(device), Dataset(rc.data, rc.model), None)
    theta0 = worker.theta()
    states = States(RUN, rc.sync.chunk_bytes, outer_snapshot(theta0, torch.zeros_like(theta0), 0, {"epoch": 0}))
    t = Tasklet(SimpleNamespace(addresses={}, me=ME, rc=rc), 0, worker, allreduce(rc, worker.numel, worker.pinned), None, states, None)  # type: ignore[arg-type]
    t.expect_next()
    s = SimpleNamespace(rc=rc, tasklet=t, replica=0, cfg=SimpleNamespace(plan_wait_s=1.0), inner=SimpleNamespace(pace=Pace()),
                        telemetry=Telemetry(ME, "test", 0.0, progress="off"), over=lambda: False,
                        set_state=lambda state: None, heartbeat=SimpleNamespace(wait_plan=lambda *a, **k: None, poke=lambda: None,
                                                                      coordinator_silent_s=lambda: 0.0))
    s.follower = SimpleNamespace(failed=lambda step, now, epoch=0: pytest.fail(f"step {step} failed"),
                                 resolve=lambda plan, step, stage, held, epoch, silent_s=0.0: Round(
                                     step=step, members=[Member(peer_id=ME, address="-")]))
    return s


def train(worker: StageWorker, step: int) -> torch.Tensor:
    """An inner phase of real AdamW steps on the worker's device; returns theta_local (a CPU copy)."""
    rc = worker.rc
    worker.inner_phase([(0, rc.diloco.inner_steps * rc.train.batch_size)], threading.Event(), lambda *a: None, step)
    return flatten_params(worker.params)


def reference(rc: RunConfig, first: Snapshot, locals_: list[torch.Tensor], overlap: bool) -> list[Snapshot]:
    """The committed steps, computed with the blocking primitives on CPU from the same theta_local.

    Blocking: ``delta_k = theta_global_{k-1} - local_k``, the phase trained from theta_global_{k-1}.
    Overlapped: the phase of ``k`` trained from ``start_k = theta_global_{k-2} - delta_{k-1}`` (the
    committed state plus its own progress), ``delta_k = start_k - local_k``, applied to theta_global_{k-1}.
    """
    ar, held, start, out = allreduce(rc, first.tensors["theta"].numel()), first, first.tensors["theta"], []
    for k, local in enumerate(locals_, 1):
        delta = (start if overlap else held.tensors["theta"]) - local
        ar.expect(k, held.hash)
        info = RoundInfo(step=k, members=(MemberAddr(ME, "-"),), me=ME, base_hash=held.hash)
        start = held.tensors["theta"] - delta
        held = outer_step(rc, ar, info, held, delta.clone(), 1.0, {}).snapshot
        out.append(held)
    ar.close()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
def test_each_path_commits_the_blocking_computations_bits(device: str, overlap: bool) -> None:
    rc = config(overlap)
    s = session(rc, device)
    t, outer = s.tasklet, OuterSteps(s)  # type: ignore[arg-type]
    first, locals_, committed = t.states.current, [], []
    try:
        for step in (1, 2):
            start = t.worker.start_point() if overlap else None
            if overlap and step == 2:  # the next phase starts from the vector loaded for it, not a copy back
                assert start is t.worker._loaded and torch.equal(start, flatten_params(t.worker.params))
            locals_.append(train(t.worker, step))
            outer.after_phase(step, 1.0, start, False, True)
            if not overlap:
                committed.append(t.states.current)
        if overlap:
            committed.append(t.states.current)  # step 1: landed when phase 2 ended
            assert outer.inflight is not None and outer.land()
            committed.append(t.states.current)
        for got, want in zip(committed, reference(rc, first, locals_, overlap), strict=True):
            assert got.version == want.version
            for key in ("theta", "momentum"):
                assert torch.equal(got.tensors[key], want.tensors[key]), f"v{got.version} {key} differs"
            assert got.hash == want.hash
        assert torch.equal(flatten_params(t.worker.params), committed[-1].tensors["theta"])  # what it trains on next
        if device == "cuda":  # the vectors that cross the bus are page-locked
            assert committed[-1].tensors["theta"].is_pinned() and committed[-1].tensors["momentum"].is_pinned()
    finally:
        t.allreduce.close()


def test_a_rollback_ends_the_wait_for_a_round_that_is_not_coming() -> None:
    """A peer ends its inner phase of step 3 (epoch 0) and waits for the coordinator's round for it, for up to
    plan_wait_s; the plan's newest round is the rerun of step 1 in epoch 1 (a proven lie was undone): no round
    for step 3 will come, and it stops waiting at once (it waited the whole 10 s while its peers reran without
    it, in a lying owner's run)."""
    s = session(config(False), "cpu")
    rerun = Plan(seq=2, rounds=[Round(step=1, epoch=1, members=[Member(peer_id=ME, address="-")])])
    waited: list[bool] = []

    def wait_plan(predicate, timeout: float) -> Plan:  # type: ignore[no-untyped-def]
        waited.append(predicate(rerun))  # (True: the wait is over with this plan)
        return rerun

    s.heartbeat.wait_plan, s.follower = wait_plan, Follower(ME, pipelined=False, plan_wait_s=10.0)
    try:
        assert OuterSteps(s)._resolve(3) is None and waited == [True]  # type: ignore[arg-type]
    finally:
        s.tasklet.allreduce.close()
