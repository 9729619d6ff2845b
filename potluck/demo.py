"""``potluck demo``: a whole swarm on this machine, from nothing to a trained tiny model.

It writes a run file, starts a coordinator and ``--peers`` peer processes (real processes, real DHT,
real gRPC on 127.0.0.1), follows the run through the coordinator's status API, prints the loss of
every outer step and the final eval loss next to the data's entropy floor, and stops every process
it started, also on Ctrl+C.

Its work folder (run file, journal, checkpoints, logs) is kept, also the temporary one it makes
without ``--workdir``: a user may want the logs of a failed run or to export the trained model. The
last lines say where it is, how to export the model from it and (a temporary one) how to remove it.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from potluck.local import LocalSwarm, SwarmError, get_state
from potluck.protos.config.files import apply_overrides, load_config
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.config.section import ConfigError

DEMO_DEFAULTS = {
    "run_id": "demo",
    "diloco.outer_steps": 12,
    "diloco.inner_steps": 30,
    "coordinator.host": "127.0.0.1",
    "coordinator.checkpoint_every": 4,
}


def demo_config(args: argparse.Namespace, workdir: Path) -> RunConfig:
    overrides: dict[str, Any] = dict(DEMO_DEFAULTS)
    if args.config:
        overrides = {k: v for k, v in overrides.items() if k in ("coordinator.host",)}
    if args.stages > 1:
        overrides["pipeline.stages"] = args.stages
        if not args.config:  # the demo's own tiny model grows a layer per stage; a model --config names is the user's
            overrides.update({"data.num_samples": 1024, "model.n_layers": max(2, args.stages)})
    overrides["membership.min_peers"] = args.peers
    overrides["coordinator.journal_dir"] = str(workdir / "journal")
    if args.outer_steps is not None:
        overrides["diloco.outer_steps"] = args.outer_steps
    if args.inner_steps is not None:
        overrides["diloco.inner_steps"] = args.inner_steps
    for pair in args.set:
        key, _, value = pair.partition("=")
        overrides[key.strip()] = value.strip()
    return apply_overrides(load_config(args.config), overrides)


class Progress:
    """One status line on a terminal (redrawn in place), nothing on a pipe."""

    def __init__(self, total: int) -> None:
        self.total, self.tty = total, sys.stdout.isatty()

    def line(self, text: str) -> None:
        if self.tty:
            sys.stdout.write("\r\x1b[2K")
        print(text, flush=True)

    def bar(self, done: int, text: str) -> None:
        if not self.tty:
            return
        width = 24
        fill = int(width * done / max(self.total, 1))
        sys.stdout.write(f"\r\x1b[2K[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} outer steps  {text}")
        sys.stdout.flush()


def run_demo(args: argparse.Namespace) -> int:
    if args.stages < 1 or (args.replicas is not None and args.replicas < 1):
        raise SystemExit("potluck demo: --stages and --replicas must be at least 1")
    if args.replicas is not None or args.stages > 1:
        args.peers = args.stages * (args.replicas or 2)
    if args.peers < 1:
        raise SystemExit("potluck demo: --peers must be at least 1")
    made = not args.workdir
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="potluck-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        cfg = demo_config(args, workdir)
    except ConfigError as err:
        if made:
            workdir.rmdir()  # still empty: nothing to keep
        raise SystemExit(f"potluck demo: {err}") from None

    from potluck.peer.training.data import Dataset  # the floor is a property of the data, computed here once

    floor = Dataset(cfg.data, cfg.model).loss_floor
    progress = Progress(cfg.diloco.outer_steps)
    print(
        f"potluck demo: {args.peers} peers x {cfg.diloco.outer_steps} outer steps x {cfg.diloco.inner_steps} inner steps "
        f"({model_line(cfg)}, {cfg.sync.codec} all-reduce) on {peer_device()}\n"
        + (f"  grid: {cfg.pipeline.stages} stages x {args.peers // cfg.pipeline.stages} replicas, activations "
           f"{cfg.pipeline.compression} {cfg.pipeline.bits}-bit, gradients {cfg.pipeline.grad_bits or 32}-bit\n"
           if cfg.pipeline.stages > 1 else "")
        + f"  work dir: {workdir}",
        flush=True,
    )
    swarm = LocalSwarm(workdir, logs=not args.verbose, threads=max(1, (os.cpu_count() or 2) // args.peers))
    # Ctrl+C stops the demo even when it was started with SIGINT ignored (a background job of a
    # script, nohup): Python installs its handler only where the parent left SIGINT's default
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        ready = swarm.start_coordinator(cfg)
        print(f"  join address: {ready['join']}\n  status page: {ready['status_url']}", flush=True)
        if not args.verbose:
            print(f"  logs: {swarm.logs}", flush=True)
        for i in range(args.peers):
            swarm.start_peer(name=f"demo-{i}")
        assert swarm.coordinator is not None
        final = follow(ready["status_url"], cfg, progress, swarm.coordinator, swarm.peers, swarm.logs)
        if final is None:
            return 1
        start = math.log(cfg.model.vocab_size)
        floor_text = f"; entropy floor of the data {floor:.3f}" if floor is not None else ""
        progress.line(f"final eval loss {final:.3f} nats/token (untrained: {start:.3f}){floor_text}")
        revisits = revisits_per_sample(cfg, args.peers)
        if cfg.pipeline.stages > 1 and revisits >= 2:
            progress.line(f"  note: this pipelined demo revisits its {cfg.data.num_samples} samples ~{revisits:.0f} times "
                          "each on purpose (AC-SGD saves bytes on revisits), so train loss can fall below the floor "
                          "by memorization while eval loss rises")
        if args.linger > 0:
            progress.line(f"lingering {args.linger:.0f} s: status page {ready['status_url']} (Ctrl+C to stop)")
            time.sleep(args.linger)
        return 0
    except KeyboardInterrupt:
        progress.line("interrupted: stopping every process the demo started")
        return 130
    except (RuntimeError, SwarmError) as err:
        progress.line(f"potluck demo failed: {err} (logs in {swarm.logs})")
        return 1
    finally:
        swarm.stop()
        for line in leftover_lines(workdir, made, cfg.model.family):
            progress.line(line)


def revisits_per_sample(cfg: RunConfig, peers: int) -> float:
    """How many times each training sample is drawn over the run: every replica draws ``batch_size``
    samples per inner step from its shard of ``num_samples``."""
    replicas = max(1, peers // cfg.pipeline.stages)
    draws = replicas * cfg.diloco.outer_steps * cfg.diloco.inner_steps * cfg.train.batch_size
    return draws / cfg.data.num_samples


def model_line(cfg: RunConfig) -> str:
    m = cfg.model
    size = f"d_model {m.d_model}, {m.n_layers} layers" if m.family != "hf" else f"{m.hf_model}"
    return f"{m.family} model, {size}" if m.family != "tiny" else size


def peer_device() -> str:
    """Where the demo's peers train: each picks CUDA when this machine has it (``--device auto``)."""
    import torch

    if torch.cuda.is_available():
        return f"CUDA ({torch.cuda.get_device_name(0)})"
    return "this CPU"


