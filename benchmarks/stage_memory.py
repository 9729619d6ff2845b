"""Peak memory of one pipeline stage's peer, and of the coordinator checkpointing the whole model.

Each figure is the peak RSS (``ru_maxrss``) of a fresh Python process that does one job:

* ``stage``: a peer of stage ``--stage`` of ``--stages``, built alone on the meta device, through
  ``--inner-steps`` AdamW steps on its own part (random activations in, random gradients back, as
  a middle stage gets them), then an outer step as ``peer/outer/outer.py`` takes it (pseudo-gradient,
  Nesterov step, the new snapshot hashed and published while the previous one stays served);
* ``whole``: the same peer as it was before #13, building the whole model and keeping its slice;
* ``coordinator``: the coordinator's checkpoint store taking the ``--stages`` stage snapshots (theta
  and momentum) of one version as its checkpointer receives them, one after the other, writing them
  and serving them from the file (the gRPC fetch of each stage is not part of this figure);
  ``--old-coordinator`` also measures the whole-model path it replaced (every stage held,
  consolidated, written).

The reference is what the stage itself must hold: its fp32 parameters, AdamW's two moments and
the outer state (theta_global and momentum), 5 x 4 bytes per parameter. Targets: stage peer <= 1.5x
that, coordinator <= 1.5x that.

The line also gives, for each memory option (``train.step_in_backward`` among them: no stage-sized gradient,
one parameter's at most, which is what it counts), the bytes a parameter takes on a GPU peer's device and in its
host memory, counted tensor by tensor in the stage peer above (``options``), and the size check's stage
plan of ``--plan-preset`` for a ``--card-gib`` card (``plan``: :func:`potluck.models.sizecheck.plan`).

    python benchmarks/stage_memory.py [--preset llama-1b] [--stages 4] [--stage 1] [--plan-preset llama-7b] [--card-gib 24]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

TARGET = 1.5

PRELUDE = """
import json, resource, sys
import torch
from potluck.protos.config.runconfig import ModelConfig, PipelineConfig
from potluck.models import build_stage, stage_bounds
args = json.loads(sys.argv[1])
cfg = ModelConfig(preset=args["preset"], vocab_size=256, seq_len=args["seq"])
bounds = stage_bounds(cfg, PipelineConfig(stages=args["stages"]))
start, stop = bounds[args["stage"]]
def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
"""

STAGE = """
from potluck.compression.transfer import SnapshotServer
from potluck.peer.outer.diloco import flatten_params, nesterov_step, outer_snapshot
if args["whole"]:  # before #13: every peer built the whole model, then kept its slice
    layers = build_stage(cfg, 0)[start:stop]
else:
    layers = build_stage(cfg, 0, start, stop)
params = list(layers.parameters())
build_peak = peak_mib()
n = sum(p.numel() for p in params)
held = outer_snapshot(flatten_params(params), torch.zeros(n), 0)  # theta_global and momentum, as joined
server = SnapshotServer("bench", 1 << 20)
server.publish(held)
import contextlib
bf16 = args.get("weights") == "bf16"
if bf16:  # train.weights = "bf16": the weights (and so their gradients) in bf16, autocast's bf16 math
    for p in params:
        p.data = p.data.to(torch.bfloat16)
def make(ps):
    if args.get("optimizer") == "adamw8bit" or bf16:
        from potluck.peer.training.adamw8bit import AdamW8bit
        return AdamW8bit(ps, lr=1e-4, eight_bit=args.get("optimizer") == "adamw8bit")
    return torch.optim.AdamW(ps, lr=1e-4)
if args.get("in_backward"):  # train.step_in_backward: each parameter stepped as its gradient is complete
    from potluck.peer.training.inbackward import StepInBackward
    opt = StepInBackward(params, make)
else:
    opt = make(params)
x = torch.randn(args["batch"], args["seq"], cfg.d_model)
for _ in range(args["inner_steps"]):
    opt.zero_grad(set_to_none=True)
    out = x
    with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        for layer in layers:
            out = layer(out)
    out.backward(torch.randn_like(out))
    opt.step()
def nbytes(ts):
    return sum(t.numel() * t.element_size() for t in ts if t is not None)
