"""Commands potluck prints paste and run as they are ("A community run's first week": a volunteer pasted what a
coordinator, a status page and an error told them, and it did not run).

Fast, from the code and the parsers:

* every flag a message of potluck's names (an error's "pass --data-path FILE", a log line's "pass --host 0.0.0.0",
  a ``--help`` text, a printed command's parts) is a flag of the command whose user reads it, or of the
  ``potluck SUB`` the message names, and shows in that command's ``--help``;
* every example line of every ``--help`` parses through potluck's own parser;
* one flag name per meaning across the commands (``--journal-dir`` everywhere), an old spelling kept hidden.

Slow, with real processes: every command a private text run, its errors and its status print, and every command a
demo and its status print, is collected from their output (a command follows a label: "start a peer: potluck peer
..."; one that no test here runs fails) and run as printed, pasted into bash; a printed command parses, names no old
spelling of a flag and holds no placeholder, except the one the status page puts for a journal dir it keeps private.
An error that names a flag is followed as a user would: the flag, with what the user has (a key file of its own for
a second peer, the token the operator handed out, the corpus), until the peer trains.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from readme import REPO, parse, potluck_exe, subparsers
from swarm import LocalSwarm

from potluck.cli import QUICKSTART
from potluck.local import wait_for
from potluck.procs import ProcessGroup
from potluck.protos.net.join import parse_join_address

# ---------------------------------------------------------------------- the commands and their flags


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every potluck command's parser by its name (``data prepare`` for a subcommand's)."""
    out: dict[str, argparse.ArgumentParser] = {}
    for name, parser in subparsers().items():
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        out.update({f"{name} {sub}": p for a in nested for sub, p in a.choices.items()} if nested else {name: parser})
    return out


PARSERS = parsers()


def visible(command: str) -> set[str]:
    """The flags ``potluck COMMAND --help`` shows."""
    return {flag for flag, action in PARSERS[command]._option_string_actions.items() if action.help != argparse.SUPPRESS}


# ---------------------------------------------------------------------- what potluck's messages name

PACKAGES = ("potluck", "coordinator", "peer", "protos", "compression", "kernels")  # pyproject maps them to potluck.*
NOT_POTLUCKS = {"protos/generate.py"}  # a command line of its own (python -m potluck.protos.generate), and protoc's flags
EVERYONE = tuple(PARSERS)
# Who reads a file's messages, where it is not every command: "path" or "path::function", the most specific wins.
AUDIENCE: dict[str, tuple[str, ...]] = {
    "potluck/demo.py": ("demo",),
    "potluck/export.py": ("export",),
    "potluck/generate.py": ("generate",),
    "potluck/local.py": ("coordinator", "peer"),  # (the argv it starts them with)
    "potluck/data": ("data prepare",),
    "potluck/data/corpus.py": ("peer", "coordinator", "data prepare"),  # the run's shards, and how to prepare them
    "potluck/data/fetch.py": ("peer",),
    "potluck/data/shards.py": ("peer", "coordinator", "data prepare"),
    "potluck/cli.py": ("coordinator", "demo", "peer"),  # the commands it runs itself (--set: coordinator and demo)
    "potluck/cli.py::_add_demo": ("demo",),
    "potluck/cli.py::demo_grid": ("demo",),
    "potluck/cli.py::_add_coordinator": ("coordinator",),
    "potluck/cli.py::cmd_coordinator": ("coordinator",),
    "potluck/cli.py::_add_peer": ("peer",),
    "potluck/cli.py::cmd_peer": ("peer",),
    "potluck/cli.py::_flag_error": ("peer",),
    "coordinator": ("coordinator",),
    "coordinator/bootstrap.py::announce": ("peer",),  # the flags of the start-a-peer line it prints
    "coordinator/trust/admission.py": ("peer",),  # its refusals reach the peer refused
    "coordinator/status/status_cli.py": ("status",),
    "coordinator/status/status_cli.py::": ("status", "coordinator"),  # (_PLAIN: "its coordinator runs without --status-tls")
    "coordinator/placement/schedule_cli.py": ("schedule",),
    "peer": ("peer",),
    "protos": ("coordinator", "peer"),
    "coordinator/status/static": (),  # the status page (JavaScript, CSS: "--fg"): only the potluck commands it shows
}
PAGE = ("coordinator/status/static/app.js", "coordinator/status/static/index.html")
FOREIGN = r"torchrun|pip|protoc|docker|python -m (?!potluck\b)[\w.]+"  # (their flags are theirs)
CLAUSE_END = re.compile(r"[)'`,;\n]|\. ")  # what ends the clause a command is named in
COMMAND = re.compile(rf"\bpotluck (?P<sub>data [a-z]+|[a-z]+)\b|(?<![\w-])(?P<flag>--[a-z][a-z0-9-]*)|\b(?P<foreign>{FOREIGN})\b")


