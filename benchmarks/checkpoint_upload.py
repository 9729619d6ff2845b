"""Off-box checkpoints: what uploading a checkpoint costs, against a plain copy to disk, and what it does to the tick.

Two measurements, one JSON line:

1. **upload vs copy.** A checkpoint of ``--mb`` MB (600 by default; two stage files of float32 theta and momentum,
   written by the coordinator's own :class:`CheckpointStore`) is uploaded by :class:`~potluck.coordinator.store.offbox.Uploader` (each file sent, read back and hashed,
   the manifest last) to moto's S3 server in a process of its own on 127.0.0.1, and, as the baseline, copied to
   another folder of the same disk and fsynced. Figures: seconds and bytes of each, and their ratio.
2. **the tick while it uploads.** A real coordinator (``potluck coordinator`` through ``LocalSwarm``, no peers, tick
   ``--tick-s``) starts with that checkpoint in its journal: with ``coordinator.checkpoint_url`` it uploads it at
   once (its uploader's first pass), and its ``coordinator.tick_s`` p99 from ``/api/v1/state`` is read when the
   store holds the manifest; the baseline is the same coordinator without the URL, read after as long.

    python benchmarks/checkpoint_upload.py [--mb 600] [--tick-s 0.05] [--no-tick] [--store-nice 19]

The box is shared (2 cores here): moto, the uploader and the copy share them, so the upload is an upper bound on
what a store on another machine costs the coordinator's box.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from benchargs import bench_parser  # (beside this script)

from potluck.compression.transfer import Snapshot, tensors_hash
from potluck.coordinator.store.checkpoint import CheckpointStore
from potluck.coordinator.store.offbox import Uploader, complete, open_store
from potluck.local import LocalSwarm, wait_for
from potluck.procs import ProcessGroup
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig

BUCKET = "bench"
KEYS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def stages(total_bytes: int) -> Iterator[Snapshot]:
    floats = total_bytes // 16  # two stages, each theta + momentum at 4 bytes
    for s in range(2):
        theta = torch.randn(floats, generator=torch.Generator().manual_seed(s))
        tensors = {"theta": theta, "momentum": theta * 0.5}
        yield Snapshot(tensors, 1, tensors_hash(tensors), {"layout": [[f"layers.{s}.w", [floats]]], "stage": s})
        del theta, tensors


def moto(procs: ProcessGroup, log: Path, nice: int) -> str:
    proc = procs.spawn(["nice", "-n", str(nice), sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"], log)

    def port() -> str | None:
        if proc.poll() is not None:
            raise SystemExit(f"moto's server did not start: {log.read_text()[-300:]}")
        found = re.search(r"Running on (http://127\.0\.0\.1:\d+)", log.read_text())
        return found.group(1) if found else None

    endpoint: str = wait_for(port, 60, "moto's server")
    os.environ.update({**KEYS, "AWS_ENDPOINT_URL": endpoint})
    import boto3

    wait_for(lambda: _made(boto3, endpoint), 30, "moto's bucket")
    return endpoint


def _made(boto3: Any, endpoint: str) -> bool:
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
        return True
    except Exception:
        return False


def copy(src: CheckpointStore, dest: Path) -> float:
    dest.mkdir()
    t0 = time.monotonic()
    for f in sorted(src.dir.glob("ckpt-*")):
        shutil.copyfile(f, dest / f.name)
        with open(dest / f.name, "rb+") as out:
            os.fsync(out.fileno())
    return time.monotonic() - t0


def tick_p99(work: Path, checkpoints: Path, url: str, tick_s: float, hold_s: float | None
             ) -> tuple[float, float, int, float]:
    """A coordinator with ``checkpoints`` in its journal: (its tick p99, the seconds it ran, ticks in the window, the
    p99 of its ticks' own CPU time: what the loop did, without the waits for a core on a shared box)."""
    swarm = LocalSwarm(work, ProcessGroup(fork=True))
    journal = work / "journal"
    shutil.copytree(checkpoints, journal / "checkpoints")
    cfg = apply_overrides(RunConfig(), {"run_id": "bench", "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 2,
                                        "model.seq_len": 32, "coordinator.host": "127.0.0.1",
                                        "coordinator.tick_s": tick_s, "coordinator.journal_dir": str(journal),
                                        "coordinator.checkpoint_url": url, "coordinator.keep_checkpoints": 1})
    try:
        swarm.start_coordinator(cfg, env=dict(os.environ))
        t0 = time.monotonic()
        if url:
            remote = open_store(url)
            wait_for(lambda: complete(remote), 600, "the checkpoint in the store")
        else:
            assert hold_s is not None
            wait_for(lambda: time.monotonic() - t0 >= hold_s, hold_s + 10, "as long as the upload took", poll=0.2)
        ran = time.monotonic() - t0
        health = swarm.state()["coordinator"]
        tick = health["tick_s"]
        return float(tick["p99"]), ran, int(tick["window"]), float(health["tick_cpu_s"]["p99"])
    finally:
        swarm.stop()


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--mb", type=int, default=600, help="the checkpoint's size on disk, MB")
    parser.add_argument("--tick-s", type=float, default=0.05, help="the coordinator's tick (its p99 window: 1,000 ticks)")
    parser.add_argument("--no-tick", action="store_true", help="upload vs copy only")
    parser.add_argument("--store-nice", type=int, default=0, help="moto's CPU priority (19: it stands in for a store on "
                        "another machine, and takes the box's cores only when the coordinator leaves them)")
    args = parser.parse_args()
    procs = ProcessGroup()
    with tempfile.TemporaryDirectory(prefix="potluck-upload-") as tmp:
        work = Path(tmp)
        try:
            moto(procs, work / "moto.log", args.store_nice)
            store = CheckpointStore(work / "ckpt", keep=1)
            store.write_stages(1, stages(args.mb * 10**6), {"run_id": "bench"})
            size = sum(f.stat().st_size for f in store.dir.glob("ckpt-*"))
            copy_s = copy(store, work / "copy")
            up = Uploader(open_store(f"s3://{BUCKET}/upload"), store, keep=1)
            t0 = time.monotonic()
            up.sync()
            upload_s = time.monotonic() - t0
            out: dict[str, Any] = {
                "benchmark": "checkpoint_upload", "checkpoint_bytes": size, "upload_s": round(upload_s, 3),
                "upload_bytes_sent": up.sent_bytes, "copy_s": round(copy_s, 3),
                "upload_over_copy": round(upload_s / copy_s, 2), "target_upload_over_copy": 1.5,
                "verify": "every file read back from the store and its SHA-256 compared", "store_nice": args.store_nice,
            }
            shutil.rmtree(work / "copy")
            if not args.no_tick:
                with_url, ran, window, cpu = tick_p99(work / "with", store.dir, f"s3://{BUCKET}/tick", args.tick_s, None)
                without, _, base_window, base_cpu = tick_p99(work / "without", store.dir, "", args.tick_s, ran)
                out.update({"tick_p99_s_uploading": round(with_url, 4), "tick_p99_s_baseline": round(without, 4),
                            "tick_p99_over_baseline": round(with_url / without, 2) if without else None,
                            "ticks_uploading": window, "ticks_baseline": base_window, "upload_in_coordinator_s":
                            round(ran, 2), "target_tick_p99_over_baseline": 1.2,
                            "tick_cpu_p99_s_uploading": round(cpu, 4), "tick_cpu_p99_s_baseline": round(base_cpu, 4)})
            print(json.dumps(out), flush=True)
        finally:
            procs.stop()


if __name__ == "__main__":
    main()
