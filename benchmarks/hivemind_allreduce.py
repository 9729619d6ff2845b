"""Baseline: hivemind's DecentralizedAverager all-reduce with 8-bit quantization, on loopback.

What is measured: P peers (default 3) on 127.0.0.1, each a real hivemind DHT node (the first
bootstraps the others) and a real ``hivemind.averaging.DecentralizedAverager`` averaging one
float32 tensor of ``--numel`` values with ``Uniform8BitQuantization``, in a group of exactly P.
Only the all-reduce is timed, not matchmaking: every peer schedules its step ahead
(``step(wait=False, require_trigger=True)``, as hivemind's own Optimizer does), the script waits
until all P have formed the group (stage AWAITING_TRIGGER), then triggers all P controls and
times until the last ``control.result()`` returns. Each round is checked: the group has exactly
the P peers, and every peer's averaged tensor matches the exact mean of the P inputs (known from
their seeds) within 8-bit quantization error, over the whole vector and over each half.

Why its own virtual environment with numpy < 2.4: hivemind 1.1.12's quantization decoder calls
``int()`` on a one-element numpy array, which numpy >= 2.4 rejects (TypeError); the parts it
cannot decode are dropped, the step still reports success, and those parts stay un-averaged (with
numpy 2.4.6 and 3 peers every remote part failed: each peer kept its own input; the mean check below
catches it, see ``--skip-numpy-guard``). The venv lives in
``.bench/hivemind-venv`` (``--setup`` creates it with any python) and pins
torch==2.13.0 (a CPU build), hivemind==1.1.12 and numpy<2.4. This file imports nothing from potluck.

    python benchmarks/hivemind_allreduce.py --setup          # prints the venv's python
    .bench/hivemind-venv/bin/python benchmarks/hivemind_allreduce.py [--numel 20000000] [--peers 3]

Prints exactly one JSON line on stdout; logs go to stderr. Exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:  # imported at run time only inside functions: --setup must work under any python
    import torch
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.control import StepControl

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VENV = REPO_ROOT / ".bench" / "hivemind-venv"
PINNED_REQUIREMENTS = ("torch==2.13.0", "hivemind==1.1.12", "numpy<2.4")
HIVEMIND_VERSION = "1.1.12"
TORCH_VERSION = "2.13.0"
NUMPY_BROKEN_FROM = (2, 4)

# Inputs are uniform in [-1, 1]: no value falls outside the quantizer's +-3 sigma range, so every
# element's error is bounded by one bucket of the input plus one bucket of the returned delta
# (~0.025 here). A part that was not averaged is off by ~0.5 on average, so these catch it.
REL_L2_TOLERANCE = 0.05
MAX_ABS_TOLERANCE = 0.05

log = logging.getLogger("hivemind_allreduce")


def _fail(message: str) -> NoReturn:
    log.error(message)
    raise SystemExit(1)


# ----------------------------------------------------------------------------- venv setup


def _version_tuple(version: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _venv_is_ready(python: Path) -> bool:
    """True if ``python`` has the pinned torch, hivemind and a numpy < 2.4 (checked without importing them)."""
    if not python.exists():
        return False
    probe = (
        "import importlib.metadata as m, json; "
        "print(json.dumps({p: m.version(p) for p in ('torch', 'hivemind', 'numpy')}))"
    )
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return False
    versions: dict[str, str] = json.loads(done.stdout)
    return (
        versions["torch"].split("+")[0] == TORCH_VERSION
        and versions["hivemind"] == HIVEMIND_VERSION
        and _version_tuple(versions["numpy"]) < NUMPY_BROKEN_FROM
    )


def ensure_venv(venv: Path = DEFAULT_VENV) -> Path:
    """Create (or repair) the benchmark's own venv; return its python. Works under any python 3."""
    python = venv / "bin" / "python"
    if _venv_is_ready(python):
        log.info("venv ready: %s", venv)
        return python
    if not python.exists():
        log.info("creating venv %s", venv)
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, stdout=sys.stderr)
    log.info("installing %s", " ".join(PINNED_REQUIREMENTS))
    subprocess.run([str(python), "-m", "pip", "install", *PINNED_REQUIREMENTS], check=True, stdout=sys.stderr)
    if not _venv_is_ready(python):
        _fail(f"venv {venv} still lacks {' '.join(PINNED_REQUIREMENTS)} after pip install")
    return python


