"""Checkpoints written one stage file at a time and served memory-mapped from those files (#13: no
process holds the whole model unless it asks to), re-split by parameter name for a run with other
stages, for every model family."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from blake3 import blake3
from safetensors import safe_open
from safetensors.torch import load_file

from potluck.compression.transfer import (
    Snapshot,
    SnapshotServer,
    SnapshotUnavailable,
    Target,
    fetch_snapshot,
    probe_sources,
    tensors_hash,
)
from potluck.coordinator.store.checkpoint import (
    FORMAT,
    CheckpointStore,
    consolidate,
    slice_stage,
    split_by_layout,
)
from potluck.coordinator.store.checkpointer import Checkpointer, Job, Written
from potluck.coordinator.store.tensorfile import tensor_ranges
from potluck.coordinator.swarm.service import CoordinatorService
from potluck.models import build_stage, stage_bounds
from potluck.protos import potluck_pb2 as pb
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.transport import PeerClient, PeerServer, Traffic

RUN = "ckpt-run"
FAMILIES: dict[str, dict[str, Any]] = {
    "tiny": {"model.d_model": 32, "model.n_heads": 2, "model.n_layers": 4},
    "llama": {"model.family": "llama", "model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2,
              "model.n_layers": 4, "model.d_ff": 64},
}


def cfg_for(family: str, stages: int) -> RunConfig:
    return apply_overrides(RunConfig(), {**FAMILIES[family], "pipeline.stages": stages})


def bounds_of(cfg: RunConfig) -> list[tuple[int, int]]:
    return stage_bounds(cfg.model, cfg.pipeline)


def stage_snapshots(cfg: RunConfig, version: int = 3) -> Iterator[Snapshot]:
    """What each stage's members serve, built one stage at a time as peers hold them."""
    for s, (a, b) in enumerate(bounds_of(cfg)):
        layers = build_stage(cfg.model, cfg.train.seed, a, b)
        named = [(f"layers.{a + int(n.split('.', 1)[0])}.{n.split('.', 1)[1]}", p) for n, p in layers.named_parameters()]
        theta = torch.cat([p.detach().flatten() for _, p in named])
        tensors = {"theta": theta, "momentum": theta * 0.5 + version}
        yield Snapshot(tensors, version, tensors_hash(tensors), {"layout": [[n, list(p.shape)] for n, p in named],
                                                                   "stage": s, "inner_steps": 7})


def same(got: Snapshot, want: Snapshot) -> bool:
    return got.hash == want.hash == tensors_hash(got.tensors) and got.tensors.keys() == want.tensors.keys() and all(
        torch.equal(got.tensors[k], want.tensors[k]) for k in want.tensors)


def test_tensors_hash_streams_the_same_digest() -> None:
    """Peers and the coordinator compare these hashes: hashing without copying, a block at a time, must
    not change them; hashes an older version wrote (BLAKE2b) are still verified as such."""
    tensors = {"theta": torch.arange(10, dtype=torch.float32) / 4, "step": torch.tensor(7.0), "none": torch.empty(0),
               "momentum": -torch.arange(6, dtype=torch.float32).reshape(2, 3).t()}  # not contiguous
    legacy = "0228bbdd63981bca5e5d31e09a9a4213"  # computed by the copying BLAKE2b version
    assert tensors_hash(tensors, like=legacy) == legacy
    stream = b"".join(n.encode() + b"\0" + tensors[n].contiguous().numpy().tobytes() for n in sorted(tensors))
    assert tensors_hash(tensors) == "b3:" + blake3(stream).hexdigest(length=16)
    big = {"theta": torch.randn(5 << 20)}  # 20 MiB: more than one block
    raw = b"theta\0" + big["theta"].numpy().tobytes()
    assert tensors_hash(big) == "b3:" + blake3(raw).hexdigest(length=16)
    h = hashlib.blake2b(raw, digest_size=16).hexdigest()
    assert tensors_hash(big, like=h) == h


