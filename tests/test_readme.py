"""The README, checked: every block and every command in it works as written (issue 11).

A new user follows the README verbatim, so each fenced block is checked according to its language,
and a block in a language this file does not know fails: a new kind of example cannot slip in
unchecked.

* ``bash``: each command (a line, or a part of one between ``&&``) must be one this file can check.
  ``pip install`` may name only this project, with extras it declares, and a pinned torch within the
  project's range; ``python -m pytest`` must be the command ``.ci/run`` runs; ``potluck ...`` goes
  through potluck's own parser and command, stopped where it would start a process (placeholders of
  a join address are filled in first); ``cat FILES > OUT`` is run in a sandbox, a folder that looks
  like a clone of this repository, for the commands and files that read OUT.
* ``toml``: a run file, loaded by :func:`load_config` and passed by :func:`check_run` as a coordinator
  started in the sandbox would; one whose first line names a file (``# examples/run.toml``) must be
  that file, byte for byte.
* ``python``: it compiles and its imports resolve; :mod:`test_readme_runs` runs it on a model it trained.

Inline code that reads as a command (``potluck ...``, ``python -m ...``), a flag (``--host ...``)
or a config field (``data.path``, ``admission.mode = "private"``) is checked the same way.

One slow test here runs "A real run" as a new user would, its sections in order in one folder, with real
coordinators and peers, and checks that each ends as the README says. The other slow tests, which train
single runs of the README and compare what they make, are in :mod:`test_readme_runs`; what both read of
the README, in :mod:`readme`.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import importlib.util
import json
import re
import shlex
import signal
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path
from typing import Annotated, Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from pydantic import BaseModel, TypeAdapter, ValidationError
from readme import (
    BASH,
    BLOCKS,
    REPO,
    TEXT,
    Block,
    Section,
    commands,
    inline_code,
    parse,
    potluck_exe,
    section,
    subparsers,
)

from potluck.cli import UsageError
from potluck.coordinator import bootstrap
from potluck.local import get_state, wait_for
from potluck.procs import ProcessGroup
from potluck.protos.config.files import apply_overrides, load_config
from potluck.protos.config.runcheck import check_run
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.identity import Identity
from potluck.protos.net.probe import Answer, Kind

CI = REPO / ".ci" / "run"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


# ---------------------------------------------------------------------- what the commands name


class Launched(Exception):
    """Raised by the stand-in for what a command would start: the command got that far, with ``what``."""

    def __init__(self, what: Any) -> None:
        super().__init__("launched")
        self.what = what


def run_potluck(argv: list[str], sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Parse ``potluck ARGV`` and run its command up to where it would start a coordinator, a peer or a
    demo swarm, from the sandbox; then check what it would have started with, as that would. Returns
    that (a coordinator's RunConfig, a peer's PeerConfig), or None."""
    args = parse(argv)
    stand_ins = {"coordinator": "potluck.coordinator.app.Coordinator", "peer": "potluck.peer.daemon.Peer",
                 "demo": "potluck.demo.run_demo"}
    if args.command == "data":  # it makes files the next commands use: run it, for real, in the sandbox
        with monkeypatch.context() as m:
            m.chdir(sandbox)
            assert args.fn(args) == 0, f"potluck {shlex.join(argv)} failed"
        return None
    if args.command not in stand_ins:
        return None  # status, export, schedule: they read what a run leaves, so the slow tests run them

    def start(what: Any, **_: Any) -> None:
        raise Launched(what)

    with monkeypatch.context() as m:
        m.chdir(sandbox)
        m.setattr(stand_ins[args.command], start)
        m.setattr("potluck.peer.swarm.keyfile.load_identity", lambda path="": Identity.generate())  # not the user's key
        m.setattr("potluck.protos.net.probe.probe", lambda *a, **k: Answer(Kind.UNKNOWN))  # (no coordinator to ask)
        try:
            args.fn(args)
        except UsageError as err:
            pytest.fail(f"potluck {shlex.join(argv)}: {err}")
        except Launched as launched:
            what = launched.what
        else:
            pytest.fail(f"potluck {shlex.join(argv)} returned without starting anything")
        if args.command == "demo":
            from potluck.demo import demo_config

            what = demo_config(what, sandbox / "demo")
        if isinstance(what, RunConfig):
            check_run(what)  # what the coordinator checks before it writes anything
            if what.data.source == "shards" and "://" not in (what.data.path or ""):
                bootstrap.data_identity(what)  # and its shards: there, whole, and fit for the model
        elif what.data_path:
            assert Path(what.data_path).expanduser().exists(), f"--data-path {what.data_path}: not made by the README"
    return what


