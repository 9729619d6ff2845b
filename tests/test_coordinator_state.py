"""The coordinator's journal and checkpoints, without a network (rounds: tests/test_rounds.py)."""

from __future__ import annotations

import json

import pytest
import torch

from potluck.compression.transfer import Snapshot
from potluck.coordinator.store.checkpoint import CheckpointStore
from potluck.coordinator.store.journal import Journal, JournalError, JournalState


def test_journal_round_trip_and_corruption(tmp_path) -> None:  # type: ignore[no-untyped-def]
    j = Journal(tmp_path)
    assert j.load() is None
    j.save(JournalState(run_id="r", config={"a": 1}, created_at=1.0, committed=4, hashes={0: {4: "x"}}, epoch=2))
    state = j.load()
    assert state is not None and state.committed == 4 and state.hashes == {0: {4: "x"}} and state.epoch == 2
    j.path.write_text("{broken")
    with pytest.raises(JournalError):
        j.load()


def test_a_version_1_journal_still_loads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Version 1 kept stage 0's hashes as {version: hash}; they become stage 0's."""
    (tmp_path / "journal.json").write_text(json.dumps({"v": 1, "run_id": "r", "config": {}, "created_at": 1.0,
                                                       "committed": 3, "hashes": {"3": "abc"}}))
    state = Journal(tmp_path).load()
    assert state is not None and state.hashes == {0: {3: "abc"}} and state.epoch == 0 and state.committed_run()


def test_a_journal_keeps_each_rounds_json_between_saves_and_writes_what_a_whole_dump_would(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Rounds are dumped once and spliced into later saves (they were 70 % of a 1,000-member journal); the file
    still reads back as the whole state, after a round is replaced (a new object: never changed in place), a
    new one decided and the oldest pruned."""
    from potluck.coordinator.store.journal import KEEP_ROUNDS
    from potluck.protos.wire.records import Member, Round

    def rnd(step: int, n: int, base: str = "") -> Round:
        return Round(step=step, base_hash=base, members=[Member(peer_id=f"p{i}", address=f"h:{i}") for i in range(n)])

    j = Journal(tmp_path)
    state = JournalState(run_id="r", config={"rounds": []}, created_at=1.0, rounds=[rnd(s, 3) for s in range(1, 4)],
                         history=[{"step": 1, "loss": 2.5}])
    for turn in range(KEEP_ROUNDS + 9):
        if turn % 3 == 1:
            state.rounds[-1] = state.rounds[-1].model_copy(update={"base_hash": f"h{turn}"})  # (replaced)
        else:
            state.rounds.append(rnd(state.rounds[-1].step + 1, 2 + turn % 4))
        j.save(state)
        whole = JournalState.model_validate_json(state.model_dump_json(indent=1))
        assert j.load() == whole and json.loads(j.path.read_text())["rounds"] == json.loads(whole.model_dump_json())["rounds"]
    assert len(state.rounds) == KEEP_ROUNDS and state.rounds[0].step > 1 and f"h{KEEP_ROUNDS + 6}" in {r.base_hash for r in state.rounds}
    assert len(j._dumped) == KEEP_ROUNDS  # (the pruned rounds' JSON is not kept)


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
    from potluck.peer.training.model import build_layers

    layers = build_layers(cfg.model, cfg.train.seed, start, stop)
    named = [(f"layers.{start + int(n.split('.', 1)[0])}.{n.split('.', 1)[1]}", p) for n, p in layers.named_parameters()]
    theta = torch.cat([p.detach().flatten() for _, p in named])
    tensors = {"theta": theta, "momentum": theta * 0.5}
    meta = {"layout": [[n, list(p.shape)] for n, p in named], "stage": stage}
    return Snapshot(tensors, version, tensors_hash(tensors), meta)


def test_checkpoints_consolidate_stages_and_re_split_into_any_number(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch

    from potluck.coordinator.store.checkpoint import CheckpointStore, consolidate, slice_stage
    from potluck.models import stage_bounds
    from potluck.protos.config.files import apply_overrides
    from potluck.protos.config.runconfig import RunConfig

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


def test_the_journal_writer_writes_off_the_callers_thread_and_says_which_save_is_durable(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The loop encodes and hands over; the writer's thread writes (atomically) and calls back; ``durable`` is the
    newest ticket on disk; ``flush`` waits for all of it; a stopped writer takes nothing more."""
    import threading

    from potluck.coordinator.store.journal import JournalWriter

    j, woken = Journal(tmp_path), threading.Event()
    writer = JournalWriter(j, done=woken.set)
    try:
        for ticket in (1, 2, 3):
            writer.submit(j.encode(JournalState(run_id="r", config={}, created_at=1.0, committed=ticket)), ticket)
        assert writer.flush(timeout=30) and woken.is_set()
        assert writer.durable == 3 and writer.error is None
        loaded = j.load()
        assert loaded is not None and loaded.committed == 3, "the newest save is the one on disk"
    finally:
        writer.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        writer.submit(b"{}", 4)


def test_a_journal_write_that_fails_is_reported_and_a_later_one_heals_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A write the disk refuses leaves ``durable`` where it was and sets ``error`` (the loop stops on it: exit
    code 2); the old journal is untouched; once the disk takes writes again the next save clears it."""
    from potluck.coordinator.store.journal import JournalWriter

    j = Journal(tmp_path / "journal")
    writer = JournalWriter(j)
    try:
        writer.submit(j.encode(JournalState(run_id="r", config={}, created_at=1.0, committed=1)), 1)
        assert writer.flush(timeout=30) and writer.durable == 1
        j.path.unlink()
        (j.path / "in-the-way").mkdir(parents=True)  # (a folder where the journal goes: even root cannot replace it)
        writer.submit(j.encode(JournalState(run_id="r", config={}, created_at=1.0, committed=2)), 2)
        assert writer.flush(timeout=30)
        assert writer.durable == 1 and isinstance(writer.error, OSError)
        (j.path / "in-the-way").rmdir()
        j.path.rmdir()
        writer.submit(j.encode(JournalState(run_id="r", config={}, created_at=1.0, committed=3)), 3)
        assert writer.flush(timeout=30)
        assert writer.durable == 3 and writer.error is None
    finally:
        writer.stop()
