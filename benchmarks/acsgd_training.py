"""Training quality through a compressed stage boundary: fp32, direct quantization and AC-SGD, in one process.

A TinyGPT (``build_layers``) is cut into two pipeline stages (embedding + first half of the blocks |
the rest + head) and trained for ``--steps`` steps on a fixed set of ``--samples`` samples of the
built-in Markov data, revisited every epoch (the AC-SGD setting: multi-epoch fine-tuning), from the
same weights (optionally pretrained uncompressed on fresh samples) with the same seed and sample
order. Only the boundary differs:

* ``fp32``: activations and gradients as they are;
* ``direct4`` / ``direct2``: activations quantized directly (per-channel scales per micro-batch);
* ``acsgd4`` / ``acsgd2``: AC-SGD deltas against per-sample buffers, first visits in fp16;

with gradients quantized directly at 8 bits in every compressed variant. Eval loss is measured on
held-out samples with the full uncompressed model (the quality of the weights), next to the
source's entropy floor; the loss on the training set itself shows how well each variant optimizes.
Prints one JSON line with both losses per variant, activation bytes per step (over the whole run,
first visits included, and after the first epoch) and gradient bytes per step, as ratios to fp32.

    python benchmarks/acsgd_training.py [--steps 300] [--samples 64] [--batch 8]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch
from torch import nn

from potluck.compression.acsgd import AcsgdConfig, AcsgdMessage, AcsgdReceiver, AcsgdSender, make_grad_codec
from potluck.compression.actcodec import ActCodec, Packet
from potluck.peer.training.data import Dataset, in_run_order
from potluck.peer.training.model import build_layers, forward_layers, lm_loss
from potluck.protos.config.runconfig import DataConfig, ModelConfig


class Boundary:
    """Stage 0 -> stage 1 forward, stage 1 -> stage 0 backward; counts the bytes that would travel."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.act_bytes = self.grad_bytes = 0
        bits = int(name[-1]) if name != "fp32" else 0
        self.direct = ActCodec("quant", bits) if name.startswith("direct") else None
        cfg = AcsgdConfig(bits=bits if bits else 4, grad_bits=8)
        self.sender, self.receiver = AcsgdSender(cfg), AcsgdReceiver(cfg)
        self.grad = make_grad_codec(cfg) if name != "fp32" else None

    def forward(self, ids: list[int], h: torch.Tensor) -> torch.Tensor:
        if self.name == "fp32":
            self.act_bytes += 4 * h.numel()
            return h
        if self.direct is not None:
            packet = Packet.from_dict(self.direct.encode(h).to_dict())
            self.act_bytes += packet.nbytes
            return self.direct.decode(packet)
        msg = AcsgdMessage.from_dict(self.sender.encode(ids, h).to_dict())
        self.act_bytes += msg.nbytes
        return self.receiver.decode(ids, msg)

    def backward(self, g: torch.Tensor) -> torch.Tensor:
        if self.grad is None:
            self.grad_bytes += 4 * g.numel()
            return g
        packet = self.grad.encode(g)
        self.grad_bytes += packet.nbytes
        return self.grad.decode(packet)


@torch.no_grad()
def mean_loss(layers: nn.ModuleList, data: Dataset, ids: list[int]) -> float:
    total = 0.0
    for s in range(0, len(ids), 64):
        x, y = data.batch(ids[s : s + 64])
        total += float(lm_loss(forward_layers(layers, x), y)) * len(x)
    return total / len(ids)


def pretrain(model: ModelConfig, data: Dataset, args: argparse.Namespace) -> nn.ModuleList:
    torch.manual_seed(0)
    layers = build_layers(model, seed=0)
    opt = torch.optim.AdamW(layers.parameters(), lr=3e-3)
    fresh = list(range(args.samples, args.samples + args.pretrain_steps * args.batch))
    for s in range(args.pretrain_steps):
        x, y = data.batch(fresh[s * args.batch : (s + 1) * args.batch])
        opt.zero_grad()
        lm_loss(forward_layers(layers, x), y).backward()
        nn.utils.clip_grad_norm_(layers.parameters(), 1.0)
        opt.step()
    return layers