# ----------------------------------------------------------------------------- benchmark


@dataclass
class RoundResult:
    slowest_s: float  # first trigger -> last control.result() returning
    per_peer_s: list[float]  # each peer's own trigger -> its control.result() returning
    matchmaking_s: float  # step() -> all P peers awaiting the trigger (not part of the timing)
    max_rel_err: float  # worst relative L2 error over peers and over {whole, first half, second half}
    max_abs_err: float


def make_input(peer: int, round_index: int, numel: int, seed: int) -> torch.Tensor:
    """Peer ``peer``'s tensor for round ``round_index``: uniform in [-1, 1], from a known seed."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1000 * (round_index + 1) + peer)
    return torch.rand(numel, generator=generator, dtype=torch.float32).mul_(2.0).sub_(1.0)


def check_mean(result: torch.Tensor, mean: torch.Tensor, peer: int, round_index: int) -> tuple[float, float]:
    """Compare one peer's averaged tensor to the exact mean; fail loudly. Returns (rel L2, max abs)."""
    import torch

    half = mean.numel() // 2
    segments = {"whole": slice(None), "first half": slice(0, half), "second half": slice(half, None)}
    errors: dict[str, tuple[float, float]] = {}
    for name, part in segments.items():
        err = result[part] - mean[part]
        rel = torch.linalg.vector_norm(err, dtype=torch.float64) / torch.linalg.vector_norm(
            mean[part], dtype=torch.float64
        )
        errors[name] = (float(rel), float(err.abs().max()))
    bad = [
        name
        for name, (rel, max_abs) in errors.items()
        if not (rel < REL_L2_TOLERANCE and max_abs < MAX_ABS_TOLERANCE)
    ]
    if bad:
        detail = "; ".join(
            f"{name}: rel L2 {rel:.4f}, max abs {max_abs:.4f}" for name, (rel, max_abs) in errors.items()
        )
        _fail(
            f"round {round_index}, peer {peer}: the averaged tensor is NOT the mean on the {' and '.join(bad)}"
            f" ({detail}; limits: rel L2 < {REL_L2_TOLERANCE}, max abs < {MAX_ABS_TOLERANCE}). hivemind reported"
            " success anyway: with numpy >= 2.4 its 8-bit decoder fails and the failed parts are left unaveraged"
        )
    return max(rel for rel, _ in errors.values()), max(max_abs for _, max_abs in errors.values())


def _die_with_parent(parent_pid: int) -> None:
    """In a child process: have Linux SIGTERM it when the benchmark's main process dies.

    ``finally`` cannot run if the benchmark is SIGKILLed (``subprocess.run`` kills its child that way
    when the caller is interrupted); without this its DHT and averager processes would be orphaned.
    A DHT's p2pd exits by itself once its DHT process is gone.
    """
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _finish_recorder(finished_at: list[float], index: int) -> Callable[[object], None]:
    def record(_future: object) -> None:
        finished_at[index] = time.perf_counter()

    return record


