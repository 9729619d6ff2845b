"""What a new user gets wrong, answered in one line: ports in use, an export over an existing file,
mistakes answered before anything heavy loads, and what ``potluck demo`` leaves behind and what its
numbers mean."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from potluck.procs import ProcessGroup
from potluck.protos import potluck_pb2 as pb
from potluck.protos.net.errors import CannotBind, PortInUse, check_port_free
from potluck.protos.net.identity import Identity

# ---------------------------------------------------------------------- ports in use

COORD = Identity.generate().peer_id  # the run a test DHT node belongs to


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port on 127.0.0.1 that another program (this test) listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_port_in_use_message_names_the_port_and_the_flag() -> None:
    err = PortInUse("status port", "127.0.0.1", 8080, "--status-port", "coordinator.status_port")
    assert issubclass(PortInUse, CannotBind) and issubclass(CannotBind, ValueError)
    assert (err.port, err.what, err.flag) == (8080, "status port", "--status-port")
    assert str(err) == ("status port 8080 on 127.0.0.1 is in use by another program; choose another with "
                        "--status-port (or coordinator.status_port), or 0 for any free port")


def test_check_port_free(held_port: int) -> None:
    check_port_free("DHT port", "127.0.0.1", 0, "--dht-port")  # 0: any free port, never checked
    with pytest.raises(PortInUse, match=f"DHT port {held_port} on 127.0.0.1 is in use"):
        check_port_free("DHT port", "127.0.0.1", held_port, "--dht-port")
    with pytest.raises(PortInUse):  # the wildcard overlaps 127.0.0.1
        check_port_free("DHT port", "0.0.0.0", held_port, "--dht-port")
    with pytest.raises(CannotBind, match="not an address of this machine"):
        check_port_free("DHT port", "192.0.2.1", held_port, "--dht-port")  # TEST-NET-1, never local


def test_status_server_refuses_a_port_in_use(held_port: int) -> None:
    from potluck.coordinator.status.status import StatusServer

    with pytest.raises(PortInUse) as info:
        StatusServer("127.0.0.1", held_port, dict)
    assert str(info.value) == (f"status port {held_port} on 127.0.0.1 is in use by another program; choose another "
                               "with --status-port (or coordinator.status_port), or 0 for any free port")


class Pong:
    def ping(self, request: pb.PingRequest) -> pb.PingReply:
        return pb.PingReply(peer_id="first")


def test_grpc_server_refuses_a_port_in_use_even_by_another_grpc_server(held_port: int) -> None:
    from potluck.protos.net.transport import PeerClient, PeerServer, Traffic

    with pytest.raises(PortInUse, match=f"gRPC port {held_port} on 127.0.0.1 is in use.*--grpc-port"):
        PeerServer(Pong(), Traffic(), "127.0.0.1", held_port)  # type: ignore[arg-type]
    # gRPC sets SO_REUSEPORT by default: a second server used to share the first one's port silently
    first = PeerServer(Pong(), Traffic(), "127.0.0.1", 0)  # type: ignore[arg-type]
    try:
        client = PeerClient(Traffic())
        assert client.ping(f"127.0.0.1:{first.port}", pb.PingRequest(), timeout=10).peer_id == "first"
        client.close()
        with pytest.raises(PortInUse, match=f"gRPC port {first.port} "):
            PeerServer(object(), Traffic(), "127.0.0.1", first.port)  # type: ignore[arg-type]
        with pytest.raises(PortInUse):
            PeerServer(object(), Traffic(), "0.0.0.0", first.port)  # type: ignore[arg-type]
    finally:
        first.stop(0)


def test_dht_node_refuses_a_port_in_use_before_starting_hivemind(held_port: int) -> None:
    from potluck.protos.net.swarm import SwarmNode

    with pytest.raises(PortInUse, match=f"DHT port {held_port} on 127.0.0.1 is in use.*--dht-port"):
        SwarmNode(Identity.generate(), coordinator=COORD, host="127.0.0.1", port=held_port)


@pytest.mark.slow
def test_dht_node_refuses_the_port_of_another_dht_node() -> None:
    """p2pd binds with SO_REUSEPORT: without the check a second node listened on the same port."""
    from potluck.protos.net.swarm import SwarmNode

    first = SwarmNode(Identity.generate(), coordinator=COORD, host="127.0.0.1")
    try:
        port = int(first.maddrs[0].split("/tcp/")[1].split("/")[0])
        with pytest.raises(PortInUse, match=f"DHT port {port} "):
            SwarmNode(Identity.generate(), coordinator=COORD, host="127.0.0.1", port=port)
    finally:
        first.shutdown()


# The processes: one line naming the port and the flag, exit code 2, no traceback. These need
# Coordinator.run and Peer.run to catch CannotBind.


def run_file(tmp_path: Path) -> Path:
    from swarm import run_config

    from potluck.protos.config.files import dump_toml

    path = tmp_path / "run.toml"
    path.write_text(dump_toml(run_config(journal=tmp_path / "journal")))
    return path


def refused(procs: ProcessGroup, tmp_path: Path, args: list[str], timeout: float = 120) -> str:
    log = tmp_path / f"{args[0]}.log"
    proc = procs.spawn_potluck(args, log)
    rc = proc.wait(timeout=timeout)
    out = log.read_text()
    assert rc == 2, f"exit code {rc}:\n{out}"
    assert "Traceback" not in out, out
    return out


@pytest.mark.slow
@pytest.mark.parametrize("flag, what", [("--status-port", "status port"), ("--grpc-port", "gRPC port"),
                                        ("--dht-port", "DHT port")])
def test_coordinator_refuses_a_port_in_use(procs: ProcessGroup, tmp_path: Path, held_port: int,
                                           flag: str, what: str) -> None:
    out = refused(procs, tmp_path, ["coordinator", "--config", str(run_file(tmp_path)), flag, str(held_port)])
    assert f"{what} {held_port} on 127.0.0.1 is in use by another program; choose another with {flag}" in out
    assert not (tmp_path / "journal").exists()  # a start that fails leaves no run folder behind


@pytest.mark.slow
def test_a_restart_whose_kept_port_is_taken_says_so_and_how_to_move(procs: ProcessGroup, tmp_path: Path) -> None:
    """A coordinator listens where its run did before; when another program took that port meanwhile, it says so,
    with the flag that moves the run, and leaves the run's folder as it was."""
    import json
    import signal

    ready = tmp_path / "ready.json"
    first = procs.spawn_potluck(["coordinator", "--config", str(run_file(tmp_path)), "--ready-file", str(ready)],
                                tmp_path / "first.log")
    deadline = time.monotonic() + 120
    while not ready.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    port = int(json.loads(ready.read_text())["join"].split("/tcp/")[1].split("/")[0])
    os.killpg(first.pid, signal.SIGINT)
    assert first.wait(timeout=60) == 0
    kept = json.loads((tmp_path / "journal" / "journal.json").read_text())["ports"]
    assert kept["dht"] == port and kept["grpc"] and kept["status"]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        out = refused(procs, tmp_path, ["coordinator", "--config", str(run_file(tmp_path))])
    assert f"DHT port {port} on 127.0.0.1, where this run listened before" in out and "--dht-port PORT" in out, out
    assert (tmp_path / "journal" / "journal.json").exists()


