"""Where exported models go: a store URL (``potluck export --out s3://...``) or the Hugging Face Hub
(``potluck export --push-to-hub REPO``).

Both export to a local temporary folder first (:func:`potluck.export.export_checkpoint`, the same forms:
``.pt``, ``.safetensors`` or a Hugging Face folder), then send it:

- :func:`export_to_url` copies it under an fsspec URL (``s3://``, ``gs://``, ``file://``; credentials from the
  store's usual environment, as ``coordinator.checkpoint_url``), each file read back and its SHA-256 compared
  with the local one. A file URL ending in ``.pt`` or ``.safetensors`` is that file; any other names a folder.
  What is there already is kept unless ``force``.
- :func:`push_to_hub` creates the repository if needed and uploads the Hugging Face folder with
  ``huggingface_hub``'s ``HfApi.upload_folder`` (token from ``HF_TOKEN`` or ``huggingface-cli login``, as usual).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from potluck.coordinator.store.offbox import open_store
from potluck.export import export_checkpoint


def _files(root: Path) -> list[tuple[Path, str]]:
    """The files under ``root`` (a file: itself), each with its name relative to the URL it goes to."""
    if root.is_file():
        return [(root, root.name)]
    return [(p, p.relative_to(root).as_posix()) for p in sorted(root.rglob("*")) if p.is_file()]


def export_to_url(journal_dir: str | Path, url: str, step: int | None = None, force: bool = False) -> dict[str, Any]:
    """Export the newest checkpoint (or outer ``step``'s) to ``url``; the summary of
    :func:`~potluck.export.export_checkpoint` with ``out`` the URL and ``sent`` the bytes sent. Raises ConfigError
    (a URL that names no store) or ValueError (something there already, without ``force``; a file that does not
    read back as sent), before reading any tensor for the first."""
    from potluck.coordinator.store.tensorfile import file_sha256

    open_store(url, where="--out")  # (the URL's own faults first: not a URL, an unknown scheme, no bucket)
    scheme, rest = url.split("://", 1)
    rest = rest.rstrip("/")
    parent, name = (f"{scheme}://{rest.rsplit('/', 1)[0]}", rest.rsplit("/", 1)[1]) if "/" in rest else (url, "")
    if not name or (scheme not in ("file", "local") and "/" not in rest):
        raise ValueError(f"--out {url} names no file or folder under the store: add one (.../model.safetensors)")
    outer = open_store(parent, where="--out")
    there = name in outer.names()
    if there and not force:
        raise ValueError(f"{url} already exists; pass --force to replace it, or choose another --out")
    with tempfile.TemporaryDirectory(prefix="potluck-export-") as tmp:
        info = export_checkpoint(journal_dir, Path(tmp) / name, step, force=True)
        local = Path(tmp) / name
        if there:
            outer.fs.rm(outer.path(name), recursive=True)
        target = outer if local.is_file() else open_store(url, where="--out")
        target.prepare()
        sent = 0
        for path, rel in _files(local):
            target.put(path, rel)
            got, want = target.sha256(rel), file_sha256(path)
            if got != want:
                raise ValueError(f"{target.path(rel)} reads back as sha256 {got[:12]}, sent {want[:12]}")
            sent += path.stat().st_size
    return {**info, "out": url, "sent": sent}


def push_to_hub(journal_dir: str | Path, repo: str, step: int | None = None, private: bool = False,
                api: Any = None) -> dict[str, Any]:
    """Export the newest checkpoint (or outer ``step``'s) as a Hugging Face folder and upload it to the Hub
    repository ``repo`` (made if missing, ``private`` then); ``api``: an ``HfApi`` (default: one with the usual
    token). The summary of :func:`~potluck.export.export_checkpoint`, with ``out`` the repository and ``commit``
    what the Hub answered. Raises ValueError for the built-in model (it has no Hugging Face form)."""
    from potluck.export import default_out

    if default_out(journal_dir, step) == "model.pt":
        raise ValueError("the built-in model (family 'tiny') has no Hugging Face form: --push-to-hub takes llama and "
                         "hf runs; export it with --out model.pt (or a store URL)")
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    with tempfile.TemporaryDirectory(prefix="potluck-export-") as tmp:
        info = export_checkpoint(journal_dir, Path(tmp) / "model-hf", step, force=True)
        api.create_repo(repo, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(folder_path=str(Path(tmp) / "model-hf"), repo_id=repo, repo_type="model",
                                   commit_message=f"potluck: v{info['version']} of the run")
    return {**info, "out": f"https://huggingface.co/{repo}", "commit": str(commit)}
