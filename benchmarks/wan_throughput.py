"""Training throughput over an emulated WAN: potluck's defaults against fp32, fully synchronous training.

A real swarm (coordinator + 4 peer processes, hivemind DHT, gRPC with mutual TLS) as a grid of
S = 2 stages x R = 2 replicas (two pipelines, ``--micro-batches`` micro-batches per inner step)
trains the ~2.1M-parameter model of ``overlap_utilization.py`` (d_model 240, 3 blocks, seq 64, batch
16), every link between two peers emulated by the transport (:mod:`potluck.protos.testkit.netem`) at
``--mbps`` and ``--delay-ms`` one way. Placement is ``sticky``: all links are alike, so a re-plan
could only move tasklets for nothing. Two configurations, one swarm each, in ``--order``:

* ``potluck``: the defaults: AC-SGD 4-bit activations, 8-bit gradients across the stage boundary,
  and an int8 DiLoCo all-reduce every H = ``--inner-steps`` inner steps, for ``--outer-steps``
  outer steps (default 2 x 50 = 100 inner steps: two all-reduces, the last one inside the window);
* ``baseline``: fp32 activations (``pipeline.compression = "none"``), fp32 gradients
  (``pipeline.grad_bits = 32``) and an fp32 all-reduce (``sync.codec = "raw"``) after every inner
  step (H = 1), for ``--baseline-steps`` inner steps (default 50: every step of it costs the same,
  so tokens/s over 50 steps is its steady rate; 0 runs as many steps as the potluck run).

H = 1 makes the baseline differ from textbook synchronous data parallel training: it runs potluck's
whole outer step every step: the coordinator's round for it in the DHT (a pipeline starts a step
only on its round), the all-reduce, the reports. That per-round overhead
(``s_per_inner_step`` minus ``compute_s_per_inner_step`` minus ``sync_s_per_inner_step``, and the
waiting in ``sync_s``) is more than a plain ring all-reduce would cost, which flatters potluck. With
no WAN at all (``--delay-ms 0 --mbps 100000``) the baseline was already 2.65x slower on the 2-core CI
box (its gradients still 8-bit then): 0.32 s of inner step, 0.16 s in the outer step and 0.37 s
waiting for rounds. The line checks that the baseline's gradients really travelled in fp32
(``baseline_gradients``).

Throughput is tokens trained by stage-0 peers (tokens enter a pipeline there, so each counts once:
the coordinator's ``run.tokens_trained``) between the first moment a trained token is seen and the
moment the run finished, over that wall time; both moments are read by polling ``/api/v1/state``
(the same heartbeat and polling lag at both ends, in both runs), and the tokens already trained
when the window opened are not counted. Start-up (process starts, DHT join, admission, building the
model and optimizer) stays outside. The live ``run.tokens_per_s`` is not used: a peer's
``tokens_per_s`` is its tokens over its *inner step's* seconds, which leave out the outer steps (all
of the baseline's all-reduces), so it would flatter the baseline several times over; its median is
printed for reference (``live_tokens_per_s_median``).

The run is short, so no sample is visited twice: AC-SGD sends every activation as a first visit
(fp16, 2x less than fp32), never as 4-bit deltas (8x less); ``--num-samples`` below the samples a
run trains (2 x 16 per inner step) makes them repeat (the multi-epoch setting of the AC-SGD paper;
with 512, activations fell to 0.25x fp32 and tokens/s did not move: at this model size the inner
step is bound by latency and CPU, not by bandwidth).
The potluck configuration runs twice, with ``pipeline.schedule = "gpipe"`` and ``"1f1b"`` (its
warm-up sized from the measured wait for gradients, ``pipeline.in_flight`` unset). On this project's
shared 2-core machines the peers' CPU, not only the network, sets the inner step time, and other
runs on the box change it by 2x: compare the figures of one line, not lines of different runs. Each
peer runs ``--peer-threads`` torch threads (default 1, in both configurations: four peers with
torch's default of one thread per core would oversubscribe the box; a volunteer's peer has its
machine to itself).

Target (issue): potluck's tokens/s >= 4x the baseline's (the AC-SGD paper reports 4.3x / 4.9x end to
end over slow networks).

Streaming outer steps (``--fragments F``, default 4; 0 leaves them out): two more swarms of the same model,
links and peers as pure DiLoCo (S = 1, R = 4, int8 all-reduce), so that a peer's sends are its outer steps
(and the links' small probes), not activations: ``whole`` (``sync.fragments = 1``, H = ``--inner-steps``,
``--outer-steps``) and ``streamed`` (``sync.fragments = F``, H / F inner steps, F x the outer steps: the same
tokens, each fragment synced every H inner steps), its outer steps overlapped with the next inner phase and their
sends paced over ``--pace`` of it (``diloco.overlap``, ``sync.pace``, and ``sync.chunk_bytes`` 64 KiB: a result goes
in messages of that size, which pacing cannot split; ``--pace 0``: blocking, at line rate, as before 2026-12-03). For each: every peer's peak second of sends
(``peak_send_bps``, :meth:`~potluck.protos.net.transport.Traffic.send_rate`, read on the last poll before the
run is finished, so the coordinator's fetch of the final state is not in it; the highest one's bytes by kind,
``peak_send_kinds_max``) and the outer bytes a member
sent per step over the step's all-reduce seconds, at the step where that is highest (``peak_outer_bps``).
Target (issue): F = 4's peak <= 0.35x F = 1's. ``--only`` runs some of the swarms (the JSON line then holds
the figures of those).

    python benchmarks/wan_throughput.py [--inner-steps 50] [--outer-steps 2] [--baseline-steps 50] [--mbps 100] [--delay-ms 50]
    python benchmarks/wan_throughput.py --only whole,streamed --fragments 4 --inner-steps 8 --outer-steps 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchargs import bench_parser

from potluck.local import LocalSwarm, SwarmError
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig

PEERS, STAGES = 4, 2

POTLUCK = {"pipeline.compression": "acsgd", "pipeline.bits": 4, "pipeline.grad_bits": 8, "sync.codec": "int8"}
POTLUCK_1F1B = {**POTLUCK, "pipeline.schedule": "1f1b"}
BASELINE = {"pipeline.compression": "none", "pipeline.grad_bits": 32, "sync.codec": "raw"}
PACED_CHUNK_BYTES = 1 << 16  # the streamed run's messages when paced (a 1 MiB result message would leave at once)
DILOCO = {"pipeline.stages": 1, "sync.codec": "int8"}  # (4 replicas of the whole model: sends are outer steps)


def run_swarm(args: argparse.Namespace, workdir: Path, settings: dict[str, Any], inner: int, outer: int) -> dict:
    workdir.mkdir(parents=True)
    topology = workdir / "wan.json"
    topology.write_text(json.dumps({"regions": ["wan"], "delay_ms": [[args.delay_ms]],
                                    "bandwidth_mbps": [[args.mbps]]}))
    cfg = apply_overrides(RunConfig(), {
        "run_id": "bench-wan",
        "model.d_model": 240, "model.n_layers": 3, "model.n_heads": 4, "model.seq_len": 64,
        "train.batch_size": args.batch, "data.num_samples": args.num_samples,
        "pipeline.stages": STAGES, "pipeline.micro_batches": args.micro_batches if settings.get(
            "pipeline.stages", STAGES) > 1 else 1,
        "diloco.inner_steps": inner, "diloco.outer_steps": outer,
        "links.placement": "sticky",
        "membership.min_peers": PEERS, "coordinator.host": "127.0.0.1", "coordinator.checkpoint_every": 0,
        "coordinator.journal_dir": str(workdir / "journal"), "data.eval_every": 0,
        **settings,
    })
    swarm = LocalSwarm(workdir)
    first_token: float | None = None
    first_tokens = 0  # tokens already trained when the window opened: not counted
    gone_at = 0.0
    live: list[float] = []
    peaks: dict[str, float] = {}  # each peer's peak second of sends, on the last poll before the run finished
    peak_kinds: dict[str, dict[str, int]] = {}  # that second's bytes by kind
    sent_by_kind: dict[str, dict[str, int]] = {}  # each peer's bytes sent by kind, on the same poll

    def done(state: dict) -> bool:
        nonlocal first_token, first_tokens, gone_at
        run = state["run"]
        if not run["finished"]:
            peaks.update({p["id"]: p["peak_send_bps"] for p in state["peers"] if p.get("peak_send_bps")})
            peak_kinds.update({p["id"]: p.get("peak_send_kinds", {}) for p in state["peers"] if p.get("peak_send_bps")})
            sent_by_kind.update({p["id"]: p["bytes_sent"] for p in state["peers"] if p.get("bytes_sent")})
        if first_token is None and run["tokens_trained"] > 0:
            first_token, first_tokens = time.monotonic(), run["tokens_trained"]
        if first_token is not None and not run["finished"] and run["tokens_per_s"] > 0:
            live.append(run["tokens_per_s"])
        if not run["finished"] and not swarm.alive():  # a peer's last report may still be on its way
            gone_at = gone_at or time.monotonic()
            if time.monotonic() - gone_at > 30:
                raise SwarmError(f"every peer exited before the run finished:\n{swarm.tail('peer-0')}")
        return bool(run["finished"])

    try:
        swarm.start_coordinator(cfg)
        t0 = time.monotonic()
        for _ in range(PEERS):
            swarm.start_peer("--netem", str(topology), "--region", "wan", "--threads", str(args.peer_threads))
        state = swarm.wait_state(done, args.timeout, "the run to finish")
        end = time.monotonic()
    finally:
        swarm.stop()
    assert first_token is not None
    run, hist = state["run"], state["history"]
    tokens = run["tokens_trained"]
    wall = end - first_token
    fp32 = {k: sum(h["bytes_fp32"].get(k, 0) for h in hist) for k in ("activations", "gradients", "outer")}
    sent = {k: sum(h["bytes"].get(k, 0) for h in hist) for k in ("activations", "gradients", "outer")}
    outer_s = [h["outer_s"] for h in hist if h["outer_s"] is not None]
    outer_bps = [h["bytes"]["outer"] / max(len(h["state_hashes"]), 1) / h["allreduce_s"] for h in hist
                 if h.get("allreduce_s") and h["state_hashes"]]
    per_step = [h["bytes"]["outer"] / max(len(h["state_hashes"]), 1) for h in hist if h["state_hashes"]]
    return {
        "peak_send_bps_per_peer": sorted(round(v) for v in peaks.values()),
        "peak_send_bps_max": round(max(peaks.values())) if peaks else None,
        # what filled the highest peer's peak second (outer: its own outer step; audit: evidence an auditor fetched)
        "peak_send_kinds_max": peak_kinds.get(max(peaks, key=peaks.__getitem__)) if peaks else None,
        "peak_outer_bps": round(max(outer_bps)) if outer_bps else None,
        "outer_bytes_per_member_step": round(statistics.mean(per_step)) if per_step else None,
        # a peer's bytes sent by kind over the run, the mean of the peers (audit: the evidence its auditors fetched)
        "sent_by_kind_per_peer": {k: round(statistics.mean(s.get(k, 0) for s in sent_by_kind.values()))
                                  for k in sorted({k for s in sent_by_kind.values() for k in s})},
        "inner_steps": inner, "outer_steps": outer,
        "tokens": tokens,
        "tokens_in_window": tokens - first_tokens,
        "tokens_expected": inner * outer * args.batch * cfg.model.seq_len * (PEERS // cfg.pipeline.stages),
        "wall_s": round(wall, 1),
        "tokens_per_s": round((tokens - first_tokens) / wall, 1),
        "live_tokens_per_s_median": round(statistics.median(live), 1) if live else None,
        "outer_s_sum": round(sum(outer_s), 1),
        "outer_s_median": round(statistics.median(outer_s), 3) if outer_s else None,
        "bytes": sent, "bytes_vs_fp32": {k: round(sent[k] / fp32[k], 4) if fp32[k] else None for k in sent},
        "s_per_inner_step": round(wall / (inner * outer), 3),
        # a peer's seconds in inner steps (its pipeline's network waits included), per inner step
        "compute_s_per_inner_step": round(sum(p["compute_s"] for p in state["peers"]) / PEERS / (inner * outer), 3),
        "sync_s_per_inner_step": round(sum(p["sync_s"] for p in state["peers"]) / PEERS / (inner * outer), 3),
        "failed_rounds": len(state["failed_rounds"]),
        "replans": sum(1 for e in state["events"] if e["kind"] == "replan"),
        "start_to_end_s": round(end - t0, 1),
    }


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--inner-steps", type=int, default=50, help="H of the potluck run")
    parser.add_argument("--outer-steps", type=int, default=2, help="outer steps of the potluck run")
    parser.add_argument("--baseline-steps", type=int, default=50,
                        help="inner steps (= outer steps, H = 1) of the baseline; 0: outer_steps x H, as potluck")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--num-samples", type=int, default=1 << 16, help="training samples (smaller: they repeat)")
    parser.add_argument("--peer-threads", type=int, default=1,
                        help="torch threads per peer (4 peers share this box: more only oversubscribes its cores)")
    parser.add_argument("--mbps", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--order", choices=["baseline-first", "potluck-first"], default="baseline-first")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds each run may take")
    parser.add_argument("--fragments", type=int, default=4, help="F of the streamed run (0: no whole/streamed runs)")
    parser.add_argument("--pace", type=float, default=0.45,
                        help="sync.pace of the streamed run, overlapped (0: a blocking streamed run at line rate)")
    parser.add_argument("--codec", choices=["int8", "int4"], default="int8",
                        help="sync.codec of the potluck and streaming runs (the baseline's all-reduce stays fp32)")
    parser.add_argument("--only", default="", help="comma-separated runs: baseline, potluck, potluck_1f1b, whole, "
                        "streamed (default: all)")
    args = parser.parse_args()
    baseline_steps = args.baseline_steps or args.outer_steps * args.inner_steps
    f = max(args.fragments, 1)
    codec = {"sync.codec": args.codec}
    runs: dict[str, tuple[dict[str, Any], int, int]] = {
        "potluck": ({**POTLUCK, **codec}, args.inner_steps, args.outer_steps), "baseline": (BASELINE, 1, baseline_steps),
        "potluck_1f1b": ({**POTLUCK_1F1B, **codec}, args.inner_steps, args.outer_steps),
        "whole": ({**DILOCO, **codec}, args.inner_steps, args.outer_steps),
        "streamed": ({**DILOCO, **codec, "sync.fragments": f,
                      **({"diloco.overlap": True, "sync.pace": args.pace, "sync.chunk_bytes": PACED_CHUNK_BYTES,
                          # (the owners wait past the pace for contributions: overlapped, the next phase covers it)
                          "sync.deadline_factor": max(0.5, round(args.pace + 0.1, 2))}
                         if args.pace else {})},
                     max(args.inner_steps // f, 1), args.outer_steps * f)}
    order = ["baseline", "potluck", "potluck_1f1b"] if args.order == "baseline-first" else [
        "potluck", "potluck_1f1b", "baseline"]
    order += ["whole", "streamed"] if args.fragments else []
    if args.only:
        wanted = set(args.only.split(","))
        if wanted - set(runs):
            parser.error(f"--only: unknown runs {sorted(wanted - set(runs))}; they are {sorted(runs)}")
        order = [name for name in order if name in wanted]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="potluck-bench-") as tmp:
        for name in order:
            settings, inner, outer = runs[name]
            results[name] = run_swarm(args, Path(tmp) / name, settings, inner, outer)
    line: dict[str, Any] = {
        "benchmark": "wan_throughput",
        "peers": PEERS, "stages": STAGES, "replicas": PEERS // STAGES,
        "micro_batches": args.micro_batches, "batch": args.batch, "peer_threads": args.peer_threads, "seq_len": 64, "d_model": 240, "n_layers": 3,
        "link_mbps": args.mbps, "link_delay_ms_one_way": args.delay_ms,
    }
    p, b, g = results.get("potluck"), results.get("baseline"), results.get("potluck_1f1b")
    if p is not None and b is not None and g is not None:
        grad_ratio = b["bytes_vs_fp32"]["gradients"]
        baseline_gradients = "fp32" if grad_ratio is not None and grad_ratio > 0.99 else (
            f"NOT fp32: {grad_ratio}x fp32 bytes (pipeline.grad_bits = 32 did not reach the peers; this favours "
            "the baseline)")
        line.update({
            "tokens_per_s_potluck": p["tokens_per_s"], "tokens_per_s_baseline": b["tokens_per_s"],
            "speedup": round(p["tokens_per_s"] / b["tokens_per_s"], 2), "target_speedup": 4.0,
            "tokens_per_s_potluck_1f1b": g["tokens_per_s"], "speedup_1f1b": round(g["tokens_per_s"] / b["tokens_per_s"], 2),
            "1f1b_vs_gpipe": round(g["tokens_per_s"] / p["tokens_per_s"], 3),
            "baseline_gradients": baseline_gradients})
    w, st = results.get("whole"), results.get("streamed")
    if w is not None and st is not None:
        line.update({
            "fragments": f, "streamed_pace": args.pace, "streamed_overlap": bool(args.pace), "fragments_grid": "S = 1 x R = 4 (the stages/replicas above are the pipelined runs')",
            "peak_send_bps_f1": w["peak_send_bps_max"], f"peak_send_bps_f{f}": st["peak_send_bps_max"],
            "peak_send_ratio": round(st["peak_send_bps_max"] / w["peak_send_bps_max"], 3)
            if w["peak_send_bps_max"] and st["peak_send_bps_max"] else None,
            "peak_outer_bps_f1": w["peak_outer_bps"], f"peak_outer_bps_f{f}": st["peak_outer_bps"],
            "peak_outer_ratio": round(st["peak_outer_bps"] / w["peak_outer_bps"], 3)
            if w["peak_outer_bps"] and st["peak_outer_bps"] else None,
            "outer_bytes_per_step_ratio": round(st["outer_bytes_per_member_step"] / w["outer_bytes_per_member_step"], 3)
            if w["outer_bytes_per_member_step"] and st["outer_bytes_per_member_step"] else None,
            "target_peak_ratio": 0.35})
    line["codec"] = args.codec
    configs = {"potluck": f"GPipe, acsgd 4-bit activations, 8-bit gradients, {args.codec} all-reduce every H steps",
               "potluck_1f1b": "the same with 1F1B",
               "baseline": "fp32 activations and gradients, fp32 all-reduce every step (H = 1)",
               "whole": f"S = 1, R = 4, {args.codec} all-reduce of the whole model every H steps (sync.fragments = 1)",
               "streamed": f"S = 1, R = 4, sync.fragments = {f}: 1/{f} of the model every H / {f} steps"}
    line.update({name: {"config": configs[name], **r} for name, r in results.items()})
    print(json.dumps(line))
    sys.stdout.flush()

if __name__ == "__main__":
    main()