def declared() -> tuple[list[Requirement], dict[str, list[Requirement]]]:
    project = PYPROJECT["project"]
    return ([Requirement(r) for r in project["dependencies"]],
            {k: [Requirement(r) for r in v] for k, v in project["optional-dependencies"].items()})


def check_pip(argv: list[str]) -> None:
    """``pip install`` of this project (``-e .``, ``-e ".[extra]"``) with declared extras, or of a
    dependency pinned exactly within the project's range and to the version ``.ci/run`` installs."""
    assert argv[1:2] == ["install"], f"{shlex.join(argv)}: only 'pip install' is known"
    deps, extras = declared()
    args = iter(argv[2:])
    for arg in args:
        if arg == "-e":
            m = re.fullmatch(r"([^\[]+)(?:\[([\w,-]+)\])?", next(args, ""))
            assert m and (REPO / m[1]).resolve() == REPO, f"{shlex.join(argv)}: -e must name this project"
            unknown = set((m[2] or "").split(",")) - {""} - set(extras)
            assert not unknown, f"{shlex.join(argv)}: no such extras {sorted(unknown)} in pyproject.toml"
            continue
        assert not arg.startswith("-"), f"{shlex.join(argv)}: option {arg} is not known to this test"
        req = Requirement(arg)
        dep = next((d for d in deps if canonicalize_name(d.name) == canonicalize_name(req.name)), None)
        assert dep is not None, f"{shlex.join(argv)}: {req.name} is not a dependency of potluck"
        pins = [s.version for s in req.specifier if s.operator == "=="]
        assert len(pins) == 1, f"{shlex.join(argv)}: {req.name} must be pinned with =="
        assert dep.specifier.contains(pins[0]), f"{shlex.join(argv)}: {pins[0]} is outside potluck's {dep}"
        assert f'"{req}"' in CI.read_text(), f".ci/run does not install {req} as the README does"


def ci_test_command() -> list[str]:
    """The command under the comment in ``.ci/run`` that says it is the README's, verbatim."""
    lines = [line.strip() for line in CI.read_text().splitlines()]
    at = next(i for i, line in enumerate(lines) if line.startswith("#") and "verbatim" in line)
    return shlex.split(next(line for line in lines[at + 1:] if line and not line.startswith("#")))


