"""Peers of different speeds: does a slower volunteer add its work, or take everyone's time?

Real swarms on this machine (a coordinator and peer processes, hivemind DHT, gRPC with mutual TLS), the
same model, data and H in each, one torch thread per peer:

* ``alone``: the fast peer alone (the baseline, measured in the same run);
* ``fast+25``: the fast peer and one at a quarter of its speed;
* ``100/50/25``: three peers at full, half and a quarter of the fast one's speed;
* ``homogeneous``: two fast peers, evaluated at every step, for quality at equal tokens.

A peer is made slower as a weaker or shared GPU would be: ``--throttle stop`` stops and continues its whole
process group (its DHT daemons too), 50 ms running in every ``50 / fraction`` ms, as the issue that asked for
this measured it; ``--throttle sleep`` makes each of its inner steps take ``1 / fraction`` as long
(``POTLUCK_FAULTS=inner.step@*:slow=F``: it sleeps the difference and answers the network meanwhile).
``--base B`` throttles every peer by ``B`` more (the fast one runs ``B`` of a core): three peers at full,
half and a quarter speed keep 1.75 cores busy, with the coordinator and four DHT daemons beside them, and
on a 2-core box the fast peer's own steps then slow down by a third, which is the box, not the rounds.

The figure is the swarm's tokens/s of *committed* steps: the tokens each step's included contributions were
trained on (the coordinator's history), over the wall time from the first step's commit to the last's, so
the start-up is left out. Targets: ``fast+25`` >= 1.15x ``alone`` (ideal 1.25x) and ``100/50/25`` >= 0.85x
the sum of their speeds (1.75x ``alone``). Quality: the ``fast+25`` run's final eval loss against the
``homogeneous`` run's eval-loss curve interpolated at the same tokens: within 2 %.

    python benchmarks/hetero_swarm.py [--throttle stop|sleep] [--outer-steps 8] [--inner-steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from benchargs import bench_parser

from potluck.local import LocalSwarm, SwarmError
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig


def run_config(args: argparse.Namespace, peers: int, workdir: Path, eval_every: int) -> RunConfig:
    return apply_overrides(RunConfig(), {
        "run_id": "bench-hetero",
        "model.d_model": args.d_model, "model.n_layers": args.n_layers, "model.n_heads": 4, "model.seq_len": args.seq_len,
        "train.batch_size": args.batch, "train.seed": args.seed, "data.seed": args.seed,
        "diloco.inner_steps": args.inner_steps, "diloco.outer_steps": args.outer_steps,
        "membership.min_peers": peers, "coordinator.host": "127.0.0.1", "coordinator.checkpoint_every": 0,
        "coordinator.journal_dir": str(workdir / "journal"), "data.eval_every": eval_every,
        **dict(kv.split("=", 1) for kv in args.set),
    })


class Throttle:
    """Stops and continues a process group so it runs ``fraction`` of the time (50 ms slices)."""

    def __init__(self, pid: int, fraction: float) -> None:
        self.pid, self.fraction = pid, fraction
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        on, off = 0.05, 0.05 * (1 / self.fraction - 1)
        try:
            while not self.done.wait(on):
                os.killpg(self.pid, signal.SIGSTOP)
                self.done.wait(off)
                os.killpg(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        finally:
            try:
                os.killpg(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)


def run_swarm(args: argparse.Namespace, workdir: Path, speeds: list[float], eval_every: int) -> dict[str, Any]:
    workdir.mkdir(parents=True)
    cfg = run_config(args, len(speeds), workdir, eval_every)
    swarm = LocalSwarm(workdir, threads=1)
    throttles: list[Throttle] = []
    try:
        swarm.start_coordinator(cfg)
        for i, speed in enumerate(speeds):
            runs = speed * args.base  # the share of a core's time it computes
            env = {"POTLUCK_FAULTS": f"inner.step@*:slow={1 / runs:g}"} if runs < 1 and args.throttle == "sleep" else None
            proc = swarm.start_peer(name=f"peer-{i}-{int(round(speed * 100))}", env=env)
            if runs < 1 and args.throttle == "stop":
                throttles.append(Throttle(proc.pid, runs))

        def done(state: dict[str, Any]) -> bool:
            hist = state["history"]
            if not state["run"]["finished"] and not swarm.alive():
                raise SwarmError(f"every peer exited before the run finished:\n{swarm.tail('peer-0')}")
            return bool(state["run"]["finished"] and hist and hist[-1]["eval_loss"] is not None)

        state = swarm.wait_state(done, args.timeout, "the run to finish and evaluate its final state")
    finally:
        for t in throttles:
            t.stop()
        swarm.stop()
    hist = state["history"]
    steady = [h for h in hist if h["step"] > 1]
    span = hist[-1]["t"] - hist[0]["t"]
    tokens = [h["tokens"] for h in hist]
    by_name = {p["name"]: p for p in state["peers"]}
    return {
        "tokens_per_s": round(sum(h["tokens"] for h in steady) / span, 1) if span > 0 else None,
        "tokens": sum(tokens),
        "tokens_per_step": tokens,
        "window_s": [round(h["window_s"], 2) if h.get("window_s") else None for h in hist],
        "inner_steps": [sorted(h.get("inner_steps", {}).values(), reverse=True) for h in hist],
        "members": [h["members"] for h in hist],
        "dropped": sum(len(h["dropped"]) for h in hist),
        "failed_rounds": len(state["failed_rounds"]),
        "identical": all(len(set(h["state_hashes"].values())) == 1 for h in hist),
        "eval": [[sum(tokens[:i + 1]), round(h["eval_loss"], 4)] for i, h in enumerate(hist) if h["eval_loss"] is not None],
        "final_eval_loss": round(hist[-1]["eval_loss"], 4),
        "repeats": state["run"]["data"]["repeats"],
        "peer_tokens": {name: p.get("tokens_total") for name, p in sorted(by_name.items())},
    }


def at_tokens(curve: list[list[float]], tokens: float) -> float | None:
    """The eval loss of ``curve`` ((tokens, loss) points) at ``tokens``, linearly interpolated; None outside it."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:], strict=False):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / (t1 - t0) if t1 > t0 else l0
    return None


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--outer-steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--throttle", choices=["stop", "sleep"], default="stop")
    parser.add_argument("--base", type=float, default=1.0, help="the fast peer's own share of a core (every peer is "
                        "throttled by it too): below 1, a box with fewer cores than the swarm would keep busy measures "
                        "the rounds, not its own contention")
    parser.add_argument("--runs", default="alone,fast+25,100/50/25,homogeneous")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds each swarm run may take")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a run file field")
    parser.add_argument("--keep", default="", help="keep each run's folder (logs, journal) under this folder")
    args = parser.parse_args()
    plans = {"alone": ([1.0], 0), "fast+25": ([1.0, 0.25], 0), "100/50/25": ([1.0, 0.5, 0.25], 0),
             "homogeneous": ([1.0, 1.0], 1), "two": ([1.0, 1.0], 0)}
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="potluck-bench-") as tmp:
        if args.keep:
            tmp = args.keep
        for name in args.runs.split(","):
            speeds, every = plans[name]
            results[name] = run_swarm(args, Path(tmp) / name.replace("/", "-").replace("+", "-"), speeds,
                                      every or args.outer_steps)
    out: dict[str, Any] = {"benchmark": "hetero_swarm", "throttle": args.throttle, "base": args.base,
                           "cpus": os.cpu_count(), "inner_steps": args.inner_steps,
                           "outer_steps": args.outer_steps, "batch": args.batch, "d_model": args.d_model,
                           "n_layers": args.n_layers, "seq_len": args.seq_len, "seed": args.seed}
    alone = results.get("alone", {}).get("tokens_per_s")
    if alone:
        out["tokens_per_s_alone"] = alone
        if "fast+25" in results:
            out["ratio_fast_plus_quarter"] = round(results["fast+25"]["tokens_per_s"] / alone, 3)
            out["target_fast_plus_quarter"] = 1.15
        if "100/50/25" in results:
            out["ratio_three_vs_sum_of_speeds"] = round(results["100/50/25"]["tokens_per_s"] / (1.75 * alone), 3)
            out["target_three_vs_sum"] = 0.85
    if "fast+25" in results and "homogeneous" in results:
        hetero = results["fast+25"]
        same = at_tokens(results["homogeneous"]["eval"], hetero["tokens"])
        out["eval_loss_hetero"] = hetero["final_eval_loss"]
        out["eval_loss_homogeneous_at_equal_tokens"] = round(same, 4) if same is not None else None
        out["quality_ratio"] = round(hetero["final_eval_loss"] / same, 4) if same else None
        out["target_quality_ratio"] = 1.02
    out.update(results)
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
