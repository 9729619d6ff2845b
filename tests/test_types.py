"""The package type-checks: ``mypy -p potluck`` passes, with the configuration in pyproject.toml's ``[tool.mypy]``.

mypy cannot follow the editable install's import finder, which maps the top-level folders (``protos/``,
``peer/``, ...) into the one namespace ``potluck.*``. So the test builds that namespace as mypy can read it: a
folder ``potluck`` of links to the files of the repository's ``potluck/`` and to each mapped folder, under the
name it imports as, taken from pyproject.toml's ``package-dir`` (a new top-level folder is checked once it is
mapped there), and points ``MYPYPATH`` at it. Slow: a cold run takes about a minute, in two worker processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOT = "potluck"  # the namespace every folder imports into


def namespace_tree(dest: Path) -> Path:
    """``dest``/potluck as the package imports: the folder MYPYPATH must name."""
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert package_dir.get(ROOT) == ROOT, f"pyproject.toml's package-dir maps {ROOT!r} to {package_dir.get(ROOT)!r}"
    subs = {name.removeprefix(ROOT + "."): folder for name, folder in package_dir.items() if name != ROOT}
    odd = [name for name in subs if "." in name or name in package_dir]
    assert not odd, f"package-dir maps {odd}, not a subpackage of {ROOT} one level down: teach this test to link it"
    top = dest / ROOT
    top.mkdir(parents=True)
    for entry in sorted((REPO / ROOT).iterdir()):
        if entry.name != "__pycache__" and entry.name not in subs:
            (top / entry.name).symlink_to(entry)
    for name, folder in subs.items():
        (top / name).symlink_to(REPO / folder, target_is_directory=True)
    return dest


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.xdist_group("mypy")  # no swarm: it runs on the other worker, beside the swarms (tests/conftest.py)
def test_mypy_passes(tmp_path: Path) -> None:
    tree = namespace_tree(tmp_path / "tree")
    env = {**os.environ, "MYPYPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "-p", ROOT, "--config-file", str(REPO / "pyproject.toml"),
         "--cache-dir", str(tmp_path / "mypy-cache"),
         "--num-workers", "2"],  # (mypy >= 2: two processes; on CI's 2 cores a cold run 90 -> 72 s)
        cwd=REPO, env=env, capture_output=True, text=True, timeout=570,
    )
    assert done.returncode == 0, f"mypy -p {ROOT} failed (exit {done.returncode}):\n{done.stdout}{done.stderr}"
