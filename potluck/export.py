"""``potluck export``: the run's latest verified checkpoint as a plain file or a Hugging Face folder.

    potluck export --journal-dir potluck-run --out model.pt
    >>> from potluck.export import load_model
    >>> model = load_model("model.pt")

or, with torch alone::

    >>> import torch
    >>> from potluck.peer.training.model import Model
    >>> from potluck.protos.config.runconfig import ModelConfig
    >>> sd = torch.load("model.pt")
    >>> model = Model(ModelConfig(**sd["config"])); model.load_state_dict(sd["model"])

Parameters are named as in :class:`~potluck.peer.training.model.Model` (``layers.<i>.<...>``), whatever
number of pipeline stages wrote the checkpoint. ``.safetensors`` output holds the same tensors
(the config goes into its metadata). An ``--out`` without either suffix is a Hugging Face folder
(``llama`` and ``hf`` runs) that ``transformers`` loads as it is. After writing, the command prints
the Python lines that load what it wrote, for each form (:func:`load_lines`), with the text-to-tokens
step of the run's data: its tokenizer when the folder holds one, UTF-8 bytes for a byte-level run.
An existing output is never replaced without ``--force``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from potluck.peer.training.model import Model

DESCRIPTION = """\
Write the run's newest verified checkpoint in one of three forms, chosen by
--out: a .pt file that torch.load reads, its tensors named as in potluck's
Model (layers.<i>.<...>) whatever number of pipeline stages wrote it; a
.safetensors file with the same tensors and the model config in its metadata;
or, with no such suffix, a Hugging Face folder (config.json, model.safetensors
and the run's tokenizer if it has one) that transformers' from_pretrained loads
(llama and hf runs; loading it needs pip install -e ".[hf]"). It then prints the
Python lines that load what it wrote. Run it where the coordinator keeps its
journal (its --journal-dir). An existing --out is kept unless --force."""


def load_lines(path: str, tokens: str = "bytes") -> list[str]:
    """The Python lines that load what ``potluck export`` wrote to ``path`` and run it on a few tokens
    (printed after an export, and in --help). ``tokens`` says how text becomes token ids: "hf" (the
    folder holds the run's tokenizer), "bytes" (a byte-level run: a token is a byte of UTF-8 text, there
    is no tokenizer) or "ids" (the built-in synthetic data: token ids, no text)."""
    quoted = json.dumps(path, ensure_ascii=False)  # a JSON string is a valid Python literal
    if path.endswith(".safetensors"):
        lines = ["from potluck.export import load_model", f"model = load_model({quoted})",
                 "# or with safetensors and torch alone (the model config is in the file's metadata):",
                 "import json", "from safetensors import safe_open", "from safetensors.torch import load_file",
                 "from potluck.peer.training.model import Model", "from potluck.protos.config.runconfig import ModelConfig",
                 f'with safe_open({quoted}, framework="pt") as f:',
                 '    config = json.loads(f.metadata()["config"])',
                 "model = Model(ModelConfig(**config))", f"model.load_state_dict(load_file({quoted}))"]
        vocab = "model.cfg.vocab_size"
    elif path.endswith(".pt"):
        lines = ["from potluck.export import load_model", f"model = load_model({quoted})",
                 "# or with torch alone:", "import torch", "from potluck.peer.training.model import Model",
                 "from potluck.protos.config.runconfig import ModelConfig", f"sd = torch.load({quoted})",
                 'model = Model(ModelConfig(**sd["config"]))', 'model.load_state_dict(sd["model"])']
        vocab = "model.cfg.vocab_size"
    else:
        lines = ['# a Hugging Face folder: transformers loads it (pip install -e ".[hf]"), potluck is not needed',
                 "from transformers import AutoModelForCausalLM",
                 f"model = AutoModelForCausalLM.from_pretrained({quoted})"]
        vocab = "model.config.vocab_size"
    lines += ["import torch"] if "import torch" not in lines else []
    if tokens == "hf" and not path.endswith((".pt", ".safetensors")):
        lines += ["from transformers import AutoTokenizer", f"tokenizer = AutoTokenizer.from_pretrained({quoted})",
                  'ids = tokenizer("Peers find each other", return_tensors="pt").input_ids']
    elif tokens == "bytes":
        lines += ["# byte-level: no tokenizer; a token is a byte of the UTF-8 text (and decodes back with bytes())",
                  'ids = torch.tensor([list("Peers find each other".encode())])']
    else:
        lines += ["# token ids of the run's data (its synthetic source has no text)",
                  f"ids = torch.randint(0, {vocab}, (1, 8))"]
    logits = "model(ids).logits" if not path.endswith((".pt", ".safetensors")) else "model(ids)"
    return lines + [f"logits = {logits}  # [batch, tokens, vocab_size]"]


EXAMPLES = """\
examples:
  potluck export --journal-dir potluck-run --out model.pt
  potluck export --journal-dir potluck-run --step 8 --out step8.safetensors
  potluck export --journal-dir llama-run --out model-hf   a Hugging Face folder
  potluck export --journal-dir potluck-run --out model.pt --force
  potluck export --journal-dir potluck-run --out s3://my-bucket/run-1/model.pt
  potluck export --journal-dir llama-run --push-to-hub my-org/my-model

then, in Python (a .pt file; for a .safetensors file and a folder the command
prints the lines that load it):
""" + "\n".join(f"  {line}" for line in load_lines("model.pt", "ids"))


def _newest(journal_dir: str | Path, step: int | None) -> tuple[Any, list[Path]]:
    from potluck.coordinator.store.checkpoint import CheckpointStore

    store = CheckpointStore(Path(journal_dir) / "checkpoints")
    manifests = store.manifests()
    if step is not None:
        manifests = [m for m in manifests if m.stem == f"ckpt-{step:06d}"]
    if not manifests:
        raise ValueError(f"no checkpoint{f' of outer step {step}' if step is not None else ''} in {journal_dir}")
    return store, manifests


def read_model(journal_dir: str | Path, step: int | None = None) -> tuple[dict[str, Any], Any, dict[str, Any], list[str]]:
    """(model config, verified whole-model snapshot, its manifest, skipped checkpoints) of the newest
    valid checkpoint (or that of outer ``step``): what ``export`` and ``generate --journal-dir`` read."""
    store, manifests = _newest(journal_dir, step)
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
    if not snap.meta.get("layout"):
        raise ValueError(f"{path.stem} has no per-parameter layout; it cannot be exported as a model")
    journal = Path(journal_dir) / "journal.json"
    try:  # what the run trained on decides how ``potluck generate`` reads a prompt
        data = json.loads(journal.read_text()).get("config", {}).get("data", {}) if journal.exists() else {}
    except (OSError, ValueError):
        data = {}
    manifest["data"] = {"source": data.get("source", "markov")}
    if data.get("source") in ("shards", "hf"):  # the tokenizer its shards were made with, where this machine has it
        from potluck.data.corpus import tokenizer_folder
        from potluck.protos.config.runconfig import DataConfig

        found = tokenizer_folder(DataConfig.model_validate(data))
        manifest["data"]["tokenizer"] = "hf" if found else "bytes"
        manifest["tokenizer_folder"] = str(found) if found else ""
    return manifest.get("model") or {}, snap, manifest, errors


def named_theta(snap: Any) -> dict[str, Any]:
    """The snapshot's parameters by their potluck names (``layers.<entry>.<name>``)."""
    from potluck.coordinator.store.checkpoint import layer_of, split_by_layout

    layout = [(n, list(s)) for n, s in snap.meta["layout"]]
    named = split_by_layout(snap.tensors["theta"], layout)
    return {f"layers.{layer_of(n)}.{n.split('.', 2)[2] if n.startswith('layers.') else n.split('.', 1)[1]}": t
            for n, t in named.items()}


def default_out(journal_dir: str | Path, step: int | None = None) -> str:
    """``model.pt`` for the built-in model, ``model-hf`` (a Hugging Face folder) for the others."""
    _, manifests = _newest(journal_dir, step)
    family = (json.loads(manifests[0].read_text()).get("model") or {}).get("family", "tiny")
    return "model.pt" if family == "tiny" else "model-hf"


def export_checkpoint(journal_dir: str | Path, out: str | Path | None = None, step: int | None = None,
                      force: bool = False) -> dict[str, Any]:
    """Write the newest valid checkpoint (or the one of outer ``step``) to ``out``; returns a summary.

    ``out`` ending in ``.pt`` is a torch file, ``.safetensors`` one safetensors file (potluck names);
    anything else is a Hugging Face folder (``config.json`` + ``model.safetensors``) that
    ``AutoModelForCausalLM.from_pretrained`` loads, for ``llama`` and ``hf`` runs. Raises ``ValueError``
    when ``out`` exists and not ``force``, before reading any tensor. Output is written under a
    temporary name and renamed, so an interrupted export leaves no half file (and, with ``force``,
    the old one intact).
    """
    out = Path(out if out is not None else default_out(journal_dir, step))
    folder = out.suffix not in (".pt", ".safetensors")
    if out.exists() and not force:
        raise ValueError(f"{out} already exists; pass --force to replace it, or choose another --out")
    if out.is_dir() and not folder:
        raise ValueError(f"{out} is a folder; --out names the file to write")
    import torch  # here, not at module level: ``potluck --help`` must not wait for torch

    config, snap, manifest, errors = read_model(journal_dir, step)
    model = named_theta(snap)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        if folder:
            from potluck.models.hub import write_folder
            from potluck.protos.config.runconfig import ModelConfig

            cfg = ModelConfig.model_validate(config)
            if cfg.family == "tiny":
                raise ValueError(f"{out} has no .pt or .safetensors suffix, so it names a Hugging Face folder; the "
                                 "built-in model (family 'tiny') has none: use --out model.pt")
            run = {"version": snap.version, "state_hash": snap.hash, "run_id": manifest.get("run_id", ""),
                   "data": manifest.get("data") or {}}
            write_folder(tmp, cfg, model.items(), run, Path(manifest.get("tokenizer_folder") or "") or None)
            if out.exists():
                shutil.rmtree(out) if out.is_dir() else out.unlink()
        elif out.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in model.items()}, str(tmp),
                      metadata={"config": json.dumps(config), "version": str(snap.version)})
        else:
            torch.save({"model": model, "config": config, "version": snap.version, "state_hash": snap.hash}, tmp)
        tmp.replace(out)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    return {"version": snap.version, "parameters": int(sum(t.numel() for t in model.values())), "out": str(out),
            "skipped": errors, "folder": folder, "tokens": token_kind(manifest.get("data") or {}, out if folder else None)}


