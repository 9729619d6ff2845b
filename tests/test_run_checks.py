"""A run is checked as a whole before anything is published, and a peer trains only on the run's data.

A new user's first byte-level run (the README's old minimal run file, kept here as the case that
used to fail): byte-level data in ``corpus.txt`` and no ``model.vocab_size``. It must validate,
train, and tell volunteers that they need the corpus; every
run its peers could not train is refused in one line that says what to change, before a journal is
written or a manifest published.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from potluck.coordinator import bootstrap
from potluck.coordinator.store.journal import Journal, JournalError
from potluck.peer.swarm.joining import warn_unreachable, with_local_data
from potluck.peer.training.data import DataError
from potluck.protos.config.files import apply_overrides, parse_config
from potluck.protos.config.runcheck import check_run, file_identity, min_corpus_bytes, non_public
from potluck.protos.config.runconfig import CoordinatorConfig, RunConfig
from potluck.protos.config.section import ConfigError
from potluck.protos.wire.records import DataIdentity

README_RUN = """\
run_id = "my-run"
[model]
d_model = 512
n_layers = 8
n_heads = 8
[diloco]
inner_steps = 500
outer_steps = 100
[pipeline]
stages = 1          # > 1 cuts the model into pipeline stages
[data]
source = "bytes"    # byte-level text
path = "corpus.txt"
"""
SMALL = {"model.d_model": 32, "model.n_layers": 1, "diloco.inner_steps": 2, "diloco.outer_steps": 1}


def corpus(path: Path, size: int = 16 << 10, seed: int = 0) -> Path:
    text = b"".join(b"potluck line %d of corpus %d: volunteers train one transformer.\n" % (i, seed)
                    for i in range(size // 40))
    path.write_bytes(text[:size])
    return path


def readme_config(**overrides: Any) -> RunConfig:
    return apply_overrides(parse_config(tomllib.loads(README_RUN), source="run.toml"), overrides)


def flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.fixture(autouse=True)
def caplog_sees_potluck(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(logging.getLogger("potluck"), "propagate", True)  # its own handler stops it at "potluck"


# ---------------------------------------------------------------------- the coordinator's checks


def test_the_readme_run_file_validates_and_byte_data_sets_the_vocabulary(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    text = corpus(tmp_path / "corpus.txt")
    cfg = readme_config()
    assert cfg.model.vocab_size == 256 and "vocab_size" not in cfg.model.model_fields_set
    check = check_run(cfg)
    assert check.data == DataIdentity(source="bytes", sha256=hashlib.sha256(text.read_bytes()).hexdigest(),
                                      size=text.stat().st_size)
    [note] = check.notes
    assert "volunteers need this run's corpus" in note and str(text) in note and "--data-path FILE" in note
    assert parse_config(cfg.manifest_sections()).model.vocab_size == 256  # what peers read from the manifest
    assert apply_overrides(cfg, {"data.source": "markov"}).model.vocab_size == 64  # decided again, not pinned


def _vocab_64() -> None:
    parse_config({**tomllib.loads(README_RUN), "model": {"vocab_size": 64}}, source="run.toml")


def _twelve_stages() -> None:
    apply_overrides(readme_config(), {"pipeline.stages": 12})


def _huge_markov() -> None:
    parse_config({"model": {"vocab_size": 256}, "data": {"markov_order": 3}})


@pytest.mark.parametrize("refuse,fix", [
    (_vocab_64, "model.vocab_size = 64, but data.source = 'bytes' has 256 tokens (one per byte value): "
                "set model.vocab_size = 256, or leave it out"),
    (_twelve_stages, "pipeline.stages = 12 exceeds the model's 10 layers"),
    (_huge_markov, "lower model.vocab_size or data.markov_order"),
])
def test_configs_that_cannot_mean_a_run_are_refused_in_one_line(refuse, fix) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as err:
        refuse()
    assert fix in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("setup,fix", [
    (lambda d: None, "data.path = 'corpus.txt': no such file (looked for {d}/corpus.txt); set data.path to the text "
                     "file to train on (a relative path is read from the coordinator's working directory)"),
    (lambda d: (d / "corpus.txt").mkdir(), "data.path = 'corpus.txt': {d}/corpus.txt is not a file; set data.path to the text "
                                            "file to train on"),
    (lambda d: corpus(d / "corpus.txt", 8000),
     "data.path = 'corpus.txt': the file holds 8000 bytes; the run needs at least 8257 for data.eval_samples = 128 "
     "held-out windows and one training window of model.seq_len = 64 tokens: use a bigger file, or lower "
     "data.eval_samples or model.seq_len"),
])
def test_runs_without_a_usable_corpus_are_refused_before_anything_is_written(tmp_path, monkeypatch, setup,  # type: ignore[no-untyped-def]
                                                                             fix) -> None:
    monkeypatch.chdir(tmp_path)
    setup(tmp_path)
    cfg = readme_config(**{"coordinator.journal_dir": str(tmp_path / "journal")})
    with pytest.raises(ConfigError) as err:
        bootstrap.open_journal(cfg)
    assert str(err.value) == fix.format(d=tmp_path)
    assert not (tmp_path / "journal").exists()


def test_the_smallest_corpus_is_enough(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from potluck.peer.training.data import Dataset

    monkeypatch.chdir(tmp_path)
    cfg = readme_config(**{"model.seq_len": 16, "data.eval_samples": 4})
    corpus(tmp_path / "corpus.txt", min_corpus_bytes(16, 4))
    check_run(cfg)
    assert Dataset(cfg.data, cfg.model).num_samples == 1


def test_the_coordinator_cli_refuses_a_missing_corpus_and_writes_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "run.toml").write_text(README_RUN)
    done = subprocess.run([sys.executable, "-m", "potluck", "coordinator", "--config", "run.toml", "--journal-dir", "j",
                           "--ready-file", "ready.json"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.rstrip().splitlines()[-1].endswith(
        f"data.path = 'corpus.txt': no such file (looked for {tmp_path}/corpus.txt); set data.path to the text file "
        "to train on (a relative path is read from the coordinator's working directory)")
    assert not (tmp_path / "j").exists() and not (tmp_path / "ready.json").exists()  # not even identity.key (issue 27)


def test_a_journal_that_never_committed_a_step_does_not_pin_its_config(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    corpus(tmp_path / "corpus.txt")
    journal = {"coordinator.journal_dir": str(tmp_path / "journal")}
    first = apply_overrides(RunConfig(), {**journal, "model.d_model": 32})  # the run that failed at step 0
    _, state = bootstrap.open_journal(first)
    fixed = readme_config(**journal)
    _, again = bootstrap.open_journal(fixed)
    assert state.run_id != "my-run" and again.run_id == "my-run" and again.config == fixed.manifest_sections()
    assert Journal(tmp_path / "journal").load().config["model"]["d_model"] == 512  # type: ignore[union-attr]
    again.committed = 1
    Journal(tmp_path / "journal").save(again)
    with pytest.raises(JournalError, match="sections differ: data, model"):
        bootstrap.open_journal(first)


# ---------------------------------------------------------------------- a peer's data


def test_a_peer_uses_its_corpus_only_if_it_is_the_runs(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    run_dir, peer_dir = tmp_path / "run", tmp_path / "peer"
    run_dir.mkdir(), peer_dir.mkdir()
    theirs = file_identity(corpus(run_dir / "corpus.txt"))
    monkeypatch.chdir(peer_dir)
    run = f"the run's corpus 'corpus.txt' (sha256 {theirs.sha256}, {theirs.size} bytes)"
    fix = f"get the run's corpus and pass --data-path FILE (without it, data.path is looked up in this peer's " \
          f"working directory {peer_dir})"
    with pytest.raises(DataError) as err:  # nothing at the relative path
        with_local_data(readme_config(), theirs, None)
    assert str(err.value) == f"no corpus at {peer_dir}/corpus.txt: this peer needs {run}; {fix}"
    mine = file_identity(corpus(peer_dir / "corpus.txt", seed=1))
    with pytest.raises(DataError) as err:  # another corpus there
        with_local_data(readme_config(), theirs, None)
    assert str(err.value) == (f"this peer's corpus {peer_dir}/corpus.txt (sha256 {mine.sha256}, {mine.size} bytes) "
                              f"is not {run}: {fix}")
    with pytest.raises(DataError) as err:  # another corpus named by --data-path: no word of the working directory
        with_local_data(readme_config(), theirs, "corpus.txt")
    assert str(err.value).endswith(f"is not {run}: get the run's corpus and pass --data-path FILE")
    assert with_local_data(readme_config(), theirs, str(run_dir / "corpus.txt")).data.path == str(run_dir / "corpus.txt")
    monkeypatch.chdir(run_dir)  # the run's corpus at the relative path: used, at its absolute path
    assert with_local_data(readme_config(), theirs, None).data.path == str(run_dir / "corpus.txt")


def test_a_peer_checks_the_synthetic_source_too(caplog) -> None:  # type: ignore[no-untyped-def]
    cfg = RunConfig()
    run = check_run(cfg).data
    assert with_local_data(cfg, run, None) is cfg
    assert with_local_data(cfg, DataIdentity(), "x.txt") is cfg  # an older coordinator: nothing to compare
    assert "--data-path x.txt is not used" in caplog.text
    with pytest.raises(DataError, match="run the coordinator's potluck version"):
        with_local_data(cfg, run.model_copy(update={"sha256": "0" * 64}), None)


# ---------------------------------------------------------------------- addresses


def test_addresses_other_networks_cannot_reach() -> None:
    assert CoordinatorConfig().host == "127.0.0.1"
    kinds = {"127.0.0.1": "loopback", "10.1.2.3": "private", "192.168.0.7": "private", "172.20.0.1": "private",
             "169.254.3.4": "link-local", "192.0.2.2": "documentation", "203.0.113.7": "documentation",
             "100.64.0.1": "non-public", "fe80::1": "link-local", "8.8.4.4": "", "2a00:1450::1": "",
             "example.org": ""}
    assert {h: non_public(h) for h in kinds} == kinds


def test_the_coordinator_says_when_peers_elsewhere_cannot_reach_it(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="potluck")
    guessed = ["192.0.2.2"]
    monkeypatch.setattr(bootstrap, "guess_reachable_host", lambda: guessed[0])
    assert bootstrap.public_host(CoordinatorConfig(host="0.0.0.0")) == "192.0.2.2"
    assert ("announcing 192.0.2.2 (a documentation address, guessed from this box's route to the internet): peers "
            "on other networks will not reach it; pass --announce-host PUBLIC_IP") in caplog.text
    caplog.clear()
    guessed[0] = "8.8.4.4"
    assert bootstrap.public_host(CoordinatorConfig(host="0.0.0.0")) == "8.8.4.4"
    assert bootstrap.public_host(CoordinatorConfig(host="0.0.0.0", announce_host="10.0.0.1")) == "10.0.0.1"
    assert "announcing" not in caplog.text
    assert bootstrap.public_host(CoordinatorConfig()) == "127.0.0.1"
    assert "peers on this machine only (for volunteers elsewhere pass --host 0.0.0.0)" in caplog.text


def test_a_peer_says_when_peers_elsewhere_cannot_reach_it(caplog) -> None:  # type: ignore[no-untyped-def]
    warn_unreachable("127.0.0.1", "127.0.0.1")  # a local swarm
    warn_unreachable("192.168.1.5", "192.168.1.2")  # a LAN
    warn_unreachable("8.8.4.4", "example.org")
    assert "announcing" not in caplog.text
    warn_unreachable("192.168.1.5", "example.org")
    assert "announcing 192.168.1.5 (a private address) to a run on the internet" in caplog.text


# ---------------------------------------------------------------------- a real swarm


@pytest.mark.slow
def test_the_readme_run_trains_and_a_peer_needs_the_runs_corpus(swarm, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run_dir.mkdir(), elsewhere.mkdir()
    theirs = file_identity(corpus(run_dir / "corpus.txt"))
    mine = file_identity(corpus(elsewhere / "corpus.txt", seed=1))
    monkeypatch.chdir(run_dir)  # the coordinator reads data.path = "corpus.txt" here
    swarm.start_coordinator({**flat(tomllib.loads(README_RUN)), **SMALL})
    assert "volunteers need this run's corpus" in swarm.tail("coordinator")

    monkeypatch.chdir(elsewhere)  # a volunteer with another corpus.txt
    wrong = swarm.start_peer()
    assert wrong.wait(timeout=120) == 2
    log = swarm.tail("peer-0")
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert "Traceback" not in log and len(errors) == 1
    assert errors[0].endswith(
        f"this peer's corpus {elsewhere}/corpus.txt (sha256 {mine.sha256}, {mine.size} bytes) is not the run's corpus "
        f"'corpus.txt' (sha256 {theirs.sha256}, {theirs.size} bytes): get the run's corpus and pass --data-path FILE "
        f"(without it, data.path is looked up in this peer's working directory {elsewhere})")

    right = swarm.start_peer("--data-path", str(run_dir / "corpus.txt"))
    state = swarm.wait_state(lambda s: s["run"]["finished"], 180, "one outer step of the README's run")
    assert state["run"]["outer_step"] == 1 and len(state["history"]) == 1
    assert right.wait(timeout=60) == 0


@pytest.mark.slow
def test_a_run_too_big_for_this_peer_is_warned_and_the_peer_refuses_it_in_one_line(swarm) -> None:  # type: ignore[no-untyped-def]
    """Issue 27: a run bigger than a peer's memory used to crash the peer with the allocator's 50-line
    traceback. The coordinator warns (naming the field); the peer refuses before it builds anything."""
    import torch
    from swarm import run_config

    from potluck.models.sizecheck import estimate
    from potluck.peer.swarm.joining import device_memory

    big = {"model.seq_len": 2_000_000}
    need = estimate(run_config(big)).bytes
    if device_memory(torch.device("cpu")) >= need:
        pytest.skip(f"this machine holds the {need / 1e9:.0f} GB the run needs")
    swarm.start_coordinator(big)
    warned = [line for line in swarm.tail("coordinator").splitlines() if " WARN " in line]
    assert len(warned) == 1 and "model.seq_len = 2000000: this run needs about" in warned[0], warned
    peer = swarm.start_peer()
    assert peer.wait(timeout=120) == 2
    log = swarm.tail("peer-0")
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert "Traceback" not in log and len(errors) == 1, log
    assert "this run needs about" in errors[0] and "and this peer's cpu holds" in errors[0], errors
    # issue 45: it was admitted, so the run's page lists it, refused, with why, and `potluck status` says it too
    state = swarm.wait_state(lambda s: any(p["state"] == "refused" for p in s["peers"]), 60, "the refused peer listed")
    row = next(p for p in state["peers"] if p["state"] == "refused")
    assert "this run needs about" in row["error"] and row["device"] == "cpu" and row["memory_gb"] > 1, row
    assert any(e["kind"] == "refused" and e["peer"] == row["id"] for e in state["events"]), state["events"]
    assert state["peers_summary"]["live"] == 0, state["peers_summary"]
    from potluck.coordinator.status.status_cli import summary

    assert f"{row['short_id']} refused: this run needs about" in summary(state), summary(state)