@pytest.mark.slow
def test_peer_refuses_a_dht_port_in_use(procs: ProcessGroup, tmp_path: Path, held_port: int) -> None:
    join = f"/ip4/127.0.0.1/tcp/9/p2p/{Identity.generate().peer_id}"  # never reached: the port is checked first
    out = refused(procs, tmp_path, ["peer", "--join", join, "--host", "127.0.0.1", "--dht-port", str(held_port)])
    assert f"DHT port {held_port} on 127.0.0.1 is in use by another program; choose another with --dht-port" in out


@pytest.mark.slow
def test_peer_refuses_a_grpc_port_in_use(procs: ProcessGroup, tmp_path: Path, held_port: int) -> None:
    from swarm import LocalSwarm

    swarm = LocalSwarm(procs, tmp_path)
    swarm.start_coordinator()
    peer = swarm.start_peer("--grpc-port", str(held_port))
    rc = peer.wait(timeout=120)
    out = (swarm.logs / "peer-0.log").read_text()
    assert rc == 2 and "Traceback" not in out, f"exit code {rc}:\n{out}"
    assert f"gRPC port {held_port} on 127.0.0.1 is in use by another program; choose another with --grpc-port" in out


# ---------------------------------------------------------------------- answered at once

PROBE = """
import sys
import time
from potluck.cli import main
rc = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "hivemind", "grpc") if m in sys.modules)
print(rc, ",".join(heavy) or "-")
"""