def audience(path: str, function: str) -> tuple[str, ...]:
    keys = [f"{path}::{function}", path, *(path.rsplit("/", k)[0] for k in range(1, path.count("/") + 1))]
    return next((AUDIENCE[k] for k in keys if k in AUDIENCE), EVERYONE)


def text_of(node: ast.AST) -> str | None:
    """A string literal, an f-string's literal parts around ``{}``: the words a message shows."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def messages(root: Path = REPO) -> list[tuple[str, int, str, str]]:
    """Every string potluck's code shows a user (docstrings aside): (path, line, enclosing function, text)."""
    out: list[tuple[str, int, str, str]] = []
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel not in NOT_POTLUCKS and not path.stem.endswith(("_pb2", "_pb2_grpc")):
                tree = ast.parse(path.read_text(), filename=rel)
                out += [(rel, line, function, text) for line, function, text in strings(tree, unread(tree), "")]
    for rel in PAGE:
        out += [(rel, k + 1, "", line) for k, line in enumerate((root / rel).read_text().splitlines())]
    return out


def unread(tree: ast.AST) -> set[int]:
    """The string nodes no user reads as such: docstrings, and the parts of an f-string (read as the whole)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            skip.add(id(body[0].value))
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            skip.update(id(a) for a in node.args)  # a flag's definition (an old, hidden spelling too)
    return skip


def strings(node: ast.AST, skip: set[int], function: str) -> list[tuple[int, str, str]]:
    """(line, top-level function, text) of every string under ``node``."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not function:
        function = node.name
    text = text_of(node)
    here = [(getattr(node, "lineno", 0), function, text)] if text is not None and id(node) not in skip else []
    return here + [s for child in ast.iter_child_nodes(node) for s in strings(child, skip, function)]


def misnamed_flags(root: Path = REPO, found: list[tuple[str, int, str, str]] | None = None) -> list[str]:
    """Each flag a message names that the command it belongs to does not show in its --help, said where. A flag
    belongs to the ``potluck SUB ...`` (or another program's command) it follows in the same clause, else to the
    message's readers (AUDIENCE). (``found``: the messages of ``root``, where the caller has them already.)"""
    wrong = []
    commands_of_potluck = subparsers()  # (built once: a parser each message would cost a second in all)
    for path, line, function, text in messages(root) if found is None else found:
        readers = audience(path, function)
        named: tuple[str, ...] | None = None  # the commands of the clause that names one (): another program's
        ends = -1
        for m in COMMAND.finditer(text):
            if m.start() > ends:
                named = None
            if m["foreign"] or m["sub"]:
                clause = CLAUSE_END.search(text, m.end())
                ends = clause.start() if clause else len(text)
                sub = m["sub"] or ""
                if sub.split(" ")[0] in commands_of_potluck:  # (not "potluck version", "potluck fork server")
                    assert sub in PARSERS, f"{path}:{line}: no command 'potluck {sub}': {text!r}"
                named = (sub,) if sub in PARSERS else () if m["foreign"] else None
                continue
            commands = readers if named is None else named
            if commands and not any(m["flag"] in visible(c) for c in commands):
                wrong.append(f"{path}:{line}: {m['flag']} is not a flag of potluck {' or '.join(commands)}: {text!r}")
    return wrong