def leftover_lines(workdir: Path, made: bool, family: str = "tiny") -> list[str]:
    """What the demo leaves on disk, how to export the model from it (a Hugging Face folder for the families
    transformers loads, one torch file for the built-in one), and how to remove it."""
    kind = "temporary work folder" if made else "work folder"
    lines = [f"kept the {kind} {workdir} (run file, journal, checkpoints, logs)"]
    if any((workdir / "journal" / "checkpoints").glob("ckpt-*.json")):
        out = "model.pt" if family == "tiny" else "model-hf"
        lines.append(f"  export the model: potluck export --journal-dir {shlex.quote(str(workdir / 'journal'))} --out {out}")
    if made:  # never suggest removing a folder the user named: it may hold other things
        lines.append(f"  remove it: rm -r {shlex.quote(str(workdir))}")
    return lines


def follow(url: str, cfg: RunConfig, progress: Progress, coord: Any, peers: list[Any],
           logs: Path | None = None) -> float | None:
    """Print each outer step as it completes; returns the final eval loss, None on failure. A peer that exits
    with an error ends the demo with its reason (its own peers are all the demo has)."""
    printed: set[int] = set()
    final_eval: float | None = None
    while True:
        if coord.poll() is not None:
            raise RuntimeError(f"the coordinator exited with code {coord.returncode}")
        failed = [k for k, p in enumerate(peers) if p.poll() not in (None, 0)]
        if failed and final_eval is None:
            raise RuntimeError(why_failed(url, failed[0], peers[failed[0]].returncode, logs))
        if all(p.poll() is not None for p in peers) and final_eval is None:
            raise RuntimeError("every peer exited before the run finished")
        state = get_state(url)
        if state is None:
            time.sleep(0.5)
            continue
        run = state["run"]
        for h in state["history"]:
            if h["step"] in printed or h["eval_loss"] is None or h["loss"] is None:
                continue
            printed.add(h["step"])
            outer = f", outer step {h['outer_s']:.2f} s" if h.get("outer_s") else ""
            progress.line(
                f"outer step {h['step']:3d}/{cfg.diloco.outer_steps}  train loss {h['loss']:.3f}  "
                f"eval loss {h['eval_loss']:.3f}  ({h['members']} peers{outer})"
            )
            for line in pipeline_lines(h):
                progress.line(line)
            if h["step"] >= cfg.diloco.outer_steps:
                final_eval = h["eval_loss"]
        progress.bar(run["outer_step"], run.get("waiting_reason") or f"{len([p for p in state['peers'] if p['state'] == 'training'])} training")
        if run["finished"] and final_eval is not None:
            return final_eval
        time.sleep(0.5)


