"""Consolidated checkpoints: one safetensors file per committed version, plus a JSON manifest.

Tensors are stored per parameter (``theta/layers.1.attn.qkv.weight``, ``momentum/...``) whenever
the peers report the model's layout, so a checkpoint does not depend on how the model was split
into stages when it was written; without a layout the flat vectors are stored as they are.

The coordinator writes a checkpoint one stage at a time (:meth:`CheckpointStore.write_stages`):
each stage's tensors are appended to the file's body as the stage arrives, so it never holds more
than one stage, and the manifest records where each stage's ``theta`` and ``momentum`` lie in the
file, so that recovering peers are served straight from it (:func:`stage_views`, memory-mapped).

Writing is atomic: the tensor file and then its manifest are written under temporary names and
renamed, and the manifest (written last) records the file's SHA-256 and the state hash. Reading
checks both, newest first, and falls back to the previous checkpoint with a clear log line when a
file is truncated or corrupted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from potluck.compression.transfer import Snapshot, tensors_hash
from potluck.coordinator.journal import write_atomic
from potluck.protos.log import get_logger

log = get_logger(__name__)

FORMAT = "potluck-checkpoint-v1"


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


def _whole_hash(path: Path, parts: list[dict[str, Any]]) -> str:
    """:func:`tensors_hash` of the whole model (``momentum`` then ``theta``, all stages in order), read
    back from the file in chunks."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for key in ("momentum", "theta"):
            h.update(key.encode() + b"\0")
            for part in parts:
                begin, end = part[key]
                f.seek(begin)
                while begin < end:
                    block = f.read(min(CHUNK, end - begin))
                    h.update(block)
                    begin += len(block)
    return h.hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


CHUNK = 16 << 20


def _header(entries: list[tuple[str, list[int], int, int]], metadata: dict[str, str]) -> bytes:
    """A safetensors header (length prefix included) for F32 tensors at the given body offsets."""
    head: dict[str, Any] = {"__metadata__": metadata}
    head.update({name: {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}
                 for name, shape, begin, end in entries})
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _write_view(f: Any, flat: torch.Tensor) -> None:
    """Write a flat float32 CPU tensor's bytes without copying it whole."""
    view = memoryview(flat.detach().contiguous().numpy()).cast("B")
    for k in range(0, len(view), CHUNK):
        f.write(view[k : k + CHUNK])


