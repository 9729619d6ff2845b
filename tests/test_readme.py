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
* ``python``: it compiles and its imports resolve; the slow test runs it on a model it trained.

Inline code that reads as a command (``potluck ...``, ``python -m ...``), a flag (``--host ...``)
or a config field (``data.path``, ``admission.mode = "private"``) is checked the same way. The slow
test trains the README's first run with a real coordinator and peer, then runs the README's status,
export and Python lines against it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path
from typing import Annotated, Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from pydantic import BaseModel, TypeAdapter, ValidationError

from potluck.cli import UsageError, build_parser
from potluck.coordinator import bootstrap
from potluck.local import LocalSwarm, wait_for
from potluck.procs import ProcessGroup
from potluck.protos.config.runcheck import check_run
from potluck.protos.config.runconfig import RunConfig, apply_overrides, load_config
from potluck.protos.net.identity import Identity

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
CI = REPO / ".ci" / "run"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PEER_ID = Identity.generate().peer_id  # a real coordinator id for the README's "12D3KooW..." placeholders


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int  # of the opening fence, 1-based

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.lang or 'no language'})"


def fenced_blocks(markdown: str) -> list[Block]:
    """Every fenced block (``` or ~~~, indented or not), its text dedented by its fence's indent."""
    out: list[Block] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^( *)(`{3,}|~{3,})\s*(\S*)", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m[1]), m[2], m[3]
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), None)
        assert end is not None, f"README.md:{i + 1}: a fenced block that is never closed"
        out.append(Block(lang, "".join(line[indent:] + "\n" for line in lines[i + 1:end]), i + 1))
        i = end + 1
    return out


def prose(markdown: str) -> str:
    """The README without its fenced blocks (blank lines in their place)."""
    kept, fence = [], None
    for line in markdown.splitlines():
        opening = re.match(r"^ *(`{3,}|~{3,})", line)
        if fence is None and opening:
            fence = opening[1]
        elif fence is not None and line.strip() == fence:
            fence = None
        elif fence is None:
            kept.append(line)
            continue
        kept.append("")
    return "\n".join(kept)


def inline_code(markdown: str) -> list[str]:
    return [" ".join(m[1].split()) for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose(markdown))]


def commands(script: str) -> list[list[str]]:
    """The commands of a bash block, each as its argv: lines joined at ``\\``, comments dropped, split at ``&&``."""
    out: list[list[str]] = []
    for line in script.replace("\\\n", " ").splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        words = list(lex)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            out.append(words[:cut])
            words = words[cut + 1:]
    return [c for c in out if c]


TEXT = README.read_text()
BLOCKS = fenced_blocks(TEXT)
BASH = [argv for b in BLOCKS if b.lang == "bash" for argv in commands(b.text)]


# ---------------------------------------------------------------------- what the commands name


def fill(arg: str) -> str:
    """A README argument with its placeholders filled: a join address gets a port and a real id."""
    return arg.replace("/tcp/PORT/", "/tcp/31337/").replace("/p2p/12D3KooW...", f"/p2p/{PEER_ID}")


class Launched(Exception):
    """Raised by the stand-in for what a command would start: the command got that far, with ``what``."""

    def __init__(self, what: Any) -> None:
        super().__init__("launched")
        self.what = what


