"""Every potluck process is stoppable: within a bound, at any moment, taking its children along.

Real OS processes. Coordinators and peers get SIGTERM at different moments (still importing,
starting their DHT node, just ready, training), once or twice in a row, and must be gone, with
everything in their process group, within ``EXIT_S``. A SIGKILLed ``potluck demo`` must not leave
its swarm running, and the CLI must work from a folder where ``./potluck`` is not the package.

Several tries run at once (on a loaded machine is where shutdown paths are slow), each signalled
when an observable condition holds or after a small delay drawn from a seeded RNG.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from swarm import LocalSwarm, run_config

from potluck.procs import ProcessGroup, group_alive
from potluck.protos.config.files import dump_toml
from potluck.protos.runtime.stopping import descendants

pytestmark = pytest.mark.slow

EXIT_S = 10.0  # from SIGTERM until the process and its whole group are gone
SECOND_S = 3.0  # from a second SIGTERM, during the orderly shutdown, until the process is gone
TRIES = 12  # (three a phase: 20 took 70 s of CI's 30 minutes)
PARALLEL = 4
START_S = 120.0  # a try must reach the moment it is signalled at within this long
REPO = Path(__file__).resolve().parent.parent

# A run that never ends while the tries come and go; any peer is enough for a round.
RUN = {"diloco.outer_steps": 100_000, "membership.min_peers": 1, "data.eval_every": 0}


def tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)
    return value


class PeerStates:
    """Each peer's state by name, as the coordinator's status page shows it (fetched at most every 0.2 s,
    so watching many tries does not slow down timing their exits)."""

    def __init__(self, url: str) -> None:
        self.url, self.at = url, 0.0
        self.states: dict[str, str] = {}

    def __call__(self, name: str) -> str | None:
        if time.monotonic() - self.at > 0.2:
            self.at = time.monotonic()
            try:
                with urllib.request.urlopen(self.url + "api/v1/state", timeout=1) as resp:
                    self.states = {p.get("name"): p.get("state") for p in json.loads(resp.read()).get("peers", [])}
            except (OSError, ValueError):
                pass
        return self.states.get(name)


@dataclass
class Try:
    """One process, signalled once ``due()`` holds; ``exit_s``: signal to the group being gone."""

    name: str
    proc: subprocess.Popen
    log: Path
    due: Callable[[], bool]
    started: float
    signalled: float | None = None
    exit_s: float | None = None
    error: str | None = None


def run_tries(procs: ProcessGroup, start: Callable[[int], Try], n: int) -> list[Try]:
    """Start ``n`` tries, ``PARALLEL`` at a time; SIGTERM each when due, time its way out."""
    waiting, running, done = list(range(n)), list[Try](), list[Try]()
    while waiting or running:
        while waiting and len(running) < PARALLEL:
            running.append(start(waiting.pop(0)))
        now = time.monotonic()
        for t in list(running):
            if t.signalled is None:
                if t.proc.poll() is not None:
                    t.error = f"exited with {t.proc.returncode} before it was signalled"
                elif t.due():
                    os.kill(t.proc.pid, signal.SIGTERM)
                    t.signalled = time.monotonic()
                elif now - t.started > START_S:
                    t.error = f"not due within {START_S:.0f} s"
            elif t.proc.poll() is not None and not group_alive(t.proc.pid):
                t.exit_s = time.monotonic() - t.signalled
            elif now - t.signalled > EXIT_S:
                t.error = f"still running {EXIT_S:.0f} s after SIGTERM"
            if t.error or t.exit_s is not None:
                if t.error:
                    procs.kill(t.proc)
                running.remove(t)
                done.append(t)
        time.sleep(0.02)
    return done


def check(tries: list[Try], what: str) -> None:
    failed = [f"{t.name}: {t.error}\n{tail(t.log)}" for t in tries if t.error]
    assert not failed, "\n\n".join(failed)
    times = sorted(t.exit_s for t in tries if t.exit_s is not None)
    codes = sorted({t.proc.returncode for t in tries})
    print(f"{what}: {len(times)} exits, median {statistics.median(times):.2f} s, max {times[-1]:.2f} s, exit codes {codes} "
          f"({', '.join(f'{t.name} {t.exit_s:.2f} s/{t.proc.returncode}' for t in tries)})")
    assert len(times) == len(tries) and times[-1] <= EXIT_S


def has_children(proc: subprocess.Popen) -> bool:
    return bool(descendants(proc.pid))


STUCK = """
import ctypes, multiprocessing, subprocess, sys, threading, time
from potluck.protos.runtime.stopping import children_die_with_parent, install_stop_handlers
stopping = threading.Event()
install_stop_handlers(stopping, grace_s=1.0)
children_die_with_parent()
forked = multiprocessing.get_context("fork").Process(target=time.sleep, args=(1000,))
forked.start()
execd = subprocess.Popen(["sleep", "1000"])
print(forked.pid, execd.pid, flush=True)
stopping.wait()
if sys.argv[1] == "wedged":
    ctypes.PyDLL(None).sleep(1000)  # holds the GIL: no watchdog thread, no second signal can run