def test_hashing_survives_a_fork() -> None:
    """hivemind forks a process to run a DHT node after a coordinator resuming from a checkpoint hashed
    it: the child must be able to hash too (a hash on BLAKE3's thread pool left the child hung)."""
    tensors = {"theta": torch.arange(1 << 20, dtype=torch.float32)}
    want = tensors_hash(tensors)
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    child = ctx.Process(target=lambda: results.put(tensors_hash(tensors)))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("hashing hung in a forked child")
    assert child.exitcode == 0 and results.get(timeout=5) == want


def test_a_checkpoint_an_older_version_wrote_still_loads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Its manifest's hashes are BLAKE2b: they are verified as such (and still catch a changed bit)."""
    part = next(stage_snapshots(cfg_for("tiny", 1)))
    old = Snapshot(part.tensors, 3, tensors_hash(part.tensors, like="0" * 32), part.meta)
    store = CheckpointStore(tmp_path)
    path = store.write_stages(3, iter([old]), {"run_id": "r"})
    manifest = json.loads(path.read_text())
    manifest["state_hash"] = old.hash  # as the older version wrote it
    path.write_text(json.dumps(manifest))
    assert store.load(path).hash == old.hash
    manifest["state_hash"] = old.hash[:-1] + ("0" if old.hash[-1] != "0" else "1")
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="state hash"):
        store.load(path)


