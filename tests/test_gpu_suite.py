"""``benchmarks/gpu_suite.sh`` on a machine without CUDA: the script a GPU session runs in one call works, every
benchmark in it says in its own JSON line that it measured nothing and why, and its logs go where ``$OUT`` says
(never into the repository)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = ["gpu_codec", "int4_kernels_cuda", "mfu", "outer_step", "gpu_swarm", "device_memory"]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU path measures for minutes: run the suite by hand")
def test_the_gpu_suite_says_what_it_did_not_measure(tmp_path: Path) -> None:
    default_logs = ROOT / "gpu-suite"  # where its logs go without $OUT (a developer's run may have left some)

    def listing() -> list[tuple[str, int]]:
        return sorted((p.name, p.stat().st_mtime_ns) for p in default_logs.iterdir()) if default_logs.exists() else []

    before = listing()
    env = {**os.environ, "OUT": str(tmp_path / "logs"), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "--quick"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["benchmark"] for line in lines] == NO_GPU, done.stdout
    for line in lines:
        assert line["measured"] is False and "no CUDA" in line["reason"], line
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == sorted(f"{name}.log" for name in NO_GPU)
    assert listing() == before  # (a run's logs were once committed from there)
