"""``potluck``'s command line as a new user meets it: helps that describe and show, one-line errors.

Every check runs ``python -m potluck`` as a subprocess from an empty directory, as a shell would.
How fast the helps answer is a claim of ``benchmarks/cli_help.py``, not of these tests.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from potluck.cli import UsageError, build_parser, demo_grid
from potluck.protos.net.identity import Identity, IdentityError, public_key_from_peer_id

COMMANDS = ["demo", "coordinator", "peer", "status", "schedule", "export", "generate", "data"]
PEER_ID = Identity.generate().peer_id
JOIN = f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER_ID}"


def potluck(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "80"}
    return subprocess.run([sys.executable, "-m", "potluck", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_parser_knows_every_command() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == COMMANDS


def loaded_after(statement: str, modules: tuple[str, ...], cwd: Path) -> str:
    """Which of ``modules`` a fresh interpreter has imported after running ``statement``."""
    code = f"import sys; {statement}; print(' '.join(m for m in {modules!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_building_the_parser_imports_nothing_heavy(tmp_path: Path) -> None:
    heavy = ("torch", "numpy", "scipy", "hivemind", "grpc", "pydantic")
    assert loaded_after("from potluck.cli import build_parser; build_parser()", heavy, tmp_path) == ""


def test_schedule_searches_without_torch_or_hivemind(tmp_path: Path) -> None:
    """``potluck schedule`` is numpy and scipy only: its help answers in well under half a second."""
    statement = "from potluck.coordinator.placement import schedule_cli, scheduler"
    assert loaded_after(statement, ("torch", "hivemind", "grpc", "transformers"), tmp_path) == ""


def test_top_level_help_lists_every_command_with_a_description(tmp_path: Path) -> None:
    done = potluck("--help", cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == ""
    for name in COMMANDS:
        line = re.search(rf"^    {name} +(\S.*)$", done.stdout, re.MULTILINE)
        assert line, f"{name} has no one-line description in:\n{done.stdout}"
        assert len(line.group(1).split()) >= 4
    assert "quick start:" in done.stdout and "potluck demo" in done.stdout
    assert potluck("--version", cwd=tmp_path).stdout.startswith("potluck ")


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_help_has_a_description_and_examples(name: str, tmp_path: Path) -> None:
    done = potluck(name, "--help", cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == ""
    text = done.stdout
    description = text.split("\n\n")[1]  # usage, blank line, description
    assert not description.startswith(("options:", "positional arguments:")) and len(description.split()) >= 15
    examples = text.split("examples:\n", 1)[1]
    assert re.search(rf"^  potluck {name}\b", examples, re.MULTILINE)
    for markup in ("``", ":class:", ":func:", ":data:", ":mod:", "::"):
        assert markup not in text, f"RST markup {markup!r} in `potluck {name} --help`"
    assert max(map(len, text.splitlines())) <= 80, "a line wider than an 80-column terminal"


# ---------------------------------------------------------------------- usage mistakes

BAD_ID = PEER_ID[:8] + ("z" if PEER_ID[8] != "z" else "2") + PEER_ID[9:]  # still 52 characters

MISTAKES = {
    "device": (["peer", "--join", JOIN, "--device", "tpu"], ["--device", "'tpu'", "cpu", "cuda:N"]),
    "demo grid": (["demo", "--stages", "2", "--peers", "3"], ["stages x replicas", "--replicas"]),
    "demo grid with replicas": (["demo", "--stages", "2", "--replicas", "3", "--peers", "4"], ["= 6"]),
    "demo stages": (["demo", "--stages", "0"], ["--stages must be at least 1"]),
    "address without id": (["peer", "--join", "/ip4/127.0.0.1/tcp/31337"], ["/p2p/"]),
    "truncated id": (["peer", "--join", JOIN[:-10]], ["has 42 characters", "52"]),
    "mistyped id": (["peer", "--join", JOIN.replace(PEER_ID, BAD_ID)], ["typos"]),
    "not an Ed25519 id": (["peer", "--join", JOIN.replace(PEER_ID, "Qm" + PEER_ID[2:46])], ["start with 12D3KooW"]),
    "port": (["peer", "--join", JOIN, "--grpc-port", "99999"], ["--grpc-port 99999", "65535"]),
    "missing --join": (["peer"], ["--join"]),
    "shard without torchrun": (["peer", "--join", JOIN, "--devices", "shard"], ["torchrun", "--nproc-per-node"]),
    "unknown devices mode": (["peer", "--join", JOIN, "--devices", "split"], ["--devices", "replicate", "shard"]),
    "no command": ([], ["COMMAND"]),
    "unknown command": (["frobnicate"], ["invalid choice"]),
    "bad --set": (["coordinator", "--set", "diloco"], ["SECTION.FIELD=VALUE", "--set diloco=VALUE"]),
    "--set with a space": (["coordinator", "--set", "diloco.inner_steps", "10"], ["--set diloco.inner_steps=10"]),
    "demo --set with a space": (["demo", "--set", "diloco.inner_steps", "10"], ["--set diloco.inner_steps=10"]),
    "unknown field": (["coordinator", "--set", "diloco.nope=1"], ["diloco.nope"]),
    "mistyped field": (["coordinator", "--set", "diloco.inner_step=1"], ["did you mean diloco.inner_steps?"]),
    "field of another section": (["coordinator", "--set", "train.inner_steps=1"], ["did you mean diloco.inner_steps?"]),
}


@pytest.mark.parametrize("case", list(MISTAKES))
def test_a_usage_mistake_is_one_line_and_status_2(case: str, tmp_path: Path) -> None:
    argv, wanted = MISTAKES[case]
    done = potluck(*argv, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("potluck") and "error: " in lines[0]
    for text in wanted:
        assert text in lines[0]
    ids = re.findall(r"12D3KooW\w*", " ".join(argv))
    if ids and "start with 12D3KooW" in lines[0]:  # the old message said so even of ids that did
        assert not all(i.startswith("12D3KooW") for i in ids), lines[0]


def test_peer_id_errors_do_not_contradict_the_id() -> None:
    for pid, wanted in ((PEER_ID[:20], "has 20 characters"), (BAD_ID, "typos"), ("Qm" + PEER_ID[2:], "start with")):
        with pytest.raises(IdentityError, match=wanted):
            public_key_from_peer_id(pid)
    assert len(public_key_from_peer_id(PEER_ID)) == 32


# ---------------------------------------------------------------------- renamed flags


def test_renamed_flags_keep_their_old_spelling_hidden(tmp_path: Path) -> None:
    parser = build_parser()
    old = parser.parse_args(["export", "--journal", "j", "--version", "3"])
    new = parser.parse_args(["export", "--journal-dir", "j", "--step", "3"])
    assert (old.journal_dir, old.step) == (new.journal_dir, new.step) == ("j", 3)
    assert parser.parse_args(["peer", "--join", JOIN, "--port", "7"]).port == 7
    assert parser.parse_args(["peer", "--join", JOIN, "--grpc-port", "7"]).port == 7
    export_help = potluck("export", "--help", cwd=tmp_path).stdout
    assert "--step" in export_help and "--journal-dir" in export_help
    assert "--version" not in export_help and "--journal " not in export_help
    assert not re.search(r"(?<![\w-])--port\b", potluck("peer", "--help", cwd=tmp_path).stdout)
    done = potluck("export", "--journal", str(tmp_path / "none"), "--version", "3", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--version is deprecated, use --step" in done.stderr and "no checkpoint of outer step 3" in done.stderr


@pytest.mark.parametrize(("stages", "replicas", "peers", "grid"), [
    (1, None, None, (3, None)),
    (1, None, 5, (5, None)),
    (2, None, None, (4, 2)),
    (2, None, 6, (6, 3)),
    (2, 3, None, (6, 3)),
    (2, 3, 6, (6, 3)),
    (1, 3, None, (3, 3)),
])
def test_demo_grid(stages: int, replicas: int | None, peers: int | None, grid: tuple[int, int | None]) -> None:
    assert demo_grid(stages, replicas, peers) == grid


@pytest.mark.parametrize(("stages", "replicas", "peers"), [(2, None, 3), (3, None, 2), (2, 2, 5), (1, 3, 2), (1, 0, None)])
def test_demo_grid_refuses_peers_that_do_not_fill_it(stages: int, replicas: int | None, peers: int | None) -> None:
    with pytest.raises(UsageError):
        demo_grid(stages, replicas, peers)


def test_a_private_runs_join_token_is_taken_as_the_coordinator_prints_it(tmp_path: Path) -> None:
    """The coordinator says ``potluck peer --join ... --token TOKEN``. A token that began with "-" (1 in 64 of the
    urlsafe ones) was read as an option: "argument --token: expected one argument" (a suite's private-run test
    timed out on it once in a while)."""
    from potluck.coordinator.store.journal import kept_secret

    parser = build_parser()
    for i in range(300):
        token = kept_secret(tmp_path / f"join-{i}.token", "POTLUCK_TEST_UNSET_TOKEN")
        assert len(token) >= 32 and parser.parse_args(["peer", "--join", JOIN, "--token", token]).token == token