def mistake(tmp_path: Path, name: str) -> list[str]:
    """One of issue 27's usage mistakes (8-9 s each, after torch, hivemind and a DHT node), set up in tmp_path."""
    from potluck.coordinator.store.journal import Journal, JournalState
    from potluck.protos.config.files import apply_overrides, dump_toml
    from potluck.protos.config.runconfig import RunConfig

    run = tmp_path / "run.toml"
    run.write_text(dump_toml(RunConfig(run_id="first-run")))
    other = apply_overrides(RunConfig(), {"run_id": "first-run", "model.d_model": 32})
    Journal(tmp_path / "potluck-run").save(JournalState(run_id="first-run", config=other.manifest_sections(),
                                                        created_at=1.0, committed=3))
    join = f"/ip4/127.0.0.1/tcp/9/p2p/{Identity.generate().peer_id}"
    return {"join": ["peer", "--join", "127.0.0.1:44497"],
            "journal": ["coordinator", "--config", str(run)],
            "identity": ["peer", "--join", join, "--identity", str(tmp_path / "held.key")],
            "size": ["coordinator", "--config", str(run), "--set", "model.d_model=1000000", "--journal-dir", "new"],
            "seq": ["coordinator", "--config", str(run), "--set", "model.seq_len=10000000", "--journal-dir", "new"],
            "url": ["coordinator", "--config", str(run), "--set", 'coordinator.checkpoint_url="bogus://x/y"',
                    "--journal-dir", "new"],
            "bucket": ["coordinator", "--config", str(run), "--set", 'coordinator.checkpoint_url="s3:///runs/a"',
                       "--journal-dir", "new"],
            "resume": ["coordinator", "--config", str(run), "--journal-dir", "new", "--resume-from", "bogus://x/y"],
            "backup": ["coordinator", "--config", str(run), "--journal-dir", "new", "--backup-identity", "keys"]}[name]


@pytest.mark.parametrize("name, says", [
    ("join", "join address '127.0.0.1:44497' has no /p2p/<coordinator id> part"),
    ("journal", "potluck-run holds run 'first-run' (at outer step 3), written with a different config (sections "
                "differ: model): resume it with the same values there (only diloco, links, membership, pipeline may "
                "change), start a new run with another --journal-dir, or remove potluck-run to start this one over"),
    ("identity", "held.key is in use by another peer on this machine; give this one its own with --identity FILE"),
    ("size", "model.d_model = 1000000: this run needs about 768.3 TB a peer: 24.0T parameters at 32 bytes each"),
    ("seq", "model.seq_len = 10000000: this run needs about"),
    ("url", "coordinator.checkpoint_url 'bogus://x/y': unknown scheme 'bogus' (s3, gs, file, ... : fsspec's)"),
    ("bucket", "coordinator.checkpoint_url 's3:///runs/a' names no bucket: s3://BUCKET/PREFIX"),
    ("resume", "coordinator.checkpoint_url 'bogus://x/y': unknown scheme 'bogus'"),
    ("backup", "new holds no run (no identity.key): give the run's --journal-dir"),
])
def test_usage_mistakes_are_answered_before_torch_hivemind_or_any_write(tmp_path: Path, name: str, says: str) -> None:
    """Checked before the heavy imports (what took 8-9 s), in one line, exit status 2; nothing written
    (``benchmarks/cli_help.py`` times them: < 1 s each)."""
    import fcntl

    argv = mistake(tmp_path, name)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with open(tmp_path / "held.key.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another peer on this machine holds held.key
        done = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
    assert done.stdout == "2 -\n", (done.stdout, done.stderr)  # status 2, and none of torch, hivemind, gRPC loaded
    assert len(done.stderr.splitlines()) == 1 and says in done.stderr, done.stderr
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.name != "held.key.lock")
    assert after == before, (before, after)


# ---------------------------------------------------------------------- export


def write_checkpoint(journal: Path, version: int = 5, family: str = "tiny", data: str = ""):  # type: ignore[no-untyped-def]
    """A checkpoint as the coordinator writes it, of a small model with its own init; returns the model.
    ``data``: the run's data source, in a journal beside it (what export reads to say how to feed it)."""
    import json

    import torch

    from potluck.compression.transfer import Snapshot
    from potluck.coordinator.store.checkpoint import CheckpointStore
    from potluck.peer.training.model import TinyGPT
    from potluck.protos.config.runconfig import ModelConfig

    cfg = ModelConfig(family=family, d_model=16, n_layers=2, n_heads=2, seq_len=8, vocab_size=256 if data == "bytes" else 32)
    model = TinyGPT(cfg, seed=7)
    params = list(model.named_parameters())
    theta = torch.cat([p.detach().reshape(-1) for _, p in params])
    layout = [[n, list(p.shape)] for n, p in params]
    snap = Snapshot.create({"theta": theta, "momentum": torch.zeros_like(theta)}, version, {"layout": layout})
    CheckpointStore(journal / "checkpoints").write(snap, {"run_id": "t", "model": cfg.model_dump(mode="json")})
    if data:
        (journal / "journal.json").write_text(json.dumps({"config": {"data": {"source": data}}}))
    return model