# what a GPU peer keeps on its device (weights, gradients, AdamW's moments), counted tensor by tensor
optimizer_bytes = nbytes(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
# (stepping in the backward, no gradient is left: the most one parameter's held at once counts instead)
grad_bytes = opt.peak_grad_bytes if args.get("in_backward") else nbytes(p.grad for p in params)
inner_bytes = nbytes(params) + grad_bytes + optimizer_bytes
# the issue's yardstick: the weights (as bf16) + the optimizer's state
lean_bytes = 2 * n + optimizer_bytes
opt.zero_grad(set_to_none=True)  # as StageWorker.inner_phase ends
theta_local = flatten_params(params)
delta = torch.sub(held.tensors["theta"], theta_local, out=theta_local)  # as peer/outer/outer.py does
new_theta, new_m = nesterov_step(held.tensors["theta"], held.tensors["momentum"], delta, 0.7, 0.9, consume=True)
server.publish(outer_snapshot(new_theta, new_m, 1))
# what it keeps in host memory (pinned on a GPU peer): the outer state, the new version and the one before it
outer_bytes = nbytes(held.tensors.values()) + nbytes((new_theta, new_m))
print(json.dumps({"peak_mib": peak_mib(), "params": n, "build_peak_mib": build_peak,
                  "device_bytes_per_param": inner_bytes / n, "host_bytes_per_param": outer_bytes / n,
                  "device_vs_bf16_weights_and_optimizer": inner_bytes / lean_bytes}))
"""


COORDINATOR = """
import tempfile
from pathlib import Path
from potluck.compression.transfer import Snapshot, tensors_hash
from potluck.coordinator.store.checkpoint import CheckpointStore, consolidate
from potluck.models import entry_costs
costs = entry_costs(cfg, "params")
def stage(s):  # stage s's snapshot as the checkpointer receives it from its members
    a, b = bounds[s]
    n = int(sum(costs[a:b]))
    tensors = {"theta": torch.full((n,), 0.5), "momentum": torch.full((n,), -0.5)}
    return Snapshot(tensors, 1, tensors_hash(tensors), {"layout": [[f"layers.{a}.w", [n]]]})
with tempfile.TemporaryDirectory() as d:
    store = CheckpointStore(Path(d))
    if args["whole"]:  # before #13: every stage fetched, consolidated, written
        path = store.write(consolidate([stage(s) for s in range(len(bounds))]))
    else:
        path = store.write_stages(1, (stage(s) for s in range(len(bounds))))
        store.verified(path)
        served = store.stages(path, bounds)
    print(json.dumps({"peak_mib": peak_mib(), "params": int(sum(costs[start:stop]))}))
"""


def child(code: str, args: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(PRELUDE + code), json.dumps(args)],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"child failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def option(res: dict, sizecheck_device: float) -> dict:
    from potluck.models import sizecheck
    return {"device_bytes_per_param": round(res["device_bytes_per_param"], 2),
            "host_bytes_per_param": round(res["host_bytes_per_param"], 2),
            "sizecheck_device_bytes_per_param": round(sizecheck_device, 2),
            "sizecheck_host_bytes_per_param": sizecheck.HOST_BYTES_PER_PARAM, "peak_mib": round(res["peak_mib"], 1),
            "device_vs_bf16_weights_and_optimizer": round(res["device_vs_bf16_weights_and_optimizer"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--stage", type=int, default=1, help="which stage's peer to measure (default 1: a middle one)")
    ap.add_argument("--inner-steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--old-coordinator", action="store_true",
                    help="also measure the coordinator's old whole-model path (~6x the model's fp32 size: "
                    "it does not fit a 24 GiB box at llama-1b)")
    ap.add_argument("--plan-preset", default="llama-7b", help="the model whose stage plan the size check prints")
    ap.add_argument("--card-gib", type=int, default=24, help="the card the plan is for (GiB)")
    a = ap.parse_args()
    args = {"preset": a.preset, "stages": a.stages, "stage": a.stage, "inner_steps": a.inner_steps,
            "batch": a.batch, "seq": a.seq}
    whole = child(STAGE, {**args, "whole": True})
    stage = child(STAGE, {**args, "whole": False})
    lean = child(STAGE, {**args, "whole": False, "optimizer": "adamw8bit"})
    bf16 = child(STAGE, {**args, "whole": False, "weights": "bf16"})
    leanest = child(STAGE, {**args, "whole": False, "weights": "bf16", "optimizer": "adamw8bit"})
    bf16_in_backward = child(STAGE, {**args, "whole": False, "weights": "bf16", "in_backward": True})
    leanest_in_backward = child(STAGE, {**args, "whole": False, "weights": "bf16", "optimizer": "adamw8bit",
                                        "in_backward": True})
    coordinator = child(COORDINATOR, {**args, "whole": False})
    old_coordinator = child(COORDINATOR, {**args, "whole": True}) if a.old_coordinator else None
    reference_mib = 5 * 4 * stage["params"] / 2**20
    from potluck.models import sizecheck
    from potluck.protos.config.files import apply_overrides
    from potluck.protos.config.runconfig import RunConfig
    big = apply_overrides(RunConfig(), {"model.preset": a.plan_preset, "model.seq_len": 1024, "train.batch_size": 8,
                                        "train.checkpoint_activations": True})
    stages = sizecheck.plan(big, a.card_gib * sizecheck.GiB)
    planned = sizecheck.estimate(apply_overrides(big, {"pipeline.stages": stages})) if stages else None
    print(json.dumps({
        "benchmark": "stage_memory", "preset": a.preset, "stages": a.stages, "stage": a.stage,
        "stage_params": stage["params"],
        "stage_reference_mib": round(reference_mib, 1),
        "stage_peer_peak_mib": round(stage["peak_mib"], 1),
        "stage_peer_ratio": round(stage["peak_mib"] / reference_mib, 2),
        "stage_peer_build_peak_mib": round(stage["build_peak_mib"], 1),
        "whole_model_peer_peak_mib": round(whole["peak_mib"], 1),
        "whole_model_peer_ratio": round(whole["peak_mib"] / reference_mib, 2),
        "whole_model_build_peak_mib": round(whole["build_peak_mib"], 1),
        "coordinator_checkpoint_peak_mib": round(coordinator["peak_mib"], 1),
        "coordinator_ratio": round(coordinator["peak_mib"] / reference_mib, 2),
        "whole_model_coordinator_peak_mib": round(old_coordinator["peak_mib"], 1) if old_coordinator else None,
        "target": TARGET,
        # counted tensor by tensor in the stage peer: fp32 weights, gradients and AdamW (a GPU peer's device), and
        # the outer state it keeps in host memory (pinned on a GPU), beside what the size check counts
        # and (device_vs_bf16_weights_and_optimizer) the device bytes over the weights as bf16 + the optimizer's state
        "options": {name: option(res, sizecheck.device_bytes_per_param(apply_overrides(RunConfig(), {
                        "train.weights": w, "train.optimizer": o, "train.step_in_backward": ib,
                        **({"train.grad_clip": 0.0} if ib else {})})))
                    for name, res, w, o, ib in (
                        ("fp32 + AdamW", stage, "fp32", "adamw", False),
                        ("adamw8bit (train.optimizer)", lean, "fp32", "adamw8bit", False),
                        ("bf16 weights (train.weights)", bf16, "bf16", "adamw", False),
                        ("bf16 weights + adamw8bit", leanest, "bf16", "adamw8bit", False),
                        ("bf16 weights, stepped in the backward (train.step_in_backward)", bf16_in_backward, "bf16",
                         "adamw", True),
                        ("bf16 weights + adamw8bit, stepped in the backward", leanest_in_backward, "bf16", "adamw8bit",
                         True))},
        "plan": {"preset": a.plan_preset, "seq_len": 1024, "batch_size": 8, "checkpoint_activations": True,
                 "card_gib": a.card_gib, "stages": stages,
                 "device_gb_per_stage": round(planned.device_bytes / 1e9, 1) if planned else None,
                 "host_gb_per_stage": round(planned.host_bytes / 1e9, 1) if planned else None},
    }))


if __name__ == "__main__":
    main()
