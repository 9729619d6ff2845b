"""Checkpoints written one stage at a time and served from the file (#13: no process holds the whole
model unless it asks to), for every model family; the universal re-split works for the new models."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch
from safetensors.torch import load_file

from potluck.compression.transfer import Snapshot, tensors_hash
from potluck.coordinator.checkpoint import CheckpointStore, consolidate, slice_stage, stage_views
from potluck.models import build_stage, stage_bounds
from potluck.protos.config import RunConfig, apply_overrides

FAMILIES = {
    "tiny": {"model.d_model": 32, "model.n_heads": 2, "model.n_layers": 4},
    "llama": {"model.family": "llama", "model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2,
              "model.n_layers": 4, "model.d_ff": 64},
}


def cfg_for(family: str, stages: int) -> RunConfig:
    return apply_overrides(RunConfig(), {**FAMILIES[family], "pipeline.stages": stages})


def stage_snapshots(cfg: RunConfig, version: int = 3) -> Iterator[Snapshot]:
    """What each stage's members serve, built one stage at a time as peers hold them."""
    for s, (a, b) in enumerate(stage_bounds(cfg.model, cfg.pipeline)):
        layers = build_stage(cfg.model, cfg.train.seed, a, b)
        named = [(f"layers.{a + int(n.split('.', 1)[0])}.{n.split('.', 1)[1]}", p) for n, p in layers.named_parameters()]
        theta = torch.cat([p.detach().flatten() for _, p in named])
        tensors = {"theta": theta, "momentum": theta * 0.5}
        yield Snapshot(tensors, version, tensors_hash(tensors), {"layout": [[n, list(p.shape)] for n, p in named],
                                                                   "stage": s, "inner_steps": 7})


@pytest.mark.parametrize("family", FAMILIES)
def test_stages_written_one_at_a_time_serve_and_re_split(family: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    three = cfg_for(family, 3)
    parts = list(stage_snapshots(three))
    store = CheckpointStore(tmp_path)
    path = store.write_stages(3, iter(parts), {"run_id": "r"})
    manifest = store.verified(path)
    whole = consolidate(parts)
    # the file is plain safetensors, per parameter, and the manifest's whole-model hash is consolidate's
    stored = load_file(str(tmp_path / manifest["file"]))
    assert sorted(stored) == sorted(f"{k}/{n}" for k in ("theta", "momentum") for n, _ in whole.meta["layout"])
    assert manifest["state_hash"] == whole.hash and store.load(path).hash == whole.hash
    # each stage is served straight from the file, bit for bit what its members hold
    for part, entry in zip(parts, manifest["stages"], strict=True):
        view = stage_views(tmp_path / manifest["file"], entry, 3, 7)
        assert view.hash == part.hash == tensors_hash(view.tensors)
        assert all(torch.equal(view.tensors[k], part.tensors[k]) for k in ("theta", "momentum"))
    # the universal checkpoint: re-split into any number of stages of the same model
    loaded = store.load(path)
    for stages in (1, 2, 4):
        cfg = cfg_for(family, stages)
        want = list(stage_snapshots(cfg))
        for s, (a, b) in enumerate(stage_bounds(cfg.model, cfg.pipeline)):
            got = slice_stage(loaded, a, b, s)
            assert got.hash == want[s].hash and torch.equal(got.tensors["theta"], want[s].tensors["theta"])


def test_a_write_that_dies_between_stages_leaves_nothing_and_a_corrupt_file_is_skipped(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = cfg_for("llama", 3)
    store = CheckpointStore(tmp_path)
    first = store.write_stages(3, stage_snapshots(cfg, 3))

    def dies() -> Iterator[Snapshot]:
        parts = stage_snapshots(cfg, 4)
        yield next(parts)
        raise OSError("the members went away")

    with pytest.raises(OSError, match="went away"):
        store.write_stages(4, dies())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000003.json", "ckpt-000003.safetensors"]
    assert store.latest_verified()[0] == first  # type: ignore[index]
    with pytest.raises(ValueError, match="stage 1 is at version 5, not 4"):
        store.write_stages(4, iter([next(stage_snapshots(cfg, 4)), list(stage_snapshots(cfg, 5))[1]]))
    second = store.write_stages(4, stage_snapshots(cfg, 4))
    data = tmp_path / "ckpt-000004.safetensors"
    data.write_bytes(data.read_bytes()[:-100])  # truncated
    found = store.latest_verified()
    assert found is not None and found[0] == first and second != first
    with pytest.raises(ValueError, match="corrupted or truncated"):
        store.verified(second)


def test_checkpointing_holds_one_stage_at_a_time(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Peak RSS while writing and serving a 4-stage checkpoint of 64 MiB per stage, in a fresh process:
    one stage's worth, where consolidating the whole model held four (and then copies of it)."""
    script = textwrap.dedent('''
        import json, resource, sys
        import torch
        from pathlib import Path
        from potluck.compression.transfer import Snapshot, tensors_hash
        from potluck.coordinator.checkpoint import CheckpointStore, stage_views
        n = 8 << 20  # float32 values of one stage's theta (and momentum): 64 MiB per stage
        def stage(s):  # a function of its own: the generator keeps no stage alive while making the next
            tensors = {"theta": torch.full((n,), float(s)), "momentum": torch.full((n,), -float(s))}
            return Snapshot(tensors, 1, tensors_hash(tensors), {"layout": [[f"layers.{s}.w", [n]]]})
        def stages():
            for s in range(4):
                yield stage(s)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        store = CheckpointStore(Path(sys.argv[1]))
        path = store.write_stages(1, stages())
        m = store.verified(path)
        served = [stage_views(store.dir / m["file"], part, 1) for part in m["stages"]]
        assert float(served[3].tensors["theta"][-1]) == 3.0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"growth_mib": (peak - base) / 1024}))
    ''')
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    growth = json.loads(done.stdout)["growth_mib"]
    assert growth < 1.5 * 64, f"checkpointing grew RSS by {growth:.0f} MiB; one stage is 64 MiB"
