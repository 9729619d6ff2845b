"""The code's shape is part of its design (docs/architecture.md): layering, rooms with maps, plain classes, and a
repository that stands alone (no file cites a document outside it)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("protos", "kernels", "compression", "models", "data", "peer", "coordinator", "potluck")
# who may import whom (top to bottom; nothing points back up)
ALLOWED = {
    "protos": {"protos"},
    "kernels": {"kernels", "protos"},
    "compression": {"compression", "kernels", "protos"},
    "models": {"models", "kernels", "protos"},
    "data": {"data", "protos"},
    "peer": {"peer", "models", "data", "compression", "kernels", "protos"},
    "coordinator": {"coordinator", "models", "data", "compression", "kernels", "protos"},
    "potluck": set(FOLDERS),
}
FOLDER_OF = {"protos": "protos", "kernels": "kernels", "compression": "compression", "peer": "peer",
             "coordinator": "coordinator", "models": "models", "data": "data"}
PATH_OF = {"models": "potluck/models", "data": "potluck/data"}
ROOMS_OF_PROTOS = ("wire", "net", "config", "runtime", "testkit")


def modules(folder: str) -> list[Path]:
    """The folder's modules, its rooms' too (``protos/net/...``); not the packages nested as folders of their own
    (``potluck/models``), nor generated code."""
    base = ROOT / PATH_OF.get(folder, folder)
    rooms = [d for d in base.iterdir() if d.is_dir() and (d / "__init__.py").exists() and d.name not in PATH_OF]
    return sorted(p for d in [base, *rooms] for p in d.glob("*.py") if not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))


def potluck_imports(path: Path) -> set[str]:
    """The potluck sub-packages a module imports (``potluck.peer.x`` -> ``peer``; the root -> ``potluck``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "potluck" and [a.name for a in node.names] == ["__version__"]:
            continue  # the package's version is metadata every layer may read
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        for name in names:
            parts = name.split(".")
            if parts[0] == "potluck":
                out.add(FOLDER_OF.get(parts[1], "potluck") if len(parts) > 1 else "potluck")
    return out


def test_protos_is_rooms_each_with_its_map() -> None:
    """protos/ holds the protocol and its generated code; everything else lives in a room whose __init__ says
    what each of its modules holds."""
    loose = sorted(p.name for p in (ROOT / "protos").glob("*.py")
                   if p.name not in ("__init__.py", "generate.py") and not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))
    assert not loose, f"modules outside a room of protos/: {loose}"
    for room in ROOMS_OF_PROTOS:
        doc = ast.get_docstring(ast.parse((ROOT / "protos" / room / "__init__.py").read_text())) or ""
        named = {p.stem for p in (ROOT / "protos" / room).glob("*.py") if p.name != "__init__.py"}
        missing = sorted(m for m in named if f"``{m}``" not in doc)
        assert not missing, f"protos/{room}/__init__.py does not say what {missing} hold"


@pytest.mark.parametrize("folder", FOLDERS)
def test_imports_point_one_way(folder: str) -> None:
    bad = {f"{p.relative_to(ROOT)} imports {sorted(potluck_imports(p) - ALLOWED[folder])}"
           for p in modules(folder) if potluck_imports(p) - ALLOWED[folder]}
    assert not bad, sorted(bad)


INITIALIZERS = ("__init__", "__post_init__", "setup")  # setup: how socketserver handlers initialise


def first_set_outside_init(path: Path) -> list[str]:
    """Attributes of ``self`` assigned in a method before (or without) being assigned in ``__init__``."""
    out = []
    for cls in [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]:
        init: set[str] = set()
        dataclass_fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        others: dict[str, str] = {}
        for fn in [n for n in cls.body if isinstance(n, ast.FunctionDef)]:
            for node in ast.walk(fn):
                targets = node.targets if isinstance(node, ast.Assign) else (
                    [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else [])
                for t in targets:
                    for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                            (init.add(el.attr) if fn.name in INITIALIZERS else others.setdefault(el.attr, fn.name))
        out += [f"{cls.name}.{a} (first set in {m})" for a, m in others.items() if a not in init | dataclass_fields]
    return out


@pytest.mark.parametrize("folder", ["peer", "coordinator"])
def test_no_attribute_is_first_set_outside_init(folder: str) -> None:
    bad = [f"{p.name}: {b}" for p in modules(folder) for b in first_set_outside_init(p)]
    assert not bad, bad


TRACKED = ("protos", "kernels", "compression", "peer", "coordinator", "potluck", "tests", "benchmarks")


def python_files() -> list[Path]:
    """Every Python file of the repo's own code, tests and benchmarks, but generated protobuf code."""
    return sorted(p for folder in TRACKED for p in (ROOT / folder).rglob("*.py")
                  if ".venv" not in p.parts and not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))


# No test caps a file's length: a cap made code split where the count ran out, not where the ideas part (a mixin
# re-declaring its host's attributes, state shared across two files under one lock). Size is a smell for review.


def test_no_private_name_is_imported_across_modules() -> None:
    """``from potluck.x import _name`` reaches into another room's inside: give the name a public one instead."""
    bad = []
    for p in python_files():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("potluck"):
                bad += [f"{p.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, bad


# what only the team's own notes held (outside this repository): a file that cites them sends a reader nowhere
OUTSIDE = ("LESSONS", "ARCHITECTURE.md", "STYLE.md", "design card", "../shared", "shared/")


def test_no_file_cites_a_document_outside_the_repository() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    cited = []
    for name in tracked:
        path = ROOT / name
        if path.suffix in (".png", ".svg", ".ico") or name == "tests/test_layout.py" or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        cited += [f"{name}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
                  if any(word in line for word in OUTSIDE)]
    assert not cited, "\n".join(cited)


def test_every_test_that_starts_a_swarm_is_marked_slow() -> None:
    """The fast tier (``-m "not slow"``) starts no coordinator and no peer: a test taking the ``procs`` or ``swarm``
    fixture is marked slow (the fixture itself fails an unmarked one at run time; this finds them all at once)."""
    unmarked = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_slow = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                          and "slow" in ast.unparse(n.value) for n in tree.body)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                starts = {a.arg for a in node.args.args} & {"procs", "swarm"}
                if starts and not module_slow and not any("slow" in ast.unparse(d) for d in node.decorator_list):
                    unmarked.append(f"{path.name}::{node.name} ({', '.join(sorted(starts))})")
    assert not unmarked, unmarked
