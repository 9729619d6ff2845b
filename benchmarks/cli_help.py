"""How long a new user waits for ``potluck --help``, each subcommand's ``--help``, and the answer to a
usage mistake.

Every command runs as a fresh subprocess (``python -m potluck ...``), as a user's shell would run it,
so interpreter start-up and every import the command pulls in are counted. The commands take turns,
repetition by repetition, so a burst of load on a shared box spreads over all of them instead of
landing on one; each figure is the median of its repetitions. Baseline in the same run: ``python -c
pass``, the interpreter alone.

The usage mistakes (issue 27; each took 8-9 s when the check came after torch, hivemind and a DHT
node): a malformed ``--join``, a journal directory holding another run, an identity another peer on
this machine holds, and a model no peer could hold. Each must exit with status 2 and one line.

Targets: every ``--help`` answers in < 0.5 s, every usage mistake in < 1 s.

    python benchmarks/cli_help.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from potluck.cli import build_parser
from potluck.coordinator.store.journal import Journal, JournalState
from potluck.protos.config.files import apply_overrides, dump_toml
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.identity import Identity

TARGET_S = 0.5
USAGE_TARGET_S = 1.0


def subcommands() -> list[str]:
    parser = build_parser()
    for action in parser._actions:  # argparse keeps subcommands on its (private) subparsers action
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    return []


def timed(argv: list[str], cwd: str, rc: int = 0) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120)
    seconds = time.perf_counter() - t0
    if done.returncode != rc or (rc and len(done.stderr.strip().splitlines()) != 1):
        raise SystemExit(f"{' '.join(argv[2:])} exited with {done.returncode} (expected {rc}): {done.stderr.strip()}")
    return seconds


def usage_mistakes(cwd: Path) -> dict[str, list[str]]:
    """The mistakes, each set up in ``cwd``: its arguments after ``potluck``."""
    run = cwd / "run.toml"
    run.write_text(dump_toml(RunConfig(run_id="first-run")))
    other = apply_overrides(RunConfig(), {"run_id": "first-run", "model.d_model": 32})
    Journal(cwd / "potluck-run").save(JournalState(run_id="first-run", config=other.manifest_sections(),
                                                   created_at=time.time(), committed=3))
    join = f"/ip4/127.0.0.1/tcp/9/p2p/{Identity.generate().peer_id}"  # never dialled: refused before
    return {
        "malformed --join": ["peer", "--join", "127.0.0.1:44497"],
        "journal of another config": ["coordinator", "--config", str(run)],
        "identity in use": ["peer", "--join", join, "--identity", str(cwd / "held.key")],
        "model too big": ["coordinator", "--config", str(run), "--set", "model.d_model=1000000", "--journal-dir", "new"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="runs of each command; the median is reported")
    args = parser.parse_args()
    commands = {"potluck --help": ["--help"], **{f"potluck {c} --help": [c, "--help"] for c in subcommands()}}
    runs: dict[str, list[float]] = {name: [] for name in ["python -c pass", *commands]}
    with tempfile.TemporaryDirectory() as cwd:  # not the checkout: `-m potluck` must find the installed package
        mistakes = usage_mistakes(Path(cwd))
        wrong: dict[str, list[float]] = {name: [] for name in mistakes}
        with open(Path(cwd) / "held.key.lock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # another peer on this machine runs with held.key
            for _ in range(args.repeats):
                runs["python -c pass"].append(timed([sys.executable, "-c", "pass"], cwd))
                for name, argv in commands.items():
                    runs[name].append(timed([sys.executable, "-m", "potluck", *argv], cwd))
                for name, argv in mistakes.items():
                    wrong[name].append(timed([sys.executable, "-m", "potluck", *argv], cwd, rc=2))
    median = {name: statistics.median(times) for name, times in runs.items()}
    usage = {name: statistics.median(times) for name, times in wrong.items()}
    baseline = median.pop("python -c pass")
    worst = max(median, key=median.__getitem__)
    usage_worst = max(usage, key=usage.__getitem__)
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
        "usage_error_seconds": {name: round(s, 3) for name, s in usage.items()},
        "usage_error_worst": usage_worst,
        "usage_error_worst_s": round(usage[usage_worst], 3),
        "usage_error_target_s": USAGE_TARGET_S,
        "usage_error_met": usage[usage_worst] < USAGE_TARGET_S,
    }))


if __name__ == "__main__":
    main()
