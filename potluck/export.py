"""``potluck export``: the run's latest verified checkpoint as one plain file a user loads with torch.

    potluck export --journal potluck-run --out model.pt
    >>> sd = torch.load("model.pt")
    >>> model = TinyGPT(ModelConfig(**sd["config"])); model.load_state_dict(sd["model"])

Parameters are named as in :class:`~potluck.peer.model.TinyGPT` (``layers.<i>.<...>``), whatever
number of pipeline stages wrote the checkpoint. ``.safetensors`` output holds the same tensors
(the config goes into its metadata).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from potluck.coordinator.checkpoint import CheckpointStore, layer_of, split_by_layout


def export_checkpoint(journal_dir: str | Path, out: str | Path, version: int | None = None) -> dict[str, Any]:
    """Write the newest valid checkpoint (or ``version``) to ``out``; returns a summary."""
    store = CheckpointStore(Path(journal_dir) / "checkpoints")
    manifests = store.manifests()
    if version is not None:
        manifests = [m for m in manifests if m.stem == f"ckpt-{version:06d}"]
    if not manifests:
        raise ValueError(f"no checkpoint{f' of version {version}' if version is not None else ''} in {journal_dir}")
    errors = []
    for path in manifests:
        try:
            snap = store.load(path)
            manifest = json.loads(path.read_text())
            break
        except (ValueError, KeyError) as err:
            errors.append(f"{path.stem}: {err}")
    else:
        raise ValueError("no usable checkpoint: " + "; ".join(errors))
    layout = [(n, list(s)) for n, s in snap.meta.get("layout", [])]
    if not layout:
        raise ValueError(f"{path.stem} has no per-parameter layout; it cannot be exported as a model")
    named = split_by_layout(snap.tensors["theta"], layout)
    model = {f"layers.{layer_of(n)}.{n.split('.', 2)[2] if n.startswith('layers.') else n.split('.', 1)[1]}": t
             for n, t in named.items()}
    config = manifest.get("model") or {}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.items()}, str(out),
                  metadata={"config": json.dumps(config), "version": str(snap.version)})
    else:
        torch.save({"model": model, "config": config, "version": snap.version, "state_hash": snap.hash}, out)
    return {"version": snap.version, "parameters": int(sum(t.numel() for t in model.values())), "out": str(out),
            "skipped": errors}


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="write the latest checkpoint as one plain torch (or safetensors) file")
    p.add_argument("--journal", default="potluck-run", help="the coordinator's journal dir (default ./potluck-run)")
    p.add_argument("--out", default="model.pt", help="output file: .pt (torch.save) or .safetensors")
    p.add_argument("--version", type=int, help="a specific outer step's checkpoint (default: the newest valid)")
    p.set_defaults(fn=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        info = export_checkpoint(args.journal, args.out, args.version)
    except (ValueError, OSError) as err:
        print(f"potluck export: {err}", file=sys.stderr)
        return 2
    for skipped in info["skipped"]:
        print(f"potluck export: skipped {skipped}", file=sys.stderr)
    print(f"wrote v{info['version']} ({info['parameters'] / 1e6:.2f}M parameters) to {info['out']}")
    return 0