def test_every_flag_a_message_names_is_a_flag_of_its_command() -> None:
    found = messages()
    assert sum("--" in text for *_, text in found) > 100  # (the scan sees potluck's messages)
    wrong = misnamed_flags(found=found)
    assert not wrong, "\n".join(wrong)


def test_a_renamed_flag_in_a_message_is_caught(tmp_path: Path) -> None:
    """The check above, on a copy of the code whose peer error names a flag the peer no longer has."""
    for top in PACKAGES:
        shutil.copytree(REPO / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    joining = tmp_path / "peer" / "swarm" / "joining.py"
    joining.write_text(joining.read_text().replace("pass --data-path FILE", "pass --data FILE"))
    assert [w.split(": ")[:2] for w in misnamed_flags(tmp_path)] == [["peer/swarm/joining.py:145", "--data is not a flag of potluck peer"]]


def help_examples() -> list[tuple[str, list[str]]]:
    """Every example command of every --help: the quick start's and each command's 'examples:'."""
    texts = [("potluck --help", QUICKSTART)] + [(f"potluck {name} --help", p.epilog or "") for name, p in PARSERS.items()]
    out = []
    for where, text in texts:
        for line in text.splitlines():
            command = re.split(r" {2,}| \| ", line.strip())[0]  # (what follows two spaces or a pipe is not potluck's)
            if command.startswith("potluck ") or " -m potluck " in command:
                out.append((where, shlex.split(command[command.index("potluck "):])))
    return out


@pytest.mark.parametrize(("where", "argv"), help_examples(), ids=lambda x: shlex.join(x) if isinstance(x, list) else x)
def test_every_help_example_parses(where: str, argv: list[str]) -> None:
    parse(argv[1:])


# ---------------------------------------------------------------------- one flag name per meaning

# The parsers' dests that are not their flag's name, each with the meaning other commands name it by: the one
# place a new spelling must be argued for.
SAME_MEANING = {"journal": "journal_dir", "port": "grpc_port"}


def test_one_flag_name_per_meaning_across_the_commands() -> None:
    names: dict[str, set[str]] = defaultdict(set)
    wrong = []
    for command, parser in PARSERS.items():
        shown = {a.dest for a in parser._actions if a.help != argparse.SUPPRESS}
        for action in parser._actions:
            long = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
            if not long:
                continue
            if action.help == argparse.SUPPRESS:  # an old spelling: still read, as the flag it was renamed to
                if action.dest not in shown:
                    wrong.append(f"potluck {command} {long}: hidden, and no flag of its --help sets {action.dest}")
                continue
            if len(long) > 1:
                wrong.append(f"potluck {command} {' / '.join(long)}: one meaning, {len(long)} names in its --help "
                             "(keep the old one hidden: help=argparse.SUPPRESS)")
            if long[0] != "--" + action.dest.replace("_", "-") and action.dest not in SAME_MEANING:
                wrong.append(f"potluck {command} {long[0]} sets {action.dest}: name it so, or say in SAME_MEANING "
                             "which meaning it shares")
            names[SAME_MEANING.get(action.dest, action.dest)].add(long[0])
    wrong += [f"{meaning}: {sorted(spellings)}" for meaning, spellings in names.items() if len(spellings) > 1]
    assert not wrong, "\n".join(wrong)
    assert names["journal_dir"] == {"--journal-dir"} and names["grpc_port"] == {"--grpc-port"}


# ---------------------------------------------------------------------- printed commands, for real

# A printed command is the rest of a line after a label ("start a peer: potluck peer ..."); every one these runs
# print must be one this file runs (a new one fails until it does).
LABELED = re.compile(r"^\s*(?P<label>[a-zA-Z][\w ()',]*?[\w)]): +(?P<command>(?:potluck|rm) .*)$", re.MULTILINE)
PLACEHOLDER = re.compile(r"\b(?:[A-Z][A-Z0-9]*_)*(?:FILE|DIR|PATH|TOKEN|ADDRESS|PORT|HOST|URL|KEY|ID)\b|\.\.\.|<\w+>")


def printed(text: str) -> dict[str, str]:
    """The commands in potluck's output, by the label they follow (the status page's export line: "the model");
    a potluck command among them parses, and names no flag by an old, hidden spelling."""
    out = {}
    for m in LABELED.finditer(text):
        label = re.sub(r" \(v\d+\), on the coordinator's machine$", "", m["label"])
        out[label] = m["command"]
        if m["command"].startswith("potluck "):
            parse(shlex.split(m["command"])[1:])
    return out


def placeholders(command: str) -> list[str]:
    return PLACEHOLDER.findall(command)


def paste(procs: ProcessGroup, command: str, cwd: Path, log: Path, home: Path) -> subprocess.Popen:
    """``command`` pasted into a shell in ``cwd`` (bash, its quoting and ``$(...)`` as a terminal would), where
    ``potluck`` is the command ``pip install -e .`` installed."""
    path = os.pathsep.join([str(Path(potluck_exe()).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "HOME": str(home), "PWD": str(cwd), "PATH": path}
    log.write_text(f"$ {command}\n")
    return procs.spawn(["bash", "-c", f"cd {shlex.quote(str(cwd))} && exec {command}"], log, env)


def pasted(procs: ProcessGroup, command: str, cwd: Path, log: Path, home: Path, timeout: float = 120) -> tuple[int, str]:
    proc = paste(procs, command, cwd, log, home)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{command} still runs after {timeout:.0f} s:\n{log.read_text()}")
    return code, log.read_text()


def python_lines(export_output: str) -> str:
    """The Python lines ``potluck export`` printed under "load it in Python with:", as a script."""
    assert "load it in Python with:" in export_output, export_output
    lines = export_output.split("load it in Python with:\n", 1)[1].splitlines()
    return "\n".join(line[2:] for line in lines if line.startswith("  "))


def exported(procs: ProcessGroup, command: str, cwd: Path, log: Path, home: Path) -> None:
    """A printed export command pastes and writes its file, and the Python lines it prints then load it."""
    code, output = pasted(procs, command, cwd, log, home)
    assert code == 0, output
    out = shlex.split(command)[shlex.split(command).index("--out") + 1]
    assert (cwd / out).exists(), output
    done = subprocess.run([sys.executable, "-c", python_lines(output)], cwd=cwd, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"{python_lines(output)}\n{done.stderr}"


def following_errors(procs: ProcessGroup, command: str, cwd: Path, home: Path, log: Path, theirs: dict[str, str],
                     started: str) -> tuple[subprocess.Popen, str]:
    """Run ``command`` as a user would until it prints ``started``: each time it fails, the one flag of ``theirs`` its
    error names (a flag of that command) is added, with the user's value (or its value replaced, if given). Each flag
    of ``theirs`` must have been named once; returns the process and the command that got there."""
    sub = shlex.split(command)[1]
    followed: list[str] = []
    for attempt in range(len(theirs) + 1):
        at = log.with_name(f"{log.stem}-{attempt}.log")
        proc = paste(procs, command, cwd, at, home)
        wait_for(lambda: proc.poll() is not None or started in at.read_text(), 120,  # noqa: B023
                 f"{command} to start or fail")
        if proc.poll() is None:
            assert sorted(followed) == sorted(theirs), (followed, command)
            return proc, command
        error = at.read_text()
        assert proc.returncode == 2, error
        said = error.split("\n", 1)[1]  # (under the command line the log starts with)
        named = [flag for flag in theirs if re.search(rf"{flag}(?![\w-])", said) and flag not in followed]
        assert len(named) == 1, f"{command}: an error that names no flag to add, or several:\n{error}"
        assert named[0] in visible(sub), f"{error}\n{named[0]} is not a flag of potluck {sub}"
        followed.append(named[0])
        words = shlex.split(command)
        if named[0] in words:
            words[words.index(named[0]) + 1] = theirs[named[0]]
        else:
            words += [named[0], theirs[named[0]]]
        command = shlex.join(words)
    pytest.fail(f"{command}: still refused with every flag its errors named")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_private_text_run_its_errors_and_its_status_print_commands_that_paste(swarm: LocalSwarm, tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator starts a private run on a text file, its journal and corpus named as the README names them,
    relative to their folder, and lends their own machine twice, each time from another folder: once with the
    ``start a peer:`` line it printed, as printed; once with the status page's ``lend a GPU:`` line, following each
    error to the flag it names with what they have (a key of its own for a second peer, the run's token, the corpus),
    until it trains. The run needs both. Then the status page's export line, pasted where the coordinator runs,
    writes the model, and the Python lines export prints load it."""
    host, first, second, home = (tmp_path / n for n in ("host", "first", "second", "home"))
    for folder in (host, first, second):
        folder.mkdir()
    corpus = host / "corpus.txt"
    corpus.write_bytes(b"".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n".encode() for i in range(400)))
    monkeypatch.chdir(host)  # (the coordinator runs there)
    swarm.start_coordinator({"data.source": "bytes", "data.path": "corpus.txt", "admission.mode": "private",
                             "coordinator.journal_dir": "text-run", "membership.min_peers": 2,
                             "diloco.outer_steps": 2, "diloco.inner_steps": 5, "model.seq_len": 32,
                             "coordinator.checkpoint_every": 5})  # (the default: the final one, for the export line)
    logs = swarm.logs
    seen = printed((logs / "coordinator.log").read_text())
    status_url = re.search(r"status page: +(\S+)", (logs / "coordinator.log").read_text())
    assert set(seen) == {"start a peer"} and status_url, seen
    assert not placeholders(seen["start a peer"]), seen["start a peer"]

    started = paste(swarm.procs, seen["start a peer"], first, logs / "start-a-peer.log", home)  # (its key: ~/.potluck)
    wait_for(lambda: "joined run" in (logs / "start-a-peer.log").read_text() or started.poll() is not None, 120,
             "the pasted start-a-peer line to join")
    assert started.poll() is None, (logs / "start-a-peer.log").read_text()

    code, shown = pasted(swarm.procs, f"potluck status {status_url[1]}", second, logs / "status-1.log", home)
    assert code == 0, shown
    seen.update(printed(shown))
    command = seen["lend a GPU"]
    assert not placeholders(command) and parse_join_address(shlex.split(command)[3]), command
    theirs = {"--identity": str(second / "second.key"),  # "give this one its own ... (a missing FILE is created)"
              "--token": (host / "text-run" / "join.token").read_text().strip(),  # the operator's, in its file
              "--data-path": str(corpus)}
    lent, _ = following_errors(swarm.procs, command, second, home, logs / "lend-a-gpu.log", theirs, "joined run")

    state = swarm.wait_state(lambda s: s["run"]["finished"] and s["run"]["model_export"]["version"], 240,
                             "both peers to train the run")
    assert [h["step"] for h in state["history"]] == [1, 2] and {h["members"] for h in state["history"]} == {2}
    assert started.wait(timeout=60) == 0 and lent.wait(timeout=60) == 0

    code, shown = pasted(swarm.procs, f"potluck status {status_url[1]}", host, logs / "status-2.log", home)
    assert code == 0, shown
    seen.update(printed(shown))
    wait_for(lambda: "export the model:" in (logs / "coordinator.log").read_text(), 60, "the coordinator's export line")
    seen.update(printed((logs / "coordinator.log").read_text()))  # (its console: the journal's whole path)
    assert set(seen) == {"start a peer", "lend a GPU", "the model", "export the model"}, seen
    assert seen["the model"] == "potluck export --journal-dir text-run --out model.pt", seen
    exported(swarm.procs, seen["the model"], host, logs / "export.log", home)
    assert seen["export the model"] == f"potluck export --journal-dir {host / 'text-run'} --out model.pt", seen
    exported(swarm.procs, seen["export the model"], second, logs / "export-anywhere.log", home)  # from any folder

    # the operator's next run, a bigger model, typed over the last command: its journal and its DHT port are taken
    dht_port = re.search(r"/tcp/(\d+)/", seen["start a peer"])
    assert dht_port, seen
    command = f"potluck coordinator --config {swarm.workdir / 'run.toml'} --set model.d_model=64 --dht-port {dht_port[1]}"
    theirs = {"--journal-dir": "bigger-run", "--dht-port": "0"}  # "... or 0 for any free port"
    coordinator, command = following_errors(swarm.procs, command, host, home, logs / "next-run.log", theirs,
                                            "start a peer:")
    assert re.search(r"run: +test \(outer step 0 of 2\)", (logs / "next-run-2.log").read_text())  # a new run
    coordinator.send_signal(signal.SIGINT)
    assert coordinator.wait(timeout=60) == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_demo_and_its_status_print_commands_that_paste(procs: ProcessGroup, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``potluck demo`` as a user runs it (a fresh interpreter, its work folder a temporary one): its status page,
    pasted into ``potluck status``, prints a ``lend a GPU:`` line that pastes and joins its run, then, once trained,
    the line that exports the model; Ctrl+C ends the demo, whose last lines say how to export the model and how to
    remove its folder, and both paste."""
    monkeypatch.chdir(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    log = tmp_path / "demo.log"
    env = {"TMPDIR": str(tmp_path), "HOME": str(home)}
    demo = procs.spawn([sys.executable, "-m", "potluck", "demo", "--peers", "1", "--outer-steps", "3",
                        "--inner-steps", "5", "--set", "membership.min_peers=2", "--linger", "600"], log, env)
    wait_for(lambda: "status page:" in log.read_text() or demo.poll() is not None, 180, "the demo's status page")
    head = log.read_text()
    join, url = re.search(r"join address: (\S+)", head), re.search(r"status page: (\S+)", head)
    assert join and url and parse_join_address(join[1]), head

    code, shown = pasted(procs, f"potluck status {url[1]}", tmp_path, tmp_path / "status-1.log", home)
    assert code == 0, shown
    seen = printed(shown)
    assert seen["lend a GPU"] == f"potluck peer --join {join[1]}", seen  # (the run waits for a second peer: this one)
    code, shown = pasted(procs, seen["lend a GPU"], tmp_path, tmp_path / "lend-a-gpu.log", home, timeout=240)
    assert code == 0, shown

    wait_for(lambda: "lingering" in log.read_text() or demo.poll() is not None, 240, "the demo to finish training")
    code, shown = pasted(procs, f"potluck status {url[1]}", tmp_path, tmp_path / "status-2.log", home)
    assert code == 0, shown
    seen.update(printed(shown))
    demo.send_signal(signal.SIGINT)  # "(Ctrl+C to stop)"
    assert demo.wait(timeout=60) == 130, log.read_text()
    seen.update(printed(log.read_text()))
    assert set(seen) == {"lend a GPU", "the model", "export the model", "remove it"}, seen
    for label, command in seen.items():
        assert label == "the model" or not placeholders(command), command
    # the status page keeps the demo's folder private (an absolute journal dir): its one placeholder names it
    folder = Path(shlex.split(seen["remove it"])[-1])
    assert placeholders(seen["the model"]) == ["JOURNAL_DIR"], seen["the model"]
    assert seen["the model"].replace("JOURNAL_DIR", shlex.quote(str(folder / "journal"))) == seen["export the model"]

    exported(procs, seen["export the model"], tmp_path, tmp_path / "export.log", home)
    code, shown = pasted(procs, seen["remove it"], tmp_path, tmp_path / "rm.log", home)
    assert code == 0 and not folder.exists() and folder.parent == tmp_path, shown



def test_the_join_line_says_what_a_private_or_text_run_also_needs() -> None:
    """``lend a GPU:`` on a private run on a text file: the flags its errors would name, said before them."""
    from fake_state import make_state

    from potluck.coordinator.status.status_cli import summary

    state = make_state()
    assert "also needs" not in summary(state)
    state["run"].update(admission="private", data={**state["run"]["data"], "source": "bytes"})
    text = summary(state)
    assert "  (a private run: potluck peer also needs --token, with the token its operator hands out)" in text, text
    assert "  (a run on a text file: potluck peer also needs --data-path, with your copy of it" in text, text
