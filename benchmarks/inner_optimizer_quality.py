"""Quality and device memory of the inner phase's memory options at equal tokens: AdamW with fp32 moments and fp32
weights against ``train.optimizer = "adamw8bit"`` (its moments in 8 bits, ``potluck/peer/adamw8bit.py``),
``train.weights = "bf16"`` (bf16 weights and gradients, updates rounded stochastically) and both, and these
stepped in the backward (``train.step_in_backward``, which needs ``train.grad_clip = 0``).

Two settings, each run once per optimizer with everything else equal (model init, data, order, lr schedule):

* ``sync``: one process trains through the peers' own inner loop (:class:`~potluck.peer.training.stage.StageWorker`) for
  ``--outer-steps x --inner-steps`` steps on a batch of ``--peers x --batch``, as ``overlap_quality.py``'s
  synchronous baseline does;
* ``swarm`` (``--swarm``): a real DiLoCo swarm of ``--peers`` peer processes (``overlap_quality.py``'s swarm,
  blocking outer steps, fixed rounds), each peer's inner optimizer the option.

The figure is the final eval loss on the run's held-out set; each ratio is an option's over fp32 AdamW's, target
(issue): within 1 %. (In ``sync`` there is no outer step, so bf16 weights train all the steps without an fp32
master copy: harder than in a swarm, where every outer step starts them again from theta_global.) The line also gives each option's optimizer state in bytes a parameter, counted tensor by
tensor in the sync run (the device's share besides the weight and gradient).

    python benchmarks/inner_optimizer_quality.py [--swarm] [--peers 4] [--inner-steps 50] [--outer-steps 10]
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path

import torch
from benchargs import bench_parser, swarm_arguments
from overlap_quality import run_config, run_swarm

from potluck.models import stage_bounds
from potluck.peer.training.data import Dataset
from potluck.peer.training.stage import StageWorker

OPTIONS = {"adamw": {}, "adamw8bit": {"train.optimizer": "adamw8bit"}, "bf16": {"train.weights": "bf16"},
           "bf16+adamw8bit": {"train.weights": "bf16", "train.optimizer": "adamw8bit"},
           # stepped in the backward (train.step_in_backward), which clips nothing: against fp32 AdamW as it runs
           # by default, clipped at train.grad_clip = 1
           "bf16+inbwd": {"train.weights": "bf16", "train.step_in_backward": True, "train.grad_clip": 0.0},
           "bf16+adamw8bit+inbwd": {"train.weights": "bf16", "train.optimizer": "adamw8bit",
                                    "train.step_in_backward": True, "train.grad_clip": 0.0}}


def run_sync(args, option: dict) -> dict:  # type: ignore[no-untyped-def]
    steps, batch = args.outer_steps * args.inner_steps, args.peers * args.batch
    cfg = run_config(args, **{"train.batch_size": batch, "diloco.inner_steps": steps, "diloco.outer_steps": 1,
                              **option})
    torch.set_num_threads(args.threads)
    data = Dataset(cfg.data, cfg.model)
    worker = StageWorker(cfg, 0, stage_bounds(cfg.model, cfg.pipeline)[0], torch.device("cpu"), data, link=None)
    t0 = time.monotonic()
    phase = worker.inner_phase([(0, steps * batch)], threading.Event(), lambda i, loss, s: None)
    assert phase.steps == steps, phase
    final = worker.evaluate(1)
    assert final is not None and worker.optimizer is not None
    n = sum(p.numel() for p in worker.params)
    state = sum(v.numel() * v.element_size() for st in worker.optimizer.state.values() for v in st.values()
                if torch.is_tensor(v) and v.dim() > 0)
    return {"final_eval_loss": round(final, 4), "optimizer_state_bytes_per_param": round(state / n, 3),
            "params": n, "steps": steps, "batch": batch, "wall_s": round(time.monotonic() - t0, 1)}


def main() -> None:
    parser = bench_parser(__doc__)
    swarm_arguments(parser, peers=4, inner_steps=50, outer_steps=10)
    parser.add_argument("--swarm", action="store_true", help="also run the DiLoCo swarm with each option")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds each swarm run may take")
    parser.add_argument("--options", default="", help=f"comma-separated, of {', '.join(OPTIONS)} (default: all)")
    args = parser.parse_args()
    line: dict = {"benchmark": "inner_optimizer_quality", "peers": args.peers, "inner_steps": args.inner_steps,
                  "outer_steps": args.outer_steps, "d_model": args.d_model, "n_layers": args.n_layers,
                  "seed": args.seed, "target_ratio": 1.01}
    chosen = {o: OPTIONS[o] for o in args.options.split(",")} if args.options else OPTIONS
    sync = {o: run_sync(args, option) for o, option in {"adamw": {}, **chosen}.items()}
    line["sync"] = sync
    line["sync_ratio"] = {o: round(sync[o]["final_eval_loss"] / sync["adamw"]["final_eval_loss"], 4) for o in chosen
                          if o != "adamw"}
    if args.swarm:
        with tempfile.TemporaryDirectory(prefix="potluck-bench-") as tmp:
            swarm = {o: run_swarm(args, Path(tmp) / o, False, **{**option, "diloco.rounds": "fixed"})
                     for o, option in {"adamw": {}, **chosen}.items()}
        line["swarm"] = swarm
        line["swarm_ratio"] = {o: round(swarm[o]["final_eval_loss"] / swarm["adamw"]["final_eval_loss"], 4)
                               for o in chosen if o != "adamw"}
    print(json.dumps(line))


if __name__ == "__main__":
    main()
