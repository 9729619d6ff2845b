"""AC-SGD in the real pipeline: 2 stages x 1 replica over loopback gRPC, multi-epoch fine-tuning.

Two :class:`~potluck.peer.pipeline.pipeline.Pipeline` stages, each with its own gRPC server, layers and AdamW,
train TinyGPT on a fixed set of samples of the built-in Markov data, revisited every epoch (the
AC-SGD setting). Every variant starts from the same weights and sees the same samples in the same
order; only ``pipeline.compression`` / ``bits`` / ``grad_bits`` differ:

* ``fp32``: activations and gradients uncompressed (the baseline, measured in the same run);
* ``direct4``, ``direct2``: activations quantized directly, per-channel scales per micro-batch;
* ``acsgd4``, ``acsgd2``: AC-SGD deltas against per-sample buffers (first visits fp16);

gradients quantized directly at 8 bits in every compressed variant. Bytes are the tensor payload
the stages sent (codes + scales), per inner step, whole run and after the first epoch; eval loss is
the joined model's on held-out samples, next to the data's entropy floor.

Targets (issue 3): AC-SGD 4-bit activations <= 1/8 of fp32; its eval loss within 1% of fp32's and
better than direct quantization at the same bits.

    python benchmarks/pipeline_acsgd.py [--steps 320] [--samples 1024] [--batch 32]
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import torch
from benchargs import bench_parser

from potluck.models import stage_bounds
from potluck.peer.pipeline.pipeline import Neighbour, Pipeline
from potluck.peer.training.data import Dataset, in_run_order
from potluck.peer.training.model import build_layers, lm_loss
from potluck.protos import potluck_pb2 as pb
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.identity import Identity
from potluck.protos.net.transport import PeerClient, PeerServer, Traffic

VARIANTS = {
    "fp32": {"pipeline.compression": "none", "pipeline.grad_bits": None},
    "direct4": {"pipeline.compression": "direct", "pipeline.bits": 4},
    "acsgd4": {"pipeline.compression": "acsgd", "pipeline.bits": 4},
    "direct2": {"pipeline.compression": "direct", "pipeline.bits": 2},
    "acsgd2": {"pipeline.compression": "acsgd", "pipeline.bits": 2},
}


class Stage:
    def __init__(self, cfg: RunConfig, stage: int) -> None:
        self.id = Identity.generate().peer_id
        start, stop = stage_bounds(cfg.model, cfg.pipeline)[stage]
        self.layers = build_layers(cfg.model, cfg.train.seed, start, stop)
        self.opt = torch.optim.AdamW(self.layers.parameters(), lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2),
                                     weight_decay=0.0)
        self.client = PeerClient(Traffic())
        self.pipe = Pipeline(run_id=cfg.run_id, me=self.id, stage=stage, stages=2, model=cfg.model, cfg=cfg.pipeline,
                             client=self.client, num_samples=cfg.data.num_samples)
        self.server = PeerServer(self, Traffic(), host="127.0.0.1", port=0)
        self.address = f"127.0.0.1:{self.server.port}"

    def push_pipe(self, chunks: Iterator[pb.PipeChunk]) -> pb.Ack:
        return self.pipe.on_message(chunks)

    def close(self) -> None:
        self.server.stop(0.1)
        self.pipe.close()
        self.client.close()


def train(cfg: RunConfig, data: Dataset, steps: int, epoch_steps: int) -> dict:
    stages = [Stage(cfg, 0), Stage(cfg, 1)]
    a, b = stages
    a.pipe.begin_round(1, 0, None, Neighbour(b.id, b.address))
    b.pipe.begin_round(1, 0, Neighbour(a.id, a.address), None)
    sampler = in_run_order(cfg.data.num_samples, cfg.data.seed, steps * cfg.train.batch_size)
    marks: dict[str, dict] = {}
    errors: list[BaseException] = []

    def worker(s: Stage, idx: int) -> None:
        try:
            for i in range(steps):
                if i == epoch_steps:
                    t = s.pipe.traffic
                    marks[f"s{idx}"] = {"act": t.activations, "grad": t.gradients}
                batch = None
                if idx == 0:
                    ids = sampler.next_ids(cfg.train.batch_size)
                    x, y = data.batch(ids)
                    batch = (ids, x, y)
                s.opt.zero_grad(set_to_none=True)
                s.pipe.train_step(s.layers, i, batch, torch.device("cpu"))
                s.opt.step()
        except BaseException as err:
            errors.append(err)

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(s, i)) for i, s in enumerate(stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    seconds = time.monotonic() - t0
    ta, tb = a.pipe.traffic, b.pipe.traffic
    layers = list(a.layers) + list(b.layers)
    eval_loss = mean_loss(layers, data, data.eval_ids())
    train_loss = mean_loss(layers, data, list(range(cfg.data.num_samples)))
    footprint = a.pipe.footprint()["memory_bytes"] + b.pipe.footprint()["memory_bytes"]
    for s in stages:
        s.close()
    late = steps - epoch_steps
    return {
        "eval_loss": round(eval_loss, 4), "train_set_loss": round(train_loss, 4), "seconds": round(seconds, 1),
        "act_bytes_per_step": round(ta.activations / steps), "act_fp32_bytes_per_step": round(ta.activations_fp32 / steps),
        "act_bytes_per_step_after_epoch1": round((ta.activations - marks["s0"]["act"]) / late),
        "grad_bytes_per_step": round(tb.gradients / steps), "grad_fp32_bytes_per_step": round(tb.gradients_fp32 / steps),
        "buffer_bytes": footprint,
    }


@torch.no_grad()
def mean_loss(layers: list, data: Dataset, ids: list[int]) -> float:
    total = 0.0
    for k in range(0, len(ids), 128):
        x, y = data.batch(ids[k:k + 128])
        for layer in layers:
            x = layer(x)
        total += float(lm_loss(x, y)) * len(y)
    return total / len(ids)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--steps", type=int, default=320)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = {"run_id": "bench", "model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4, "model.seq_len": 32,
            "train.batch_size": args.batch, "train.lr": 2e-3, "train.warmup_steps": 0, "data.num_samples": args.samples,
            "pipeline.stages": 2, "pipeline.micro_batches": 2, "pipeline.pipe_timeout_s": 120.0}
    epoch_steps = -(-args.samples // args.batch)
    results, data, floor = {}, None, None
    for name in args.variants.split(","):
        cfg = apply_overrides(RunConfig(), {**base, **VARIANTS[name]})
        data = data or Dataset(cfg.data, cfg.model)
        floor = data.loss_floor
        results[name] = train(cfg, data, args.steps, epoch_steps)
    ref = results.get("fp32")
    for r in results.values():
        if ref:
            r["act_bytes_vs_fp32"] = round(r["act_bytes_per_step"] / ref["act_bytes_per_step"], 4)
            r["act_bytes_vs_fp32_after_epoch1"] = round(r["act_bytes_per_step_after_epoch1"] / ref["act_bytes_per_step"], 4)
            r["grad_bytes_vs_fp32"] = round(r["grad_bytes_per_step"] / ref["grad_bytes_per_step"], 4)
            r["eval_loss_vs_fp32"] = round(r["eval_loss"] / ref["eval_loss"] - 1, 4)
    print(json.dumps({
        "benchmark": "pipeline_acsgd", "grid": "2 stages x 1 replica over loopback gRPC", "steps": args.steps,
        "samples": args.samples, "batch": args.batch, "epochs": round(args.steps * args.batch / args.samples, 1),
        "loss_floor": round(floor, 4) if floor else None, "variants": results,
        "targets": {"acsgd4_act_bytes_vs_fp32": 0.125, "acsgd4_eval_loss_vs_fp32": 0.01},
    }))


if __name__ == "__main__":
    main()
