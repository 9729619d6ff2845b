"""Where exported models go (issue 49): ``potluck export --out URL`` writes to a real S3 server (moto's, started
by the test) or any fsspec store, each file read back and hash-checked, refusing to replace without ``--force``;
``--push-to-hub REPO`` hands ``huggingface_hub`` the Hugging Face folder (its network path is not tried here: the
upload call is made on an ``HfApi`` that keeps what it was given)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from test_checkpoint_stream import cfg_for, stage_snapshots
from test_offbox import BUCKET, s3  # noqa: F401 - the S3 server fixture

from potluck.coordinator.store.checkpoint import CheckpointStore
from potluck.export import export_checkpoint
from potluck.publish import export_to_url, push_to_hub


def journal(tmp_path: Path, family: str) -> Path:
    """A journal folder holding one checkpoint (v3) of a 2-stage ``family`` model, as the coordinator writes it."""
    cfg = cfg_for(family, 2)
    store = CheckpointStore(tmp_path / family / "checkpoints")
    store.write_stages(3, stage_snapshots(cfg, 3), {"run_id": "r", "model": cfg.model.model_dump(mode="json")})
    return tmp_path / family


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def same_safetensors(a: bytes, b: bytes) -> bool:
    """The same tensors and metadata (safetensors writes its metadata's keys in no fixed order: bytes may differ)."""
    import json

    import torch
    from safetensors.torch import load

    def header(data: bytes) -> dict:
        return json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]

    x, y = load(a), load(b)
    return header(a) == header(b) and x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_an_export_to_s3_is_the_local_export_and_is_not_replaced_without_force(
        s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    from potluck.cli import main

    j = journal(tmp_path, "tiny")
    url = f"s3://{BUCKET}/models/run-1/model.safetensors"
    assert main(["export", "--journal-dir", str(j), "--out", url]) == 0
    out = capsys.readouterr().out
    assert "wrote v3" in out and url in out
    local = export_checkpoint(j, tmp_path / "model.safetensors")
    stored = s3.objects(BUCKET, "models/run-1")
    assert list(stored) == ["model.safetensors"]
    assert same_safetensors(stored["model.safetensors"], (tmp_path / "model.safetensors").read_bytes())
    assert local["version"] == 3
    assert main(["export", "--journal-dir", str(j), "--out", url, "--step", "3"]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert s3.objects(BUCKET, "models/run-1") == stored, "refused: nothing changed"
    assert main(["export", "--journal-dir", str(j), "--out", url, "--force"]) == 0
    again = s3.objects(BUCKET, "models/run-1")
    assert list(again) == ["model.safetensors"] and same_safetensors(again["model.safetensors"], stored["model.safetensors"])
    assert main(["export", "--journal-dir", str(j), "--out", url.replace(".safetensors", ".pt")]) == 0
    assert set(s3.objects(BUCKET, "models/run-1")) == {"model.safetensors", "model.pt"}


def test_a_hugging_face_folder_goes_to_a_store_url_whole(tmp_path: Path) -> None:
    j = journal(tmp_path, "llama")
    info = export_to_url(j, f"file://{tmp_path}/store/llama-hf")
    export_checkpoint(j, tmp_path / "local-hf")
    sent = {p.relative_to(tmp_path / "store" / "llama-hf").as_posix(): sha(p.read_bytes())
            for p in (tmp_path / "store" / "llama-hf").rglob("*") if p.is_file()}
    want = {p.relative_to(tmp_path / "local-hf").as_posix(): sha(p.read_bytes())
            for p in (tmp_path / "local-hf").rglob("*") if p.is_file()}
    assert sent == want and {"config.json", "model.safetensors"} <= set(sent)
    assert info["sent"] == sum((tmp_path / "local-hf" / n).stat().st_size for n in want)
    with pytest.raises(ValueError, match="already exists"):
        export_to_url(j, f"file://{tmp_path}/store/llama-hf")
    export_to_url(j, f"file://{tmp_path}/store/llama-hf", force=True)
    assert {p.name for p in (tmp_path / "store" / "llama-hf").iterdir()} == {n.split("/")[0] for n in want}


def test_bad_export_urls_are_refused_in_one_line_and_write_nothing(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from potluck.cli import main

    j = journal(tmp_path, "tiny")
    for url, says in [("s3://", "names no bucket"), ("bogus://x/model.pt", "unknown scheme"),
                      ("file:///", "names no folder"), (f"file://{tmp_path}/store/model", "has no .pt or .safetensors")]:
        assert main(["export", "--journal-dir", str(j), "--out", url]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, (url, err)
    assert not (tmp_path / "store").exists()


class KeepingApi:
    """An ``HfApi`` stand-in at the network's edge: it keeps what it is handed (the folder's files, as they are
    when the upload is called) and answers as the Hub would."""

    def __init__(self) -> None:
        self.repos: list[tuple[str, bool]] = []
        self.uploaded: dict[str, str] = {}
        self.kwargs: dict[str, Any] = {}

    def create_repo(self, repo_id: str, repo_type: str, private: bool, exist_ok: bool) -> str:
        assert repo_type == "model" and exist_ok
        self.repos.append((repo_id, private))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, folder_path: str, **kwargs: Any) -> str:
        self.kwargs = kwargs
        root = Path(folder_path)
        self.uploaded = {p.relative_to(root).as_posix(): sha(p.read_bytes()) for p in root.rglob("*") if p.is_file()}
        return f"https://huggingface.co/{kwargs['repo_id']}/commit/abc"


def test_push_to_hub_uploads_the_hugging_face_folder_and_refuses_the_builtin_model(tmp_path: Path) -> None:
    api = KeepingApi()
    info = push_to_hub(journal(tmp_path, "llama"), "me/potluck-llama", private=True, api=api)
    export_checkpoint(tmp_path / "llama", tmp_path / "local-hf")
    want = {p.relative_to(tmp_path / "local-hf").as_posix(): sha(p.read_bytes())
            for p in (tmp_path / "local-hf").rglob("*") if p.is_file()}
    assert api.repos == [("me/potluck-llama", True)] and api.uploaded == want
    assert api.kwargs["repo_id"] == "me/potluck-llama" and "v3" in api.kwargs["commit_message"]
    assert info["commit"].endswith("/commit/abc")
    with pytest.raises(ValueError, match="no Hugging Face form"):
        push_to_hub(journal(tmp_path, "tiny"), "me/tiny", api=KeepingApi())
