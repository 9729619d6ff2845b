"""A thousand peers against a real coordinator: what its tick, decisions, admission, page and memory cost.

A real coordinator process (``potluck coordinator``, mutual TLS, its real DHT node, status server and
journal) hosts a run; ``--workers`` simulator processes each run a real hivemind DHT node bootstrapped
from it and a share of the simulated peers. A simulated peer is everything a peer is to the
coordinator, with training replaced by a sleep:

* its own identity (an Ed25519 key: its peer id) and its own TLS key;
* admitted through the real admission path: it stores a signed admission request in the DHT, reads
  the coordinator's certificate back, checks it against the run's CA and serves it: one port of its
  worker's gRPC server answers the coordinator's pings over mutual TLS with that certificate;
* a signed heartbeat record (a ``PeerRecord`` with its last 16 step reports) stored in the DHT every
  ``--heartbeat-s``, and right after each step it "trains" (``--step-s``, jittered by 10 %) once the
  coordinator's plan names it a member of the round;
* churn: ``--churn`` of the swarm leaves per minute (half say goodbye, half vanish: the coordinator
  finds them lost) and as many new peers join, through admission.

It measures, per swarm size: the coordinator's tick time (p50/p99 of its last 1,000 ticks, from its
own status API), the time from the last report stored before a step's commit to the commit, the time
to decide a round, admission throughput during the join burst, the snapshot's size, the status page's
load time in Chromium, the coordinator's RSS (main process, DHT process, p2pd), and the DHT's bytes
on the wire per peer per minute (every TCP socket of the run's p2pd daemons, from ``ss``). Baseline
measured in the same run: one full network read of every peer record plus its verification, which
is what the coordinator paid every tick (5 times a second) before its reads became incremental.

One JSON line per size, each with the fitted growth exponent of every figure with N (least squares of
log figure on log N over all sizes run).

    python benchmarks/swarm_scale.py --sizes 100,300,1000 [--minutes 4] [--workers 3] [--heartbeat-s 5]

What this box (2 cores, shared) cannot do is said in the output's ``limits``: the simulator's own DHT
nodes and the coordinator share the same CPUs, so the figures are an upper bound on what a
coordinator with a machine of its own would take. The simulator stands in for a thousand other machines, so by
default (``--sim-nice 19``) it runs at the lowest CPU priority: the coordinator's processes take a core whenever
they are ready to run, as they would on a machine of their own (its cache and memory bandwidth are still shared).
``--sim-nice 0`` lets them share the CPU alike: on 2 cores the tick's wall p99 then measures the box (232-271 ms
there at 1,000 peers, its own CPU p99 the same 41-51 ms).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from procstats import Wire, by_role, cpu_s, name, pss, rss, tree  # (beside this script)

LIMITS = ("one box for everything: the coordinator, its DHT node and p2pd, the simulator's workers (their DHT "
          "nodes, p2pd daemons and gRPC servers) and Chromium share its CPUs (2 cores, shared with other work: "
          "load_avg_1min says how busy it was; tick_cpu_s is the tick's own CPU, whatever the load), so every "
          "wall time here is an upper bound on a coordinator with a "
          "machine of its own; the DHT bytes are on loopback (no loss, no latency); runs are minutes, not hours")
TARGETS = {"tick_p99_s": 0.1, "decide_s": 1.0, "snapshot_bytes": 1_000_000, "page_load_ms": 1000,
           "coordinator_rss_bytes": 1 << 30}


def get_json(url: str, timeout: float = 10.0) -> tuple[dict[str, Any] | None, int]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read()
            return json.loads(body), len(body)
    except (OSError, ValueError):
        return None, 0


def page_load(url: str, loads: int = 3) -> list[dict[str, float]]:
    """The status page in headless Chromium: ms after navigation start until its peers table is filled."""
    chromium = "/usr/bin/chromium"
    if not Path(chromium).exists():
        return []
    from playwright.sync_api import sync_playwright

    out = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True)
        try:
            # (the page's CSP forbids eval, which Playwright's polling of a predicate uses: bypassed here only)
            page = browser.new_page(viewport={"width": 1400, "height": 900}, bypass_csp=True)
            page.goto(url + "healthz")
            for _ in range(loads):
                page.goto(url)
                page.wait_for_function("window.potluck && window.potluck.firstTableMs !== null", timeout=30000)
                out.append(page.evaluate("({table: potluck.firstTableMs, all: potluck.firstRenderMs, "
                                         "message: potluck.firstMessageMs})"))
        finally:
            browser.close()
    return out


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def steady_decisions(samples: list[dict[str, Any]], t0: float, final: dict[str, Any]) -> list[float]:
    """The seconds of each decision made after ``t0`` (each told apart by its count, not its figure: a round
    decided before ``t0`` stays the latest one until the next, and two decisions can take as long). With the
    final window too, where every decision in it came after ``t0`` (one made between two samples)."""
    at_t0 = max((s["state"]["coordinator"]["decide_s"]["count"] for s in samples if s["t"] < t0), default=0)
    seen = {d["count"]: d["last"] for s in samples if s["t"] >= t0
            for d in [s["state"]["coordinator"]["decide_s"]] if d["count"] > at_t0 and d["last"] is not None}
    out = list(seen.values())
    if final.get("max") is not None and final.get("count", 0) - at_t0 >= final.get("window", 0) \
            and final["max"] not in out:
        out.append(final["max"])  # (one no sample caught)
    return sorted(out)


def lower_priority(pid: int, nice: int) -> None:
    """``pid``'s niceness, and its session's: the kernel's autogroups share the CPU between sessions first, and
    a process's own niceness counts only within its session (each simulator worker starts one)."""
    os.setpriority(os.PRIO_PROCESS, pid, nice)
    with contextlib.suppress(OSError):  # (no autogroups: a kernel without them, or not Linux)
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def run_size(n: int, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    from potluck.local import LocalSwarm, wait_for
    from potluck.protos.config.files import apply_overrides
    from potluck.protos.config.runconfig import RunConfig

    work.mkdir(parents=True, exist_ok=True)
    timeout = max(8.0, 4 * a.heartbeat_s)
    cfg = apply_overrides(RunConfig(), {
        "run_id": f"swarm-scale-{n}", "diloco.outer_steps": 100000, "coordinator.checkpoint_every": 0,
        "coordinator.journal_dir": str(work / "journal"), "membership.heartbeat_s": a.heartbeat_s,
        "membership.heartbeat_timeout_s": timeout, "membership.min_peers": max(1, int(0.9 * n)),
        "admission.max_per_minute": 1000000, "links.placement": "sticky"})
    swarm = LocalSwarm(work)
    ready = swarm.start_coordinator(cfg, timeout=180)
    url, coord = ready["status_url"], swarm.coordinator
    assert coord is not None
    stop, churn = work / "stop", work / "churn"
    shares = [n // a.workers + (i < n % a.workers) for i in range(a.workers)]
    t_start = time.time()
    workers = [swarm.procs.spawn([sys.executable, str(Path(__file__).resolve().with_name("swarm_sim.py")), "--join", ready["join"],
                                  "--coordinator", ready["coordinator"], "--peers", str(k), "--index", str(i),
                                  "--heartbeat-s", str(a.heartbeat_s), "--heartbeat-timeout-s", str(timeout),
                                  "--step-s", str(a.step_s), "--churn", str(a.churn),
                                  "--stop-file", str(stop), "--churn-file", str(churn), "--out", str(work / f"w{i}.json")],
                                 work / "logs" / f"worker-{i}.log") for i, k in enumerate(shares)]
    for w in workers:  # (before they fork their p2pd daemons, which inherit it)
        lower_priority(w.pid, a.sim_nice)
    wire, samples, result = Wire(), [], {"peers": n}
    ours: set[int] = set()

    def sample() -> dict[str, Any] | None:
        nonlocal ours
        ours = {p for root in [coord.pid, *(w.pid for w in workers)] for p in tree(root) if name(p) == "p2pd"}
        wire.sample(ours)
        state, size = get_json(url + "api/v1/state")
        if state is not None:
            samples.append({"t": time.time(), "state": {k: state[k] for k in ("coordinator", "run", "peers_summary")},
                            "bytes": size, "rss": by_role(coord.pid, rss), "pss": by_role(coord.pid, pss)})
        return state

    try:
        def admitted() -> bool:
            s = sample()
            time.sleep(1.0)
            return bool(s and s["coordinator"]["peers_held"] >= 0.9 * n and s["round"] is not None)

        wait_for(admitted, a.warmup_timeout, f"{n} simulated peers to be admitted and a first round decided", poll=0.5)
        result["warmup_s"] = round(time.time() - t_start, 1)
        churn.touch()
        t0 = time.time()
        coord_dht = {p for p in tree(coord.pid) if name(p) == "p2pd"}
        wire_start, coord_start = wire.total(), wire.total(coord_dht)
        cpu_start = by_role(coord.pid, cpu_s)
        while time.time() - t0 < 60 * a.minutes:
            sample()
            time.sleep(2.0)
        minutes = (time.time() - t0) / 60
        cpu_end = by_role(coord.pid, cpu_s)
        sent, _ = wire.total()
        c_sent, c_got = wire.total(coord_dht)
        try:
            loads = page_load(url) if a.page_loads else []
        except Exception as err:  # (the other figures still count)
            loads, result["page_error"] = [], f"{type(err).__name__}: {err}"[:300]
        final, size = get_json(url + "api/v1/state")
        gz = len(_gzip(json.dumps(final).encode())) if final else 0
    finally:
        stop.touch()
        for w in workers:
            try:
                w.wait(timeout=120)
            except subprocess.TimeoutExpired:
                w.kill()
        swarm.stop()
    outs = [json.loads((work / f"w{i}.json").read_text()) for i in range(a.workers) if (work / f"w{i}.json").exists()]

    health = (final or {}).get("coordinator") or {}
    history = {h["step"]: h["t"] for h in (final or {}).get("history", [])}
    reports: dict[int, list[float]] = {}
    for o in outs:
        for step, rows in o["reports"].items():
            reports.setdefault(int(step), []).extend(t for _, _, t in rows)  # (when the DHT had stored it)
    lat = []
    for step, times in reports.items():  # from the last report stored before the commit (the one that made it)
        before = [t for t in times if t <= history.get(step, 0.0)]
        if step in history and history[step] >= t0 and before:
            lat.append(history[step] - max(before))
    adm = [(b - a_) for o in outs for a_, b in o["admissions"] if a_ < t0]
    first = min((a_ for o in outs for a_, _ in o["admissions"]), default=t_start)
    last = max((b for o in outs for a_, b in o["admissions"] if a_ < t0), default=first)
    decisions = steady_decisions(samples, t0, health.get("decide_s") or {})
    steady = [s for s in samples if s["t"] >= t0]
    result.update({
        "benchmark": "swarm_scale", "workers": a.workers, "sim_nice": a.sim_nice, "dht_nodes": a.workers + 1, "heartbeat_s": a.heartbeat_s,
        "step_s": a.step_s, "churn_per_min": a.churn, "minutes": round(minutes, 2),
        "tick_s": health.get("tick_s"), "tick_cpu_s": health.get("tick_cpu_s"), "ticks": health.get("ticks"),
        "gc": health.get("gc"),  # (full collections between ticks: their count and CPU seconds)
        "report_to_commit_s": {"p50": quantile(lat, 0.5), "p99": quantile(lat, 0.99), "max": max(lat, default=None),
                               "steps": len(lat)},
        "decide_s": {"max": max(decisions, default=None), "median": quantile(decisions, 0.5), "seen": len(decisions),
                     # (the join burst's first round: every peer is new to it)
                     "first_round": next((s["state"]["coordinator"]["decide_s"]["last"] for s in samples
                                          if s["state"]["coordinator"]["decide_s"]["count"] == 1), None)},
        "admission": {"admitted": len(adm), "seconds": round(last - first, 2),
                      "per_s": round(len(adm) / (last - first), 1) if last > first else None,
                      "latency_p50_s": quantile(adm, 0.5), "latency_p99_s": quantile(adm, 0.99)},
        "snapshot_bytes": size, "snapshot_gzip_bytes": gz,
        "page_load_ms": {"table_best": min((x["table"] for x in loads), default=None),
                         "all_best": min((x["all"] for x in loads), default=None), "loads": loads},
        "coordinator_cpu_cores": {k: round((cpu_end[k] - cpu_start[k]) / (60 * minutes), 3) for k in cpu_end},
        "rss_bytes": {k: max((s["rss"][k] for s in steady), default=None) for k in ("main", "dht", "p2pd")},
        # (what the three take together: shared pages counted once; the highest sample's parts)
        "pss_bytes": max((dict(s["pss"], total=sum(s["pss"].values())) for s in steady),
                         key=lambda p: p["total"], default=None),
        "dht_bytes_per_peer_per_min": round((sent - wire_start[0]) / n / minutes) if minutes else None,
        "coordinator_dht_bytes_per_min": {"sent": round((c_sent - coord_start[0]) / minutes),
                                          "received": round((c_got - coord_start[1]) / minutes)},
        "live_peers": (final or {}).get("peers_summary", {}).get("live"),
        "committed_steps": (final or {}).get("run", {}).get("outer_step"),
        "records_held": ((health.get("reads") or {}).get("peers") or {}).get("records"),
        "stores": {"done": sum(o["stores"] for o in outs), "failed": sum(o["store_failed"] for o in outs),
                   "bytes": sum(o["store_bytes"] for o in outs),
                   "heartbeat_lag_p99_s": quantile([x for o in outs for x in o["beat_lag_s"]], 0.99)},
        "churn": {"joined": sum(o["joined"] for o in outs), "left": sum(o["left"] for o in outs),
                  "vanished": sum(o["vanished"] for o in outs), "refused": sum(len(o["refused"]) for o in outs)},
        "baseline": {"full_network_read": next((o["full_read"] for o in outs if "full_read" in o), None),
                     "note": "one network read of every peer record plus its verification: what each tick did before"},
    })
    return result


def _gzip(body: bytes) -> bytes:
    import gzip

    return gzip.compress(body, compresslevel=5)


GROWTH = {
    "tick_p99_s": lambda r: (r.get("tick_s") or {}).get("p99"),
    "tick_p50_s": lambda r: (r.get("tick_s") or {}).get("p50"),
    "tick_cpu_p99_s": lambda r: (r.get("tick_cpu_s") or {}).get("p99"),
    "report_to_commit_p50_s": lambda r: r["report_to_commit_s"]["p50"],
    "decide_max_s": lambda r: r["decide_s"]["max"],
    "admission_per_s": lambda r: r["admission"]["per_s"],
    "snapshot_bytes": lambda r: r["snapshot_bytes"],
    "page_load_table_ms": lambda r: r["page_load_ms"]["table_best"],
    "coordinator_rss_bytes": lambda r: r["rss_bytes"]["main"],
    "coordinator_pss_total_bytes": lambda r: (r["pss_bytes"] or {}).get("total"),
    "coordinator_cpu_cores": lambda r: sum(r["coordinator_cpu_cores"].values()),
    "dht_bytes_per_peer_per_min": lambda r: r["dht_bytes_per_peer_per_min"],
    "full_network_read_s": lambda r: ((r["baseline"] or {}).get("full_network_read") or {}).get("seconds"),
}


def exponents(results: list[dict[str, Any]]) -> dict[str, float | None]:
    """For each figure, b in figure ~ N^b, least squares over the sizes run (None with fewer than 2)."""
    out: dict[str, float | None] = {}
    for key, get in GROWTH.items():
        pts = [(math.log(r["peers"]), math.log(v)) for r in results
               if "error" not in r and isinstance(v := get(r), int | float) and v > 0]
        if len(pts) < 2:
            out[key] = None
            continue
        mx, my = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        out[key] = round(sum((x - mx) * (y - my) for x, y in pts) / sxx, 3) if sxx else None
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100,300,1000", help="simulated peers per run, comma-separated")
    p.add_argument("--minutes", type=float, default=4.0, help="measured minutes per size, after the join burst")
    p.add_argument("--workers", type=int, default=3, help="simulator processes (each with its own DHT node)")
    p.add_argument("--heartbeat-s", type=float, default=5.0, help="a simulated peer's heartbeat period")
    p.add_argument("--step-s", type=float, default=10.0, help="an outer step's 'training' time")
    p.add_argument("--churn", type=float, default=0.1, help="share of the swarm replaced per minute")
    p.add_argument("--warmup-timeout", type=float, default=600.0, help="seconds allowed for the join burst")
    p.add_argument("--sim-nice", type=int, default=19, help="the simulator's niceness: 19 gives the coordinator's "
                   "processes the CPU first, as on a machine of their own (0: all share alike)")
    p.add_argument("--no-page", dest="page_loads", action="store_false", help="skip the Chromium page loads")
    p.add_argument("--workdir", help="keep logs and journals here (default: a temporary folder)")
    p.add_argument("--also", help="JSON lines of sizes measured before by this benchmark, fitted with these")
    a = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (stops the run's processes on the way out)
    root = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="swarm-scale-"))
    results = []
    for n in [int(x) for x in a.sizes.split(",")]:
        load = os.getloadavg()[0]
        try:
            r = run_size(n, a, root / f"n{n}")
        except Exception as err:  # (a size that could not run still gets its line, saying why)
            r = {"benchmark": "swarm_scale", "peers": n, "error": f"{type(err).__name__}: {err}"[:500]}
        r["limits"] = {"cpus": os.cpu_count(), "load_avg_1min": [round(load, 1), round(os.getloadavg()[0], 1)],
                       "note": LIMITS}
        results.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)  # (progress: the lines that count come at the end)
    earlier = [json.loads(line) for line in Path(a.also).read_text().splitlines() if line.strip()] if a.also else []
    results = sorted(earlier + results, key=lambda r: r["peers"])
    growth = exponents(results)
    for r in results:
        r["growth_exponent"] = growth
        r["targets"] = TARGETS
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "main"
    sys.exit(main())
