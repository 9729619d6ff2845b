"""A peer of several devices (issue #17): ``torchrun --nproc-per-node 2 -m potluck peer`` is one peer.

Real OS processes on 127.0.0.1, two CPU ranks over gloo. The swarm test starts a coordinator, a
single-process peer and a 2-process peer: the swarm sees two peers, both contribute to every outer
step and commit the same state, and the 2-process peer's rank 1 holds rank 0's parameters at every
load (:data:`~potluck.peer.devices.multidevice.HASHES_ENV`). The protocol test runs the leader and a helper
without a swarm, next to one process training the whole batch alone, and interrupts a phase midway.

Run as a script (``RANK``/``WORLD_SIZE`` set), this file is one rank of the protocol test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_swarm import hashes_agree

from potluck.protos.runtime.stopping import descendants

pytestmark = pytest.mark.slow

NPROC = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


HELD = re.compile(r"this process holds ([0-9.]+) MB of its stage's .*: ([0-9.]+) of the ([0-9.]+) MB a whole replica holds")


def held(log: str) -> list[float]:
    """The share of a replica's bytes each process of a multi-device peer said it holds (one line per process)."""
    return [float(m.group(2)) for m in HELD.finditer(log)]


def start_torchrun_peer(swarm, name: str, env: dict[str, str], *extra: str) -> subprocess.Popen:  # type: ignore[no-untyped-def]
    """``python -m torch.distributed.run --nproc-per-node 2 -m potluck peer --join ...`` (its log: logs/peer-<n>.log)."""
    idx = len(swarm.peers)
    key = swarm.workdir / "keys" / f"peer-{idx}.key"
    args = [sys.executable, "-P", "-m", "torch.distributed.run", "--nproc-per-node", str(NPROC),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", "potluck", "peer", "--join", swarm.ready["join"], "--host", "127.0.0.1", "--threads", "1",
            "--name", name, "--identity", str(key), *extra]
    # PYTHONSAFEPATH: the ranks' `python -m potluck` must find the installed package, not ./potluck
    proc = swarm.procs.spawn(args, swarm.logs / f"peer-{idx}.log", {"PYTHONSAFEPATH": "1", **env})
    swarm.peers.append(proc)
    return proc