def why_failed(url: str, index: int, code: int, logs: Path | None, wait_s: float = 5.0) -> str:
    """One line saying why peer ``index`` exited with ``code``: the reason its goodbye gave the coordinator (the
    page shows the same), else the last error line of its log."""
    deadline = time.monotonic() + wait_s
    while True:
        state = get_state(url) or {}
        rows = [p for p in state.get("peers", []) if p.get("state") == "failed" and p.get("error")]
        if rows:
            return f"peer {rows[-1]['short_id']} stopped: {rows[-1]['error']}"
        if time.monotonic() > deadline:
            break
        time.sleep(0.25)
    log = logs / f"peer-{index}.log" if logs is not None else None
    lines = log.read_text(errors="replace").splitlines() if log is not None and log.exists() else []
    errors = [line for line in lines if " ERROR " in line]
    return f"peer-{index} exited with code {code}" + (f": {errors[-1].split(' ERROR ', 1)[1].strip()}" if errors else "")


def pipeline_lines(h: dict[str, Any]) -> list[str]:
    """Per stage: the loss its peers report, and the bytes across each boundary vs fp32."""
    by_stage = h.get("by_stage") or {}
    out = []
    for stage in sorted(by_stage, key=int):
        b = by_stage[stage]
        loss = sum(b["losses"]) / len(b["losses"]) if b.get("losses") else float("nan")
        parts = [f"    stage {stage}: loss {loss:.3f}"]
        nxt = str(int(stage) + 1)
        if b["activations_fp32"]:
            parts.append(f"activations to stage {nxt} {b['activations'] / 1e3:.0f} kB "
                         f"({b['activations_fp32'] / max(b['activations'], 1):.1f}x less than fp32)")
        if b["gradients_fp32"]:
            parts.append(f"gradients to stage {int(stage) - 1} {b['gradients'] / 1e3:.0f} kB "
                         f"({b['gradients_fp32'] / max(b['gradients'], 1):.1f}x less than fp32)")
        out.append(", ".join(parts))
    return out
