"""A run on token shards (#14): the manifest names the shards and their tokenizer, peers get them from a
folder, a URL or a ``datasets`` dataset, and a peer with other shards or another tokenizer refuses."""

from __future__ import annotations

import functools
import math
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_data_shards import make_docs, train_bpe, write_jsonl

from potluck.coordinator import bootstrap
from potluck.data import DataError
from potluck.data.prepare import prepare
from potluck.data.tokenizer import load_tokenizer
from potluck.peer.swarm.joining import with_local_data
from potluck.peer.training.data import EVAL_ID_OFFSET, Dataset
from potluck.protos.config.files import parse_config
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.config.section import ConfigError
from potluck.protos.wire.records import DataIdentity

SMALL = {"model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32},
         "diloco": {"inner_steps": 3, "outer_steps": 3}, "train": {"batch_size": 4}}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same documents prepared with a small BPE and with bytes."""
    root = tmp_path_factory.mktemp("corpus")
    docs = write_jsonl(root / "docs.jsonl", make_docs(600, seed=3))
    bpe = train_bpe(root / "bpe")
    return {"bpe": prepare([docs], load_tokenizer(str(bpe)), root / "shards-bpe", shard_tokens=4096,
                           eval_fraction=0.05, progress=False),
            "bytes": prepare([docs], load_tokenizer("bytes"), root / "shards-bytes", shard_tokens=4096, eval_fraction=0.05,
                             progress=False),
            "jsonl": docs, "tokenizer": bpe}


def run_config(path: Path | str, tmp_path: Path, vocab: int = 512, **data: object) -> RunConfig:
    return parse_config({**SMALL, "model": {**SMALL["model"], "vocab_size": vocab},
                         "data": {"source": "shards", "path": str(path), "cache_dir": str(tmp_path / "cache"),
                                  "eval_samples": 8, **data}})


def test_the_manifest_names_the_shards_and_a_peer_checks_them(corpus: dict[str, Path], tmp_path: Path) -> None:
    cfg = run_config(corpus["bpe"], tmp_path)
    run = bootstrap.data_identity(cfg)
    assert run.source == "shards" and run.tokenizer == "bpe" and len(run.sha256) == len(run.tokenizer_sha256) == 64
    assert run.samples > 100 and run.size > run.samples * 32

    ready = with_local_data(cfg.model_copy(deep=True), run, None)
    data = Dataset(ready.data, ready.model)
    assert data.num_samples == run.samples and len(data.eval_ids()) == 8
    x, y = data.batch([0, 5, EVAL_ID_OFFSET + 7])
    assert x.shape == (3, 32) and int(x.max()) < 512 and (x[:, 1:] == y[:, :-1]).all()

    with pytest.raises(DataError, match="tokenizer 'bytes'.* the run's with 'bpe'"):  # another tokenizer
        with_local_data(cfg.model_copy(deep=True), run, str(corpus["bytes"]))
    other = prepare([write_jsonl(tmp_path / "o.jsonl", make_docs(100, seed=9))], load_tokenizer(str(corpus["tokenizer"])),
                    tmp_path / "other", progress=False)
    with pytest.raises(DataError, match="not this run's data"):  # same tokenizer, other text
        with_local_data(cfg.model_copy(deep=True), run, str(other))
    with pytest.raises(DataError, match="index.json"):
        with_local_data(cfg.model_copy(deep=True), run, str(tmp_path / "nowhere"))


def test_the_tokenizer_travels_with_its_shards(corpus: dict[str, Path]) -> None:
    """prepare saves a Hugging Face tokenizer beside the shards: the same definition (its sha256 is the
    index's), and transformers loads it to the same ids, which is how export and generate read prompts."""
    from transformers import AutoTokenizer

    from potluck.data.shards import ShardSet

    shards = corpus["bpe"]
    saved = load_tokenizer(str(shards))
    assert saved.info.sha256 == ShardSet.open(shards).tokenizer.sha256 == load_tokenizer(str(corpus["tokenizer"])).info.sha256
    assert saved.info.eos_id == ShardSet.open(shards).tokenizer.eos_id
    auto = AutoTokenizer.from_pretrained(str(shards))
    text = "the cat sat on the mat"
    assert auto.encode(text, add_special_tokens=False) == saved.encode(text).tolist()
    assert auto.eos_token_id == saved.info.eos_id
    assert not (corpus["bytes"] / "tokenizer.json").exists()  # bytes need no file


def test_a_corrupt_local_shard_is_refused_and_a_good_one_hashed_once(corpus: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    from potluck.data.corpus import locate

    copy = tmp_path / "copy"
    shutil.copytree(corpus["bpe"], copy)
    cfg = run_config(copy, tmp_path)
    run = bootstrap.data_identity(cfg)
    records = list((tmp_path / "cache" / "verified").glob("*.json"))
    assert len(records) == 1 and "train/00000.bin" in records[0].read_text()
    shard = copy / "train" / "00001.bin"
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0xFF  # same size, other content: only its hash tells
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"sha256 of train/00001.bin is .* the file is corrupt"):
        locate(cfg.data, expect=run)


def test_a_failed_prepare_leaves_the_previous_one_as_it_was(tmp_path: Path) -> None:
    from potluck.data.shards import ShardSet

    docs = write_jsonl(tmp_path / "d.jsonl", make_docs(50))
    out = prepare([docs], load_tokenizer("bytes"), tmp_path / "shards", progress=False)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    one = tmp_path / "one.txt"
    one.write_text("a single document")
    with pytest.raises(DataError, match="too few to hold some out"):
        prepare([one], load_tokenizer("bytes"), out, eval_fraction=0.1, progress=False)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert ShardSet.open(out, verify="full").num_documents == 50 - 1 and not list(tmp_path.glob(".shards.*"))
    again = prepare([one], load_tokenizer("bytes"), out, eval_fraction=0, progress=False)  # a good one replaces it
    assert ShardSet.open(again, verify="full").num_documents == 1 and not (out / "eval").exists()


def test_a_run_its_shards_cannot_feed_is_refused_in_one_line(corpus: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.path = .*has \d+ tokens, more than model.vocab_size = 256"):
        bootstrap.data_identity(run_config(corpus["bpe"], tmp_path, vocab=256))
    with pytest.raises(ConfigError, match="data.path = .*index.json"):
        bootstrap.data_identity(run_config(tmp_path / "missing", tmp_path))
    with pytest.raises(ConfigError, match="needs data.path"):
        parse_config({"data": {"source": "shards"}})
    with pytest.raises(ConfigError, match="needs data.hf_dataset"):
        parse_config({"data": {"source": "hf"}})


def test_an_hf_dataset_is_prepared_once_per_machine(corpus: dict[str, Path], tmp_path: Path) -> None:
    """``data.source = "hf"``: a datasets dataset (a local folder of jsonl here: the Hub is unreachable),
    streamed and tokenized into the cache; prepared again elsewhere it has the same identity."""
    pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", make_docs(300, seed=4))
    base = {**SMALL, "model": {**SMALL["model"], "vocab_size": 512}}
    cfgs = [parse_config({**base, "data": {"source": "hf", "hf_dataset": str(folder), "tokenizer": str(corpus["tokenizer"]),
                                           "cache_dir": str(tmp_path / f"cache-{i}"), "eval_samples": 4,
                                           "eval_fraction": 0.05}})
            for i in range(2)]
    run = bootstrap.data_identity(cfgs[0])
    assert run.source == "hf" and run.tokenizer == "bpe" and run.samples > 0
    ready = with_local_data(cfgs[1], run, None)  # another machine: its own cache, the same shards
    assert Path(ready.data.path or "").is_relative_to(tmp_path / "cache-1")
    assert Dataset(ready.data, ready.model).num_samples == run.samples


class Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def served(corpus: dict[str, Path]) -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(corpus["bpe"])))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.slow
def test_a_swarm_trains_on_shards_from_a_folder_and_a_url(corpus: dict[str, Path], served: str, tmp_path: Path,
                                                          procs) -> None:  # type: ignore[no-untyped-def]
    from potluck.local import LocalSwarm
    from potluck.protos.config.files import apply_overrides

    cfg = apply_overrides(run_config(corpus["bpe"], tmp_path), {
        "coordinator.host": "127.0.0.1", "coordinator.dht_port": 0, "coordinator.grpc_port": 0,
        "coordinator.status_port": 0, "coordinator.journal_dir": str(tmp_path / "journal"),
        "membership.min_peers": 2})
    swarm = LocalSwarm(tmp_path / "swarm", procs)
    try:
        swarm.start_coordinator(cfg)
        swarm.start_peer()  # the run's folder, where data.path says
        swarm.start_peer("--data-path", served)  # the same shards over HTTP, into its cache
        wrong = swarm.start_peer("--data-path", str(corpus["bytes"]))  # other shards: refuses to join
        assert wrong.wait(timeout=120) == 2
        state = swarm.wait_state(lambda s: s["run"]["finished"] and s["run"]["eval_loss"] is not None, 240,
                                 "3 outer steps on shards")
    except BaseException:
        swarm.dump_logs()
        raise
    run = state["run"]
    assert run["data"]["source"] == "shards" and run["data"]["repeats"] == 0
    # (each member trains what fits the round's window: what it did not reach went back to the pool, still free)
    worked = sum(h["samples"] for h in state["history"])
    assert run["data"]["trained"] == worked and run["data"]["trained"] + run["data"]["pool"] == run["data"]["frontier"]
    assert worked <= 3 * 2 * cfg.diloco.inner_steps * cfg.train.batch_size
    assert run["data"]["epoch"] == pytest.approx(worked / run["data"]["samples"])
    assert run["eval_perplexity"] == pytest.approx(math.exp(run["eval_loss"]))
    assert run["eval_loss"] < math.log(512)
    log = (tmp_path / "swarm" / "logs" / "peer-2.log").read_text()
    assert "tokenizer 'bytes'" in log and "the run's with 'bpe'" in log, log[-2000:]
    # the run's model reads a prompt with the shards' tokenizer and writes text back
    done = subprocess.run([sys.executable, "-m", "potluck", "generate", "--journal", str(tmp_path / "journal"),
                           "--prompt", "the cat", "--max-new-tokens", "6"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("the cat"), done.stdout + done.stderr
    assert len(done.stdout.split()) > 2


def test_a_byte_run_identity_counts_its_samples(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_bytes(b"potluck " * 4000)
    cfg = parse_config({**SMALL, "data": {"source": "bytes", "path": str(text), "eval_samples": 4}})
    ident = bootstrap.data_identity(cfg)
    assert isinstance(ident, DataIdentity) and ident.samples == (len(text.read_bytes()) - 1) // 32 - 4
