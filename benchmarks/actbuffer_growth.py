"""AC-SGD's per-sample buffer as it fills: peak memory and CPU of its puts, against one array doubled by copying.

A pipeline peer's AC-SGD buffer (:class:`~potluck.compression.actbuffer.ActivationBuffer`) holds one entry per
sample it has seen; it grows as first visits arrive, for the whole first epoch. Until 2026-12-03 it was one array
whose capacity doubled by copying into a fresh one; now it grows by pages, each as big as all before it, and never
copies. Each side runs in a fresh process of its own (so its peak resident set is its own): ``--samples`` entries
of ``--seq`` x ``--d-model`` activations in float16 (the buffer's storage for the built-in model's runs), put 16
at a time as micro-batches arrive. The baseline is that earlier design: the same buffer (its ids, slots, versions and
float16 conversion) over one array doubled by copying, written out here in a few lines. Printed: each side's peak resident set over what
the process held before its first put, against the bytes the entries take, and the CPU seconds of all the puts.

    python benchmarks/actbuffer_growth.py [--samples 4800] [--seq 64] [--d-model 240] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

from benchargs import bench_parser

BATCH = 16


def doubling_buffer():  # type: ignore[no-untyped-def]
    """The baseline: the same buffer (ids, slots, versions, float16 conversion) over one array whose capacity doubles
    by copying everything into a fresh one, as before 2026-12-03."""
    import numpy as np

    from potluck.compression.actbuffer import ActivationBuffer

    class Doubling(ActivationBuffer):
        def _reserve(self, n_new: int) -> None:
            assert self.sample_shape is not None
            store = getattr(self, "store", np.zeros((0, *self.sample_shape), self._np))
            need = self._high + max(0, n_new - len(self._free))
            if need > store.shape[0]:
                fresh = np.zeros((max(need, 2 * store.shape[0], 16), *self.sample_shape), self._np)
                fresh[: self._high] = store[: self._high]
                store = fresh
            self.store = store

        def _rows(self, slots: np.ndarray) -> np.ndarray:
            return self.store[slots]

        def _write(self, slots: np.ndarray, rows: np.ndarray) -> None:
            self.store[slots] = rows

    return Doubling(dtype="float16")


def one(kind: str, samples: int, seq: int, d_model: int) -> dict:
    """Fill one buffer in this process; its peak memory and CPU."""
    import torch

    from potluck.compression.actbuffer import ActivationBuffer

    values = torch.randn(BATCH, seq, d_model)
    buf = ActivationBuffer(dtype="float16") if kind == "pages" else doubling_buffer()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.process_time()
    for start in range(0, samples, BATCH):
        ids = list(range(start, start + BATCH))
        buf.put(ids, values, [1] * BATCH)
    cpu = time.process_time() - t0
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    return {"peak_bytes": peak, "cpu_s": cpu}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--samples", type=int, default=4800)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=240)
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per side, alternating")
    parser.add_argument("--one", choices=["pages", "doubling"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.samples, args.seq, args.d_model)))
        return
    held = args.samples * args.seq * args.d_model * 2
    runs: dict[str, list[dict]] = {"pages": [], "doubling": []}
    for _ in range(args.repeats):
        for kind in runs:
            out = subprocess.run([sys.executable, __file__, "--one", kind, "--samples", str(args.samples), "--seq",
                                  str(args.seq), "--d-model", str(args.d_model)], capture_output=True, text=True,
                                 check=True)
            runs[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
    peak = {k: statistics.median(r["peak_bytes"] for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r["cpu_s"] for r in v) for k, v in runs.items()}
    print(json.dumps({
        "benchmark": "actbuffer_growth", "samples": args.samples, "sample_shape": [args.seq, args.d_model],
        "dtype": "float16", "held_bytes": held,
        "peak_over_held_pages": round(peak["pages"] / held, 3), "peak_over_held_doubling": round(peak["doubling"] / held, 3),
        "cpu_s_pages": round(cpu["pages"], 3), "cpu_s_doubling": round(cpu["doubling"], 3),
        "cpu_ratio": round(cpu["pages"] / cpu["doubling"], 3), "runs": runs,
    }))


if __name__ == "__main__":
    main()
