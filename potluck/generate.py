"""``potluck generate``: sample text from a trained model.

The model comes from what ``potluck export`` wrote (a Hugging Face folder, a ``.pt`` or a
``.safetensors`` file), from any Hugging Face folder of a supported family, or, with ``--journal-dir``,
from a live run's newest verified checkpoint. The prompt is read the way the run read its data: a
tokenizer stored in the folder, else bytes (UTF-8) for byte-level runs, else token ids
(``--prompt "3 17 5"``) for the synthetic source.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

DESCRIPTION = """\
Sample a continuation of --prompt from a model potluck trained: an exported
folder or file (--model), or the newest checkpoint of a run (--journal-dir,
where the coordinator keeps its journal). Sampling: --temperature (0 = greedy),
--top-k, --top-p; --seed makes it repeatable."""

EXAMPLES = """\
examples:
  potluck generate --model model-hf --prompt "Once upon a time"
  potluck generate --journal-dir potluck-run --prompt "The" --temperature 0.7
  potluck generate --model model.pt --prompt "3 17 5" --top-k 10
"""


class Tokenizer:
    """Text <-> token ids: a Hugging Face tokenizer, bytes, or ids written as numbers."""

    def __init__(self, kind: str, hf: Any = None) -> None:
        self.kind, self.hf = kind, hf

    @classmethod
    def for_model(cls, folder: Path | None, data_source: str, tokenizer: str = "") -> Tokenizer:
        if folder is not None and (folder / "tokenizer.json").exists() or \
                folder is not None and (folder / "tokenizer_config.json").exists():
            from transformers import AutoTokenizer

            return cls("hf", AutoTokenizer.from_pretrained(str(folder)))
        byte_level = data_source == "bytes" or data_source in ("shards", "hf") and tokenizer == "bytes"
        return cls("bytes" if byte_level else "ids")

    def encode(self, text: str) -> list[int]:
        if self.kind == "hf":
            return list(self.hf.encode(text, add_special_tokens=False))
        if self.kind == "bytes":
            return list(text.encode())
        try:
            return [int(t) for t in text.split()]
        except ValueError:
            raise ValueError("this model was trained on token ids (the synthetic source): give --prompt as "
                             "numbers separated by spaces, e.g. --prompt '3 17 5'") from None

    def decode(self, ids: list[int]) -> str:
        if self.kind == "hf":
            return str(self.hf.decode(ids))
        if self.kind == "bytes":
            return bytes(ids).decode(errors="replace")
        return " ".join(str(i) for i in ids)


def load(model: str | None, journal: str | None, step: int | None = None) -> tuple[Any, Tokenizer]:
    """(the model in eval mode, its tokenizer) from ``--model`` or ``--journal-dir``."""
    from potluck.peer.training.model import Model, load_named
    from potluck.protos.config.runconfig import ModelConfig

    if journal is not None:
        from potluck.export import named_theta, read_model

        config, snap, manifest, _ = read_model(journal, step)
        net = Model(ModelConfig.model_validate(config))
        load_named(net, named_theta(snap))
        data = manifest["data"]
        folder = Path(manifest["tokenizer_folder"]) if manifest.get("tokenizer_folder") else None
        return net.eval(), Tokenizer.for_model(folder, data["source"], data.get("tokenizer", ""))
    assert model is not None
    path = Path(model)
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    if path.is_dir():
        from potluck.models.hub import POTLUCK, read_folder

        if (path / POTLUCK).exists():
            cfg, info, tensors = read_folder(path)
            net = Model(cfg)
            load_named(net, dict(tensors))
            data = info.get("data", {})
            return net.eval(), Tokenizer.for_model(path, data.get("source", "markov"), data.get("tokenizer", ""))
        net = Model(ModelConfig(family="hf", hf_model=str(path)), pretrained=True)  # any supported HF folder
        return net.eval(), Tokenizer.for_model(path, "bytes")
    from potluck.export import load_model

    net = load_model(path)
    return net, Tokenizer("bytes" if net.cfg.vocab_size == 256 else "ids")


def sample(net: Any, prompt: list[int], max_new: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           seed: int = 0) -> list[int]:
    """``max_new`` tokens after ``prompt``, each from the model's next-token distribution over (at most)
    the last ``seq_len`` tokens, cut to the ``top_k`` most likely and the smallest set holding ``top_p``
    of the mass, at ``temperature`` (0: the most likely token)."""
    import torch

    if not prompt:
        raise ValueError("the prompt is empty")
    if any(not 0 <= t < net.cfg.vocab_size for t in prompt):
        raise ValueError(f"the prompt holds tokens outside the model's vocabulary [0, {net.cfg.vocab_size})")
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            logits = net(torch.tensor([ids[-net.cfg.seq_len:]]))[0, -1].float()
            if temperature <= 0:
                ids.append(int(logits.argmax()))
                continue
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, -1)
            if top_p < 1.0:
                sorted_p, order = probs.sort(descending=True)
                drop = sorted_p.cumsum(0) - sorted_p >= top_p  # keep the smallest prefix reaching top_p
                probs = probs.clone()
                probs[order[drop]] = 0.0
                probs = probs / probs.sum()
            ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    return ids[len(prompt):]


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="sample text from a trained model", description=DESCRIPTION,
                              epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="PATH", help="what potluck export wrote (folder, .pt, .safetensors) "
                     "or a Hugging Face folder")
    # (--journal-dir, as export and the coordinator name it; --journal, its first name, still reads, out of --help)
    src.add_argument("--journal-dir", dest="journal", metavar="DIR", help="a run's journal dir: its newest verified checkpoint")
    src.add_argument("--journal", dest="journal", help=argparse.SUPPRESS)  # the old spelling
    p.add_argument("--step", type=int, metavar="N", help="with --journal-dir: the checkpoint of outer step N")
    p.add_argument("--prompt", required=True, help="text to continue (token ids for synthetic-data runs)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to sample (default 64)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, metavar="K", help="keep the K likeliest tokens; 0 keeps all "
                   "(default 50)")
    p.add_argument("--top-p", type=float, default=0.95, metavar="P", help="nucleus: the likeliest tokens holding P "
                   "of the mass (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.set_defaults(fn=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        if args.max_new_tokens < 1 or args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
            raise ValueError("need --max-new-tokens >= 1, --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1")
        net, tok = load(args.model, args.journal, args.step)
        out = sample(net, tok.encode(args.prompt), args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                     args.seed)
    except (ValueError, OSError) as err:
        print(f"potluck generate: {err}", file=sys.stderr)
        return 2
    print(args.prompt + (" " if tok.kind == "ids" else "") + tok.decode(out))
    return 0
