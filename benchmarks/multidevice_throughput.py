"""A peer of N devices against a peer of one (issue 17: a 2-GPU peer >= 1.8x one GPU's tokens/s).

The peer's own inner phase (:class:`~potluck.peer.training.stage.StageWorker`, AdamW, clipping, the run's
sampler and data) for ``--steps`` inner steps of ``--batch`` samples, timed after one warm-up phase:

* ``group``: ``--devices`` processes as torchrun starts them (``RANK``, ``WORLD_SIZE``, ...), rank 0
  a :class:`~potluck.peer.devices.multidevice.Leader` and the others helpers: each trains on its rows of every
  batch and they average gradients (gloo on CPU, NCCL on GPUs), exactly as in a run;
* ``shard``: the same group with ``--devices shard`` (FSDP2): each process holds 1/N of the stage's
  weights, gradients and AdamW state; its tokens/s and the bytes each process holds, beside the
  replicated group's;
* ``one``: one process, one device, the whole batch (the baseline in the same run);
* on CPU also ``one_all_threads``: one process using as many torch threads as the group has
  processes (a device is a core here, and one process could use them all with intra-op threads).

Tokens/s are the whole batch's tokens per inner step over the phase's seconds on rank 0. On CPU each
group process and the ``one`` baseline get one torch thread; compare the figures of one line only.

    python benchmarks/multidevice_throughput.py [--devices 2] [--device cpu|cuda] [--steps 20]

Bytes held: weights, gradients and optimizer state of rank 0's stage worker after the phase
(:func:`potluck.peer.devices.sharding.held_bytes`), and on CUDA rank 0's peak allocated bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SETTINGS = {"model.d_model": 192, "model.n_layers": 4, "model.n_heads": 4, "model.seq_len": 128,
            "train.warmup_steps": 0, "data.eval_every": 0}


def run_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from potluck.protos.config.files import apply_overrides
    from potluck.protos.config.runconfig import RunConfig
    return apply_overrides(RunConfig(), {**SETTINGS, "diloco.inner_steps": args.steps, "train.batch_size": args.batch})


def phase_seconds(worker, args: argparse.Namespace) -> float:  # type: ignore[no-untyped-def]
    never = threading.Event()
    worker.inner_phase([(0, 1 << 16)], never, lambda i, loss, s: None, 1)  # warm-up: optimizer, kernels
    t0 = time.perf_counter()
    worker.inner_phase([(0, 1 << 16)], never, lambda i, loss, s: None, 2)
    return time.perf_counter() - t0


def rank_main(args: argparse.Namespace) -> int:
    """One process of the group (RANK etc. set), or the single-process baseline (RANK unset)."""
    import torch

    from potluck.models import stage_bounds
    from potluck.peer.devices import multidevice, sharding
    from potluck.peer.training.data import Dataset
    from potluck.peer.training.stage import StageWorker

    torch.set_num_threads(args.threads)
    rc = run_config(args)
    group = multidevice.start(args.device) if "RANK" in os.environ else None
    if group is not None and not group.leads:
        return multidevice.Helper(group, threads=args.threads).run()
    device = group.device if group is not None else torch.device("cuda:0" if args.device == "cuda" else "cpu")
    leader = multidevice.Leader(group, shard=args.mode == "shard") if group is not None else None
    if leader is not None:
        leader.setup(rc)
    worker = StageWorker(rc, 0, stage_bounds(rc.model, rc.pipeline)[0], device, Dataset(rc.data, rc.model), None)
    if leader is not None:
        leader.attach(worker)
    seconds = phase_seconds(worker, args)
    for p in worker.params:  # (the phase freed them: count them as a step holds them)
        p.grad = torch.zeros_like(p)
    held, _ = sharding.held_bytes(worker.params, worker.optimizer)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    if leader is not None:
        leader.close("done")
    tokens = args.steps * args.batch * rc.model.seq_len
    Path(args.out).write_text(json.dumps({"seconds": seconds, "tokens_per_s": tokens / seconds, "held_bytes": held,
                                          "peak_device_bytes": peak}))
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(args: argparse.Namespace, tmp: Path, name: str, world: int, threads: int, mode: str = "replicate") -> dict:
    out = tmp / f"{name}.json"
    base = [sys.executable, __file__, "--rank-main", "--out", str(out), "--device", args.device, "--steps",
            str(args.steps), "--batch", str(args.batch), "--threads", str(threads), "--mode", mode]
    port = free_port()
    procs = []
    try:
        for r in range(world):
            env = dict(os.environ)
            if world > 1:
                env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(subprocess.Popen(base, env=env))
        for p in procs:
            if p.wait(timeout=args.timeout) != 0:
                raise SystemExit(f"{name}: a process exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--mode", choices=["replicate", "shard"], default="replicate", help=argparse.SUPPRESS)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        sys.exit(rank_main(args))
    if args.device == "cuda":
        import torch
        if torch.cuda.device_count() < args.devices:
            print(json.dumps({"benchmark": "multidevice_throughput", "measured": False,
                              "reason": f"{torch.cuda.device_count()} CUDA devices here, {args.devices} needed"}))
            return
    with tempfile.TemporaryDirectory(prefix="potluck-md-") as tmp:
        one = measure(args, Path(tmp), "one", 1, 1)
        group = measure(args, Path(tmp), "group", args.devices, 1)
        shard = measure(args, Path(tmp), "shard", args.devices, 1, "shard")
        threaded = measure(args, Path(tmp), "threads", 1, args.devices) if args.device == "cpu" else None
    line = {"benchmark": "multidevice_throughput", "measured": True, "device": args.device, "devices": args.devices,
            "batch": args.batch, "inner_steps": args.steps, **{k.replace(".", "_"): v for k, v in SETTINGS.items()},
            "group_tokens_per_s": round(group["tokens_per_s"], 1), "one_tokens_per_s": round(one["tokens_per_s"], 1),
            "speedup": round(group["tokens_per_s"] / one["tokens_per_s"], 2), "target_speedup": 1.8,
            "shard_tokens_per_s": round(shard["tokens_per_s"], 1),
            "shard_speedup": round(shard["tokens_per_s"] / one["tokens_per_s"], 2),
            "held_mb_per_process": {"one": round(one["held_bytes"] / 1e6, 2), "replicate": round(group["held_bytes"] / 1e6, 2),
                                    "shard": round(shard["held_bytes"] / 1e6, 2)},
            "shard_held_vs_replicate": round(shard["held_bytes"] / group["held_bytes"], 3)}
    if args.device == "cuda":
        line["peak_device_mb_rank0"] = {k: round(v["peak_device_bytes"] / 2**20, 1) for k, v in
                                        (("one", one), ("replicate", group), ("shard", shard))}
    if threaded is not None:
        line["one_all_threads_tokens_per_s"] = round(threaded["tokens_per_s"], 1)
        line["speedup_vs_all_threads"] = round(group["tokens_per_s"] / threaded["tokens_per_s"], 2)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
