"""The README, read: its fenced blocks, inline code and bash commands, parsed once, for the tests that
check it (:mod:`test_readme`: every block and command works as written; :mod:`test_readme_runs`: the
runs it describes, for real).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from potluck.cli import build_parser
from potluck.protos.net.identity import Identity

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
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


@dataclass(frozen=True)
class Section:
    """The part of the README under one heading, down to the next heading of its level or above."""

    title: str
    first: int  # its heading's line, 1-based
    last: int  # its last line
    prose: str  # its text without its fenced blocks
    blocks: tuple[Block, ...]

    def lines(self) -> list[str]:
        """Its bash lines (continued lines joined), in the order written."""
        return [line for b in self.blocks if b.lang == "bash" for line in b.text.replace("\\\n", " ").splitlines()
                if line.strip()]

    def commands(self) -> list[list[str]]:
        """Its bash commands, in the order written."""
        return [argv for line in self.lines() for argv in commands(line)]


def section(title: str, markdown: str = "") -> Section:
    """The README's section headed ``title`` (any level: ``### Your own text``)."""
    markdown = markdown or TEXT
    lines = prose(markdown).splitlines()
    heads = [(i + 1, len(m[1]), m[2].strip()) for i, line in enumerate(lines) if (m := re.match(r"^(#+) (.+)$", line))]
    at = [k for k, (_, _, t) in enumerate(heads) if t == title]
    assert len(at) == 1, f"the README should have one section '{title}', it has {len(at)}"
    first, level, _ = heads[at[0]]
    last = next((line - 1 for line, lv, _ in heads[at[0] + 1:] if lv <= level), len(lines))
    blocks = tuple(b for b in fenced_blocks(markdown) if first < b.line <= last)
    return Section(title, first, last, "\n".join(lines[first - 1:last]), blocks)


# ---------------------------------------------------------------------- what the commands name

def fill(arg: str) -> str:
    """A README argument with its placeholders filled: a join address gets a port and a real id."""
    return arg.replace("/tcp/PORT/", "/tcp/31337/").replace("/p2p/12D3KooW...", f"/p2p/{PEER_ID}")

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

def potluck_exe() -> str:
    """The ``potluck`` console script that ``pip install -e .`` puts next to this Python."""
    exe = shutil.which("potluck", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    assert exe, "no potluck command: run 'pip install -e .' (the README's first command)"
    return exe

def readme_command(*head: str, having: str | None = None, lacking: str | None = None) -> list[str]:
    found = [argv for argv in BASH if argv[:len(head)] == list(head)
             and (having is None or having in argv) and (lacking is None or lacking not in argv)]
    assert len(found) == 1, f"the README should show one '{' '.join(head)}' command, it shows {found}"
    return found[0]