def token_kind(data: dict[str, Any], folder: Path | None) -> str:
    """How text becomes the model's token ids: "hf" (the folder holds a tokenizer), "bytes" or "ids"."""
    if folder is not None and any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return "hf"
    if data.get("source") == "bytes" or data.get("tokenizer") == "bytes":
        return "bytes"
    return "ids"


def load_model(path: str | Path) -> Model:
    """The :class:`~potluck.peer.training.model.Model` that ``potluck export`` wrote to ``path`` (.pt or .safetensors).

    On the CPU and in eval mode; move it with ``model.to("cuda")``, train it after ``model.train()``.

        >>> from potluck.export import load_model
        >>> model = load_model("model.pt")
        >>> logits = model(tokens)  # tokens: LongTensor [batch, seq_len], ids < model.cfg.vocab_size
    """
    import torch  # here, not at module level: ``potluck --help`` must not wait for torch

    from potluck.peer.training.model import Model
    from potluck.protos.config.runconfig import ModelConfig

    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if "config" not in meta:
            raise ValueError(f"{path} has no model config in its metadata: not written by potluck export")
        config, state = json.loads(meta["config"]), load_file(str(path))
    else:
        sd = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(sd, dict) or "model" not in sd or "config" not in sd:
            raise ValueError(f"{path} holds no 'model' and 'config': not written by potluck export")
        config, state = sd["config"], sd["model"]
    model = Model(ModelConfig(**config))
    model.load_state_dict(state)
    return model.eval()


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
    p = subparsers.add_parser("export", help="write the newest checkpoint: .pt, .safetensors or a Hugging Face folder",
                              description=DESCRIPTION, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--journal-dir", default="potluck-run", metavar="DIR",
                   help="the coordinator's journal dir (default ./potluck-run)")
    p.add_argument("--journal", dest="journal_dir", help=argparse.SUPPRESS)  # the old spelling
    p.add_argument("--out", default="model.pt", metavar="PATH",
                   help="model.pt (torch.save), model.safetensors, or a folder without those suffixes (Hugging Face: "
                   "transformers loads it; llama and hf runs) (default model.pt); a store URL (s3://BUCKET/PATH, "
                   "gs://..., file:///...) writes it there, each file read back and hash-checked")
    p.add_argument("--force", action="store_true", help="replace --out if it exists (default: refuse)")
    p.add_argument("--push-to-hub", metavar="REPO", help="upload it as a Hugging Face folder to the Hub repository REPO "
                   "(made if missing; token from HF_TOKEN or huggingface-cli login) instead of writing --out")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: make a new repository private")
    p.add_argument("--step", type=int, metavar="N",
                   help="the checkpoint written at outer step N (default: the newest valid one)")
    # --version once meant --step, which read as this program's version next to `potluck --version`
    p.add_argument("--version", dest="step", type=int, action=_DeprecatedAlias, instead="--step",
                   help=argparse.SUPPRESS)
    p.set_defaults(fn=run)
    return p