def stage_views(path: Path, stage: dict[str, Any], version: int, inner_steps: int = 0) -> Snapshot:
    """Stage ``stage`` (an entry of a manifest's ``stages``) of the checkpoint file ``path``, its
    tensors memory-mapped read-only: nothing is read until a peer fetches a range of it."""
    import numpy as np

    tensors = {}
    for key in ("theta", "momentum"):
        begin, end = stage[key]
        arr = np.memmap(path, dtype=np.float32, mode="r", offset=begin, shape=((end - begin) // 4,))
        tensors[key] = torch.from_numpy(arr) if arr.flags.writeable else _readonly(arr)
    meta = {"layout": stage["layout"], "stage": stage["stage"], "layers": stage["layers"], "inner_steps": inner_steps}
    return Snapshot(tensors, version, stage["hash"], meta)


def _readonly(arr: Any) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():  # torch warns that it cannot protect a read-only buffer; nothing writes it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


class CheckpointStore:
    def __init__(self, directory: str | Path, keep: int = 3) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep

    def write(self, snap: Snapshot, extra: dict[str, Any] | None = None) -> Path:
        """Write ``snap`` as ``ckpt-<version>``; returns the manifest path. Prunes old ones."""
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
        save_file(tensors, str(tmp), metadata={"format": FORMAT, "version": str(snap.version)})
        tmp.replace(data_path)
        manifest = {
            "format": FORMAT,
            "version": snap.version,
            "state_hash": snap.hash,
            "file": data_path.name,
            "file_sha256": _sha256(data_path),
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

    def write_stages(self, version: int, stages: Iterable[Snapshot], extra: dict[str, Any] | None = None) -> Path:
        """Write ``ckpt-<version>`` from stage snapshots arriving one at a time (stage 0 first), holding
        none of them longer than it takes to append it; returns the manifest path.

        The file is the same safetensors layout as :meth:`write` (``theta/<name>``, ``momentum/<name>``
        per parameter, loadable by safetensors itself); its body is written first (stage by stage,
        ``theta`` then ``momentum``), then the header and the body are joined into the final file.
        """
        name = f"ckpt-{version:06d}"
        body, tmp = self.dir / f".{name}.body.tmp", self.dir / f".{name}.safetensors.tmp"
        entries: list[tuple[str, list[int], int, int]] = []
        parts: list[dict[str, Any]] = []
        inner = 0
        try:
            with open(body, "wb") as f:
                offset = 0
                for snap in stages:  # not enumerate: its cached (i, item) tuple would keep the last stage alive
                    i = len(parts)
                    if snap.version != version:
                        raise ValueError(f"stage {i} is at version {snap.version}, not {version}")
                    layout = [(n, list(sh)) for n, sh in snap.meta.get("layout", [])]
                    if not layout:
                        raise ValueError(f"stage {i}'s snapshot has no layout")
                    layers = [layer_of(n) for n, _ in layout]
                    if parts and min(layers) < parts[-1]["layers"][1]:
                        raise ValueError(f"stage {i} starts at layer {min(layers)}, not after the previous stage")
                    part: dict[str, Any] = {"stage": i, "layers": [min(layers), max(layers) + 1], "hash": snap.hash,
                                            "layout": [[n, sh] for n, sh in layout]}
                    for key in ("theta", "momentum"):
                        flat = snap.tensors[key]
                        start = offset
                        for pname, shape in layout:
                            n = math.prod(shape)
                            entries.append((f"{key}/{pname}", shape, offset, offset + 4 * n))
                            offset += 4 * n
                        if offset - start != 4 * flat.numel():
                            raise ValueError(f"stage {i}'s layout covers {(offset - start) // 4} values, "
                                             f"its {key} {flat.numel()}")
                        _write_view(f, flat)
                        part[key] = [start, offset]
                    inner = max(inner, int(snap.meta.get("inner_steps", 0)))
                    parts.append(part)
                    del snap, flat  # released before the next stage is fetched
            if not parts:
                raise ValueError("no stage snapshots to write")
            head = _header(entries, {"format": FORMAT, "version": str(version)})
            digest = hashlib.sha256(head)
            with open(tmp, "wb") as out, open(body, "rb") as f:
                out.write(head)
                for block in iter(lambda: f.read(CHUNK), b""):
                    digest.update(block)
                    out.write(block)
                out.flush()
                os.fsync(out.fileno())
            data_path = self.dir / f"{name}.safetensors"
            tmp.replace(data_path)
        finally:
            body.unlink(missing_ok=True)
            tmp.unlink(missing_ok=True)
        for part in parts:  # offsets from the start of the file, for memory-mapped serving
            for key in ("theta", "momentum"):
                part[key] = [part[key][0] + len(head), part[key][1] + len(head)]
        layout = [entry for part in parts for entry in part["layout"]]
        manifest = {
            "format": FORMAT, "version": version, "state_hash": _whole_hash(data_path, parts),
            "file": data_path.name, "file_sha256": digest.hexdigest(), "tensors": ["momentum", "theta"],
            "layout": layout, "stages": parts,
            "meta": {"layout": layout, "stages": [p["layers"] for p in parts], "inner_steps": inner},
            "created_at": time.time(), **(extra or {}),
        }
        manifest_path = self.dir / f"{name}.json"
        write_atomic(manifest_path, json.dumps(manifest, indent=1).encode())
        self._prune()
        return manifest_path

    def verified(self, manifest_path: Path) -> dict[str, Any]:
        """The manifest of a checkpoint whose file is intact (sha256 streamed, nothing held); raises
        ValueError saying what is wrong."""
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"manifest unreadable: {err}") from None
        if manifest.get("format") != FORMAT:
            raise ValueError(f"unknown checkpoint format {manifest.get('format')!r}")
        data_path = self.dir / manifest["file"]
        if not data_path.exists():
            raise ValueError(f"{data_path.name} is missing")
        digest = _sha256(data_path)
        if digest != manifest["file_sha256"]:
            raise ValueError(f"{data_path.name} is corrupted or truncated (sha256 {digest[:12]}, expected {manifest['file_sha256'][:12]})")
        return manifest

    def latest_verified(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint whose file verifies, without loading it; corrupted ones are skipped."""
        for path in self.manifests():
            try:
                return path, self.verified(path)
            except (ValueError, KeyError) as err:
                log.error("checkpoint %s is unusable (%s); trying the previous one", path.stem, err)
        return None

    def manifests(self) -> list[Path]:
        return sorted(self.dir.glob("ckpt-*.json"), reverse=True)

    def _prune(self) -> None:
        for old in self.manifests()[self.keep :]:
            data = self.dir / f"{old.stem}.safetensors"
            old.unlink(missing_ok=True)
            data.unlink(missing_ok=True)

    def load(self, manifest_path: Path) -> Snapshot:
        """Load and verify one checkpoint, the whole model (export asks for it); raises ValueError
        saying what is wrong with it."""
        manifest = self.verified(manifest_path)
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
        got = tensors_hash(tensors)
        if got != manifest["state_hash"]:
            raise ValueError(f"state hash {got[:12]} does not match the manifest's {manifest['state_hash'][:12]}")
        return Snapshot(tensors, int(manifest["version"]), got, dict(manifest.get("meta", {})))

    def latest_valid(self) -> Snapshot | None:
        """The newest checkpoint that verifies; corrupted ones are reported and skipped."""
        for path in self.manifests():
            try:
                return self.load(path)
            except (ValueError, KeyError) as err:
                log.error("checkpoint %s is unusable (%s); trying the previous one", path.stem, err)
        return None
