"""Tokenizers with an identity: the run records which tokenizer made its shards, by name and hash.

``load_tokenizer("bytes")`` is the dependency-free byte-level tokenizer (UTF-8 bytes, vocabulary
256, no EOS). Anything else is a Hugging Face tokenizer: a ``tokenizer.json`` file, a folder holding
one (or, without one, anything ``transformers.AutoTokenizer`` reads), or a Hub id.

Why a hash: two peers that tokenize differently would train on different token streams while
believing they share one. The sha256 is taken over the tokenizer's canonical definition, the bytes of
its ``tokenizer.json`` (``to_str()`` where there is no file), so a copy of the same file gives the same
hash on every machine and any change of vocabulary, merges or normalisation gives another.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from potluck.data import DataError
from potluck.protos.runtime.log import get_logger

BYTES_SPEC = "bytes"
BYTES_SHA256 = hashlib.sha256(b"potluck-bytes-v1").hexdigest()
# tried in order when the tokenizer's own config names no EOS token
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")

log = get_logger(__name__)


@dataclass(frozen=True)
class TokenizerInfo:
    """What a run and an ``index.json`` record about a tokenizer (see the module docstring)."""

    name: str
    sha256: str
    vocab_size: int
    eos_id: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> TokenizerInfo:
        """Parse a record tolerantly: unknown keys are ignored, ``eos_id`` defaults to None."""
        if not isinstance(data, dict):
            raise DataError(f"a tokenizer record must be a JSON object, got {type(data).__name__}")
        missing = [k for k in ("name", "sha256", "vocab_size") if k not in data]
        if missing:
            raise DataError(f"the tokenizer record lacks {', '.join(missing)}; prepare the data again")
        eos = data.get("eos_id")
        return cls(str(data["name"]), str(data["sha256"]), int(data["vocab_size"]), None if eos is None else int(eos))


class Tokenizer:
    """Text <-> token ids, with :attr:`info`. Subclasses implement :meth:`encode_batch` and :meth:`decode`.

    Tokenizers are picklable, so ``prepare`` can hand one to each worker process.
    """

    info: TokenizerInfo

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids (int64), without special tokens: the shards add EOS between documents."""
        raise NotImplementedError

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def decode(self, ids: Any) -> str:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: nothing to download, vocabulary 256, no EOS (documents are only delimited
    by the boundaries the shards record)."""

    def __init__(self) -> None:
        self.info = TokenizerInfo(BYTES_SPEC, BYTES_SHA256, 256, None)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]

    def decode(self, ids: Any) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` (the Rust library behind every fast Hugging Face tokenizer): its batch
    API encodes on all cores."""

    def __init__(self, tok: Any, name: str, sha256: str, eos_id: int | None, definition: str = "") -> None:
        self.tok, self.definition = tok, definition  # definition: the tokenizer.json text sha256 is of
        self.info = TokenizerInfo(name, sha256, int(tok.get_vocab_size(with_added_tokens=True)), eos_id)

    def save(self, folder: Path) -> None:
        """``tokenizer.json`` (the very bytes its sha256 is of) and a ``tokenizer_config.json`` naming its EOS,
        so that transformers' ``AutoTokenizer`` (and ``potluck generate``) load it from ``folder``."""
        text = self.definition or self.tok.to_str()
        (folder / "tokenizer.json").write_bytes(text.encode("utf-8"))
        eos = self.tok.id_to_token(self.info.eos_id) if self.info.eos_id is not None else None
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **({"eos_token": eos} if eos else {})}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)  # fast: no offsets
        return [np.asarray(e.ids, dtype=np.int64) for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Any) -> str:
        return str(self.tok.decode([int(i) for i in ids], skip_special_tokens=False))


class TransformersTokenizer(Tokenizer):
    """A ``transformers`` tokenizer without a ``tokenizers`` backend (e.g. a bare SentencePiece model).
    Its hash covers its class and full vocabulary, the definition we can read from it."""

    def __init__(self, tok: Any, name: str) -> None:
        self.tok = tok
        vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
        definition = json.dumps({"class": type(tok).__name__, "vocab": vocab}, ensure_ascii=False)
        sha = hashlib.sha256(definition.encode()).hexdigest()
        self.info = TokenizerInfo(name, sha, len(tok), tok.eos_token_id)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        ids = self.tok(texts, add_special_tokens=False)["input_ids"]
        return [np.asarray(i, dtype=np.int64) for i in ids]

    def decode(self, ids: Any) -> str:
        return str(self.tok.decode([int(i) for i in ids]))


