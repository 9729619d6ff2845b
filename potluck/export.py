"""``potluck export``: the run's latest verified checkpoint as one plain file a user loads with torch.

    potluck export --journal-dir potluck-run --out model.pt
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

DESCRIPTION = """\
Write the run's newest verified checkpoint as one plain file that torch.load
reads, its tensors named as in potluck's TinyGPT (layers.<i>.<...>) whatever
number of pipeline stages wrote it. A .safetensors file holds the same tensors
and the model config in its metadata. Run it where the coordinator keeps its
journal (its --journal-dir)."""

EXAMPLES = """\
examples:
  potluck export --journal-dir potluck-run --out model.pt
  potluck export --journal-dir potluck-run --step 8 --out step8.safetensors

then, in Python:
  import torch
  from potluck.peer.model import TinyGPT
  from potluck.protos.config import ModelConfig
  sd = torch.load("model.pt")
  model = TinyGPT(ModelConfig(**sd["config"]))
  model.load_state_dict(sd["model"])"""


def export_checkpoint(journal_dir: str | Path, out: str | Path, step: int | None = None) -> dict[str, Any]:
    """Write the newest valid checkpoint (or the one of outer ``step``) to ``out``; returns a summary."""
    import torch  # here, not at module level: ``potluck --help`` must not wait for torch

    from potluck.coordinator.checkpoint import CheckpointStore, layer_of, split_by_layout

    store = CheckpointStore(Path(journal_dir) / "checkpoints")
    manifests = store.manifests()
    if step is not None:
        manifests = [m for m in manifests if m.stem == f"ckpt-{step:06d}"]
    if not manifests:
        raise ValueError(f"no checkpoint{f' of outer step {step}' if step is not None else ''} in {journal_dir}")
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


class _DeprecatedAlias(argparse.Action):
    """A flag's old spelling: hidden from ``--help``, still accepted, with a note on stderr."""

    def __init__(self, *args: Any, instead: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.instead = instead

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog}: {option_string} is deprecated, use {self.instead}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``export`` subcommand to ``potluck``'s subparsers."""
    p = subparsers.add_parser("export", help="write the newest checkpoint to a .pt or .safetensors file",
                              description=DESCRIPTION, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--journal-dir", default="potluck-run", metavar="DIR",
                   help="the coordinator's journal dir (default ./potluck-run)")
    p.add_argument("--journal", dest="journal_dir", help=argparse.SUPPRESS)  # the old spelling
    p.add_argument("--out", default="model.pt", metavar="FILE", help="output file: .pt (torch.save) or .safetensors")
    p.add_argument("--step", type=int, metavar="N",
                   help="the checkpoint written at outer step N (default: the newest valid one)")
    # --version once meant --step, which read as this program's version next to `potluck --version`
    p.add_argument("--version", dest="step", type=int, action=_DeprecatedAlias, instead="--step",
                   help=argparse.SUPPRESS)
    p.set_defaults(fn=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        info = export_checkpoint(args.journal_dir, args.out, args.step)
    except (ValueError, OSError) as err:
        print(f"potluck export: {err}", file=sys.stderr)
        return 2
    for skipped in info["skipped"]:
        print(f"potluck export: skipped {skipped}", file=sys.stderr)
    print(f"wrote v{info['version']} ({info['parameters'] / 1e6:.2f}M parameters) to {info['out']}")
    return 0
