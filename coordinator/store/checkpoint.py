"""Checkpoints: per committed version, one safetensors file per pipeline stage plus a JSON manifest.

Format ``potluck-checkpoint-v2``, as the coordinator writes it, one stage at a time::

    ckpt-000005.s0.safetensors   theta/<name>... then momentum/<name>... of stage 0's parameters
    ckpt-000005.s1.safetensors   ...
    ckpt-000005.json             written last: per stage its file, SHA-256, state hash, layers, layout

Parameters are named by their layer in the whole model (``theta/layers.1.attn.qkv.weight``), so a
checkpoint does not depend on how the model was split when it was written: a run resumed with other
stages gets it re-split by name (:meth:`CheckpointStore.stages`). A stage file holds its parameters
in layout order, ``theta`` first, so each key's flat vector is one contiguous byte range: recovering
peers are served straight from the file, memory-mapped (:func:`map_stage`). No process holds the
whole model unless it asks to (:meth:`CheckpointStore.load`, for export;
:meth:`CheckpointStore.named_tensors` streams it instead).

Writing is atomic: each file is written under a temporary name, fsynced and renamed, and the
manifest, written last, records the SHA-256 of every file (computed while writing) and the state
hashes. Reading checks the files, newest checkpoint first, streaming, and falls back to the previous
checkpoint with a clear log line when a file is missing, truncated or corrupted. The first format
(``potluck-checkpoint-v1``, one file for the whole model, :meth:`CheckpointStore.write`) is still read.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from potluck.compression.transfer import Snapshot, byte_chunks, tensors_hash
from potluck.coordinator.store.journal import write_atomic
from potluck.coordinator.store.tensorfile import (
    CHUNK,
    Layout,
    file_sha256,
    float_view,
    map_file,
    ranges_hash,
    read_range,
    tensor_ranges,
    write_safetensors,
)
from potluck.protos.runtime.log import get_logger

log = get_logger(__name__)

FORMAT = "potluck-checkpoint-v2"
FORMAT_V1 = "potluck-checkpoint-v1"
KEYS = ("theta", "momentum")  # their order in a stage file; the state hash takes them by name
STAGE_KEYS = {"stage", "file", "sha256", "hash", "layers", "layout", "theta", "momentum"}


def split_by_layout(flat: torch.Tensor, layout: list[tuple[str, list[int]]]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, shape in layout:
        n = 1
        for d in shape:
            n *= d
        out[name] = flat[offset : offset + n].reshape(shape).clone()
        offset += n
    if offset != flat.numel():
        raise ValueError(f"layout covers {offset} elements, the state has {flat.numel()}")
    return out


def join_by_layout(tensors: dict[str, torch.Tensor], layout: list[tuple[str, list[int]]]) -> torch.Tensor:
    return torch.cat([tensors[name].reshape(-1).float() for name, _ in layout])


def layer_of(name: str) -> int:
    """The model layer-list index a parameter belongs to: ``layers.3.attn.qkv.weight`` -> 3."""
    parts = name.split(".")
    if parts[0] == "layers":
        parts = parts[1:]
    try:
        return int(parts[0])
    except (ValueError, IndexError):
        raise ValueError(f"parameter {name!r} does not name its layer (expected 'layers.<i>.<...>')") from None


def consolidate(stages: list[Snapshot]) -> Snapshot:
    """One whole-model snapshot from the snapshots of stages 0..S-1 (all at one version).

    Layouts name parameters by their layer in the whole model, and the stages hold contiguous layer
    ranges in order, so the whole model's flat vectors are the stages' concatenated.
    """
    if not stages:
        raise ValueError("no stage snapshots to consolidate")
    versions = {s.version for s in stages}
    if len(versions) != 1:
        raise ValueError(f"stage snapshots are at different versions: {sorted(versions)}")
    layout: list[tuple[str, list[int]]] = []
    bounds = []
    for i, snap in enumerate(stages):
        entries = [(n, list(sh)) for n, sh in snap.meta.get("layout", [])]
        if not entries:
            raise ValueError(f"stage {i}'s snapshot has no layout")
        layers = [layer_of(n) for n, _ in entries]
        if layout and min(layers) <= layer_of(layout[-1][0]):
            raise ValueError(f"stage {i} starts at layer {min(layers)}, not after the previous stage")
        bounds.append([min(layers), max(layers) + 1])
        layout += entries
    tensors = {key: torch.cat([s.tensors[key] for s in stages]) for key in stages[0].tensors}
    meta = {"layout": layout, "stages": bounds, "inner_steps": max(int(s.meta.get("inner_steps", 0)) for s in stages)}
    return Snapshot(tensors, stages[0].version, tensors_hash(tensors), meta)


def slice_stage(whole: Snapshot, start: int, stop: int, stage: int) -> Snapshot:
    """The part of a whole-model snapshot that a stage holding layers ``[start, stop)`` needs."""
    layout = [(n, list(sh)) for n, sh in whole.meta.get("layout", [])]
    if not layout:
        raise ValueError("the checkpoint has no per-parameter layout; it cannot be re-split into stages")
    offset, lo, hi, mine = 0, None, 0, []
    for name, shape in layout:
        n = 1
        for d in shape:
            n *= d
        if start <= layer_of(name) < stop:
            if lo is None:
                lo = offset
            elif offset != hi:
                raise ValueError("the stage's parameters are not contiguous in the checkpoint")
            hi = offset + n
            mine.append((name, shape))
        offset += n
    if lo is None:
        raise ValueError(f"the checkpoint has no parameters of layers [{start}, {stop})")
    tensors = {key: flat[lo:hi].clone() for key, flat in whole.tensors.items()}
    meta = {"layout": mine, "stage": stage, "layers": [start, stop], "inner_steps": whole.meta.get("inner_steps", 0)}
    return Snapshot(tensors, whole.version, tensors_hash(tensors), meta)


def map_stage(path: Path, entry: dict[str, Any], version: int, meta: dict[str, Any]) -> Snapshot:
    """The stage that ``entry`` (of a manifest's ``stages``) describes, its flat ``theta`` and
    ``momentum`` memory-mapped from ``path``: nothing is read until a peer fetches a range of it."""
    flat = map_file(path)
    tensors = {}
    for key in KEYS:
        begin, end = entry[key]
        tensors[key] = float_view(flat, begin, end, path.name)
    return Snapshot(tensors, version, entry["hash"], meta)


def manifest_files(manifest: Any) -> list[tuple[str, str]]:
    """(file name, SHA-256) of each data file a manifest (either format) names; raises ValueError for a manifest
    that names none or names a path rather than a file of its folder (a store's manifests are read from afar)."""
    if not isinstance(manifest, dict) or manifest.get("format") not in (FORMAT, FORMAT_V1):
        raise ValueError(f"unknown checkpoint format {manifest.get('format') if isinstance(manifest, dict) else None!r}")
    if manifest["format"] == FORMAT_V1:
        files = [(manifest.get("file"), manifest.get("file_sha256"))]
    else:
        stages = manifest.get("stages")
        if not isinstance(stages, list) or not stages or not all(isinstance(e, dict) for e in stages):
            raise ValueError("the manifest lists no stage files")
        files = [(e.get("file"), e.get("sha256")) for e in stages]
    for name, sha in files:
        if not isinstance(name, str) or not name or Path(name).name != name or name.startswith("."):
            raise ValueError(f"the manifest names {name!r}, not a file of its folder")
        if not isinstance(sha, str) or len(sha) != 64:
            raise ValueError(f"the manifest gives {name} no SHA-256")
    return [(str(n), str(h)) for n, h in files]


def _stem(path: Path) -> str:
    """``ckpt-000005`` of every file of version 5."""
    return path.name.split(".")[0]


class CheckpointStore:
    """The checkpoints in ``directory`` (the newest ``keep`` of them kept). Its state is the directory: it
    holds nothing in memory between calls. In a coordinator the :class:`~potluck.coordinator.store.checkpointer.
    Checkpointer` owns it and is its only writer; the files themselves live in
    :mod:`potluck.coordinator.store.tensorfile`'s format."""

    def __init__(self, directory: str | Path, keep: int = 3) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.split_dir = self.dir / "split"  # versions re-split into a run's other stages, while served
        self.keep = keep

    # ------------------------------------------------------------------ writing

    def write_stages(self, version: int, stages: Iterable[Snapshot], extra: dict[str, Any] | None = None) -> Path:
        """Write ``ckpt-<version>`` from the snapshots of stages 0, 1, ... as ``stages`` yields them (a
        generator may fetch each when asked): each is written to its file and let go before the next
        is asked for. Returns the manifest path; if any stage fails, no file of the version is left."""
        name = f"ckpt-{version:06d}"
        (self.dir / f"{name}.json").unlink(missing_ok=True)  # a version written again (after a rollback):
        self._remove(name)  # never an old manifest over new files, nor old files left over
        parts: list[dict[str, Any]] = []
        t0 = time.monotonic()
        try:
            for snap in stages:  # not enumerate(): its reused result tuple would hold a stage while the next is fetched
                i = len(parts)
                parts.append(self._write_stage(f"{name}.s{i}.safetensors", i, snap, version, parts[-1] if parts else None))
                del snap
            if not parts:
                raise ValueError("no stage snapshots to write")
            paths = [self.dir / p["file"] for p in parts]
            state_hash = ranges_hash({key: [(f, *p[key]) for f, p in zip(paths, parts, strict=True)] for key in KEYS})
        except BaseException:
            self._remove(name)
            raise
        inner = max(p.pop("inner_steps") for p in parts)
        manifest = {
            **(extra or {}),
            "format": FORMAT, "version": version, "state_hash": state_hash, "tensors": sorted(KEYS),
            "stages": parts, "meta": {"stages": [p["layers"] for p in parts], "inner_steps": inner},
            "created_at": time.time(),
        }
        manifest_path = self.dir / f"{name}.json"
        write_atomic(manifest_path, json.dumps(manifest, indent=1).encode())
        log.info("checkpoint v%d written: %d stage files, %.1f MB, in %.1f s", version, len(parts),
                 sum(f.stat().st_size for f in paths) / 1e6, time.monotonic() - t0)
        self._prune()
        return manifest_path

    def _write_stage(self, file: str, i: int, snap: Snapshot, version: int, before: dict[str, Any] | None) -> dict[str, Any]:
        if snap.version != version:
            raise ValueError(f"stage {i} is at version {snap.version}, not {version}")
        if sorted(snap.tensors) != sorted(KEYS):
            raise ValueError(f"stage {i}'s snapshot holds {sorted(snap.tensors)}, not {sorted(KEYS)}")
        layout = [(n, list(sh)) for n, sh in snap.meta.get("layout", [])]
        if not layout:
            raise ValueError(f"stage {i}'s snapshot has no layout")
        layers = [layer_of(n) for n, _ in layout]
        if before is not None and min(layers) < before["layers"][1]:
            raise ValueError(f"stage {i} starts at layer {min(layers)}, not after the previous stage")
        numel = sum(math.prod(sh) for _, sh in layout)
        for key in KEYS:
            t = snap.tensors[key]
            if t.dtype != torch.float32 or t.dim() != 1 or t.numel() != numel:
                raise ValueError(f"stage {i}'s {key} is {t.dtype} {tuple(t.shape)}; its layout covers {numel} float32")
        entries = [(f"{key}/{n}", sh) for key in KEYS for n, sh in layout]
        blocks = itertools.chain.from_iterable(byte_chunks(snap.tensors[key], CHUNK) for key in KEYS)
        sha, start = write_safetensors(self.dir / file, entries, blocks,
                                       {"format": FORMAT, "version": str(version), "stage": str(i)})
        return {"stage": i, "file": file, "sha256": sha, "hash": snap.hash, "layers": [min(layers), max(layers) + 1],
                "layout": [[n, sh] for n, sh in layout], "theta": [start, start + 4 * numel],
                "momentum": [start + 4 * numel, start + 8 * numel], "inner_steps": int(snap.meta.get("inner_steps", 0))}

    def write(self, snap: Snapshot, extra: dict[str, Any] | None = None) -> Path:
        """Write a whole-model ``snap`` as ``ckpt-<version>`` in format v1 (one file; a layout is optional);
        returns the manifest path. Prunes old ones. The coordinator writes :meth:`write_stages`."""
        name = f"ckpt-{snap.version:06d}"
        layout = [(n, list(s)) for n, s in snap.meta.get("layout", [])]
        tensors: dict[str, torch.Tensor] = {}
        for key, flat in snap.tensors.items():
            if layout:
                tensors.update({f"{key}/{n}": t for n, t in split_by_layout(flat, layout).items()})
            else:
                tensors[key] = flat
        data_path = self.dir / f"{name}.safetensors"
        tmp = self.dir / f".{name}.safetensors.tmp"
        save_file(tensors, str(tmp), metadata={"format": FORMAT_V1, "version": str(snap.version)})
        tmp.replace(data_path)
        manifest = {
            "format": FORMAT_V1,
            "version": snap.version,
            "state_hash": snap.hash,
            "file": data_path.name,
            "file_sha256": file_sha256(data_path),
            "tensors": sorted(snap.tensors),
            "layout": layout,
            "meta": snap.meta,
            "created_at": time.time(),
            **(extra or {}),
        }
        manifest_path = self.dir / f"{name}.json"
        write_atomic(manifest_path, json.dumps(manifest, indent=1).encode())
        self._prune()
        return manifest_path

    def _remove(self, name: str) -> None:
        for f in [*self.dir.glob(f"{name}.s*.safetensors"), *self.split_dir.glob(f"{name}.*")]:
            f.unlink(missing_ok=True)

    def _prune(self) -> None:
        """Keep the newest ``keep`` versions; remove every file of the others, and what writes that died
        left behind (called between writes: none is under way)."""
        kept = self.manifests()
        for old in kept[self.keep :]:
            old.unlink(missing_ok=True)  # first: a version half removed is never listed
        keep = {_stem(p) for p in kept[: self.keep]}
        for f in [*self.dir.glob("ckpt-*.safetensors"), *self.split_dir.glob("ckpt-*.safetensors")]:
            if _stem(f) not in keep:
                f.unlink(missing_ok=True)
        for f in [*self.dir.glob(".ckpt-*.tmp*"), *self.split_dir.glob(".ckpt-*.tmp*")]:
            f.unlink(missing_ok=True)

    # ------------------------------------------------------------------ reading

    def manifests(self) -> list[Path]:
        return sorted(self.dir.glob("ckpt-*.json"), reverse=True)

    def read_manifest(self, manifest_path: Path) -> dict[str, Any]:
        """A checkpoint's manifest, its files unchecked; raises ValueError saying what is wrong with it."""
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"manifest unreadable: {err}") from None
        if not isinstance(manifest, dict) or manifest.get("format") not in (FORMAT, FORMAT_V1):
            raise ValueError(f"unknown checkpoint format {manifest.get('format') if isinstance(manifest, dict) else None!r}")
        if manifest["format"] == FORMAT:
            stages = manifest.get("stages")
            if not isinstance(stages, list) or not stages or not all(isinstance(e, dict) for e in stages):
                raise ValueError("the manifest lists no stage files")
            for i, entry in enumerate(stages):
                if STAGE_KEYS - set(entry):
                    raise ValueError(f"the manifest's stage {i} lacks {sorted(STAGE_KEYS - set(entry))}")
        return manifest

    def _files(self, manifest: dict[str, Any]) -> list[tuple[Path, str, Layout | None]]:
        """(path, SHA-256, layout) of each file of a checkpoint, in layer order (no layout: flat vectors)."""
        if manifest["format"] == FORMAT_V1:
            layout = [(n, list(sh)) for n, sh in manifest.get("layout", [])]
            return [(self.dir / manifest["file"], manifest["file_sha256"], layout or None)]
        return [(self.dir / e["file"], e["sha256"], [(n, list(sh)) for n, sh in e["layout"]]) for e in manifest["stages"]]

    @staticmethod
    def _check(path: Path, sha256: str) -> None:
        if not path.exists():
            raise ValueError(f"{path.name} is missing")
        digest = file_sha256(path)
        if digest != sha256:
            raise ValueError(f"{path.name} is corrupted or truncated (sha256 {digest[:12]}, expected {sha256[:12]})")

    def verified(self, manifest_path: Path) -> dict[str, Any]:
        """The manifest of a checkpoint whose files are intact (each SHA-256 computed streaming, nothing
        held); raises ValueError saying what is wrong."""
        manifest = self.read_manifest(manifest_path)
        for path, sha256, _ in self._files(manifest):
            self._check(path, sha256)
        return manifest

    def named_tensors(self, manifest_path: Path, key: str = "theta") -> Iterator[tuple[str, torch.Tensor]]:
        """Each parameter of ``key`` (whole-model names, in layer order), memory-mapped from its file once
        that file's SHA-256 is checked: a reader holds what it keeps, never the whole model at once. A
        checkpoint without a layout yields its flat vector, named ``key``."""
        manifest = self.read_manifest(manifest_path)
        if key not in manifest.get("tensors", []):
            raise ValueError(f"the checkpoint has no {key!r} (it has {manifest.get('tensors')})")
        for path, sha256, layout in self._files(manifest):
            self._check(path, sha256)
            flat = map_file(path)
            ranges = tensor_ranges(path)
            names = [(f"{key}/{n}", n, sh) for n, sh in layout] if layout else [(key, key, None)]
            for stored, name, shape in names:
                if stored not in ranges:
                    raise ValueError(f"{path.name} has no tensor {stored!r}")
                t = float_view(flat, *ranges[stored], path.name)
                yield name, t if shape is None else t.view(shape)

    def load(self, manifest_path: Path) -> Snapshot:
        """Load and verify one checkpoint, the whole model in memory (export asks for it); raises
        ValueError saying what is wrong with it."""
        manifest = self.verified(manifest_path)
        version = int(manifest["version"])
        if manifest["format"] == FORMAT:
            meta = {"inner_steps": manifest.get("meta", {}).get("inner_steps", 0)}
            whole = consolidate([map_stage(self.dir / e["file"], e, version, {**meta, "layout": e["layout"]})
                                 for e in manifest["stages"]])
            tensors, meta = whole.tensors, whole.meta
        else:
            data_path = self.dir / manifest["file"]
            try:
                stored = load_file(str(data_path))
            except Exception as err:
                raise ValueError(f"{data_path.name} cannot be read: {err}") from None
            layout = [(n, list(s)) for n, s in manifest.get("layout", [])]
            tensors = {}
            for key in manifest["tensors"]:
                if layout:
                    tensors[key] = join_by_layout({n[len(key) + 1 :]: t for n, t in stored.items() if n.startswith(key + "/")}, layout)
                else:
                    tensors[key] = stored[key]
            meta = dict(manifest.get("meta", {}))
        got = tensors_hash(tensors, like=manifest["state_hash"])  # (an older version's is BLAKE2b: still read)
        if got != manifest["state_hash"]:
            raise ValueError(f"state hash {got[:12]} does not match the manifest's {manifest['state_hash'][:12]}")
        return Snapshot(tensors, version, got, meta)

    def latest_valid(self) -> Snapshot | None:
        """The newest checkpoint that verifies, loaded whole; corrupted ones are reported and skipped."""
        for path in self.manifests():
            try:
                return self.load(path)
            except (ValueError, KeyError) as err:
                log.error("checkpoint %s is unusable (%s); trying the previous one", path.stem, err)
        return None

    # ------------------------------------------------------------------ serving

    def stages(self, manifest_path: Path, bounds: list[tuple[int, int]]) -> list[Snapshot]:
        """The checkpoint (its files checked by the caller) cut into stages holding layers ``bounds``,
        each memory-mapped from a file: a stage file of the checkpoint when it holds exactly that
        stage's parameters, else a re-split file written under ``split/``, one stage at a time, its
        parameters copied by name from the checkpoint's files in blocks. Hashes are each stage's
        :func:`tensors_hash`, as its members compute it."""
        manifest = self.read_manifest(manifest_path)
        version = int(manifest["version"])
        inner = int(manifest.get("meta", {}).get("inner_steps", 0))
        files = self._files(manifest)
        if files[0][2] is None:  # flat vectors without a layout (single-stage runs): every stage serves them
            return [self.load(manifest_path)] * len(bounds)
        layout = [entry for _, _, part in files for entry in part or []]
        stored = manifest["stages"] if manifest["format"] == FORMAT else []
        ranges = {name: (path, *r) for path, _, _ in files for name, r in tensor_ranges(path).items()}
        out = []
        for s, (start, stop) in enumerate(bounds):
            mine = [(n, sh) for n, sh in layout if start <= layer_of(n) < stop]
            if not mine:
                raise ValueError(f"the checkpoint has no parameters of layers [{start}, {stop})")
            meta = {"layout": [[n, sh] for n, sh in mine], "stage": s, "layers": [start, stop], "inner_steps": inner}
            same = [e for e in stored if [n for n, _ in e["layout"]] == [n for n, _ in mine]]
            if same:
                out.append(map_stage(self.dir / same[0]["file"], same[0], version, meta))
            else:
                out.append(self._resplit(f"ckpt-{version:06d}.s{s}.safetensors", mine, ranges, version, meta))
        return out

    def _resplit(self, file: str, mine: Layout, ranges: dict[str, tuple[Path, int, int]], version: int,
                 meta: dict[str, Any]) -> Snapshot:
        missing = [f"{key}/{n}" for key in KEYS for n, _ in mine if f"{key}/{n}" not in ranges]
        if missing:
            raise ValueError(f"the checkpoint's files lack {missing[:3]}")
        self.split_dir.mkdir(exist_ok=True)
        path = self.split_dir / file
        entries = [(f"{key}/{n}", sh) for key in KEYS for n, sh in mine]
        blocks = itertools.chain.from_iterable(read_range(*ranges[name]) for name, _ in entries)
        _, start = write_safetensors(path, entries, blocks, {"format": FORMAT, "version": str(version),
                                                             "stage": str(meta["stage"])})
        size = 4 * sum(math.prod(sh) for _, sh in mine)
        entry: dict[str, Any] = {"theta": [start, start + size], "momentum": [start + size, start + 2 * size]}
        entry["hash"] = ranges_hash({key: [(path, *entry[key])] for key in KEYS})
        log.info("checkpoint v%d: stage %d (layers %s) re-split to %s", version, meta["stage"], meta["layers"], file)
        return map_stage(path, entry, version, meta)
