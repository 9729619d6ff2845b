"""The outer state on disk (``potluck peer --outer-state-dir DIR``, :mod:`potluck.peer.outer.spill`): the same bits and
hash in memory-mapped files, nothing left in the folder, a folder that cannot be written refused in one line, and a
real swarm in which one peer keeps its outer state there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from potluck.compression.transfer import Snapshot
from potluck.peer.outer.spill import Spill, mapped
from potluck.peer.outer.states import States
from potluck.protos.config.section import ConfigError


def snapshot(version: int, seed: int = 0) -> Snapshot:
    g = torch.Generator().manual_seed(seed)
    return Snapshot.create({"theta": torch.randn(5000, generator=g), "momentum": torch.randn(5000, generator=g)},
                           version, {"epoch": 0})


def test_a_placed_snapshot_is_the_same_bits_in_files_that_are_gone_from_the_folder(tmp_path: Path) -> None:
    snap = snapshot(3)
    placed = Spill(tmp_path / "outer").place(snap)
    assert placed.hash == snap.hash and placed.version == 3 and placed.meta == snap.meta
    for name, t in snap.tensors.items():
        assert torch.equal(placed.tensors[name], t) and mapped(placed.tensors[name]) and not mapped(t)
    assert list((tmp_path / "outer").iterdir()) == []  # unlinked once mapped: nothing to clean up, whatever happens


def test_the_states_hold_what_they_commit_in_files(tmp_path: Path) -> None:
    states = States("run", 1 << 16, snapshot(0), Spill(tmp_path))
    assert mapped(states.current.tensors["theta"])
    held = states.commit(snapshot(1, seed=1))
    assert held is states.current and mapped(held.tensors["momentum"])
    assert torch.equal(held.tensors["theta"], snapshot(1, seed=1).tensors["theta"])
    prev = states.previous(0, snapshot(0).hash)  # served to a peer rolling back one step: from its file
    assert prev is not None and mapped(prev.tensors["theta"])
    plain = States("run", 1 << 16, snapshot(0))
    assert not mapped(plain.commit(snapshot(1)).tensors["theta"])  # (without the option: RAM, as before)


def test_a_folder_that_cannot_be_written_is_refused_in_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"--outer-state-dir .*a-file/outer: cannot write there"):
        Spill(blocker / "outer")
    done = subprocess.run([sys.executable, "-m", "potluck", "peer", "--join",
                           "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA",
                           "--outer-state-dir", str(blocker / "outer")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "cannot write there" in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_peer_with_its_outer_state_on_disk_trains_in_a_swarm(swarm, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """One peer keeps its outer state in files, the other (at half speed) in RAM: the same theta_global after every
    outer step, and the folder is empty when the run is over."""
    from test_swarm import hashes_agree

    folder = tmp_path / "outer-state"
    swarm.start_coordinator({"diloco.outer_steps": 3, "diloco.inner_steps": 8, "membership.min_peers": 2,
                             "diloco.rounds": "fixed"})
    swarm.start_peer(env={"POTLUCK_FAULTS": "inner.step@*:slow=2"}, name="in-ram")
    disk = swarm.start_peer("--outer-state-dir", str(folder), name="on-disk")
    state = swarm.wait_state(lambda s: s["run"]["finished"] and s["history"] and len(s["history"][-1]["state_hashes"]) == 2,
                             180, "the run to finish")
    assert [h["step"] for h in state["history"]] == [1, 2, 3] and hashes_agree(state) == []
    assert all(h["contributors"] == 2 for h in state["history"])
    assert disk.wait(timeout=60) == 0
    assert "memory-mapped files" in (swarm.logs / "peer-1.log").read_text()
    assert list(folder.iterdir()) == []
