"""``potluck schedule``: plan stages and replicas onto devices, offline, from a topology file.

The user's documentation, the file format included, is :data:`DESCRIPTION` and :data:`EXAMPLES`:
what ``potluck schedule --help`` prints. The search itself is
:func:`~potluck.coordinator.placement.scheduler.evolutionary_search`, the coordinator's own.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

PROG = "potluck schedule"
DEFAULT_SECONDS = 10.0

# --help text: plain, unlike the module docstring (argparse prints it verbatim)
DESCRIPTION = """\
Plan which device serves which pipeline stage of which replica, offline, from
a topology file, with the coordinator's evolutionary search. It prints one JSON
object: the plan (stage_groups[s][r] and pipelines[r][s] both name the device
at stage s of replica r, stages in pipeline order), its cost terms and how much
searching it took. A file that cannot be scheduled exits with status 2 and the
reason on stderr.

The topology file is one JSON object (milliseconds, Gbit/s, gigabytes):
  {"delay_ms": [[...], ...], "bandwidth_gbps": [[...], ...],
   "stages": 8, "replicas": 8, "activation_gb": 0.2, "gradient_gb": 0.25,
   "outer_every": 50, "compute": [1.0, ...]}"""

EXAMPLES = f"""\
examples:
  potluck schedule --topology swarm.json                  search for {DEFAULT_SECONDS:g} s
  potluck schedule --topology swarm.json --budget-evals 5000
                                      reproducible: same seed, same plan"""


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``schedule`` subcommand to ``potluck``'s subparsers."""
    p = subparsers.add_parser("schedule", help="plan stages and replicas onto devices from a topology file",
                              description=DESCRIPTION, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(fn=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", required=True, metavar="FILE.json", help="delays, bandwidths and job shape")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--budget-seconds", type=float, default=None, metavar="T",
                   help=f"stop searching after T seconds (default {DEFAULT_SECONDS:g} unless --budget-evals is given)")
    p.add_argument("--budget-evals", type=int, default=None, metavar="N",
                   help="stop after N cost evaluations; with this alone a run is reproducible")


def run(args: argparse.Namespace) -> int:
    # numpy and scipy load here, not at import: `potluck --help` builds this parser
    from potluck.coordinator.placement.costmodel import Topology, TopologyError
    from potluck.coordinator.placement.scheduler import evolutionary_search

    try:
        topology = Topology.load(args.topology)
    except TopologyError as err:
        return _fail(str(err))
    if args.budget_seconds is not None and args.budget_seconds <= 0:
        return _fail(f"--budget-seconds must be > 0, got {args.budget_seconds:g}")
    if args.budget_evals is not None and args.budget_evals < 1:
        return _fail(f"--budget-evals must be >= 1, got {args.budget_evals}")
    # An evaluation budget given alone is the whole budget, so that the run is reproducible.
    seconds = args.budget_seconds
    if seconds is None and args.budget_evals is None:
        seconds = DEFAULT_SECONDS
    result = evolutionary_search(topology, seed=args.seed, budget_seconds=seconds, budget_evals=args.budget_evals)
    plan = {k: v for k, v in result.plan.to_json().items() if k != "order"}  # order: the search's own labels
    out = {**plan, "evaluations": result.evaluations, "seconds": round(result.seconds, 3),
           "evals_to_best": result.evals_to_best, "stopped": result.stopped, "devices": topology.devices,
           "seed": args.seed}
    print(json.dumps(out))
    return 0


def _fail(reason: str) -> int:
    print(f"{PROG}: {reason}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
