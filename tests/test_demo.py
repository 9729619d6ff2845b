"""``potluck demo`` end to end, and Ctrl+C leaving no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from swarm import alarming

pytestmark = pytest.mark.slow


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, their DHT processes, p2pd daemons)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - out
        out |= frontier
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


def test_demo_trains_and_reports(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = subprocess.run(
        [sys.executable, "-m", "potluck", "demo", "--peers", "2", "--outer-steps", "3", "--inner-steps", "10",
         "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "join address: /ip4/127.0.0.1/tcp/" in out and "status page: http://127.0.0.1:" in out
    assert "outer step   3/3" in out
    assert "final eval loss" in out and "entropy floor of the data" in out
    assert (tmp_path / "run.toml").exists() and (tmp_path / "journal" / "journal.json").exists()
    assert alarming(tmp_path / "logs") == []  # coordinator, peers, DHT processes, p2pd: nothing at WARN or above


def test_ctrl_c_stops_every_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    demo = subprocess.Popen(
        [sys.executable, "-m", "potluck", "demo", "--peers", "2", "--outer-steps", "50", "--inner-steps", "50",
         "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    tree: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        lines = []
        assert demo.stdout is not None
        for line in demo.stdout:
            lines.append(line)
            if "outer step   1/50" in line or time.monotonic() > deadline:
                break
        assert any("outer step   1/50" in line for line in lines), "".join(lines)
        tree = descendants(demo.pid)
        assert len(tree) >= 6, f"expected coordinator, peers, DHT processes and p2pd daemons, got {tree}"
        os.kill(demo.pid, signal.SIGINT)
        try:  # read while waiting: a demo blocked on a full stdout pipe would never exit
            rest, _ = demo.communicate(timeout=60)
        except subprocess.TimeoutExpired as err:
            said = err.output.decode(errors="replace") if isinstance(err.output, bytes) else err.output
            raise AssertionError(f"the demo did not exit within 60 s of Ctrl+C; it said:\n{said}") from None
        rc = demo.returncode
        assert rc == 130, rest
        assert "interrupted" in rest
        deadline = time.monotonic() + 10
        while {p for p in tree if alive(p)} and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {p: Path(f"/proc/{p}/cmdline").read_bytes()[:80] for p in tree if alive(p)}
        assert not left, f"processes left behind after Ctrl+C: {left}"
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
        for p in tree:
            if alive(p):
                os.kill(p, signal.SIGKILL)


def test_demo_stages_never_rewrite_a_model_that_config_names(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`--stages` grows the demo's own model a layer per stage; a model `--config` names is trained as written."""
    import argparse

    from potluck.demo import demo_config, leftover_lines

    run = tmp_path / "run.toml"
    run.write_text('[model]\npreset = "llama-20m"\nseq_len = 64\n')
    args = argparse.Namespace(config=str(run), stages=4, peers=8, outer_steps=None, inner_steps=None, set=[])
    cfg = demo_config(args, tmp_path)
    assert (cfg.model.family, cfg.model.n_layers, cfg.pipeline.stages) == ("llama", 12, 4)
    args = argparse.Namespace(config=None, stages=4, peers=8, outer_steps=None, inner_steps=None, set=[])
    assert demo_config(args, tmp_path).model.n_layers == 4  # the demo's own tiny model: one layer per stage
    (tmp_path / "journal" / "checkpoints").mkdir(parents=True)
    (tmp_path / "journal" / "checkpoints" / "ckpt-1.json").write_text("{}")
    assert "--out model-hf" in "\n".join(leftover_lines(tmp_path, False, "llama"))
    assert "--out model.pt" in "\n".join(leftover_lines(tmp_path, False, "tiny"))


def test_a_send_that_can_never_succeed_ends_the_demo_with_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Stage 0's first message of step 1 goes out with a piece over gRPC's cap (a fault: as every real-size
    message did before messages were cut): the demo says why in one line and exits 1, instead of retrying."""
    env = {**os.environ, "POTLUCK_FAULTS": "pipe.send@1:oversize"}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "potluck", "demo", "--stages", "2", "--replicas", "1", "--outer-steps", "2",
         "--inner-steps", "2", "--set", "pipeline.pipe_timeout_s=10", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=240, env=env,
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed = [line for line in proc.stdout.splitlines() if line.startswith("potluck demo failed:")]
    assert len(failed) == 1, proc.stdout
    assert "stopped" in failed[0] and "RESOURCE_EXHAUSTED" in failed[0], failed[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert elapsed < 120, elapsed
