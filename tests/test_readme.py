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
or a config field (``data.path``, ``admission.mode = "private"``) is checked the same way. The slow
tests, which train the README's runs with a real coordinator and peers and run its status, export and
Python lines against them, are in :mod:`test_readme_runs`; what both read of the README, in :mod:`readme`.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import re
import shlex
import subprocess
import sys
import tomllib
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
    commands,
    inline_code,
    parse,
    potluck_exe,
    subparsers,
)

from potluck.cli import UsageError
from potluck.coordinator import bootstrap
from potluck.protos.config.files import apply_overrides, load_config
from potluck.protos.config.runcheck import check_run
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.identity import Identity

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
        m.setattr("potluck.peer.keyfile.load_identity", lambda path="": Identity.generate())  # not the user's key
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
    elif argv[:3] == ["python", "-m", "pytest"]:
        assert argv == ci_test_command(), f"the README runs {shlex.join(argv)}, .ci/run {shlex.join(ci_test_command())}"
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
    from potluck.coordinator.journal import Journal, JournalError
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