@pytest.mark.parametrize("family", FAMILIES)
def test_stage_files_are_safetensors_and_re_split_by_name(family: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    parts = list(stage_snapshots(cfg_for(family, 3)))
    store = CheckpointStore(tmp_path)
    path = store.write_stages(3, iter(parts), {"run_id": "r"})
    manifest = store.verified(path)
    assert manifest["format"] == FORMAT and manifest["run_id"] == "r" and manifest["meta"]["inner_steps"] == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000003.json"] + [f"ckpt-000003.s{s}.safetensors" for s in range(3)]
    for part, entry in zip(parts, manifest["stages"], strict=True):
        file = tmp_path / entry["file"]
        assert entry["hash"] == part.hash and entry["sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()
        layout = [(n, sh) for n, sh in part.meta["layout"]]
        assert entry["layout"] == [list(e) for e in layout] and entry["layers"][0] == int(layout[0][0].split(".")[1])
        names = [f"{k}/{n}" for k in ("theta", "momentum") for n, _ in layout]
        stored = load_file(str(file))  # safetensors' own reader
        assert sorted(stored) == sorted(names)
        spans = [tensor_ranges(file)[n] for n in names]  # in layout order, theta then momentum, back to back
        assert spans[0][0] == entry["theta"][0] and spans[-1][1] == entry["momentum"][1] == file.stat().st_size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
        for key in ("theta", "momentum"):
            for name, t in split_by_layout(part.tensors[key], layout).items():
                assert torch.equal(stored[f"{key}/{name}"], t)
        with safe_open(str(file), "pt") as f:
            assert f.metadata()["format"] == FORMAT and f.metadata()["stage"] == str(entry["stage"])
    # whole-model readers: the consolidated snapshot, or one parameter at a time
    whole = consolidate(parts)
    assert manifest["state_hash"] == whole.hash and same(store.load(path), whole)
    for key in ("theta", "momentum"):
        streamed = list(store.named_tensors(path, key))
        assert [n for n, _ in streamed] == [n for n, _ in whole.meta["layout"]]
        want = split_by_layout(whole.tensors[key], whole.meta["layout"])
        assert all(torch.equal(t, want[n]) for n, t in streamed)
    # served in the stages it was written in: straight from the stage files
    for got, part in zip(store.stages(path, bounds_of(cfg_for(family, 3))), parts, strict=True):
        assert same(got, part) and got.meta["stage"] == part.meta["stage"]
    assert not store.split_dir.exists()
    # the universal checkpoint: re-split into any number of stages, from the files, one stage at a time
    for stages in (1, 2, 4):
        cfg = cfg_for(family, stages)
        native = list(stage_snapshots(cfg))
        for s, (got, (a, b)) in enumerate(zip(store.stages(path, bounds_of(cfg)), bounds_of(cfg), strict=True)):
            assert same(got, slice_stage(whole, a, b, s)) and same(got, native[s])
            assert got.meta["stage"] == s and got.meta["layers"] == [a, b] and got.meta["inner_steps"] == 7
    assert sorted(p.name for p in store.split_dir.iterdir()) == [f"ckpt-000003.s{s}.safetensors" for s in range(4)]


class Members:
    """The members of each stage, as the checkpointer reaches them: a snapshot server per stage behind
    a real gRPC server on localhost."""

    def __init__(self, parts: list[Snapshot]) -> None:
        self.servers = []
        for part in parts:
            state = SnapshotServer(RUN, 1 << 16)
            state.publish(part)
            self.servers.append(PeerServer(state, Traffic(), host="127.0.0.1", port=0))  # type: ignore[arg-type]

    def job(self, parts: list[Snapshot]) -> Job:
        return Job(parts[0].version, {s: [Target(f"member-{s}", f"127.0.0.1:{server.port}")]
                                      for s, server in enumerate(self.servers)}, {s: p.hash for s, p in enumerate(parts)})

    def stop(self) -> None:
        for server in self.servers:
            server.stop(0)


def fetch_all(client: PeerClient, checkpointer: Checkpointer, stages: int) -> list[Snapshot]:
    """Every stage as a recovering peer fetches it from the coordinator."""
    server = PeerServer(CoordinatorService("coordinator", lambda: 0, checkpointer), Traffic(), host="127.0.0.1", port=0)
    try:
        header = pb.Header(run_id=RUN, sender="peer")
        coordinator = [Target("coordinator", f"127.0.0.1:{server.port}")]
        return [fetch_snapshot(client, header, probe_sources(client, header, coordinator, stage=s), stage=s, timeout=10)
                for s in range(stages)]
    finally:
        server.stop(0)


def test_a_download_must_hash_to_what_its_sources_advertise() -> None:
    """A recovering peer takes a state only if it hashes to the hash agreed on: a source that serves other
    bits under the honest hash (one value changed) is refused; the honest one, hashed in the background
    when it was committed, is taken."""
    gen = torch.Generator().manual_seed(3)
    honest = Snapshot.create({"theta": torch.randn(50_000, generator=gen), "momentum": torch.randn(50_000, generator=gen)},
                             4, {"stage": 0}, hash_later=True)
    forged = Snapshot({k: v.clone() for k, v in honest.tensors.items()}, 4, honest.hash, honest.meta)
    forged.tensors["momentum"][31_337] = torch.nextafter(forged.tensors["momentum"][31_337], torch.tensor(1e9))
    client, header = PeerClient(Traffic()), pb.Header(run_id=RUN, sender="peer")
    served = {"honest": Members([honest]), "forged": Members([forged])}
    try:
        def fetch(name: str) -> Snapshot:
            target = [Target("member-0", f"127.0.0.1:{served[name].servers[0].port}")]
            return fetch_snapshot(client, header, probe_sources(client, header, target), timeout=10)

        with pytest.raises(SnapshotUnavailable, match="hashes to"):
            fetch("forged")
        assert same(fetch("honest"), honest)
    finally:
        for members in served.values():
            members.stop()
        client.close()


def checkpointer(directory, client: PeerClient, cfg: RunConfig) -> Checkpointer:  # type: ignore[no-untyped-def]
    return Checkpointer(directory, 3, client, run_id=RUN, me="coordinator", bounds=bounds_of(cfg), chunk_bytes=1 << 14,
                        rpc_timeout_s=10.0, meta={"model": cfg.model.model_dump(mode="json")})


def test_checkpointer_fetches_writes_and_serves_over_grpc_then_re_splits_on_restart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    three, two = cfg_for("llama", 3), cfg_for("llama", 2)
    parts = list(stage_snapshots(three, 5))
    members, client = Members(parts), PeerClient(Traffic())
    try:
        c = checkpointer(tmp_path, client, three)
        done = c._checkpoint(members.job(parts))
        assert isinstance(done, Written) and done.checkpoint.hashes == {s: p.hash for s, p in enumerate(parts)}
        assert c.served is not None and c.served.version == 5 and not hasattr(c.served, "whole")
        assert all(same(got, want) for got, want in zip(fetch_all(client, c, 3), parts, strict=True))
        # the coordinator restarts in a run resumed with two stages: the checkpoint is re-split from the files
        again = checkpointer(tmp_path, client, two)
        again.start()
        again.stop()
        whole = consolidate(parts)
        want = [slice_stage(whole, a, b, s) for s, (a, b) in enumerate(bounds_of(two))]
        assert again.served is not None and again.served.checkpoint().hashes == {s: w.hash for s, w in enumerate(want)}
        assert all(same(got, w) for got, w in zip(fetch_all(client, again, 2), want, strict=True))
    finally:
        members.stop()
        client.close()


def test_a_write_that_dies_leaves_no_checkpoint_and_a_bad_file_is_skipped(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    cfg = cfg_for("llama", 3)
    store = CheckpointStore(tmp_path, keep=5)
    first = store.write_stages(3, stage_snapshots(cfg, 3))

    def dies() -> Iterator[Snapshot]:
        parts = stage_snapshots(cfg, 4)
        yield next(parts)
        raise OSError("the members went away")

    with pytest.raises(OSError, match="went away"):
        store.write_stages(4, dies())
    with pytest.raises(ValueError, match="stage 1 is at version 5, not 4"):
        store.write_stages(4, iter([next(stage_snapshots(cfg, 4)), list(stage_snapshots(cfg, 5))[1]]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000003.json"] + [f"ckpt-000003.s{s}.safetensors" for s in range(3)]
    # the process dies after the stage files, before the manifest: the version is not listed
    (tmp_path / store.write_stages(4, stage_snapshots(cfg, 4)).name).unlink()
    assert store.manifests() == [first] and store.latest_valid().version == 3  # type: ignore[union-attr]
    # a corrupted, a truncated and a missing stage file: each such version is skipped, saying why
    for version, spoil, why in [(6, lambda p: p.write_bytes(p.read_bytes()[:-100]), "is corrupted or truncated"),
                                (7, lambda p: p.write_bytes(p.read_bytes()[:-4] + b"\0\0\0\1"), "is corrupted or truncated"),
                                (8, lambda p: p.unlink(), "is missing")]:
        path = store.write_stages(version, stage_snapshots(cfg, version))
        spoil(tmp_path / f"ckpt-{version:06d}.s1.safetensors")
        with pytest.raises(ValueError, match=f"ckpt-{version:06d}.s1.safetensors {why}"):
            store.verified(path)
    c = checkpointer(tmp_path, PeerClient(Traffic()), cfg)
    c.start()
    c.stop()
    assert c.served is not None and c.served.version == 3
    assert all(f"ckpt-{v:06d} is unusable" in caplog.text for v in (6, 7, 8))
    # the next write prunes the versions beyond ``keep``, and the files no manifest lists
    store.write_stages(9, stage_snapshots(cfg, 9))
    assert {p.name.split(".")[0] for p in tmp_path.iterdir()} == {f"ckpt-{v:06d}" for v in (3, 6, 7, 8, 9)}


def test_pruning_removes_every_file_of_a_version(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = cfg_for("tiny", 2)
    store = CheckpointStore(tmp_path, keep=2)
    for v in (1, 2):
        store.write_stages(v, stage_snapshots(cfg, v))
    store.stages(store.manifests()[0], bounds_of(cfg_for("tiny", 4)))  # v2 re-split, as a resumed run serves it
    assert len(list(store.split_dir.iterdir())) == 4
    (tmp_path / ".ckpt-000003.s0.safetensors.tmp-1").write_bytes(b"a write that died")
    for v in (3, 4):
        store.write_stages(v, stage_snapshots(cfg, v))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
        "ckpt-000003.json", "ckpt-000003.s0.safetensors", "ckpt-000003.s1.safetensors",
        "ckpt-000004.json", "ckpt-000004.s0.safetensors", "ckpt-000004.s1.safetensors"]
    assert not list(store.split_dir.iterdir())


def test_a_version_1_checkpoint_still_loads_and_serves(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The first format: one file of the whole model (journals on users' disks hold them)."""
    parts = list(stage_snapshots(cfg_for("tiny", 2)))
    whole = consolidate(parts)
    store = CheckpointStore(tmp_path)
    path = store.write(whole, {"run_id": "r", "stages": 2})
    assert json.loads(path.read_text())["format"] == "potluck-checkpoint-v1"
    assert same(store.load(path), whole) and store.verified(path)["run_id"] == "r"
    want = split_by_layout(whole.tensors["momentum"], whole.meta["layout"])
    assert all(torch.equal(t, want[n]) for n, t in store.named_tensors(path, "momentum"))
    for stages in (2, 4):  # served re-split from its one file, by parameter name
        cfg = cfg_for("tiny", stages)
        assert all(same(got, slice_stage(whole, a, b, s))
                   for s, (got, (a, b)) in enumerate(zip(store.stages(path, bounds_of(cfg)), bounds_of(cfg), strict=True)))
    flat = Snapshot.create({"theta": torch.arange(6.0), "momentum": torch.zeros(6)}, 9)  # no layout: served whole
    served = store.stages(store.write(flat), [(0, 4)])
    assert len(served) == 1 and same(served[0], flat)


MEMORY = '''
import json, sys
import torch
from pathlib import Path
from potluck.compression.transfer import Snapshot, tensors_hash
from potluck.coordinator.store.checkpoint import CheckpointStore, consolidate, slice_stage
def status(field):  # in KiB; VmHWM is this process's peak RSS (ru_maxrss may carry the forking parent's)
    return int(next(line for line in open("/proc/self/status") if line.startswith(field + ":")).split()[1])
n = 8 << 20  # float32 values of one stage's theta (and momentum): 64 MiB per stage
def stage(s):  # a function of its own: the generator keeps no stage alive while making the next
    tensors = {"theta": torch.full((n,), float(s)), "momentum": torch.full((n,), -float(s))}
    return Snapshot(tensors, 1, tensors_hash(tensors), {"layout": [[f"layers.{s}.w", [n]]]})
store = CheckpointStore(Path(sys.argv[2]))
try:
    open("/proc/self/clear_refs", "w").write("5")  # the peak so far (imports) is not the checkpoint's
except OSError:
    pass
base = status("VmRSS")
if sys.argv[1] == "stages":  # as the checkpointer does now
    path = store.write_stages(1, (stage(s) for s in range(4)))
    store.verified(path)
    served = store.stages(path, [(s, s + 1) for s in range(4)])
    resplit = store.stages(path, [(0, 2), (2, 4)])
    assert float(served[3].tensors["theta"][-1]) == 3.0 and float(resplit[1].tensors["momentum"][-1]) == -3.0
else:  # before #13: every stage held, consolidated, written, and served sliced from the whole
    whole = consolidate([stage(s) for s in range(4)])
    store.write(whole)
    served = [slice_stage(whole, s, s + 1, s) for s in range(4)]
print(json.dumps({"growth_mib": (status("VmHWM") - base) / 1024}))
'''


@pytest.mark.slow
def test_checkpointing_holds_one_stage_at_a_time(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Peak RSS (over the RSS after imports) while writing, serving and re-splitting a
    4-stage checkpoint of 64 MiB stages, in a fresh process: about one stage, where the whole-model
    path held every stage and copies of them."""
    runs = {path: subprocess.Popen([sys.executable, "-c", textwrap.dedent(MEMORY), path, str(tmp_path / path)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for path in ("stages", "whole")}
    growth = {}
    for path, run in runs.items():
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        growth[path] = json.loads(out)["growth_mib"]
    print(f"peak RSS growth: {growth}")
    assert growth["stages"] < 2 * 64, f"checkpointing grew RSS by {growth['stages']:.0f} MiB; one stage is 64 MiB"
    assert growth["whole"] > 4 * 64  # the measure sees the old path's copies
