"""Commands potluck prints paste and run as they are: the coordinator's ``start a peer:`` line of a private run on a
text file (its join token read from its file, the corpus by its absolute path) runs, from another folder, a peer
that trains the run to its end (real processes)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_printed_start_a_peer_command_pastes_and_trains(swarm, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n".encode() for i in range(400)))
    swarm.start_coordinator({"data.source": "bytes", "data.path": str(corpus), "admission.mode": "private",
                             "diloco.outer_steps": 2, "diloco.inner_steps": 5, "model.seq_len": 32})
    printed = (swarm.logs / "coordinator.log").read_text()
    line = re.search(r"start a peer: (potluck peer .*)", printed)
    assert line is not None, printed
    command = line.group(1)
    assert "FILE" not in command and "TOKEN" not in command and str(corpus.resolve()) in command, command
    elsewhere = tmp_path / "elsewhere"  # (not where the coordinator runs: the paths in it must be whole)
    elsewhere.mkdir()
    home = tmp_path / "home"  # (the peer's default identity goes to $HOME/.potluck)
    env = {**os.environ, "HOME": str(home), "PWD": str(elsewhere)}
    pasted = swarm.procs.spawn(["bash", "-c", f"cd {elsewhere} && exec {command}"], swarm.logs / "pasted.log", env)
    state = swarm.wait_state(lambda s: s["run"]["finished"], 240, "the pasted peer to train the run")
    assert [h["step"] for h in state["history"]] == [1, 2] and pasted.wait(timeout=60) == 0
