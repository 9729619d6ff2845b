"""How long a new user waits for ``potluck --help`` and for each subcommand's ``--help``.

Every command runs as a fresh subprocess (``python -m potluck ... --help``), as a user's shell
would run it, so interpreter start-up and every import the parser pulls in are counted. The
commands take turns, repetition by repetition, so a burst of load on a shared box spreads over all
of them instead of landing on one; each figure is the median of its repetitions. Baseline in the
same run: ``python -c pass``, the interpreter alone.

Target: every ``--help`` answers in < 0.5 s.

    python benchmarks/cli_help.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

from potluck.cli import build_parser

TARGET_S = 0.5


def subcommands() -> list[str]:
    parser = build_parser()
    for action in parser._actions:  # argparse keeps subcommands on its (private) subparsers action
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    return []


def timed(argv: list[str], cwd: str) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[2:])} exited with {done.returncode}: {done.stderr.strip()}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="runs of each command; the median is reported")
    args = parser.parse_args()
    commands = {"potluck --help": ["--help"], **{f"potluck {c} --help": [c, "--help"] for c in subcommands()}}
    runs: dict[str, list[float]] = {name: [] for name in ["python -c pass", *commands]}
    with tempfile.TemporaryDirectory() as cwd:  # not the checkout: `-m potluck` must find the installed package
        for _ in range(args.repeats):
            runs["python -c pass"].append(timed([sys.executable, "-c", "pass"], cwd))
            for name, argv in commands.items():
                runs[name].append(timed([sys.executable, "-m", "potluck", *argv], cwd))
    median = {name: statistics.median(times) for name, times in runs.items()}
    baseline = median.pop("python -c pass")
    worst = max(median, key=median.__getitem__)
    print(json.dumps({
        "benchmark": "cli_help",
        "repeats": args.repeats,
        "baseline_python_s": round(baseline, 3),
        "seconds": {name: round(s, 3) for name, s in median.items()},
        "worst": worst,
        "worst_s": round(median[worst], 3),
        "worst_over_baseline": round(median[worst] / baseline, 1),
        "target_s": TARGET_S,
        "met": median[worst] < TARGET_S,
    }))


if __name__ == "__main__":
    main()