def check_command(argv: list[str], sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    head = argv[0]
    if head == "pip":
        check_pip(argv)
    elif head == "potluck":
        run_potluck(argv[1:], sandbox, monkeypatch)
    elif argv[:3] == ["python", "-m", "potluck"]:
        run_potluck(argv[3:], sandbox, monkeypatch)
    elif argv[:3] == ["python", "-m", "pytest"]:  # CI's command, or its fast tier (the markers pyproject declares)
        fast = [*ci_test_command(), "-m", "not slow"]
        assert argv in (ci_test_command(), fast), f"the README runs {shlex.join(argv)}, .ci/run {shlex.join(ci_test_command())}"
        if argv == fast:
            assert any(m.startswith("slow:") for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"])
    elif head == "cat" and ">" in argv:
        made = sandbox / argv[-1]
        assert made.is_file() and made.stat().st_size > 0, f"{shlex.join(argv)} made nothing"
    else:
        pytest.fail(f"README command {shlex.join(argv)!r}: tests/test_readme.py does not know how to check it")


# ---------------------------------------------------------------------- the blocks


def clone(root: Path) -> Path:
    """``root``, made to look like a clone of this repository (its entries linked)."""
    for entry in REPO.iterdir():
        if not entry.name.startswith("."):
            (root / entry.name).symlink_to(entry)
    return root


def run_cat(line: str, root: Path) -> None:
    """A README ``cat FILES > OUT`` line, through bash, as written: only into a new file of ``root``."""
    argv = commands(line)
    assert len(argv) == 1 and argv[0][-2] == ">" and re.fullmatch(r"[\w.-]+", argv[0][-1]), line
    done = subprocess.run(["bash", "-c", line], cwd=root, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"{line}: {done.stderr}"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clone-like folder in which the README's file-making commands (``cat ... > corpus.txt``) have run."""
    root = clone(tmp_path_factory.mktemp("readme"))
    lines = [line for b in BLOCKS if b.lang == "bash" for line in b.text.replace("\\\n", " ").splitlines()]
    for line in lines:
        argv = commands(line)
        if argv and argv[0][0] == "cat":
            run_cat(line, root)
    return root


def check_toml(block: Block, sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    named = re.match(r"#\s*(\S+\.toml)\b", block.text)
    if named:
        assert (REPO / named[1]).read_text() == block.text, f"{block} is not {named[1]} as it is in the repository"
    path = sandbox / f"readme-{block.line}.toml"
    path.write_text(block.text)
    cfg = load_config(path)
    with monkeypatch.context() as m:
        m.chdir(sandbox)
        check_run(cfg)


def check_python(block: Block) -> None:
    tree = ast.parse(block.text, filename=str(block))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert importlib.util.find_spec(alias.name), f"{block}: no module {alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{block}: {node.module} has no {alias.name}"


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_block(block: Block, sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.lang == "bash":
        for argv in commands(block.text):
            check_command(argv, sandbox, monkeypatch)
    elif block.lang == "toml":
        check_toml(block, sandbox, monkeypatch)
    elif block.lang == "python":
        check_python(block)
    else:
        pytest.fail(f"{block}: tests/test_readme.py does not know how to check a block of this language")


# ---------------------------------------------------------------------- inline code

SECTIONS = {name for name, f in RunConfig.model_fields.items()
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)}
CHECKED_INLINE = list(dict.fromkeys(
    code for code in inline_code(TEXT)
    if code.startswith(("potluck ", "python -m ", "pip ", "--"))
    or re.fullmatch(r"(\w+)\.\w+( = .+)?", code) and code.split(".")[0] in SECTIONS))


def options() -> set[str]:
    """Every flag some potluck command (or subcommand: ``potluck data prepare``) documents in its --help."""
    parsers = list(subparsers().values())
    parsers += [p for parser in parsers for a in parser._actions if isinstance(a, argparse._SubParsersAction)
                for p in a.choices.values()]
    return {flag for parser in parsers for flag, action in parser._option_string_actions.items()
            if action.help != argparse.SUPPRESS}


def check_field(dotted: str, value: str | None) -> None:
    """``section.field`` names a field of the run file, and ``value`` (TOML) is one it accepts."""
    section, name = dotted.split(".", 1)
    model = RunConfig.model_fields[section].annotation
    assert name in model.model_fields, f"`{dotted}`: the run file has no such field"
    if value is not None:
        field = model.model_fields[name]
        try:
            kind: Any = Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
            TypeAdapter(kind).validate_python(tomllib.loads(f"v = {value}")["v"])
        except ValidationError as err:
            pytest.fail(f"`{dotted} = {value}`: {err}")


@pytest.mark.parametrize("code", CHECKED_INLINE)
def test_inline_code(code: str, sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    words = shlex.split(code)
    if words[0] in ("potluck", "pip") or words[:3] in (["python", "-m", "potluck"], ["python", "-m", "pytest"]):
        check_command(words, sandbox, monkeypatch)
    elif words[0] == "python":
        assert importlib.util.find_spec(words[2]), f"`{code}`: no module {words[2]}"
    elif words[0].startswith("--"):
        assert words[0] in options(), f"`{code}`: no potluck command has {words[0]}"
        if words[0] == "--set" and len(words) > 1:
            key, _, value = words[1].partition("=")
            apply_overrides(RunConfig(), {key: value})
    else:
        dotted, _, value = code.partition(" = ")
        check_field(dotted, value or None)


# ---------------------------------------------------------------------- the sections, in order


def test_the_sections_work_in_the_order_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new user follows the README from the top, in one folder (issue 27: "Your own text", "Train a real
    model" and "Real data" each reused ./potluck-run, and the coordinator refused the journal three times).

    Every bash command runs in turn in one clone-like folder: files are made as written, ``potluck data``
    runs for real, each coordinator opens its journal for real (its checks, then the journal written) and
    its run is then taken as trained (its journal committed to the last step, as the user's run would be);
    an export must read a journal an earlier coordinator wrote, of a model that form can hold, and
    ``generate --model`` a folder an earlier export wrote."""
    from potluck.coordinator.store.journal import Journal, JournalError
    from potluck.protos.config.section import ConfigError

    root = clone(tmp_path)
    journals: dict[Path, RunConfig] = {}
    exported: set[Path] = set()
    for block in (b for b in BLOCKS if b.lang == "bash"):
        for line in block.text.replace("\\\n", " ").splitlines():
            for argv in commands(line):
                where = f"README.md:{block.line}: {shlex.join(argv)}"
                if argv[0] == "cat":
                    run_cat(line, root)
                elif argv[0] != "potluck":
                    continue
                elif argv[1] == "coordinator":
                    cfg = run_potluck(argv[1:], root, monkeypatch)
                    with monkeypatch.context() as m:
                        m.chdir(root)
                        try:
                            journal, state = bootstrap.open_journal(cfg)
                        except (ConfigError, JournalError) as err:  # what the user would read, and where
                            pytest.fail(f"{where}: {err}")
                        state.committed, state.finished = cfg.diloco.outer_steps, True  # the user trains it
                        journal.save(state)
                    journals[(root / cfg.coordinator.journal_dir).resolve()] = cfg
                elif argv[1] == "export":
                    args = parse(argv[1:])
                    cfg = journals.get((root / args.journal_dir).resolve())
                    assert cfg is not None, f"{where}: no earlier coordinator wrote {args.journal_dir}"
                    assert Journal(root / args.journal_dir).load() is not None
                    folder = not args.out.endswith((".pt", ".safetensors"))
                    assert not folder or cfg.model.family != "tiny", f"{where}: a tiny model has no Hugging Face form"
                    exported.add((root / args.out).resolve())
                elif argv[1] == "generate":
                    args = parse(argv[1:])
                    assert (root / args.model).resolve() in exported, f"{where}: no earlier export wrote {args.model}"
                else:
                    run_potluck(argv[1:], root, monkeypatch)
    assert len(journals) >= 4, sorted(journals)  # the first run, your own text, token shards, the real model


# ---------------------------------------------------------------------- the setup commands


def test_two_setup_commands_and_ci_runs_the_same() -> None:
    installs = [shlex.join(argv) for argv in BASH if argv[0] == "pip"]
    assert installs == ["pip install torch==2.13.0", "pip install -e .", "pip install -e '.[dev]'"], installs
    lines = [" ".join(b.text.split()) for b in BLOCKS if b.lang == "bash" and "pip install" in b.text]
    assert lines == ["pip install torch==2.13.0 && pip install -e . && potluck demo",
                     'pip install -e ".[dev]" && python -m pytest -q']
    ci = CI.read_text()
    assert 'pip install --quiet -e ".[dev]"' in ci and "torch==2.13.0" in ci
    assert ci_test_command() == ["python", "-m", "pytest", "-q"]


def test_dev_extras_hold_what_the_tests_import() -> None:
    """The README's second command installs everything the tests import (on top of potluck's own)."""
    deps, extras = declared()
    have = {canonicalize_name(r.name) for r in deps + extras["dev"]}
    local = {p.stem for p in Path(__file__).parent.glob("*.py")}
    imported: dict[str, str] = {}
    for path in sorted(Path(__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                imported.setdefault(name.split(".")[0], path.name)
    dists = packages_distributions()
    missing = {f"{top} ({where})": dists.get(top) for top, where in imported.items()
               if top not in sys.stdlib_module_names and top not in local and top != "potluck"
               and not {canonicalize_name(d) for d in dists.get(top, [])} & have}
    assert not missing, f"imported by tests but in neither dependencies nor the dev extras: {missing}"

SUBCOMMANDS = sorted({argv[1] for argv in BASH if argv[0] == "potluck"}
                     | {code.split()[1] for code in CHECKED_INLINE if code.startswith("potluck ")})


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_the_installed_command_answers(sub: str, tmp_path: Path) -> None:
    done = subprocess.run([potluck_exe(), sub, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith(f"usage: potluck {sub}"), done.stderr


# ---------------------------------------------------------------------- the sections, for real, in order

REAL_RUN = ("On one machine first", "Volunteers on other machines", "Your own text", "Real data: token shards",
            "Train a real model")
# What a test must change in a section's coordinator command, and nothing else: its fixed public ports become
# any free ones on 127.0.0.1 (the README's own default), and its training is shortened where the README's is long.
SHORTER = {"Volunteers on other machines": {"diloco.outer_steps": 2, "diloco.inner_steps": 5},
           "Your own text": {"diloco.outer_steps": 2, "diloco.inner_steps": 5},
           "Real data: token shards": {"diloco.outer_steps": 2, "diloco.inner_steps": 5},
           "Train a real model": {"diloco.outer_steps": 1, "diloco.inner_steps": 2}}
LOCAL = {"--host": "127.0.0.1", "--dht-port": "0", "--grpc-port": "0", "--status-port": "0"}
JOIN_PLACEHOLDER = re.compile(r"/ip4/[\d.]+/tcp/(\d+|PORT)/p2p/12D3KooW\.\.\.")


@dataclass
class Printed:
    """What a coordinator printed at start-up: ``potluck coordinator ready`` and the lines below it."""

    run: str
    join: str
    status: str
    start_a_peer: str
    notes: list[str]

    @classmethod
    def read(cls, log: str) -> Printed | None:
        block = log[log.find("potluck coordinator ready"):] if "potluck coordinator ready" in log else ""
        fields = dict(re.findall(r"^  ([\w ]+): +(.*)$", block, re.MULTILINE))
        if "start a peer" not in fields:
            return None
        notes = re.findall(r"^ {16}\((.*)\)$", block, re.MULTILINE)
        return cls(fields["run"], fields["join address"], fields["status page"], fields["start a peer"], notes)


class Newcomer:
    """Someone following the README from the top, in one folder (``root``), each command as written and in turn:
    potluck's processes through ``procs`` (reaped whatever happens), their output in ``logs``."""

    def __init__(self, root: Path, procs: ProcessGroup, home: Path) -> None:
        self.root, self.procs, self.env = root, procs, {"HOME": str(home)}  # (a peer's key goes to ~/.potluck)
        self.logs = root.parent / "logs"
        self.logs.mkdir(exist_ok=True)
        self.count = 0
        self.coordinator: subprocess.Popen | None = None
        self.printed: Printed | None = None

    def start(self, argv: list[str]) -> tuple[subprocess.Popen, Path]:
        assert argv[0] == "potluck", argv
        self.count += 1
        log = self.logs / f"{self.count:02d}-{'-'.join(w for w in argv[1:3] if re.fullmatch('[a-z]+', w))}.log"
        log.write_text(f"$ {shlex.join(argv)}\n")
        return self.procs.spawn_potluck(argv[1:], log, self.env), log

    def run(self, argv: list[str], timeout: float) -> str:
        """``argv`` to its end: what it printed (it must exit 0)."""
        proc, log = self.start(argv)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{shlex.join(argv)} still runs after {timeout:.0f} s:\n{tail(log)}")
        assert code == 0, f"{shlex.join(argv)} exited with {code}:\n{tail(log)}"
        return log.read_text()

    def start_coordinator(self, argv: list[str]) -> Printed:
        proc, log = self.start(argv)
        self.coordinator = proc
        printed = wait_for(lambda: Printed.read(log.read_text()) or proc.poll() is not None, 120,
                           f"{shlex.join(argv)} to print its start-a-peer line")
        assert isinstance(printed, Printed), f"{shlex.join(argv)} exited with {proc.returncode}:\n{tail(log)}"
        self.printed = printed
        return printed

    def state(self) -> dict[str, Any]:
        assert self.printed is not None
        status = self.printed.status  # ("ready" is printed before the first tick's snapshot: 503 until it is built)
        state = wait_for(lambda: get_state(status), 60, f"a state from {status}")
        assert isinstance(state, dict), state
        return state

    def ctrl_c(self) -> None:
        """Stop the coordinator as the README says (Ctrl+C): it exits 0."""
        assert self.coordinator is not None and self.coordinator.poll() is None, "the coordinator exited by itself"
        self.coordinator.send_signal(signal.SIGINT)
        assert self.coordinator.wait(timeout=60) == 0
        self.coordinator = None


def tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def localized(argv: list[str], title: str) -> list[str]:
    """A section's coordinator command with this test's changes: see LOCAL and SHORTER."""
    out = [LOCAL.get(argv[i - 1], a) if i else a for i, a in enumerate(argv)]
    for key, value in SHORTER.get(title, {}).items():
        out += ["--set", f"{key}={value}"]
    return out


def joined(argv: list[str], printed: Printed) -> list[str]:
    """A README peer command with the join address the coordinator printed in place of its placeholder."""
    at = argv.index("--join") + 1
    assert JOIN_PLACEHOLDER.fullmatch(argv[at]), f"{shlex.join(argv)}: not a join address placeholder"
    return [*argv[:at], printed.join, *argv[at + 1:]]


def python_blocks(sec: Section) -> list[Block]:
    return [b for b in sec.blocks if b.lang == "python"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_real_run_sections_run_in_order_in_one_folder(procs: ProcessGroup, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A new user runs "A real run" from the top, in one folder, each section's commands as written: its coordinator,
    a peer (the section's own command, else the ``start a peer:`` line the coordinator printed), then its status,
    export and generate lines and its Python blocks; and each section ends as the README says it does. (A user who
    did so found the volunteers' coordinator resuming the first run, already over: its peer said "done at version 0".)

    Changed from the README, and only so: the volunteers' coordinator binds 127.0.0.1 and any free ports instead of
    its public ones, the join address and status page are the printed ones instead of the README's placeholders,
    and every run but the first trains a couple of outer steps (SHORTER). The README's other ways to start a peer
    (``--relay``) and its run files for the same runs are checked by test_block, not run."""
    (tmp_path / "work").mkdir()
    root = clone(tmp_path / "work")
    home = tmp_path / "home"
    monkeypatch.chdir(root)  # (where potluck's processes start)
    user = Newcomer(root, procs, home)
    try:
        first_run(user, section(REAL_RUN[0]))
        volunteers(user, section(REAL_RUN[1]))
        own_text(user, section(REAL_RUN[2]))
        shards(user, section(REAL_RUN[3]))
        real_model(user, section(REAL_RUN[4]))
    except BaseException:
        procs.stop()
        for log in sorted(user.logs.glob("*.log")):
            print(f"===== {log.name} =====\n{tail(log, 80)}")
        raise


def trains_to_the_end(user: Newcomer, argv: list[str], outer_steps: int) -> dict[str, Any]:
    """``potluck peer ...`` trains the run's ``outer_steps`` and exits 0; the run's state then."""
    user.run(argv, timeout=300)
    state = wait_for(lambda: (s := user.state())["run"]["finished"] and s, 60, "the run to be finished")
    assert [h["step"] for h in state["history"]] == list(range(1, outer_steps + 1)), state["history"]
    return state


def a_new_run(printed: Printed, run_id: str, outer_steps: int) -> None:
    assert printed.run == f"{run_id} (outer step 0 of {outer_steps})", f"not a new run: {printed.run}"


def run_id(user: Newcomer, coordinator: list[str]) -> str:
    return load_config(user.root / parse(coordinator[1:]).config).run_id


def first_run(user: Newcomer, sec: Section) -> None:
    coordinator, shown_peer, export = sec.commands()
    cfg = load_config(user.root / parse(coordinator[1:]).config)
    claimed = re.search(r"trains the (\d+) outer steps of `([^`]+)`", sec.prose)
    assert claimed and int(claimed[1]) == cfg.diloco.outer_steps and claimed[2] == coordinator[3], claimed

    printed = user.start_coordinator(localized(coordinator, sec.title))
    a_new_run(printed, cfg.run_id, cfg.diloco.outer_steps)
    shape = re.escape(shlex.join(shown_peer)).replace("PORT", r"\d+").replace(r"12D3KooW\.\.\.", r"12D3KooW\w{44}")
    assert re.fullmatch(shape, printed.start_a_peer), (printed.start_a_peer, shlex.join(shown_peer))
    peer = shlex.split(printed.start_a_peer)  # "run it in a second terminal"
    trains_to_the_end(user, peer, cfg.diloco.outer_steps)
    assert user.coordinator is not None and user.coordinator.poll() is None, "it keeps serving until Ctrl+C"
    user.ctrl_c()

    shown = user.run(export, timeout=120)  # the trained model: the run's last version
    assert f"wrote v{cfg.diloco.outer_steps} " in shown and (user.root / export[export.index("--out") + 1]).is_file()
    for block in python_blocks(sec):
        done = subprocess.run([sys.executable, "-c", block.text], cwd=user.root, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, f"{block}:\n{done.stderr}"


def volunteers(user: Newcomer, sec: Section) -> None:
    coordinator, peer, relayed, status = sec.commands()
    assert "--relay" in relayed  # another way to start the same peer: checked by test_block
    journal = user.root / (parse(coordinator[1:]).journal_dir or "potluck-run")
    first = user.root / "potluck-run"
    before = {p: p.read_bytes() for p in first.glob("*.json")}
    printed = user.start_coordinator(localized(coordinator, sec.title))
    cfg = load_config(user.root / parse(coordinator[1:]).config)
    outer_steps = SHORTER[sec.title]["diloco.outer_steps"]
    a_new_run(printed, cfg.run_id, outer_steps)
    assert journal.is_dir() and {p: p.read_bytes() for p in first.glob("*.json")} == before  # the first run's, untouched
    trains_to_the_end(user, joined(peer, printed), outer_steps)

    url = [a for a in status if a.startswith("http")]
    assert len(url) == 1, status
    wait_for(lambda: user.state()["run"]["model_export"]["version"], 60, "the final checkpoint")
    shown = user.run([printed.status if a in url else a for a in status], timeout=60)
    export = f"potluck export --journal-dir {journal.name} --out model.pt"
    assert f"run {cfg.run_id} " in shown and "FINISHED" in shown and export in shown, shown
    user.ctrl_c()
    # "Started again with the same command ... a join address survives a restart" (ports left to the system here)
    again = user.start_coordinator(localized(coordinator, sec.title))
    assert again.join == printed.join and again.run == f"{cfg.run_id} (outer step {outer_steps} of {outer_steps})"
    user.ctrl_c()


def own_text(user: Newcomer, sec: Section) -> None:
    cat, coordinator, peer = sec.commands()
    run_cat(next(line for line in sec.lines() if commands(line) == [cat]), user.root)  # through bash, as written
    corpus = user.root / cat[-1]
    printed = user.start_coordinator(localized(coordinator, sec.title))
    a_new_run(printed, run_id(user, coordinator), SHORTER[sec.title]["diloco.outer_steps"])
    assert f"--data-path {corpus.resolve()}" in printed.start_a_peer, printed.start_a_peer
    sha = hashlib.sha256(corpus.read_bytes()).hexdigest()
    assert any(sha in note for note in printed.notes), printed.notes  # the corpus `cat` made, by its sha256
    state = trains_to_the_end(user, joined(peer, printed), SHORTER[sec.title]["diloco.outer_steps"])
    assert state["run"]["data"]["source"] == "bytes" and state["run"]["model"]["vocab_size"] == 256, state["run"]
    user.ctrl_c()


def shards(user: Newcomer, sec: Section) -> None:
    prepare, coordinator = sec.commands()
    shown = user.run(prepare, timeout=120)
    folder = user.root / prepare[prepare.index("--out") + 1]
    index = json.loads((folder / "index.json").read_text())
    printed = user.start_coordinator(localized(coordinator, sec.title))
    a_new_run(printed, run_id(user, coordinator), SHORTER[sec.title]["diloco.outer_steps"])
    state = trains_to_the_end(user, shlex.split(printed.start_a_peer), SHORTER[sec.title]["diloco.outer_steps"])
    run = state["run"]
    assert run["data"]["source"] == "shards" and run["eval_loss"] is not None and run["eval_perplexity"], run
    assert index["splits"]["eval"], index  # (--eval-fraction: the held-out split the eval loss is of)
    assert f"index sha256 {hashlib.sha256((folder / 'index.json').read_bytes()).hexdigest()}" in shown, shown
    user.ctrl_c()


def real_model(user: Newcomer, sec: Section) -> None:
    coordinator, export, generate = sec.commands()
    cfg = load_config(user.root / parse(coordinator[1:]).config)
    outer_steps = SHORTER[sec.title]["diloco.outer_steps"]
    # (the first run's "--exit-when-finished makes it exit too", here: the state is read before the run ends)
    printed = user.start_coordinator(localized(coordinator, sec.title) + ["--exit-when-finished"])
    a_new_run(printed, cfg.run_id, outer_steps)
    model = user.state()["run"]["model"]
    claimed = re.search(r"trains a ([\d.]+)M-parameter", sec.prose)
    assert claimed and f"{model['parameters'] / 1e6:.1f}" == claimed[1] and model["family"] == "llama", (claimed, model)
    user.run(shlex.split(printed.start_a_peer), timeout=300)
    assert user.coordinator is not None and user.coordinator.wait(timeout=60) == 0

    shown = user.run(export, timeout=300)
    assert f"wrote v{outer_steps} " in shown and (user.root / export[export.index("--out") + 1] / "config.json").is_file()
    shown = user.run(generate, timeout=300)
    prompt = generate[generate.index("--prompt") + 1]
    assert shown.splitlines()[1].startswith(prompt), shown  # (under the command line the log starts with)
    for block in python_blocks(sec):
        done = subprocess.run([sys.executable, "-c", block.text], cwd=user.root, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"{block}:\n{done.stderr}"