def subparsers() -> dict[str, argparse.ArgumentParser]:
    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def parse(argv: list[str]) -> argparse.Namespace:
    """``potluck ARGV`` through potluck's own parser; an unknown flag, a missing value or a flag's old,
    hidden spelling fails the test."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = build_parser().parse_args([fill(a) for a in argv])
    except SystemExit:
        pytest.fail(f"potluck {shlex.join(argv)}: {err.getvalue().strip()}")
    flags = subparsers()[args.command]._option_string_actions
    hidden = [a for a in argv if a.split("=")[0] in flags and flags[a.split("=")[0]].help == argparse.SUPPRESS]
    assert not hidden, f"potluck {shlex.join(argv)}: {hidden} is not in its --help (an old spelling?)"
    return args


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
    from potluck.protos.config.runconfig import ConfigError

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


def potluck_exe() -> str:
    """The ``potluck`` console script that ``pip install -e .`` puts next to this Python."""
    exe = shutil.which("potluck", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    assert exe, "no potluck command: run 'pip install -e .' (the README's first command)"
    return exe


SUBCOMMANDS = sorted({argv[1] for argv in BASH if argv[0] == "potluck"}
                     | {code.split()[1] for code in CHECKED_INLINE if code.startswith("potluck ")})


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_the_installed_command_answers(sub: str, tmp_path: Path) -> None:
    done = subprocess.run([potluck_exe(), sub, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith(f"usage: potluck {sub}"), done.stderr


# ---------------------------------------------------------------------- the first run, for real


def readme_command(*head: str, having: str | None = None, lacking: str | None = None) -> list[str]:
    found = [argv for argv in BASH if argv[:len(head)] == list(head)
             and (having is None or having in argv) and (lacking is None or lacking not in argv)]
    assert len(found) == 1, f"the README should show one '{' '.join(head)}' command, it shows {found}"
    return found[0]


@contextlib.contextmanager
def logs_on_failure(swarm: LocalSwarm) -> Iterator[None]:
    try:
        yield
    except BaseException:
        swarm.dump_logs()
        raise


@pytest.mark.slow
def test_the_first_run_trains_and_its_model_loads(procs: ProcessGroup, tmp_path: Path) -> None:
    cfg = load_config(REPO / "examples" / "run.toml")
    # What a test must change, and nothing else: this machine only, any free ports, and the journal in
    # tmp_path, where the README's `potluck export --journal-dir potluck-run` finds it.
    cfg = apply_overrides(cfg, {"coordinator.host": "127.0.0.1", "coordinator.dht_port": 0, "coordinator.grpc_port": 0,
                                "coordinator.status_port": 0, "coordinator.journal_dir": str(tmp_path / "potluck-run")})
    swarm = LocalSwarm(tmp_path / "swarm", procs)
    with logs_on_failure(swarm):
        ready = swarm.start_coordinator(cfg)
        swarm.start_peer()  # the README's `potluck peer --join ADDRESS`, with its own key in tmp_path
        swarm.wait_state(lambda s: s["run"]["outer_step"] >= 1, 120, "the first outer step")
        swarm.wait_state(lambda s: s["run"]["finished"], 120, f"all {cfg.diloco.outer_steps} outer steps")
        final = tmp_path / "potluck-run" / "checkpoints" / f"ckpt-{cfg.diloco.outer_steps:06d}.json"
        swarm.wait_for(final.exists, 30, f"the final checkpoint {final.name}")

        status = readme_command("potluck", "status", lacking="--fingerprint")
        status = [potluck_exe(), *status[1:-1], ready["status_url"]]  # the README's address is a public one
        done = subprocess.run(status, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "first-run" in done.stdout, done.stdout + done.stderr

        export = [potluck_exe(), *readme_command("potluck", "export", lacking="model-hf")[1:]]
        done = subprocess.run(export, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        for block in (b for b in BLOCKS if b.lang == "python" and "model-hf" not in b.text):
            done = subprocess.run([sys.executable, "-c", block.text], cwd=tmp_path, capture_output=True, text=True,
                                  timeout=120)
            assert done.returncode == 0, f"{block}:\n{done.stderr}"


@pytest.mark.slow
def test_the_real_model_section_trains_exports_and_generates(procs: ProcessGroup, tmp_path: Path) -> None:
    """"Train a real model", shortened to 2 outer steps of 2 inner steps and split into 2 stages: the
    exported Hugging Face folder loads with from_pretrained and gives the run's own eval loss (1e-4)."""
    import torch
    from transformers import AutoModelForCausalLM

    from potluck.peer.data import Dataset

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"".join(p.read_bytes() for p in [README, *sorted((REPO / "docs").glob("*.md"))]))
    cfg = load_config(REPO / "examples" / "llama-20m.toml")
    coordinator = parse(readme_command("potluck", "coordinator", having="examples/llama-20m.toml")[1:])
    journal = tmp_path / coordinator.journal_dir  # the README's, where its export reads
    cfg = apply_overrides(cfg, {"coordinator.host": "127.0.0.1", "coordinator.dht_port": 0, "coordinator.grpc_port": 0,
                                "coordinator.status_port": 0, "coordinator.journal_dir": str(journal),
                                "data.path": str(corpus), "diloco.inner_steps": 2, "diloco.outer_steps": 2,
                                "train.batch_size": 2, "pipeline.stages": 2, "pipeline.balance": "params",
                                "membership.min_peers": 2})
    swarm = LocalSwarm(tmp_path / "swarm", procs)
    with logs_on_failure(swarm):
        swarm.start_coordinator(cfg)
        swarm.start_peer()
        swarm.start_peer()
        state = swarm.wait_state(lambda s: s["run"]["finished"] and s["history"][-1]["eval_loss"] is not None,
                                 300, "2 outer steps of the 2-stage llama-20m run")
        final = journal / "checkpoints" / "ckpt-000002.json"
        swarm.wait_for(final.exists, 60, f"the final checkpoint {final.name}")
        export = [potluck_exe(), *readme_command("potluck", "export", having="model-hf")[1:]]
        done = subprocess.run(export, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        generate = [potluck_exe(), *readme_command("potluck", "generate")[1:], "--max-new-tokens", "8"]
        done = subprocess.run(generate, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.startswith("Peers find each other"), done.stdout + done.stderr
        for block in (b for b in BLOCKS if b.lang == "python" and "model-hf" in b.text):
            done = subprocess.run([sys.executable, "-c", block.text], cwd=tmp_path, capture_output=True, text=True,
                                  timeout=300)
            assert done.returncode == 0, f"{block}:\n{done.stderr}"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model-hf").eval()
    data = Dataset(cfg.data, cfg.model)
    ids = data.eval_ids()
    with torch.no_grad():
        total = sum(float(torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())) * len(c)
                    for c in (ids[k:k + 64] for k in range(0, len(ids), 64)) for x, y in [data.batch(c)])
    assert total / len(ids) == pytest.approx(state["history"][-1]["eval_loss"], abs=1e-4)


@pytest.mark.slow
def test_a_self_signed_status_page_reads_with_the_printed_fingerprint(procs: ProcessGroup, tmp_path: Path) -> None:
    """The README's HTTPS lines: a coordinator with a self-signed status page prints its fingerprint, and
    `potluck status https://... --fingerprint ...` reads the page with it (and refuses it without)."""
    argv = readme_command("potluck", "coordinator", having="self-signed")
    argv = [str(REPO / a) if a.endswith(".toml") else a for a in argv[1:]]
    ready, log = tmp_path / "ready.json", tmp_path / "coordinator.log"
    coord = procs.spawn_potluck([*argv, "--journal-dir", str(tmp_path / "potluck-run"), "--ready-file", str(ready)], log)
    try:
        wait_for(lambda: ready.exists() or coord.poll() is not None, 120, "the coordinator's ready file")
        assert coord.poll() is None, log.read_text()
        url = json.loads(ready.read_text())["status_url"]
        printed = re.search(r"status TLS: +SHA-256 ([0-9A-F:]{95})", log.read_text())
        assert url.startswith("https://") and printed, log.read_text()
        status = readme_command("potluck", "status", having="--fingerprint")
        status = [potluck_exe(), *status[1:]]
        status[status.index("--fingerprint") + 1] = printed[1]
        status[[a.startswith("https://") for a in status].index(True)] = url
        done = subprocess.run(status, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "first-run" in done.stdout, done.stdout + done.stderr
        unpinned = subprocess.run(status[:status.index("--fingerprint")], cwd=tmp_path, capture_output=True,
                                  text=True, timeout=60)
        assert unpinned.returncode != 0 and "certificate" in unpinned.stderr, unpinned.stdout + unpinned.stderr
    finally:
        procs.stop()
