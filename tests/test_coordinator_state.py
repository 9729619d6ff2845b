"""The coordinator's decisions, journal and checkpoints, without a network."""

from __future__ import annotations

import json

import pytest
import torch

from potluck.compression.transfer import Snapshot
from potluck.coordinator.checkpoint import CheckpointStore
from potluck.coordinator.journal import Journal, JournalError, JournalState
from potluck.coordinator.membership import PeerTable
from potluck.protos.records import PeerRecord


def rec(pid: str, version: int = 0, state: str = "waiting", h: str = "h0", seq: int = 1) -> PeerRecord:
    return PeerRecord(peer_id=pid, address=f"{pid}:1", version=version, state=state, state_hash=h, seq=seq)


def test_first_round_waits_for_min_peers_then_admits_all_sorted() -> None:
    t = PeerTable(heartbeat_timeout_s=5)
    t.update({"b": rec("b")}, now=0)
    assert not t.ready_to_decide(min_peers=2, now=0)
    t.update({"a": rec("a"), "b": rec("b")}, now=1)
    assert t.ready_to_decide(min_peers=2, now=1)
    d = t.decide()
    assert [m.peer_id for m in d.round.members] == ["a", "b"] and d.round.step == 1 and d.round.base_hash == "h0"
    assert t.pending_step() is None  # round 1 is running


def test_next_round_after_commit_admits_joiners_and_drops_the_lost() -> None:
    t = PeerTable(heartbeat_timeout_s=5, settle_s=1)
    t.update({"a": rec("a"), "b": rec("b")}, now=0)
    t.decide()
    t.update({"a": rec("a", 1, "training", "h1", 2), "c": rec("c")}, now=2)
    assert t.committed == 1
    assert not t.ready_to_decide(1, now=2)  # b has not reported v1 yet, settle time not over
    t.update({}, now=3.5)
    assert t.ready_to_decide(1, now=3.5)
    t.update({}, now=6)  # b silent for 6 s > timeout: lost
    d = t.decide()
    assert [m.peer_id for m in d.round.members] == ["a", "c"] and d.joined == ["c"] and d.dropped == ["b"]
    assert d.round.base_hash == "h1"


def test_canonical_hash_is_the_majority() -> None:
    t = PeerTable(heartbeat_timeout_s=5)
    t.update({p: rec(p) for p in "abc"}, now=0)
    t.decide()
    t.update({"a": rec("a", 1, h="good", seq=2), "b": rec("b", 1, h="good", seq=2), "c": rec("c", 1, h="bad", seq=2)}, now=1)
    assert t.canonical_hash(1) == "good"


def test_goodbye_evicts_at_once() -> None:
    t = PeerTable(heartbeat_timeout_s=100)
    t.update({"a": rec("a")}, now=0)
    events = t.update({"a": rec("a", state="left", seq=2)}, now=1)
    assert ("left", "a") in events and t.live() == []


def test_journal_round_trip_and_corruption(tmp_path) -> None:  # type: ignore[no-untyped-def]
    j = Journal(tmp_path)
    assert j.load() is None
    j.save(JournalState(run_id="r", config={"a": 1}, created_at=1.0, committed=4, hashes={4: "x"}))
    state = j.load()
    assert state is not None and state.committed == 4 and state.hashes == {4: "x"}
    j.path.write_text("{broken")
    with pytest.raises(JournalError):
        j.load()


def snap(version: int) -> Snapshot:
    gen = torch.Generator().manual_seed(version)
    layout = [["w", [3, 4]], ["b", [4]]]
    return Snapshot.create({"theta": torch.randn(16, generator=gen), "momentum": torch.randn(16, generator=gen)},
                           version, {"layout": layout})


def test_checkpoints_round_trip_per_parameter_and_keep_the_last_k(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = CheckpointStore(tmp_path, keep=2)
    for v in (1, 2, 3):
        store.write(snap(v))
    assert [p.stem for p in store.manifests()] == ["ckpt-000003", "ckpt-000002"]
    loaded = store.latest_valid()
    assert loaded is not None and loaded.version == 3 and loaded.hash == snap(3).hash
    from safetensors.torch import load_file
    names = set(load_file(str(tmp_path / "ckpt-000003.safetensors")))
    assert names == {"theta/w", "theta/b", "momentum/w", "momentum/b"}


def test_truncated_checkpoint_falls_back_to_the_previous(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    store = CheckpointStore(tmp_path, keep=3)
    store.write(snap(1))
    store.write(snap(2))
    data = tmp_path / "ckpt-000002.safetensors"
    data.write_bytes(data.read_bytes()[:-10])
    loaded = store.latest_valid()
    assert loaded is not None and loaded.version == 1
    assert "ckpt-000002 is unusable" in caplog.text
    manifest = json.loads((tmp_path / "ckpt-000001.json").read_text())
    assert manifest["state_hash"] == snap(1).hash


def _stage_snapshot(cfg, start: int, stop: int, stage: int, version: int = 3):  # type: ignore[no-untyped-def]
    """What a peer of this stage serves: theta and momentum of its layers, named by model layer."""
    import torch

    from potluck.compression.transfer import Snapshot, tensors_hash
    from potluck.peer.model import build_layers

    layers = build_layers(cfg.model, cfg.train.seed, start, stop)
    named = [(f"layers.{start + int(n.split('.', 1)[0])}.{n.split('.', 1)[1]}", p) for n, p in layers.named_parameters()]
    theta = torch.cat([p.detach().flatten() for _, p in named])
    tensors = {"theta": theta, "momentum": theta * 0.5}
    meta = {"layout": [[n, list(p.shape)] for n, p in named], "stage": stage}
    return Snapshot(tensors, version, tensors_hash(tensors), meta)


def test_checkpoints_consolidate_stages_and_re_split_into_any_number(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch

    from potluck.coordinator.checkpoint import CheckpointStore, consolidate, slice_stage
    from potluck.peer.pipeline import stage_bounds
    from potluck.protos.config import RunConfig, apply_overrides

    def cfg_for(stages: int):  # type: ignore[no-untyped-def]
        return apply_overrides(RunConfig(), {"model.n_layers": 2, "model.d_model": 32, "model.n_heads": 2,
                                             "pipeline.stages": stages})

    two = cfg_for(2)
    parts = [_stage_snapshot(two, a, b, s) for s, (a, b) in enumerate(stage_bounds(two.model, two.pipeline))]
    whole = consolidate(parts)
    single = _stage_snapshot(cfg_for(1), 0, 4, 0)
    assert torch.equal(whole.tensors["theta"], single.tensors["theta"]) and whole.hash == single.hash
    store = CheckpointStore(tmp_path)
    loaded = store.load(store.write(whole))
    for stages in (1, 4):
        cfg = cfg_for(stages)
        for s, (a, b) in enumerate(stage_bounds(cfg.model, cfg.pipeline)):
            got, want = slice_stage(loaded, a, b, s), _stage_snapshot(cfg, a, b, s)
            assert torch.equal(got.tensors["theta"], want.tensors["theta"])
            assert torch.equal(got.tensors["momentum"], want.tensors["momentum"])
            assert got.hash == want.hash and got.meta["stage"] == s
    with pytest.raises(ValueError, match="different versions"):
        consolidate([parts[0], _stage_snapshot(two, *stage_bounds(two.model, two.pipeline)[1], 1, version=4)])
    with pytest.raises(ValueError, match="not after the previous stage"):
        consolidate([parts[1], parts[0]])
