"""Data pipeline throughput: ``potluck data prepare`` (MB/s of text), the shard reader (tokens/s), and
the baseline that matters, what one CPU training peer consumes (tokens/s), measured in the same run.

Worker processes are spawned, so each ``prepare`` call with workers pays a start-up (about half a
second here) that a corpus of gigabytes does not notice but ``--mb 32`` does.

Workload: ``--mb`` MB of deterministic synthetic text (jsonl; Zipf-distributed pseudo-words, documents
of 20 to 2000 words) and a byte-level BPE of 8192 ids trained on its first 2 MB.

* ``prepare_MBps``: text MB/s of ``prepare`` with ``--workers`` processes, byte-level and BPE (and
  BPE with one worker, the in-process path);
* ``loader_tokens_per_s``: uniformly random windows of ``seq_len + 1`` = 257 tokens through
  ``ShardSet.window``, one by one, and as the trainer takes them, a batch of 8 stacked into a tensor;
  shards are 2**18 tokens here (64x smaller than the default), so most reads map a shard afresh (the
  reader keeps 4 mapped): the reader's worst case;
* ``training_tokens_per_s``: AdamW steps of the native ``llama-20m`` on this CPU at batch 8 x 256;
* ``loader_over_training``: batch loader tokens/s over training tokens/s (target > 10: reading data
  must never be what a peer waits on).

    python benchmarks/data_pipeline.py [--mb 32] [--workers 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from potluck.data.prepare import prepare
from potluck.data.shards import ShardSet
from potluck.data.tokenizer import load_tokenizer

TARGET = 10.0
SEQ, BATCH = 256, 8
SHARD_TOKENS = 1 << 18  # ~17 BPE shards at 32 MB: random windows keep remapping (the reader maps 4 at a time)


def synthetic_corpus(path: Path, mb: float, seed: int = 0) -> int:
    """``mb`` MB of jsonl text, the same on every run; its size in bytes of text."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    vocab = ["".join(rng.choice(letters, size=rng.integers(1, 11))) for _ in range(20_000)]
    size = 0
    with open(path, "w") as f:
        while size < mb * 1e6:
            ids = np.minimum(rng.zipf(1.3, size=int(rng.integers(20, 2000))), len(vocab)) - 1
            text = " ".join(vocab[i] for i in ids) + "."
            f.write(json.dumps({"text": text}) + "\n")
            size += len(text)
    return size


def train_bpe(corpus: Path, out: Path, vocab_size: int = 8192) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts, size = [], 0
    with open(corpus) as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(texts[-1])
            if size > 2e6:
                break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                       show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def prepare_mbps(corpus: Path, text_bytes: int, tokenizer: str, out: Path, workers: int) -> float:
    t0 = time.perf_counter()
    prepare([corpus], load_tokenizer(tokenizer), out, workers=workers, shard_tokens=SHARD_TOKENS, progress=False)
    return text_bytes / 1e6 / (time.perf_counter() - t0)


def loader_tokens_per_s(shards: ShardSet, reads: int = 20_000) -> dict[str, float]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, shards.num_windows(SEQ), reads).tolist()
    import torch
    t0 = time.perf_counter()
    for i in ids:
        shards.window(i, SEQ)
    single = reads * (SEQ + 1) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for b in range(0, reads, BATCH):
        torch.from_numpy(np.stack([shards.window(i, SEQ) for i in ids[b:b + BATCH]]))
    batched = reads * (SEQ + 1) / (time.perf_counter() - t0)
    return {"window": round(single), "batch8x256": round(batched)}


def training_tokens_per_s(shards: ShardSet, steps: int) -> float:
    import torch

    from potluck.models import build_stage, forward_layers, lm_loss
    from potluck.protos.config.runconfig import ModelConfig

    cfg = ModelConfig(family="llama", preset="llama-20m", vocab_size=shards.tokenizer.vocab_size, seq_len=SEQ)
    layers = build_stage(cfg, 0)
    opt = torch.optim.AdamW(layers.parameters(), lr=3e-4)
    batch = torch.from_numpy(np.stack([shards.window(i, SEQ) for i in range(BATCH)]))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        lm_loss(forward_layers(layers, batch[:, :-1]), batch[:, 1:]).backward()
        opt.step()

    step()  # warm-up: allocator, AdamW state
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * BATCH * SEQ / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=32.0, help="MB of synthetic text (default 32)")
    parser.add_argument("--workers", type=int, default=2, help="prepare's worker processes (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps (default 3)")
    args = parser.parse_args()
    import torch  # here, not at the top: prepare's spawned workers re-import this module

    torch.set_num_threads(min(torch.get_num_threads(), 2))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        text_bytes = synthetic_corpus(root / "corpus.jsonl", args.mb)
        bpe = str(train_bpe(root / "corpus.jsonl", root / "bpe"))
        rates = {"bytes": prepare_mbps(root / "corpus.jsonl", text_bytes, "bytes", root / "bytes", args.workers),
                 "bpe": prepare_mbps(root / "corpus.jsonl", text_bytes, bpe, root / "bpe-shards", args.workers),
                 "bpe_1_worker": prepare_mbps(root / "corpus.jsonl", text_bytes, bpe, root / "bpe-1", 1)}
        shards = ShardSet.open(root / "bpe-shards")
        loader = loader_tokens_per_s(shards)
        training = training_tokens_per_s(shards, args.steps)
        result = {
            "benchmark": "data_pipeline",
            "text_MB": round(text_bytes / 1e6, 1),
            "bpe_tokens": shards.num_tokens,
            "workers": args.workers,
            "prepare_MBps": {k: round(v, 2) for k, v in rates.items()},
            "loader_tokens_per_s": loader,
            "training_tokens_per_s": round(training, 1),
            "training": f"llama-20m, AdamW, batch {BATCH}x{SEQ}, {torch.get_num_threads()} CPU threads",
            "loader_over_training": round(loader["batch8x256"] / training, 1),
            "target": TARGET,
            "wall_s": 0.0,
        }
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
