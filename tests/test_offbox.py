"""Off-box checkpoints (coordinator.checkpoint_url): checkpoints the coordinator's own code writes, uploaded to a real
S3-compatible server (moto's, in a process of its own: ``tests/s3server.py``), each file verified and the manifest
last, pruned as the local ones, read back byte for byte; an upload the server's death cuts short leaves no manifest
and goes out whole once the server is back; files already there are not sent again; bad URLs are refused at once;
and a real run's kept checkpoints land in the store with the state hashes its peers reported."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from s3server import S3Server
from test_checkpoint_stream import cfg_for, stage_snapshots

from potluck.compression.transfer import Snapshot, tensors_hash
from potluck.coordinator.store.checkpoint import CheckpointStore
from potluck.coordinator.store.offbox import Uploader, complete, download, open_store, probe
from potluck.local import wait_for
from potluck.procs import ProcessGroup, group_alive
from potluck.protos.config.section import ConfigError

BUCKET = "potluck-ckpts"


@pytest.fixture
def s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """moto's S3 server, its bucket made, and this process's environment pointing at it (as an operator's would)."""
    group = ProcessGroup()
    try:
        server = S3Server(group, tmp_path / "moto.log")
        server.start()
        server.bucket(BUCKET)
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        yield server
    finally:
        group.stop(timeout=10)
        assert not [p.pid for p in group.procs if group_alive(p.pid)]


def started(uploader: Uploader) -> Uploader:
    uploader.start()
    return uploader


def big_stages(version: int, floats: int) -> Iterator[Snapshot]:
    """Two stages of ``floats`` float32 parameters each (theta and momentum: 8 bytes a parameter on disk)."""
    g = torch.Generator().manual_seed(version)
    for s in range(2):
        theta = torch.randn(floats, generator=g)
        tensors = {"theta": theta, "momentum": theta * 0.5}
        yield Snapshot(tensors, version, tensors_hash(tensors), {"layout": [[f"layers.{s}.w", [floats]]], "stage": s})


def files_of(manifest: Path) -> list[str]:
    return [e["file"] for e in json.loads(manifest.read_text())["stages"]]


def test_bad_urls_are_refused_with_what_to_write() -> None:
    for url, says in [("backups", "is not a URL"), ("bogus://x/y", "unknown scheme 'bogus'"),
                      ("s3://", "names no bucket"), ("s3:///a/b", "names no bucket"), ("file://", "names no folder")]:
        with pytest.raises(ConfigError, match=says):
            open_store(url)


def test_resuming_refuses_a_journal_that_holds_a_run_an_empty_store_and_another_model(tmp_path: Path) -> None:
    from swarm import run_config

    from potluck.coordinator.store.journal import Journal, JournalState
    from potluck.coordinator.store.offbox import backup_identity, resume_journal

    cfg = run_config({}, tmp_path / "journal")
    Journal(tmp_path / "journal").save(JournalState(run_id="r", config=cfg.manifest_sections(), created_at=1.0,
                                                    committed=3))
    with pytest.raises(ConfigError, match="holds run 'r' at outer step 3: give another --journal-dir"):
        resume_journal(cfg, f"file://{tmp_path}/store")
    fresh = run_config({}, tmp_path / "fresh")
    with pytest.raises(ConfigError, match="no complete checkpoint there"):
        resume_journal(fresh, f"file://{tmp_path}/store")
    store = CheckpointStore(tmp_path / "store")
    store.write_stages(2, stage_snapshots(cfg_for("tiny", 1), 2), {"run_id": "r", "model": {"d_model": 7}})
    with pytest.raises(ConfigError, match="its checkpoint v2 is of another model"):
        resume_journal(fresh, f"file://{tmp_path}/store")
    assert not (tmp_path / "fresh" / "journal.json").exists()
    with pytest.raises(ConfigError, match="holds no run"):
        backup_identity(tmp_path / "fresh", tmp_path / "keys")
    (tmp_path / "journal" / "identity.key").write_bytes(b"k")
    assert backup_identity(tmp_path / "journal", tmp_path / "keys") == ["identity.key"]
    with pytest.raises(ConfigError, match="exists"):
        backup_identity(tmp_path / "journal", tmp_path / "keys")


def test_the_roster_goes_out_after_each_pass_and_a_resumed_journal_holds_it(tmp_path: Path) -> None:
    """The roster (peers' addresses, admissions, trust, the evicted) is written beside the checkpoints after a pass,
    again only when it changed, and a journal resumed from the store holds it: the new box rejoins those peers and
    keeps the evicted out. Another run's roster, or an unreadable one, is left aside with a warning."""
    from functools import partial

    from swarm import run_config

    from potluck.coordinator.store.journal import Journal, JournalState, read_journal
    from potluck.coordinator.store.offbox import ROSTER, resume_journal, roster_of

    cfg = run_config({}, tmp_path / "journal")
    roster = {"known_peers": ["/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWA"], "admitted": {"12D3KooWA": {"fp": "ab"}},
              "trust": {"verified": {"12D3KooWA": 4}}, "revoked": ["12D3KooWE"]}
    Journal(tmp_path / "journal").save(JournalState(run_id=cfg.run_id, config=cfg.manifest_sections(), created_at=1.0,
                                                    committed=2, **roster))
    local = CheckpointStore(tmp_path / "journal" / "checkpoints", keep=2)
    local.write_stages(2, stage_snapshots(cfg_for("tiny", 1), 2), {"run_id": cfg.run_id,
                                                                     "model": cfg.model.model_dump(mode="json")})
    url = f"file://{tmp_path}/store"
    remote = open_store(url)
    up = Uploader(remote, local, keep=2, roster=partial(roster_of, tmp_path / "journal"))
    up.sync()
    assert json.loads(remote.read(ROSTER)) == {"run_id": cfg.run_id, **roster}
    written = (tmp_path / "store" / ROSTER).stat().st_mtime_ns
    up.sync()
    assert (tmp_path / "store" / ROSTER).stat().st_mtime_ns == written, "unchanged: not written again"
    fresh = run_config({}, tmp_path / "new")
    said = resume_journal(fresh, url)
    assert "rejoining the swarm through the 1 peers its roster names" in said, said
    held = read_journal(tmp_path / "new")
    assert held is not None and held.committed == 2
    assert {f: getattr(held, f) for f in roster} == roster
    (tmp_path / "store" / ROSTER).write_text(json.dumps({"run_id": "another", **roster}))
    said = resume_journal(run_config({}, tmp_path / "other"), url)
    assert "no roster of its peers there" in said, said
    held = read_journal(tmp_path / "other")
    assert held is not None and held.known_peers == [] and held.revoked == []
    (tmp_path / "store" / ROSTER).write_text("{not json")
    assert "no roster" in resume_journal(run_config({}, tmp_path / "third"), url)


def test_the_uploader_in_a_process_of_its_own_sends_what_is_offered_and_is_reaped(tmp_path: Path) -> None:
    """The coordinator's uploader runs in a spawned child (off the coordinator's interpreter lock): a checkpoint
    offered is owed until it is complete in the store, with the roster beside it; stopping reaps the child."""
    from potluck.coordinator.store.journal import Journal, JournalState
    from potluck.coordinator.store.offbox import ROSTER
    from potluck.coordinator.store.uploadproc import UploadProcess

    Journal(tmp_path / "journal").save(JournalState(run_id="r", config={}, created_at=1.0, known_peers=["/ip4/x"]))
    local = CheckpointStore(tmp_path / "journal" / "checkpoints", keep=2)
    url = f"file://{tmp_path}/store"
    up = UploadProcess(url, local.dir, 2, tmp_path / "journal")
    up.start()
    try:
        wait_for(lambda: not up.pending(), 60, "the first (empty) pass")
        local.write_stages(1, big_stages(1, 50_000), {"run_id": "r"})
        up.offer()
        assert up.pending(), "owed from the offer on"
        wait_for(lambda: not up.pending(), 60, "v1 sent")
        remote = open_store(url)
        assert [c.version for c in complete(remote)] == [1]
        assert json.loads(remote.read(ROSTER))["known_peers"] == ["/ip4/x"]
        assert up.failing is None and up.news() == []
        child = up._proc
    finally:
        up.stop()
    assert child is not None and not child.is_alive() and child.exitcode == 0


def test_a_missing_bucket_is_refused_at_the_start(s3: S3Server) -> None:
    with pytest.raises(ConfigError, match="bucket 'no-such-bucket' does not exist"):
        probe(open_store("s3://no-such-bucket/run"))
    probe(open_store(f"s3://{BUCKET}/run"))  # (there: no error)


def test_checkpoints_go_out_verified_manifest_last_pruned_and_read_back_byte_identical(s3: S3Server,
                                                                                       tmp_path: Path) -> None:
    cfg = cfg_for("tiny", 2)
    local = CheckpointStore(tmp_path / "checkpoints", keep=2)
    remote = open_store(f"s3://{BUCKET}/run-1")
    sent: list[tuple[str, bool]] = []  # (file, whether its version's manifest was in the store while it went out)

    def progress(file: str, n: int) -> None:
        sent.append((file, f"{file.split('.')[0]}.json" in s3.names(BUCKET, "run-1")))

    up = started(Uploader(remote, local, keep=2, progress=progress))
    try:
        for v in (1, 2, 3):
            local.write_stages(v, stage_snapshots(cfg, v), {"run_id": "r"})
            up.offer()
            wait_for(lambda v=v: [c.version for c in complete(remote)][:1] == [v], 60, f"v{v} in the store")
        wait_for(lambda: not up.pending(), 30, "the uploader idle")
        assert up.failing is None and up.news() == []
        assert sent and not any(there for _, there in sent), sent  # every file went before its manifest
        assert [c.version for c in complete(remote)] == [3, 2]  # pruned as the local ones: keep 2
        stored = s3.objects(BUCKET, "run-1")
        kept = [p for p in local.manifests()]
        assert sorted(stored) == sorted([p.name for p in kept] + [f for p in kept for f in files_of(p)])
        for name, data in stored.items():
            assert data == (local.dir / name).read_bytes(), name
        # read back: the newest, into a folder laid out as the coordinator's, loads with its state hash
        newest = complete(remote)[0]
        path = download(remote, newest, tmp_path / "back")
        assert path.name == "ckpt-000003.json" and path.read_bytes() == (local.dir / path.name).read_bytes()
        for f in files_of(path):
            assert (tmp_path / "back" / f).read_bytes() == (local.dir / f).read_bytes()
        assert CheckpointStore(tmp_path / "back").load(path).hash == json.loads(path.read_text())["state_hash"]
        # a version written again (after a rollback) replaces the store's: never the old manifest over new files
        local.write_stages(3, big_stages(3, 1000), {"run_id": "r"})
        up.offer()
        wait_for(lambda: s3.objects(BUCKET, "run-1").get("ckpt-000003.json") == (local.dir / "ckpt-000003.json")
                 .read_bytes(), 60, "v3 rewritten in the store")
        assert [c.version for c in complete(remote)] == [3, 2]
    finally:
        up.stop()


def test_files_already_there_and_verified_are_not_sent_again(s3: S3Server, tmp_path: Path) -> None:
    local = CheckpointStore(tmp_path / "checkpoints", keep=3)
    remote = open_store(f"s3://{BUCKET}/run-2")
    manifest = local.write_stages(1, big_stages(1, 50_000), {"run_id": "r"})
    first, second = files_of(manifest)
    Uploader(remote, local, keep=3).sync()
    assert [c.version for c in complete(remote)] == [1]
    # as an upload cut short after the first file: the second file and the manifest are not there
    s3.client().delete_object(Bucket=BUCKET, Key=f"run-2/{manifest.name}")
    s3.client().delete_object(Bucket=BUCKET, Key=f"run-2/{second}")
    assert complete(remote) == []
    sent: list[str] = []
    again = Uploader(remote, local, keep=3, progress=lambda f, n: sent.append(f))  # (a restarted coordinator's)
    again.sync()
    assert set(sent) == {second} and again.sent_bytes == (local.dir / second).stat().st_size
    assert [c.version for c in complete(remote)] == [1]
    again.sync()  # nothing new: nothing sent
    assert set(sent) == {second} and again.sent_bytes == (local.dir / second).stat().st_size


@pytest.mark.slow  # (the server killed and started again: 16-20 s of the clients' retries)
def test_an_upload_the_server_dies_in_leaves_no_manifest_and_goes_out_whole_later(s3: S3Server, tmp_path: Path) -> None:
    local = CheckpointStore(tmp_path / "checkpoints", keep=2)
    remote = open_store(f"s3://{BUCKET}/run-3", part_bytes=5 << 20)  # (S3's smallest part: a 12 MB file is 3 parts)
    sending, killed = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def progress(file: str, n: int) -> None:
        if not sending.is_set() and n > 0:
            seen["names"] = s3.names(BUCKET, "run-3")  # the store while the first part of the first file is in
            sending.set()
            killed.wait(30)  # the server dies between two parts of this file

    up = started(Uploader(remote, local, keep=2, progress=progress, backoff_s=(0.2, 1.0)))
    try:
        local.write_stages(1, big_stages(1, 1_500_000), {"run_id": "r"})
        up.offer()
        wait_for(sending.is_set, 60, "the first file going out")
        s3.kill()
        killed.set()
        assert "ckpt-000001.json" not in seen["names"]
        wait_for(lambda: up.failing is not None, 120, "the uploader to see the store failing")
        assert up.failing.startswith("checkpoint upload failing: ")
        assert any(warn and m.startswith("checkpoint upload failing: ") for m, warn in up.news())
        assert not up.pending()  # (a failing store never holds the run's end)
        s3.start()  # (the same port, an empty store: its bucket made again)
        s3.bucket(BUCKET)
        local.write_stages(2, big_stages(2, 1000), {"run_id": "r"})
        up.offer()
        wait_for(lambda: [c.version for c in complete(remote)] == [2, 1], 120, "both checkpoints in the store")
        wait_for(lambda: up.failing is None, 30, "the uploader working again")
        assert any(not warn and "work again" in m for m, warn in up.news())
        stored = s3.objects(BUCKET, "run-3")
        for name, data in stored.items():
            assert data == (local.dir / name).read_bytes(), name
        assert len(stored) == 6  # two manifests, four stage files
    finally:
        killed.set()
        up.stop()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_runs_kept_checkpoints_land_in_the_store_with_its_state_hashes(swarm, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server = S3Server(swarm.procs, tmp_path / "moto.log")
    server.start()
    server.bucket(BUCKET)
    url = f"s3://{BUCKET}/swarm"
    swarm.start_coordinator({"coordinator.checkpoint_every": 1, "coordinator.keep_checkpoints": 2,
                             "coordinator.checkpoint_url": url, "diloco.outer_steps": 3, "membership.min_peers": 2},
                            env=server.env())
    for _ in range(2):
        swarm.start_peer()
    state = swarm.wait_state(
        lambda s: s["run"]["finished"] and any(e["kind"] == "checkpoint" and "v3 " in e["message"] for e in s["events"]),
        300, "3 outer steps and their checkpoint")
    env = server.env()
    import os

    os.environ.update(env)  # (this process reads the store as the coordinator did)
    try:
        remote = open_store(url)
        wait_for(lambda: [c.version for c in complete(remote)] == [3, 2], 60, "the kept checkpoints in the store")
        hashes = {h["step"]: set(h["state_hashes"].values()) for h in state["history"]}
        local = CheckpointStore(swarm.workdir / "journal" / "checkpoints")
        for c in complete(remote):
            assert {e["hash"] for e in c.manifest["stages"]} == hashes[c.version], (c.version, hashes)
            path = download(remote, c, tmp_path / f"back-{c.version}")
            assert CheckpointStore(path.parent).load(path).hash == c.manifest["state_hash"]
            for f in files_of(path):
                assert (path.parent / f).read_bytes() == (local.dir / f).read_bytes()
        assert not any(e["message"].startswith("checkpoint upload failing") for e in state["events"])
    finally:
        for k in env:
            os.environ.pop(k, None)


@pytest.mark.slow
def test_a_coordinator_whose_bucket_is_missing_exits_2_saying_so(procs: ProcessGroup, tmp_path: Path) -> None:
    from swarm import run_config

    from potluck.protos.config.files import dump_toml

    server = S3Server(procs, tmp_path / "moto.log")
    server.start()
    run = tmp_path / "run.toml"
    run.write_text(dump_toml(run_config({"coordinator.checkpoint_url": "s3://no-such-bucket/run"}, tmp_path / "j")))
    log = tmp_path / "coordinator.log"
    coord = procs.spawn_potluck(["coordinator", "--config", str(run)], log, env=server.env())
    assert coord.wait(timeout=120) == 2
    errors = [line for line in log.read_text().splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "bucket 'no-such-bucket' does not exist" in errors[0], log.read_text()[-2000:]
    assert not (tmp_path / "j").exists()  # (it never served: the folder it made is gone)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_store_that_dies_is_on_the_page_and_the_run_goes_on(swarm, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server = S3Server(swarm.procs, tmp_path / "moto.log")
    server.start()
    server.bucket(BUCKET)
    swarm.start_coordinator({"coordinator.checkpoint_every": 1, "coordinator.checkpoint_url": f"s3://{BUCKET}/dies",
                             "diloco.outer_steps": 2, "membership.min_peers": 2}, env=server.env())
    server.kill()  # (after the start's look at the bucket: the store is gone for the whole run)
    for _ in range(2):
        swarm.start_peer()
    state = swarm.wait_state(
        lambda s: s["run"]["finished"] and any(e["kind"] == "checkpoint" and "v2 " in e["message"] for e in s["events"])
        and any(e["message"].startswith("checkpoint upload failing: ") for e in s["events"]),
        300, "the run's end, its checkpoints written, and the store failing on the page")
    assert [h["step"] for h in state["history"]] == [1, 2]
    assert "checkpoint upload failing: " in (swarm.workdir / "logs" / "coordinator.log").read_text()


STEPS = 8
SLOW_PEER = {"POTLUCK_FAULTS": "inner.step@*:slow=2"}  # (one volunteer at half speed: the normal case)


def three_peers(swarm, overrides: dict[str, Any], env: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    import os

    swarm.start_coordinator(overrides, env=env)
    for k in range(3):
        swarm.start_peer(env={**os.environ, **SLOW_PEER} if k == 2 else None)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_goes_on_on_a_new_box_from_its_store_and_its_backed_up_identity(swarm, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 49's box lost: three peers (one at half speed) train with checkpoints going to a real S3 server; the
    coordinator is killed with SIGKILL and its whole journal folder deleted. On a "new box" (a fresh folder with the
    backed-up secrets, other ports) ``--resume-from`` starts it again from the store's newest checkpoint and roster;
    the peers, never restarted, find it through the roster and go on. The run finishes with every step in its
    history once and its replicas agreeing at each, its eval loss within 1 % of an uninterrupted run's."""
    import shutil
    import signal
    import subprocess
    import sys

    from swarm import run_config

    from potluck.coordinator.store.offbox import ROSTER, resume_journal

    group = ProcessGroup()  # (the store outlives the first box's processes)
    try:
        server = S3Server(group, tmp_path / "moto.log")
        server.start()
        server.bucket(BUCKET)
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        url = f"s3://{BUCKET}/moved"
        overrides = {"coordinator.checkpoint_every": 1, "coordinator.checkpoint_url": url, "membership.min_peers": 3,
                     "diloco.outer_steps": STEPS, "diloco.rounds": "fixed"}  # (fixed: the two runs comparable to 1 %)
        three_peers(swarm, overrides, server.env())
        first = swarm.ready
        remote = open_store(url)
        backup = subprocess.run([sys.executable, "-m", "potluck", "coordinator", "--config", str(swarm.workdir / "run.toml"),
                                 "--backup-identity", str(tmp_path / "secrets")], capture_output=True, text=True,
                                timeout=120)
        assert backup.returncode == 0, backup.stderr
        assert {"identity.key", "ca.key"} <= {p.name for p in (tmp_path / "secrets").iterdir()}
        wait_for(lambda: any(c.version >= 3 for c in complete(remote)) and ROSTER in remote.names(), 300,
                 "v3 and the roster in the store")
        before = swarm.state()
        swarm.coordinator.send_signal(signal.SIGKILL)  # the box is gone: its process, then its disk
        swarm.coordinator.wait(30)
        shutil.rmtree(swarm.workdir / "journal")
        # the new box: a fresh journal with the run's secrets, started from the store's newest checkpoint and roster
        new = swarm.workdir / "journal-new"
        shutil.copytree(tmp_path / "secrets", new)
        said = resume_journal(run_config(overrides, new), url)
        assert "downloaded" in said and "rejoining the swarm through the 3 peers" in said, said
        again = swarm.start_coordinator(overrides, journal="journal-new", env=server.env())
        assert again["join"].rsplit("/", 1)[-1] == first["join"].rsplit("/", 1)[-1]  # (the same id, other ports)
        assert again["join"] != first["join"]
        after = swarm.wait_state(lambda s: s["run"]["finished"] and s["history"][-1]["eval_loss"] is not None, 400,
                                 "the run to finish on the new box with the same peers")
        assert after["run"]["coordinator"] == before["run"]["coordinator"]
        assert after["run"]["run_id"] == before["run"]["run_id"]
        assert len(swarm.peers) == 3 and all(p.poll() in (None, 0) for p in swarm.peers), "the peers were never restarted"
        steps = [h["step"] for h in after["history"]]
        assert steps == list(range(1, STEPS + 1)), steps
        for h in after["history"]:
            if h["step"] > before["run"]["outer_step"]:  # (the steps the new box saw: its replicas agree)
                assert h["state_hashes"] and len(set(h["state_hashes"].values())) == 1, (h["step"], h["state_hashes"])
        wait_for(lambda: max(c.version for c in complete(remote)) == STEPS, 60, "the last version in the store")
        loss = after["history"][-1]["eval_loss"]
    finally:
        group.stop(timeout=10)
    swarm.procs.stop()
    swarm.peers.clear()
    ref = uninterrupted(tmp_path / "ref", {k: v for k, v in overrides.items() if "checkpoint" not in k})
    print(f"eval loss after losing the box: {loss:.4f}; uninterrupted: {ref:.4f}")
    assert abs(loss - ref) <= 0.01 * ref, (loss, ref)


def uninterrupted(workdir: Path, overrides: dict[str, Any]) -> float:
    from swarm import LocalSwarm

    ref = LocalSwarm(ProcessGroup(fork=True), workdir)
    try:
        three_peers(ref, overrides, {})
        state = ref.wait_state(lambda s: s["run"]["finished"] and s["history"][-1]["eval_loss"] is not None, 300,
                               "the uninterrupted run")
        return float(state["history"][-1]["eval_loss"])
    finally:
        ref.procs.stop()
