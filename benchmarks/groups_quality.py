"""What grouped averaging costs in model quality: DiLoCo with groups vs full averaging, equal tokens.

Two real swarms (a coordinator and ``--peers`` peer processes, hivemind DHT, gRPC with mutual TLS),
S = 1, the same model, data, seed and number of outer and inner steps, so the same tokens:

* ``grouped``: ``sync.group_size = --group-size``: each outer step every member averages with its
  group only (rows on odd steps, diagonals on even ones; :mod:`potluck.coordinator.rounds.groups`), and the
  groups end each step with different states;
* ``full``: ``sync.group_size = 0``: every step averages all members (today's all-reduce).

The figure is each swarm's eval loss of ``theta_global`` after the last outer step
(``data.eval_every = outer_steps``), as each member logs it. In the grouped run every member evaluates its own group's
state: the line gives their mean, best and worst, and the ratio of the mean and of the worst to the
full run's loss. Also: tokens trained (equal, or the comparison is void), failed rounds, the distinct
states after each step (one per group; one for the full run), the bytes each member sent per step
and the slowest all-reduce of a step.

Target (issue 30): with 16 peers and groups of 4, the grouped run's eval loss within 1 % of the full
run's.

    python benchmarks/groups_quality.py [--peers 16] [--group-size 4] [--inner-steps 50] [--outer-steps 10]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

from benchargs import bench_parser, swarm_arguments

from potluck.local import LocalSwarm, SwarmError
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig

TARGET = 0.01


def run_config(args: argparse.Namespace, group_size: int, journal: Path) -> RunConfig:
    return apply_overrides(RunConfig(), {
        "run_id": "bench-groups-quality",
        "model.d_model": args.d_model, "model.n_layers": args.n_layers, "model.n_heads": 4,
        "train.batch_size": args.batch, "train.seed": args.seed, "data.seed": args.seed,
        "diloco.inner_steps": args.inner_steps, "diloco.outer_steps": args.outer_steps, "sync.codec": "int8",
        "sync.group_size": group_size, "sync.deadline_floor_s": args.deadline_floor,
        "membership.min_peers": args.peers, "membership.round_timeout_floor_s": 300.0,
        "coordinator.host": "127.0.0.1", "coordinator.checkpoint_every": 0,
        "coordinator.journal_dir": str(journal), "data.eval_every": args.outer_steps,
    })


def run_swarm(args: argparse.Namespace, workdir: Path, group_size: int) -> dict:
    workdir.mkdir(parents=True)
    swarm = LocalSwarm(workdir, threads=args.threads)
    steps = args.outer_steps

    def done(state: dict) -> bool:
        """Every member evaluated its last state and the run finished, or every peer has left (on an overloaded
        box the coordinator's DHT can stop answering near the end: the members go on and evaluate anyway)."""
        peers = [p for p in state["peers"] if p["version"] == steps and p["eval_loss"] is not None]
        return bool(state["run"]["finished"] and len(peers) == args.peers) or not swarm.alive()

    state, wall = swarm.run_to_end(run_config(args, group_size, workdir / "journal"), args.peers, done, args.timeout,
                                   "the run to finish and every member to evaluate its state")
    hist = state["history"]
    evals, inner = logged_evals(swarm.logs, steps), logged_inner_steps(swarm.logs)
    if not evals:
        raise SwarmError(f"no member evaluated v{steps}:\n{swarm.tail('peer-0')}")
    return {
        "eval_loss_mean": round(statistics.fmean(evals), 5), "eval_loss_best": round(min(evals), 5),
        "eval_loss_worst": round(max(evals), 5), "distinct_final_states": len(set(hist[-1]["state_hashes"].values())),
        "tokens": state["run"]["tokens_trained"], "failed_rounds": len(state["failed_rounds"]),
        "members": [h["members"] for h in hist], "states_per_step": [len(set(h["state_hashes"].values())) for h in hist],
        "bytes_per_member_per_step": round(statistics.fmean(h["bytes"]["outer"] / h["members"] for h in hist)),
        "allreduce_s_median": round(statistics.median(h["allreduce_s"] for h in hist if h["allreduce_s"]), 3),
        "wall_s": round(wall, 1), "run_finished": state["run"]["finished"], "members_evaluated": len(evals),
        "steps_committed": len(hist), "inner_steps_logged": inner,
        "tokens_logged": inner * args.batch * state["run"]["model"]["seq_len"],
    }


def logged_inner_steps(logs: Path) -> int:
    """Inner steps the members trained, summed over their logs' inner phases: the tokens' count when the
    coordinator's does not reach the end."""
    return sum(int(n) for f in logs.glob("peer-*.log") for n in re.findall(r"inner phase done: (\d+)/", f.read_text()))


def logged_evals(logs: Path, version: int) -> list[float]:
    """The eval loss each member logged for its ``version`` (its own group's state), from its log: read there
    rather than from the coordinator, whose view may stop short of the end on an overloaded box. A member
    that fetched the last state instead of computing it did not evaluate it."""
    found = (re.search(rf"eval loss of v{version}: ([0-9.]+)", f.read_text()) for f in sorted(logs.glob("peer-*.log")))
    return [float(m.group(1)) for m in found if m]


def main() -> None:
    parser = bench_parser(__doc__)
    swarm_arguments(parser, peers=16, outer_steps=10)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--deadline-floor", type=float, default=120.0,
                        help="sync.deadline_floor_s: generous, so no member of an overloaded box is dropped")
    parser.add_argument("--order", choices=["grouped-first", "full-first"], default="grouped-first")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds each swarm run may take")
    parser.add_argument("--workdir", default="", help="keep each swarm's logs and journal here (default: a temporary "
                        "folder, removed)")
    args = parser.parse_args()
    sizes = [args.group_size, 0] if args.order == "grouped-first" else [0, args.group_size]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="potluck-bench-") as tmp:
        for size in sizes:
            root = Path(args.workdir) if args.workdir else Path(tmp)
            name = "grouped" if size else "full"
            results[name] = run_swarm(args, root / name, size)
            print(json.dumps({"benchmark": "groups_quality_swarm", "config": name, "group_size": size,
                              "peers": args.peers, **results[name]}), file=sys.stderr, flush=True)
    g, f = results["grouped"], results["full"]
    print(json.dumps({
        "benchmark": "groups_quality", "peers": args.peers, "group_size": args.group_size,
        "inner_steps": args.inner_steps, "outer_steps": args.outer_steps, "batch_per_peer": args.batch,
        "d_model": args.d_model, "n_layers": args.n_layers, "seed": args.seed, "order": args.order,
        "equal_tokens": g["tokens_logged"] == f["tokens_logged"],
        "eval_loss_full": f["eval_loss_mean"], "eval_loss_grouped_mean": g["eval_loss_mean"],
        "eval_loss_grouped_worst": g["eval_loss_worst"],
        "ratio_mean": round(g["eval_loss_mean"] / f["eval_loss_mean"], 5),
        "ratio_worst": round(g["eval_loss_worst"] / f["eval_loss_mean"], 5), "target_ratio": 1 + TARGET,
        "bytes_ratio": round(g["bytes_per_member_per_step"] / f["bytes_per_member_per_step"], 3),
        **results,
    }))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
