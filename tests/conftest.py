"""Shared fixtures: every process a test starts is reaped, whatever happens in the test."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests import their helpers as plain modules

from swarm import LocalSwarm

from potluck.procs import ProcessGroup, group_alive

ARTIFACTS = Path(os.environ.get("POTLUCK_ARTIFACTS", Path(__file__).resolve().parent.parent / "artifacts"))


SWARMS = "swarms"  # the xdist group of every slow test (pyproject.toml's addopts: -n 2 --dist loadgroup)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every slow test goes to one worker, one at a time: each is a swarm of OS processes that a second swarm
    beside it on CI's 2 cores would starve (two of them at once failed three tests in a tried run), and their
    deadlines are set for one swarm on the box. The fast tier's tests share out over both workers, and so does a
    slow test that starts no swarm and names a group of its own (mypy: a minute of CPU, no deadline)."""
    for item in items:
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(SWARMS))


@pytest.fixture
def procs(request: pytest.FixtureRequest) -> Iterator[ProcessGroup]:
    if request.node.get_closest_marker("slow") is None:  # the fast tier starts no coordinator and no peer
        pytest.fail(f"{request.node.nodeid} starts potluck processes (the procs or swarm fixture): mark it "
                    "@pytest.mark.slow, so `pytest -m 'not slow'` stays the quick loop", pytrace=False)
    group = ProcessGroup(fork=True)
    try:
        yield group
    finally:
        group.stop(timeout=10)
        leaked = [p.pid for p in group.procs if group_alive(p.pid)]
        assert not leaked, f"process groups left behind: {leaked}"


@pytest.fixture
def swarm(procs: ProcessGroup, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalSwarm]:
    s = LocalSwarm(procs, tmp_path)
    try:
        yield s
    finally:
        failed = getattr(request.node, "rep_call", None)
        if failed is not None and failed.failed:
            s.dump_logs()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture(autouse=True)
def _potluck_logs_reach_caplog(request: pytest.FixtureRequest) -> Iterator[None]:
    """potluck's logger stops at its own handler (``propagate = False``), so ``caplog`` saw its records only when an
    earlier test had let them through: a test that reads caplog passed in the whole suite and failed alone."""
    if "caplog" not in request.fixturenames:
        yield
        return
    logger = logging.getLogger("potluck")
    before, logger.propagate = logger.propagate, True
    try:
        yield
    finally:
        logger.propagate = before