def load_tokenizer(spec: str) -> Tokenizer:
    """``"bytes"``, a ``tokenizer.json`` file, a tokenizer folder, or a Hugging Face Hub id."""
    if spec == BYTES_SPEC:
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_file():
        return _from_file(path, path.parent.name if path.name == "tokenizer.json" else path.stem)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return _from_file(path / "tokenizer.json", path.resolve().name)
        return _from_transformers(str(path), path.resolve().name)
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1 or spec.endswith(".json"):
        raise DataError(f"no tokenizer at {spec}: give 'bytes', a tokenizer.json, a folder holding one, or a Hub id")
    return _from_hub(spec)


def _from_file(path: Path, name: str) -> HFTokenizer:
    from tokenizers import Tokenizer as RustTokenizer

    raw = path.read_bytes()
    try:
        tok = RustTokenizer.from_str(raw.decode("utf-8"))
    except Exception as err:  # the Rust library raises plain Exception on a bad definition
        raise DataError(f"{path} is not a Hugging Face tokenizer.json ({err})") from None
    return HFTokenizer(tok, name, hashlib.sha256(raw).hexdigest(), _eos_id(tok, path.parent / "tokenizer_config.json"),
                       raw.decode("utf-8"))


def _eos_id(tok: Any, config: Path) -> int | None:
    """The EOS id named by ``tokenizer_config.json`` next to the file, else the first known EOS token."""
    names: list[str] = []
    if config.is_file():
        try:
            eos = json.loads(config.read_text()).get("eos_token")
        except (OSError, ValueError):
            eos = None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        names += [eos] if isinstance(eos, str) else []
    for name in [*names, *EOS_CANDIDATES]:
        found = tok.token_to_id(name)
        if found is not None:
            return int(found)
    return None


def _from_transformers(source: str, name: str) -> Tokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(f"{source} has no tokenizer.json; reading it needs transformers: pip install "
                        "'potluck[hf]'") from None
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except Exception as err:  # transformers raises OSError, ValueError, ImportError (sentencepiece), ...
        raise DataError(f"cannot load a tokenizer from {source}: {err}") from None
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return TransformersTokenizer(tok, name)
    definition = backend.to_str()
    sha = hashlib.sha256(definition.encode("utf-8")).hexdigest()
    eos = tok.eos_token_id if tok.eos_token_id is not None else _eos_id(backend, Path("/nonexistent"))
    return HFTokenizer(backend, name, sha, eos, definition)


def _from_hub(repo_id: str) -> Tokenizer:
    """The Hub's ``tokenizer.json`` file itself (so its hash equals a local copy's), else transformers."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError
    except ImportError:
        return _from_transformers(repo_id, repo_id)
    try:
        path = Path(hf_hub_download(repo_id, "tokenizer.json"))
    except EntryNotFoundError:
        return _from_transformers(repo_id, repo_id)
    except Exception as err:  # offline, unknown repo, gated model: all end the same way for the user
        raise DataError(f"cannot load tokenizer {repo_id!r}: it is not a local file or folder, and the Hugging "
                        f"Face Hub said: {err}") from None
    tok = _from_file(path, repo_id)
    if tok.info.eos_id is None:  # the Hub's config names the EOS token; fetch it when cached or reachable
        try:
            config = Path(hf_hub_download(repo_id, "tokenizer_config.json"))
            tok = HFTokenizer(tok.tok, repo_id, tok.info.sha256, _eos_id(tok.tok, config), tok.definition)
        except Exception as err:  # no config: the EOS candidates were already tried
            log.warning("tokenizer %s: no tokenizer_config.json (%s) and no EOS among the usual names; documents "
                        "are joined without an end-of-document token", repo_id, err)
    return tok
