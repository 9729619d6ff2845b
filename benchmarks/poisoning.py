"""One poisoner among four peers: how far it gets with and without robust aggregation.

Four real peer processes train the demo model for ``--outer-steps`` outer steps. In each scenario one
of them is Byzantine (``POTLUCK_FAULTS=outer.delta@*:...``, see potluck/protos/faults.py): it sends
its pseudo-gradient x1000, sign-flipped, or as NaN. Every scenario runs twice, with the default
robust aggregation (clip to 4x the median norm, leave out contributions opposed to the others) and
with a plain mean (``sync.clip_factor = 0``, ``sync.reject_below = -1``). The baseline, measured
in the same run, is the same swarm with four honest peers.

Target (issue 12): eval loss after 10 outer steps within 5% of the honest run with protection, and
the poisoner flagged (clipped or rejected by the owners, and evicted).

    python benchmarks/poisoning.py [--outer-steps 10] [--inner-steps 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from potluck.local import LocalSwarm
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig

PEERS = 4
ATTACKS = {"x1000": "scale=1000", "sign-flip": "flip", "nan": "nan"}


def run(workdir: Path, args: argparse.Namespace, attack: str | None, protected: bool) -> dict:
    overrides = {
        "run_id": "poison", "coordinator.host": "127.0.0.1", "coordinator.checkpoint_every": 0,
        "coordinator.journal_dir": str(workdir / "journal"), "membership.min_peers": PEERS,
        "diloco.outer_steps": args.outer_steps, "diloco.inner_steps": args.inner_steps,
        "data.eval_every": args.outer_steps,
    }
    if not protected:
        overrides.update({"sync.clip_factor": 0.0, "sync.reject_below": -1.0})
    swarm = LocalSwarm(workdir)
    t0 = time.monotonic()
    try:
        swarm.start_coordinator(apply_overrides(RunConfig(), overrides))
        for i in range(PEERS):
            env = {"POTLUCK_FAULTS": f"outer.delta@*:{ATTACKS[attack]}"} if attack and i == 0 else None
            swarm.start_peer(name="poisoner" if attack and i == 0 else f"honest-{i}", env=env)

        def done(s: dict) -> bool:
            hist = s["history"]
            return s["run"]["finished"] and bool(hist) and hist[-1]["eval_loss"] is not None

        state = swarm.wait_state(done, 900, "the run to finish")
    finally:
        swarm.stop()
    poisoner = next((p["id"] for p in state["peers"] if p["name"] == "poisoner"), None)
    flagged = sorted({h["step"] for h in state["history"]
                      if poisoner and poisoner in (h.get("clipped", []) + h.get("rejected", []))})
    return {"eval_loss": state["history"][-1]["eval_loss"], "flagged_at_steps": flagged,
            "evicted": any(e["kind"] == "evicted" for e in state["events"]), "seconds": round(time.monotonic() - t0, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outer-steps", type=int, default=10)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated subset of " + ",".join(ATTACKS))
    args = parser.parse_args()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="potluck-poison-") as tmp:
        def go(name: str, attack: str | None, protected: bool) -> dict:
            out = run(Path(tmp) / name, args, attack, protected)
            print(f"{name}: {out}", file=sys.stderr, flush=True)
            return out

        honest = go("honest", None, True)
        for attack in args.attacks.split(","):
            prot, plain = go(f"{attack}-protected", attack, True), go(f"{attack}-plain", attack, False)
            results[attack] = {
                "protected_eval": prot["eval_loss"], "plain_mean_eval": plain["eval_loss"],
                "protected_vs_honest": round(prot["eval_loss"] / honest["eval_loss"] - 1, 4),
                "plain_vs_honest": round(plain["eval_loss"] / honest["eval_loss"] - 1, 4),
                "poisoner_flagged_at_steps": prot["flagged_at_steps"], "poisoner_evicted": prot["evicted"],
            }
    worst = max(abs(r["protected_vs_honest"]) for r in results.values())
    print(json.dumps({
        "benchmark": "poisoning", "peers": PEERS, "outer_steps": args.outer_steps, "inner_steps": args.inner_steps,
        "honest_eval": honest["eval_loss"], "attacks": results, "worst_protected_vs_honest": worst,
        "target": "protected within 5% of honest", "met": worst <= 0.05
        and all(r["poisoner_flagged_at_steps"] or r["poisoner_evicted"] or k == "nan" for k, r in results.items()),
    }))


if __name__ == "__main__":
    main()
