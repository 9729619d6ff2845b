"""What the benchmarks' command lines share: a parser that cleans up on SIGTERM, and a swarm's size and model.

Benchmarks run as scripts (``python benchmarks/NAME.py``), so this module is imported from their folder.
"""

from __future__ import annotations

import argparse
import signal
import sys


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser, described by its docstring's first line. A SIGTERM (``timeout``, CI) becomes
    ``SystemExit(143)``, so the benchmark unwinds through its swarm's cleanup instead of orphaning its peers."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    return argparse.ArgumentParser(description=(doc or "").splitlines()[0] if doc else None)


def swarm_arguments(parser: argparse.ArgumentParser, peers: int, outer_steps: int, inner_steps: int = 50,
                    model: bool = True) -> None:
    """``--peers``, ``--inner-steps``, ``--outer-steps`` and, with ``model``, each peer's batch and model size,
    the seed and the torch threads per process."""
    parser.add_argument("--peers", type=int, default=peers)
    parser.add_argument("--inner-steps", type=int, default=inner_steps)
    parser.add_argument("--outer-steps", type=int, default=outer_steps)
    if not model:
        return
    parser.add_argument("--batch", type=int, default=16, help="train.batch_size of each peer")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="train.seed and data.seed (model init, data, order)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