def run(args: argparse.Namespace) -> int:
    from potluck.protos.config.section import ConfigError

    try:
        if args.push_to_hub:
            from potluck.publish import push_to_hub

            info = push_to_hub(args.journal_dir, args.push_to_hub, args.step, private=args.private)
        elif "://" in args.out:
            from potluck.publish import export_to_url

            info = export_to_url(args.journal_dir, args.out, args.step, force=args.force)
        else:
            info = export_checkpoint(args.journal_dir, args.out, args.step, force=args.force)
    except (ValueError, OSError, ConfigError) as err:
        print(f"potluck export: {err}", file=sys.stderr)
        return 2
    for skipped in info["skipped"]:
        print(f"potluck export: skipped {skipped}", file=sys.stderr)
    if "://" in info["out"]:
        print(f"wrote v{info['version']} ({info['parameters'] / 1e6:.2f}M parameters) to {info['out']}"
              f"{' (' + info['commit'] + ')' if info.get('commit') else ''}; fetch it, then load it as `potluck "
              "export --help` shows")
        return 0
    form = ", a Hugging Face folder" if info["folder"] else ""
    print(f"wrote v{info['version']} ({info['parameters'] / 1e6:.2f}M parameters) to {info['out']}{form}; "
          "load it in Python with:")
    for line in load_lines(info["out"], info["tokens"]):
        print(f"  {line}")
    return 0