@pytest.mark.parametrize("name", ["model.pt", "model.safetensors"])
def test_export_then_load_model_gives_back_the_checkpointed_model(tmp_path: Path, name: str) -> None:
    import torch

    from potluck.export import export_checkpoint, load_model

    original = write_checkpoint(tmp_path / "journal")
    info = export_checkpoint(tmp_path / "journal", tmp_path / name)
    assert info["version"] == 5 and not list(tmp_path.glob(".*.tmp"))
    model = load_model(tmp_path / name)
    assert not model.training and model.cfg == original.cfg
    for (n, a), (m, b) in zip(original.state_dict().items(), model.state_dict().items(), strict=True):
        assert n == m and torch.equal(a, b), n
    tokens = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        assert torch.equal(original.eval()(tokens), model(tokens))


def test_export_never_overwrites_without_force(tmp_path: Path) -> None:
    from potluck.export import export_checkpoint

    write_checkpoint(tmp_path / "journal")
    out = tmp_path / "model.pt"
    out.write_text("the user's own file")
    with pytest.raises(ValueError, match="already exists; pass --force"):
        export_checkpoint(tmp_path / "journal", out)
    assert out.read_text() == "the user's own file"
    export_checkpoint(tmp_path / "journal", out, force=True)
    assert out.stat().st_size > 100


def test_export_cli_refuses_in_one_line(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "journal")
    (tmp_path / "model.pt").write_text("keep me")
    export = [sys.executable, "-m", "potluck", "export", "--journal-dir", "journal", "--out", "model.pt"]
    proc = subprocess.run(export, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("potluck export: model.pt already exists; pass --force to replace it, "
                           "or choose another --out\n")
    assert (tmp_path / "model.pt").read_text() == "keep me"


@pytest.mark.slow
@pytest.mark.parametrize("out, family, data", [("model.pt", "tiny", ""), ("model.safetensors", "tiny", "markov"),
                                               ("model-hf", "llama", "bytes"), ("hf-ids", "llama", "markov")])
def test_export_prints_lines_that_load_what_it_wrote(tmp_path: Path, out: str, family: str, data: str) -> None:
    """For every form --out picks (issue 27: a folder's lines were load_model("model-hf") and torch.load,
    both IsADirectoryError), the printed lines run as they are, from where the user ran the export, and
    feed the model tokens the way the run's data makes them (bytes of text for a byte-level run)."""
    write_checkpoint(tmp_path / "journal", family=family, data=data)
    export = [sys.executable, "-m", "potluck", "export", "--journal-dir", "journal", "--out", out]
    proc = subprocess.run(export, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first, *code = proc.stdout.splitlines()
    assert first.startswith("wrote v5 (0.0") and f"M parameters) to {out}" in first, first
    assert first.endswith("load it in Python with:"), first
    if out.endswith(".pt"):
        assert code[:2] == ["  from potluck.export import load_model", '  model = load_model("model.pt")']
    elif out.endswith(".safetensors"):
        assert "  from safetensors.torch import load_file" in code
    else:
        assert f'  model = AutoModelForCausalLM.from_pretrained("{out}")' in code
        assert any('pip install -e ".[hf]"' in line for line in code)
    if data == "bytes":
        assert any("byte-level: no tokenizer" in line for line in code)
    script = "\n".join(line[2:] for line in code) + "\nprint(tuple(logits.shape))"
    ran = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    vocab = 256 if data == "bytes" else 32
    assert ran.stdout.startswith("(1, ") and ran.stdout.endswith(f", {vocab})\n"), ran.stdout


def test_load_model_says_when_a_file_is_not_an_export(tmp_path: Path) -> None:
    import torch

    from potluck.export import load_model

    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not written by potluck export"):
        load_model(tmp_path / "other.pt")


# ---------------------------------------------------------------------- demo


def test_demo_says_what_it_leaves_behind(tmp_path: Path) -> None:
    from potluck.demo import leftover_lines

    (tmp_path / "journal" / "checkpoints").mkdir(parents=True)
    assert leftover_lines(tmp_path, made=False) == [
        f"kept the work folder {tmp_path} (run file, journal, checkpoints, logs)"]  # never 'rm -r' the user's own
    (tmp_path / "journal" / "checkpoints" / "ckpt-000003.json").write_text("{}")
    lines = leftover_lines(tmp_path, made=True)
    assert lines == [f"kept the temporary work folder {tmp_path} (run file, journal, checkpoints, logs)",
                     f"  export the model: potluck export --journal-dir {tmp_path / 'journal'} --out model.pt",
                     f"  remove it: rm -r {tmp_path}"]


def test_pipelined_demo_revisits_its_samples() -> None:
    from potluck.demo import demo_config, revisits_per_sample

    args = argparse.Namespace(config=None, stages=2, peers=4, replicas=2, outer_steps=None, inner_steps=None, set=[])
    cfg = demo_config(args, Path("/nonexistent"))
    # 2 replicas x 12 outer x 30 inner x 16 samples over 1024 samples
    assert revisits_per_sample(cfg, 4) == pytest.approx(2 * 12 * 30 * 16 / 1024)
