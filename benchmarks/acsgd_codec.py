"""Stage-boundary traffic and error: AC-SGD 4-bit against fp32 and direct 4-bit, on drifting activations.

Two workloads, each a sequence of micro-batches in which every sample comes back once per epoch:

* ``synthetic``: ``[seq, d]`` activations with per-channel magnitudes spread over two decades (real
  activations have outlier channels), each sample drifting by a small random step per epoch;
* ``tinygpt``: the activations between block ``cut - 1`` and ``cut`` of a TinyGPT trained
  (uncompressed) for several epochs on a fixed set of the built-in Markov data.

For every workload the same sequence goes through fp32 (no compression), direct 4-bit
quantization (per-channel scales per micro-batch) and AC-SGD 4-bit (first visits in fp16). Prints
one JSON line with bytes per micro-batch (first epoch and later epochs apart: AC-SGD pays fp16 on
first visits), the relative reconstruction error ``||a_hat - a|| / ||a||`` over later epochs, and
encode+decode throughput in MB/s of fp32 input (AC-SGD including its buffer updates on both sides).

    python benchmarks/acsgd_codec.py [--epochs 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator

import torch

from potluck.compression.acsgd import AcsgdConfig, AcsgdMessage, AcsgdReceiver, AcsgdSender
from potluck.compression.actcodec import ActCodec
from potluck.peer.training.data import Dataset, in_run_order
from potluck.peer.training.model import build_layers, lm_loss
from potluck.protos.config.runconfig import DataConfig, ModelConfig

Batch = tuple[int, list[int], torch.Tensor]  # (epoch, sample ids, activations)


def synthetic(args: argparse.Namespace) -> Iterator[Batch]:
    gen = torch.Generator().manual_seed(0)
    n, seq, d = args.samples, args.seq, args.d
    acts = torch.randn(n, seq, d, generator=gen) * torch.logspace(-1, 1, d)
    for epoch in range(args.epochs):
        acts += args.drift * torch.randn(n, seq, d, generator=gen) * torch.logspace(-1, 1, d)
        order = torch.randperm(n, generator=gen).tolist()
        for s in range(0, n, args.batch):
            ids = order[s : s + args.batch]
            yield epoch, ids, acts[ids].clone()


def tinygpt(args: argparse.Namespace) -> Iterator[Batch]:
    torch.manual_seed(0)
    model_cfg = ModelConfig(vocab_size=32, d_model=128, n_layers=4, n_heads=4, seq_len=64)
    data = Dataset(DataConfig(markov_order=2, num_samples=args.samples), model_cfg)
    layers = build_layers(model_cfg, seed=0)
    opt = torch.optim.AdamW(layers.parameters(), lr=2e-3)
    sampler = in_run_order(args.samples, seed=0, count=1 << 16)
    cut = 3  # embedding + 2 blocks | 2 blocks + head
    steps_per_epoch = args.samples // args.batch
    for step in range(args.epochs * steps_per_epoch):
        ids = sampler.next_ids(args.batch)
        x, y = data.batch(ids)
        h = x
        for i, layer in enumerate(layers):
            h = layer(h)
            if i == cut - 1:
                boundary = h.detach().clone()
        loss = lm_loss(h, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield step // steps_per_epoch, ids, boundary


def measure(batches: list[Batch]) -> dict:
    fp32 = [4 * a.numel() for _, _, a in batches]
    direct = ActCodec("quant", 4)
    sender, receiver = AcsgdSender(AcsgdConfig(bits=4)), AcsgdReceiver(AcsgdConfig(bits=4))
    d_bytes, d_err, ac_bytes, ac_err = [], [], [], []
    d_time = ac_time = 0.0
    for epoch, ids, a in batches:
        t0 = time.perf_counter()
        packet = direct.encode(a)
        rec = direct.decode(packet)
        t1 = time.perf_counter()
        msg = sender.encode(ids, a)
        rec_ac = receiver.decode(ids, AcsgdMessage.from_dict(msg.to_dict()))
        t2 = time.perf_counter()
        if epoch > 0:
            d_time += t1 - t0
            ac_time += t2 - t1
        d_bytes.append((epoch, packet.nbytes))
        ac_bytes.append((epoch, msg.nbytes))
        d_err.append((epoch, float((rec - a).norm() / a.norm())))
        ac_err.append((epoch, float((rec_ac - a).norm() / a.norm())))
    assert sender.buffer.digest() == receiver.buffer.digest()
    later_mb = sum(f for (e, _, _), f in zip(batches, fp32, strict=True) if e > 0) / 1e6

    def mean(pairs: list[tuple[int, float]], first: bool) -> float:
        return statistics.mean(v for e, v in pairs if (e == 0) == first)

    fp32_step = statistics.mean(fp32)
    return {
        "micro_batch_shape": list(batches[0][2].shape),
        "bytes_per_step": {
            "fp32": round(fp32_step),
            "direct4": round(mean(d_bytes, False)),
            "acsgd4_first_epoch": round(mean(ac_bytes, True)),
            "acsgd4_later_epochs": round(mean(ac_bytes, False)),
        },
        "ratio_vs_fp32_later_epochs": {
            "direct4": round(mean(d_bytes, False) / fp32_step, 4),
            "acsgd4": round(mean(ac_bytes, False) / fp32_step, 4),
        },
        "rel_error_later_epochs": {
            "fp32": 0.0,
            "direct4": round(mean(d_err, False), 5),
            "acsgd4": round(mean(ac_err, False), 5),
            "acsgd4_last_epoch": round(statistics.mean(v for e, v in ac_err if e == batches[-1][0]), 5),
        },
        "encode_decode_MBps": {"direct4": round(later_mb / d_time, 1), "acsgd4": round(later_mb / ac_time, 1)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128, help="synthetic workload only")
    parser.add_argument("--d", type=int, default=512, help="synthetic workload only")
    parser.add_argument("--drift", type=float, default=0.02, help="synthetic drift per epoch, relative")
    args = parser.parse_args()
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    t0 = time.perf_counter()
    result = {
        "benchmark": "acsgd_codec",
        "epochs": args.epochs,
        "samples": args.samples,
        "synthetic": {"drift_per_epoch": args.drift, **measure(list(synthetic(args)))},
        "tinygpt": measure(list(tinygpt(args))),
        "wall_s": 0.0,
    }
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