def run_round(
    averagers: Sequence[DecentralizedAverager],
    peer_ids: Sequence[object],
    round_index: int,
    args: argparse.Namespace,
) -> RoundResult:
    """Load fresh inputs, form the group, then time one triggered all-reduce and check its mean."""
    import torch
    from hivemind.averaging.control import AveragingStage
    from hivemind.utils.timed_storage import get_dht_time

    peers = len(averagers)
    inputs = [make_input(peer, round_index, args.numel, args.seed) for peer in range(peers)]
    mean = torch.stack(inputs).mean(dim=0)
    for averager, tensor in zip(averagers, inputs, strict=True):
        with averager.get_tensors() as local:
            local[0].copy_(tensor)
    del inputs

    # Matchmaking, not timed: every step waits for its trigger once the group is assembled.
    started = time.perf_counter()
    scheduled_time = get_dht_time() + args.matchmaking_time
    controls: list[StepControl] = [
        averager.step(
            scheduled_time=scheduled_time,
            timeout=args.matchmaking_timeout,
            allow_retries=False,
            require_trigger=True,
            wait=False,
        )
        for averager in averagers
    ]
    while not all(control.stage == AveragingStage.AWAITING_TRIGGER for control in controls):
        for control in controls:
            if control.done():
                control.result()  # raises the matchmaking error, if any
                _fail(f"round {round_index}: a step finished before it was triggered")
        if time.perf_counter() - started > args.matchmaking_timeout:
            _fail(
                f"round {round_index}: the {peers} peers did not form a group in {args.matchmaking_timeout}s"
            )
        time.sleep(0.005)
    matchmaking_s = time.perf_counter() - started

    # The timed all-reduce: trigger all P steps, wait for the last one.
    triggered_at = [0.0] * peers
    finished_at = [0.0] * peers
    for index, control in enumerate(controls):
        control.add_done_callback(_finish_recorder(finished_at, index))
    t0 = time.perf_counter()
    for index, control in enumerate(controls):
        triggered_at[index] = time.perf_counter()
        control.allow_allreduce()
    gathered = [control.result(timeout=args.allreduce_timeout + 30) for control in controls]
    while not all(finished_at):  # done-callbacks run in hivemind's pipe thread, maybe just after result()
        time.sleep(0.001)

    for index, group in enumerate(gathered):
        if not isinstance(group, dict) or set(group) != set(peer_ids):
            _fail(f"round {round_index}, peer {index}: the group was {group!r}, not all {peers} peers")
    errors = []
    for index, averager in enumerate(averagers):
        with averager.get_tensors() as local:
            errors.append(check_mean(local[0], mean, index, round_index))
    return RoundResult(
        slowest_s=max(finished_at) - t0,
        per_peer_s=[end - start for start, end in zip(triggered_at, finished_at, strict=True)],
        matchmaking_s=matchmaking_s,
        max_rel_err=max(rel for rel, _ in errors),
        max_abs_err=max(max_abs for _, max_abs in errors),
    )


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Start P DHT nodes and averagers, run the warm-up and timed rounds, always shut everything down."""
    try:
        import numpy as np
        import torch
        from hivemind.averaging import DecentralizedAverager
        from hivemind.compression import Uniform8BitQuantization
        from hivemind.dht import DHT
    except ImportError as exc:
        _fail(
            f"{exc} under {sys.executable}: run `python {Path(__file__).name} --setup`, then this script"
            f" with {DEFAULT_VENV / 'bin' / 'python'}"
        )
    if _version_tuple(np.__version__) >= NUMPY_BROKEN_FROM and not args.skip_numpy_guard:
        _fail(f"numpy {np.__version__} >= 2.4 breaks hivemind 1.1.12's 8-bit decoder; use the --setup venv")

    threads: int = args.threads
    torch.set_num_threads(threads)

    main_pid = os.getpid()

    class BenchDHT(DHT):
        """A DHT whose background process dies with the benchmark, even if that is SIGKILLed."""

        def run(self) -> None:
            _die_with_parent(main_pid)
            super().run()

    class BenchAverager(DecentralizedAverager):
        """A DecentralizedAverager whose background process pins torch's threads and dies with the benchmark."""

        def run(self) -> None:
            _die_with_parent(main_pid)
            torch.set_num_threads(threads)
            super().run()

    peers: int = args.peers
    dhts: list[DHT] = []
    averagers: list[DecentralizedAverager] = []
    results: list[RoundResult] = []
    sigint_handler = signal.getsignal(signal.SIGINT)
    try:
        log.info("starting %d DHT nodes on 127.0.0.1", peers)
        for _ in range(peers):
            initial_peers = [str(addr) for addr in dhts[0].get_visible_maddrs()] if dhts else None
            dhts.append(
                BenchDHT(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
            )

        log.info("starting %d averagers over %d float32 values each", peers, args.numel)
        for dht in dhts:
            averagers.append(
                BenchAverager(
                    [torch.zeros(args.numel, dtype=torch.float32)],
                    dht=dht,
                    start=True,
                    prefix="hivemind_allreduce_bench",
                    target_group_size=peers,
                    min_group_size=peers,
                    min_matchmaking_time=args.matchmaking_time,
                    request_timeout=min(3.0, args.matchmaking_time / 2),
                    allreduce_timeout=args.allreduce_timeout,
                    compression=Uniform8BitQuantization(),
                )
            )
            # run_in_background() sets SIGINT to SIG_IGN in *this* process; give Ctrl-C back.
            signal.signal(signal.SIGINT, sigint_handler)

        peer_ids = [dht.peer_id for dht in dhts]
        for round_index in range(-1, args.rounds):  # round -1 is the warm-up, not counted
            result = run_round(averagers, peer_ids, round_index, args)
            log.info(
                "%s: all-reduce %.3fs (per peer %s), matchmaking %.2fs, rel err %.4f, max abs err %.4f",
                "warm-up" if round_index < 0 else f"round {round_index}",
                result.slowest_s,
                ", ".join(f"{s:.3f}" for s in result.per_peer_s),
                result.matchmaking_s,
                result.max_rel_err,
                result.max_abs_err,
            )
            if round_index >= 0:
                results.append(result)
    finally:
        for averager in averagers:
            try:
                averager.shutdown()
            except Exception:
                log.exception("averager shutdown failed")
        for dht in dhts:
            try:
                dht.shutdown()
            except Exception:
                log.exception("DHT shutdown failed")

    round_times = [r.slowest_s for r in results]
    return {
        "benchmark": "hivemind_allreduce",
        "numel": args.numel,
        "peers": peers,
        "threads": threads,
        "compression": "Uniform8BitQuantization",
        "rounds": [round(t, 4) for t in round_times],
        "per_peer_s": [[round(t, 4) for t in r.per_peer_s] for r in results],
        "median_s": round(statistics.median(round_times), 4),
        "min_s": round(min(round_times), 4),
        "matchmaking_s": [round(r.matchmaking_s, 3) for r in results],
        "max_rel_err": round(max(r.max_rel_err for r in results), 5),
        "max_abs_err": round(max(r.max_abs_err for r in results), 5),
        "hivemind": importlib.metadata.version("hivemind"),
        "torch": torch.__version__,
        "numpy": np.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--setup", action="store_true", help="create the venv if missing, print its python, exit"
    )
    parser.add_argument(
        "--venv", type=Path, default=DEFAULT_VENV, help="venv for --setup (default: %(default)s)"
    )
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--numel", type=int, default=20_000_000, help="float32 values averaged per peer")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, after one warm-up round")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--matchmaking-time", type=float, default=5.0, help="hivemind min_matchmaking_time")
    parser.add_argument("--matchmaking-timeout", type=float, default=120.0, help="seconds to form the group")
    parser.add_argument("--allreduce-timeout", type=float, default=600.0, help="seconds for one all-reduce")
    parser.add_argument(
        "--skip-numpy-guard",
        action="store_true",
        help="run even with numpy >= 2.4 (only to see the mean check catch the broken decoder)",
    )
    args = parser.parse_args()

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False

    if args.setup:
        print(ensure_venv(args.venv))
        return
    if args.peers < 2 or args.numel < 2 or args.rounds < 1 or args.threads < 1:
        parser.error("need --peers >= 2, --numel >= 2, --rounds >= 1, --threads >= 1")

    def _terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally that shuts hivemind down

    signal.signal(signal.SIGTERM, _terminate)
    started = time.perf_counter()
    result = run_benchmark(args)
    log.info("done in %.1fs", time.perf_counter() - started)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