def finetune(start: nn.ModuleList, data: Dataset, name: str, args: argparse.Namespace) -> dict:
    layers = copy.deepcopy(start)
    stage0, stage1 = layers[: args.cut], layers[args.cut :]
    opt = torch.optim.AdamW(layers.parameters(), lr=args.lr)
    sampler = in_run_order(args.samples, 1, args.steps * args.batch)  # (epoch after epoch, each in its own order)
    boundary = Boundary(name)
    first_epoch_steps = -(-args.samples // args.batch)
    act_bytes_epoch1 = 0
    t0 = time.perf_counter()
    for step in range(args.steps):
        if step == first_epoch_steps:
            act_bytes_epoch1 = boundary.act_bytes
        ids = sampler.next_ids(args.batch)
        x, y = data.batch(ids)
        h = forward_layers(stage0, x)
        h_in = boundary.forward(ids, h.detach()).requires_grad_()
        loss = lm_loss(forward_layers(stage1, h_in), y)
        opt.zero_grad()
        loss.backward()
        assert h_in.grad is not None
        h.backward(boundary.backward(h_in.grad))
        nn.utils.clip_grad_norm_(layers.parameters(), 1.0)
        opt.step()
    return {
        "eval_loss": round(mean_loss(layers, data, data.eval_ids()), 4),
        "finetune_set_loss": round(mean_loss(layers, data, list(range(args.samples))), 4),
        "act_bytes_per_step": round(boundary.act_bytes / args.steps),
        "act_bytes_per_step_after_epoch1": round(
            (boundary.act_bytes - act_bytes_epoch1) / max(1, args.steps - first_epoch_steps)
        ),
        "grad_bytes_per_step": round(boundary.grad_bytes / args.steps),
        "train_s": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=320, help="fine-tuning steps")
    parser.add_argument("--samples", type=int, default=1024, help="fine-tuning set, revisited every epoch")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--pretrain-steps", type=int, default=0, help="uncompressed steps on fresh samples first")
    parser.add_argument("--lr", type=float, default=2e-3, help="fine-tuning lr")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks; the cut is after half of them")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--markov-order", type=int, default=1)
    parser.add_argument("--variants", default="fp32,direct4,acsgd4,direct2,acsgd2")
    args = parser.parse_args()
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    t0 = time.perf_counter()
    model = ModelConfig(vocab_size=64, d_model=args.d_model, n_layers=args.layers, n_heads=4, seq_len=args.seq)
    args.cut = 1 + args.layers // 2  # stage 0: embedding + half the blocks; stage 1: the rest + head
    data = Dataset(DataConfig(markov_order=args.markov_order, num_samples=args.samples + args.pretrain_steps * args.batch,
                              eval_samples=128), model)
    start = pretrain(model, data, args)
    results = {name: finetune(start, data, name, args) for name in args.variants.split(",")}
    fp32 = results.get("fp32")
    for r in results.values():
        if fp32:
            r["act_bytes_vs_fp32"] = round(r["act_bytes_per_step"] / fp32["act_bytes_per_step"], 4)
            r["act_bytes_vs_fp32_after_epoch1"] = round(
                r["act_bytes_per_step_after_epoch1"] / fp32["act_bytes_per_step_after_epoch1"], 4
            )
            r["grad_bytes_vs_fp32"] = round(r["grad_bytes_per_step"] / fp32["grad_bytes_per_step"], 4)
    print(json.dumps({
        "benchmark": "acsgd_training",
        "model": {"d_model": model.d_model, "n_layers": model.n_layers, "seq_len": model.seq_len, "cut": args.cut,
                  "markov_order": args.markov_order},
        "finetune": {"samples": args.samples, "batch": args.batch, "steps": args.steps,
                     "epochs": round(args.steps * args.batch / args.samples, 1), "lr": args.lr},
        "pretrain_steps": args.pretrain_steps,
        "start_eval_loss": round(mean_loss(start, data, data.eval_ids()), 4),
        "loss_floor": round(data.loss_floor or 0.0, 4),
        "variants": results,
        "wall_s": round(time.perf_counter() - t0, 1),
    }))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
