"""What a benchmark reads of its processes from /proc and ``ss``: their tree, RSS, PSS, CPU time, names, and the
bytes their TCP sockets carried (``benchmarks/swarm_scale.py`` measures the coordinator's processes with these)."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path


def tree(pid: int) -> list[int]:
    """``pid`` and every live process below it."""
    from potluck.protos.runtime.stopping import descendants

    return [pid, *descendants(pid)]


def rss(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def pss(pid: int) -> int:
    """``pid``'s proportional set size: its private pages plus its share of those it shares (the DHT process
    is forked from the coordinator and shares its imports' pages): summed over processes, the memory they take."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def by_role(root: int, figure: Callable[[int], float]) -> dict[str, float]:
    """``figure`` of the coordinator's processes: its main process, its DHT process, its p2pd."""
    procs = tree(root)
    return {"main": figure(root), "dht": sum(figure(p) for p in procs[1:] if name(p) != "p2pd"),
            "p2pd": sum(figure(p) for p in procs if name(p) == "p2pd")}


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) ``pid`` has used so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


_SOCK = re.compile(r"^\S+\s+\d+\s+\d+\s+(\S+)\s+(\S+)\s.*pid=(\d+)")


class Wire:
    """Bytes on the wire of a set of processes' TCP sockets, from ``ss -tinp`` samples (each connection's
    highest counters seen; libp2p keeps its connections open, so little is lost between samples)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str, int], tuple[int, int]] = {}

    def sample(self, pids: set[int]) -> None:
        try:
            out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return
        lines = out.splitlines()
        for head, info in zip(lines[::2], lines[1::2], strict=False):
            m = _SOCK.match(head)
            if not m or int(m.group(3)) not in pids:
                continue
            acked = re.search(r"bytes_acked:(\d+)", info)
            got = re.search(r"bytes_received:(\d+)", info)
            key = (m.group(1), m.group(2), int(m.group(3)))
            old = self.seen.get(key, (0, 0))
            self.seen[key] = (max(old[0], int(acked.group(1)) if acked else 0), max(old[1], int(got.group(1)) if got else 0))

    def total(self, pids: set[int] | None = None) -> tuple[int, int]:
        """(bytes sent, bytes received) by the sockets of ``pids`` (all sampled ones by default)."""
        rows = [v for k, v in self.seen.items() if pids is None or k[2] in pids]
        return sum(r[0] for r in rows), sum(r[1] for r in rows)