time.sleep(1000)
"""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("how", ["ignores the stop", "wedged"])
def test_watchdog_ends_a_process_that_does_not_stop(how: str, procs: ProcessGroup, tmp_path: Path) -> None:
    """Past the grace period the watchdog kills what is below and exits; if even it cannot run (the
    GIL held in C code), the kernel ends the process and the parent-death signal its forked child."""
    log = tmp_path / "stuck.log"
    proc = procs.spawn([sys.executable, "-c", STUCK, how.split()[0]], log)
    pids = wait_for(lambda: log.exists() and log.read_text().split(), START_S, "the children's pids")
    forked, execd = (int(p) for p in pids[:2])
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=EXIT_S)
    exited = time.monotonic() - t0
    wait_for(lambda: not alive(forked), 2.0, "the forked child to die with its parent")
    if how == "wedged":  # only children with a parent-death signal can follow
        os.kill(execd, signal.SIGKILL)
        wait_for(lambda: not group_alive(proc.pid), 5.0, "the leftover sleep to be reaped")
        assert proc.returncode == -signal.SIGALRM, tail(log)
        assert 1.4 < exited < 3.0, exited
    else:
        assert proc.returncode == 128 + signal.SIGTERM, tail(log)
        assert 0.9 < exited < 2.5, exited
        assert not alive(execd), "hard_exit left a child behind"


def test_coordinator_exits_on_sigterm_at_any_moment(procs: ProcessGroup, tmp_path: Path) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text(dump_toml(run_config(RUN)))
    rng = random.Random(1)

    def start(i: int) -> Try:
        phase = ("importing", "starting", "ready", "serving")[i % 4]
        ready, log = tmp_path / f"ready-{i}.json", tmp_path / f"coordinator-{i}.log"
        proc = procs.spawn_potluck(["coordinator", "--config", str(run_file), "--ready-file", str(ready),
                                    "--journal-dir", str(tmp_path / f"journal-{i}")], log)
        t0, delay = time.monotonic(), rng.uniform(0.0, 1.5)
        due = {
            "importing": lambda: time.monotonic() - t0 > delay,
            "starting": lambda: has_children(proc),  # its DHT process is up, maybe not ready yet
            "ready": ready.exists,
            "serving": lambda: ready.exists() and time.time() - ready.stat().st_mtime > delay,
        }[phase]
        return Try(f"{phase}-{i}", proc, log, due, t0)

    check(run_tries(procs, start, TRIES), "coordinator")


def test_peer_exits_on_sigterm_at_any_moment(swarm: LocalSwarm) -> None:
    peer_state = PeerStates(swarm.start_coordinator(RUN)["status_url"])
    rng = random.Random(2)

    def start(i: int) -> Try:
        phase = ("importing", "starting", "joined", "training")[i % 4]
        name = f"try-{i}"
        proc = swarm.start_peer(name=name)
        t0, delay = time.monotonic(), rng.uniform(0.0, 1.5)
        due = {
            "importing": lambda: time.monotonic() - t0 > delay,
            "starting": lambda: has_children(proc),
            "joined": lambda: peer_state(name) is not None,
            "training": lambda: peer_state(name) == "training",
        }[phase]
        return Try(f"{phase}-{i}", proc, swarm.logs / f"peer-{len(swarm.peers) - 1}.log", due, t0)

    check(run_tries(swarm.procs, start, TRIES), "peer")
    assert swarm.coordinator is not None and swarm.coordinator.poll() is None, swarm.tail("coordinator")


def test_sigkilled_coordinator_takes_its_dht_and_p2pd_along(procs: ProcessGroup, tmp_path: Path) -> None:
    """No exit handler runs on SIGKILL: the DHT process and its p2pd go by their parent-death signal."""
    run_file, ready, log = tmp_path / "run.toml", tmp_path / "ready.json", tmp_path / "coordinator.log"
    run_file.write_text(dump_toml(run_config(RUN, tmp_path / "journal")))
    proc = procs.spawn_potluck(["coordinator", "--config", str(run_file), "--ready-file", str(ready)], log)
    wait_for(lambda: ready.exists() or proc.poll() is not None, START_S, "the coordinator's ready file")
    below = descendants(proc.pid)
    assert len(below) == 2 and b"p2pd" in Path(f"/proc/{below[1]}/cmdline").read_bytes(), (below, tail(log))
    os.kill(below[1], signal.SIGSTOP)  # p2pd cannot notice anything itself: only the kernel can end it
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_for(lambda: not any(alive(p) for p in below), EXIT_S, "the DHT process and p2pd to die with the coordinator")


def signal_twice(proc: subprocess.Popen, log: Path) -> None:
    """SIGTERM, and once the process says it is stopping, SIGTERM again: it must be gone at once."""
    os.kill(proc.pid, signal.SIGTERM)
    wait_for(lambda: "received signal 15" in log.read_text(), EXIT_S, "the first signal's log line")
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    wait_for(lambda: proc.poll() is not None, EXIT_S, f"{log.stem} to exit after the second SIGTERM")
    exited = time.monotonic() - t0
    wait_for(lambda: not group_alive(proc.pid), EXIT_S, f"{log.stem}'s process group to go")
    print(f"{log.stem}: exited {exited:.2f} s after the second SIGTERM (group gone after "
          f"{time.monotonic() - t0:.2f} s), code {proc.returncode}")
    # -SIGTERM: the signal came while the interpreter was finalizing, after Python had given the
    # default disposition back, and the kernel ended the process: gone at once all the same
    assert proc.returncode in (0, 128 + signal.SIGTERM, -signal.SIGTERM), tail(log)
    if proc.returncode == 128 + signal.SIGTERM:
        assert "second signal" in log.read_text()
    assert exited < SECOND_S, f"{exited:.1f} s after the second SIGTERM"


def test_second_sigterm_during_shutdown_exits_at_once(swarm: LocalSwarm) -> None:
    """The first SIGTERM starts an orderly shutdown; one more, while it runs, ends the process now.
    Each shutdown is held at its start (a fault: 30 s, longer than the grace period), so the second
    signal surely lands in it, however quickly this box would have finished it."""
    slow = {"POTLUCK_FAULTS": "shutdown.start@*:sleep=30"}
    peer_state = PeerStates(swarm.start_coordinator(RUN, env=slow)["status_url"])
    peer = swarm.start_peer(name="twice", env=slow)
    wait_for(lambda: peer_state("twice") == "training" or peer.poll() is not None, START_S, "the peer to train")
    assert peer.poll() is None, swarm.tail("peer-0")
    signal_twice(peer, swarm.logs / "peer-0.log")
    assert swarm.coordinator is not None
    signal_twice(swarm.coordinator, swarm.logs / "coordinator.log")
    # both shutdowns were held: the second signal cut each short
    assert peer.returncode == swarm.coordinator.returncode == 128 + signal.SIGTERM


OWN_LINE = re.compile(r"\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) +\[(peer|potluck)[] ]")  # potluck's logger's


@pytest.mark.parametrize("codec", ["torch", "triton"])
def test_ctrl_c_peer_writes_only_its_own_log_lines(swarm: LocalSwarm, codec: str) -> None:
    """Ctrl+C in a volunteer's terminal once the peer trains (SIGINT to its process group): all that reaches its
    output (its DHT process's too) is potluck's own log lines, not one line from a library. Triton's nanobind leak
    report was 30 of them, printed by the interpreter's teardown; so the peer is a fresh interpreter, as a terminal
    starts it (the fork server's children leave without that teardown). ``triton``: the codec ran Triton's kernels
    (in Triton's interpreter, on CPU); ``torch``: it did not (Triton is loaded all the same: torch._dynamo imports it)."""
    swarm.start_coordinator(RUN)
    swarm.procs.fork = False  # (the peer, not the coordinator: its own interpreter)
    peer = swarm.start_peer(env={"POTLUCK_TRITON": "force", "TRITON_INTERPRET": "1"} if codec == "triton" else None)
    log = swarm.logs / "peer-0.log"
    trained = "outer step 1:" if codec == "triton" else "first training step"  # (the first: after the codec's kernels)
    wait_for(lambda: trained in log.read_text() or peer.poll() is not None, START_S, f"the peer's {trained!r} line")
    assert peer.poll() is None, tail(log)
    if codec == "triton":
        assert "libtriton" in Path(f"/proc/{peer.pid}/maps").read_text()
    os.killpg(peer.pid, signal.SIGINT)
    wait_for(lambda: peer.poll() is not None and not group_alive(peer.pid), EXIT_S, "the peer's process group to go")
    lines = log.read_text(errors="replace").splitlines()
    foreign = [line for line in lines if not OWN_LINE.match(line)]
    assert not foreign, f"{len(foreign)} lines not potluck's own:\n" + "\n".join(lines)
    assert peer.returncode == 0 and any("received signal 2" in line for line in lines), tail(log)


def sessions_alive(sids: set[int]) -> dict[int, str]:
    """Live processes (not zombies) in any of the sessions ``sids``, with their command lines."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[3]) in sids:
                out[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes()[:80].decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
    return out


def test_sigkilled_demo_leaves_nothing_behind(tmp_path: Path) -> None:
    """Nothing runs the demo's exit handlers; its children go because their parent did."""
    demo = subprocess.Popen(
        [sys.executable, "-P", "-m", "potluck", "demo", "--peers", "1", "--outer-steps", "50", "--inner-steps", "50",
         "--workdir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    sids: set[int] = {demo.pid}
    try:
        # coordinator, peer, their DHT processes and p2pd daemons
        tree = wait_for(lambda: len(d := descendants(demo.pid)) >= 6 and d, START_S, "the demo's swarm")
        for pid in tree:
            try:
                sids.add(os.getsid(pid))
            except ProcessLookupError:
                pass
        assert len(sids) >= 3, f"expected the demo and a session per child, got {sids}"
        os.kill(demo.pid, signal.SIGKILL)
        demo.wait()
        t0 = time.monotonic()
        while sessions_alive(sids) and time.monotonic() - t0 < EXIT_S:
            time.sleep(0.05)
        left = sessions_alive(sids)
        assert not left, f"left behind {EXIT_S:.0f} s after the demo was killed: {left}"
        print(f"demo's swarm gone {time.monotonic() - t0:.2f} s after SIGKILL")
    finally:
        for pid in sessions_alive(sids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        demo.wait()


@pytest.fixture
def shadowing_folder(tmp_path: Path) -> Path:
    """A folder holding a clone named ``potluck``: ``python -m potluck`` there finds the clone, not the package."""
    here = tmp_path / "src"
    (here / "potluck" / "protos").mkdir(parents=True)
    (here / "potluck" / "pyproject.toml").write_text("")
    return here


def potluck_command() -> list[str]:
    """How a user runs potluck: the installed script (beside the interpreter), else ``python -P -m potluck``."""
    script = Path(sys.executable).with_name("potluck")
    return [str(script)] if script.exists() else [sys.executable, "-P", "-m", "potluck"]


def test_help_works_from_the_clone_and_beside_it(shadowing_folder: Path) -> None:
    for cwd, command in ((REPO, [sys.executable, "-m", "potluck"]), (shadowing_folder, potluck_command())):
        out = subprocess.run([*command, "demo", "--help"], cwd=cwd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "--peers" in out.stdout, f"from {cwd}: {out.stdout}{out.stderr}"


def test_short_demo_beside_the_clone(shadowing_folder: Path, tmp_path: Path) -> None:
    """The demo's children run the installed package even where ``./potluck`` is something else
    (run from the clone's root, ``./potluck`` is the package itself: test_demo covers that)."""
    work = tmp_path / "work"
    out = subprocess.run(
        [*potluck_command(), "demo", "--peers", "1", "--outer-steps", "1", "--inner-steps", "2", "--workdir", str(work)],
        cwd=shadowing_folder, capture_output=True, text=True, timeout=180,
    )
    logs = "\n".join(f"== {p.name}\n{tail(p)}" for p in sorted((work / "logs").glob("*.log")))
    assert "ImportError" not in logs, logs
    assert out.returncode == 0, f"{out.stdout}{out.stderr}\n{logs}"
    assert "join address:" in out.stdout and "final eval loss" in out.stdout, out.stdout