@pytest.mark.parametrize("devices", ["replicate", "shard"])
def test_a_two_process_peer_is_one_member_and_its_ranks_agree(swarm, tmp_path: Path, devices: str) -> None:  # type: ignore[no-untyped-def]
    steps = 3
    swarm.start_coordinator({"diloco.outer_steps": steps, "diloco.inner_steps": 6, "membership.min_peers": 2,
                             "diloco.rounds": "fixed", "data.eval_every": 1})  # (both contribute every step)
    single = swarm.start_peer(name="single", env={"POTLUCK_FAULTS": "inner.step@*:slow=2"})  # (another speed)
    hashes = tmp_path / "hashes"
    group = start_torchrun_peer(swarm, "two-procs", {"POTLUCK_DEVICE_HASHES": str(hashes)}, "--devices", devices)
    ranks: set[int] = set()  # torchrun starts its workers in sessions of their own: not in the agent's group

    def finished(s: dict) -> bool:
        ranks.update(descendants(group.pid))
        return s["run"]["finished"] and bool(s["history"]) and len(s["history"][-1]["state_hashes"]) == 2

    try:
        state = swarm.wait_state(finished, 90, "the run to finish with the 2-process peer")
        peers = state["peers"]
        assert sorted(p["name"] for p in peers) == ["single", "two-procs"], "torchrun's ranks must be one peer"
        pid = next(p["id"] for p in peers if p["name"] == "two-procs")
        hist = state["history"]
        assert [h["step"] for h in hist] == list(range(1, steps + 1))
        for h in hist:
            assert h["members"] == 2 and pid in h["state_hashes"], h
            assert h["contributors"] == 2 and h["dropped"] == [] and h["rejected"] == [], h
        assert hashes_agree(state) == [], "members held different parameters after an outer step"
        for proc in (group, single):
            assert proc.wait(timeout=30) == 0
        swarm.wait_for(lambda: not [r for r in ranks if alive(r)], 15, "the torchrun peer's processes to exit")
    finally:
        for r in ranks:  # whatever happened, none of them outlives the test
            if alive(r):
                try:
                    os.kill(r, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    zero, one = lines(hashes / "rank-0.txt"), lines(hashes / "rank-1.txt")
    assert len([x for x in zero if x.startswith("before")]) >= steps + 1, zero
    log = (swarm.logs / "peer-1.log").read_text()
    shares = held(log)
    assert len(shares) == NPROC, log[-3000:]
    if devices == "replicate":
        # at the start, then after every inner phase: rank 1's parameters, trained on its half of each
        # batch, are rank 0's before the load ("before") and after it ("after")
        assert zero == one
        assert shares == [1.0] * NPROC
    else:
        # the leader writes, for every load, the hash of the theta it loaded and of the stage gathered back
        # from both ranks' shards right after: the same bits
        assert one == []
        loads = [x for x in zero if x.startswith("loaded")]
        afters = [x for x in zero if x.startswith("after")]
        assert len(loads) == len(afters) >= steps + 1
        assert [x.split()[-1] for x in loads] == [x.split()[-1] for x in afters], zero
        assert all(0.45 <= s <= 0.55 for s in shares), shares  # each process: half of a replica's bytes
        assert "sharded" in log


# ---------------------------------------------------------------------- the protocol, without a swarm

H = 4


def _protocol_rank(out: Path, devices: str) -> int:
    """One rank of :func:`test_the_leader_and_a_helper_train_the_whole_batch`."""
    import torch
    from swarm import run_config

    from potluck.models import stage_bounds
    from potluck.peer.devices import multidevice
    from potluck.peer.training.data import Dataset
    from potluck.peer.training.stage import StageWorker

    torch.set_num_threads(1)
    rc = run_config({"diloco.inner_steps": H, "train.batch_size": 8, "train.warmup_steps": 0, "train.lr": 1e-2,
                     "model.tie_embeddings": devices == "shard-tied",  # (tied: those two layers stay whole)
                     "train.weights": "bf16" if devices == "replicate-bf16" else "fp32"})  # (rounded alike on each)
    group = multidevice.start("cpu")
    assert group is not None
    if not group.leads:
        return multidevice.Helper(group, threads=1).run()
    leader = multidevice.Leader(group, shard=devices.startswith("shard"))  # ('replicate-bf16': replicas, bf16)
    leader.setup(rc)
    data, cpu, bounds = Dataset(rc.data, rc.model), torch.device("cpu"), stage_bounds(rc.model, rc.pipeline)[0]
    alone = StageWorker(rc, 0, bounds, cpu, data, None)  # one process, the whole batch: the reference
    worker = StageWorker(rc, 0, bounds, cpu, data, None)
    leader.attach(worker)
    never, spans = threading.Event(), [(0, 64)]

    def noop(i: int, loss: float, seconds: float) -> None:
        pass

    start = worker.theta()
    losses: list[float] = []
    worker.inner_phase(spans, never, lambda i, loss, s: losses.append(loss), 1)
    alone_losses: list[float] = []
    alone.inner_phase(spans, never, lambda i, loss, s: alone_losses.append(loss), 1)
    moved = float((alone.theta() - start).norm())
    apart = float((worker.theta() - alone.theta()).norm())
    evals = [worker.evaluate(1)]  # (sharded: rank 1 runs the same forward passes)
    alone.load(worker.theta())
    evals.append(alone.evaluate(1))
    worker.load(worker.theta() * 0.5, worker.steps_done)  # as an outer step would: rank 1 gets the same theta
    stopping = threading.Event()
    half = worker.inner_phase(spans, stopping, lambda i, loss, s: stopping.set() if i == 1 else None, 2)
    worker.load(worker.theta())  # rank 1 is still in its phase, waiting for the third batch: this ends it
    worker.inner_phase(spans, never, noop, 3)
    worker.load(worker.theta())
    leader.close("done")
    out.write_text(json.dumps({"moved": moved, "apart": apart, "losses": losses, "alone_losses": alone_losses,
                               "interrupted_after": half.steps, "steps_done": worker.steps_done, "evals": evals}))
    return 0


@pytest.mark.parametrize("devices", ["replicate", "replicate-bf16", "shard", "shard-tied"])
def test_the_leader_and_a_helper_train_the_whole_batch(procs, tmp_path: Path, devices: str) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    out, hashes = tmp_path / "out.json", tmp_path / "hashes"
    ranks = [procs.spawn([sys.executable, __file__, str(out), devices], tmp_path / f"rank-{r}.log", {
        "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(NPROC), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "POTLUCK_DEVICE_HASHES": str(hashes)}) for r in range(NPROC)]
    for r, proc in enumerate(ranks):
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0, f"rank {r} exited with {code}:\n" + (tmp_path / f"rank-{r}.log").read_text()[-3000:]
    res = json.loads(out.read_text())
    # two halves of each batch, gradients averaged: the step one process takes on the whole batch (bf16 weights:
    # the same noise rounds both alike, and the two halves' bf16 gradients differ from the whole's in their last bits)
    bf16 = devices == "replicate-bf16"
    assert res["apart"] < (0.1 if bf16 else 1e-3) * res["moved"], res  # (bf16: an ulp of rounding noise apart)
    assert res["losses"] == pytest.approx(res["alone_losses"], rel=1e-2 if bf16 else 1e-4)
    assert res["interrupted_after"] == 2 and res["steps_done"] == 2 * H + 2
    assert res["evals"][0] == pytest.approx(res["evals"][1], rel=1e-3 if bf16 else 1e-5)  # the same parameters, the same loss
    zero, one = lines(hashes / "rank-0.txt"), lines(hashes / "rank-1.txt")
    shares = [s for r in range(NPROC) for s in held((tmp_path / f"rank-{r}.log").read_text())]
    if devices.startswith("replicate"):  # (bf16 weights too: both ranks round each update with the same noise)
        assert len(zero) == 2 * 4 and zero == one  # attach, and three loads: before and after each
        assert shares == [1.0] * NPROC
    else:  # the leader's record of each load: the theta it loaded, then the stage gathered back from the shards
        assert one == [] and len(zero) == 3 * 4, zero
        loaded, after = ([x.split()[-1] for x in zero if x.startswith(e)] for e in ("loaded", "after"))
        assert loaded == after, zero
        # each process: half of a replica's bytes (tied: more, the tied embedding is whole on each)
        low, high = (0.45, 0.55) if devices == "shard" else (0.55, 0.75)
        assert len(shares) == NPROC and all(low <= s <= high for s in shares), shares


if __name__ == "__main__":
    sys.exit(_protocol_rank(Path(sys.argv[1]), sys.argv[2]))
