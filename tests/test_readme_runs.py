"""The README's runs, for real (slow), beyond what ``test_readme.py`` runs of "A real run" section by section
(its first run, status, export and Python lines among them): "Train a real model" split into 2 stages, whose
exported folder gives the run's own eval loss; a self-signed status page reads with the fingerprint the
coordinator prints.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from readme import BLOCKS, README, REPO, parse, potluck_exe, readme_command

from potluck.local import LocalSwarm, wait_for
from potluck.procs import ProcessGroup
from potluck.protos.config.files import apply_overrides, load_config


@contextlib.contextmanager
def logs_on_failure(swarm: LocalSwarm) -> Iterator[None]:
    try:
        yield
    except BaseException:
        swarm.dump_logs()
        raise


@pytest.mark.slow
def test_the_real_model_section_trains_exports_and_generates(procs: ProcessGroup, tmp_path: Path) -> None:
    """"Train a real model", shortened to 2 outer steps of 2 inner steps and split into 2 stages: the
    exported Hugging Face folder loads with from_pretrained and gives the run's own eval loss (1e-4)."""
    import torch
    from transformers import AutoModelForCausalLM

    from potluck.peer.training.data import Dataset

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"".join(p.read_bytes() for p in [README, *sorted((REPO / "docs").glob("*.md"))]))
    cfg = load_config(REPO / "examples" / "llama-20m.toml")
    coordinator = parse(readme_command("potluck", "coordinator", having="examples/llama-20m.toml")[1:])
    journal = tmp_path / coordinator.journal_dir  # the README's, where its export reads
    cfg = apply_overrides(cfg, {"coordinator.host": "127.0.0.1", "coordinator.dht_port": 0, "coordinator.grpc_port": 0,
                                "coordinator.status_port": 0, "coordinator.journal_dir": str(journal),
                                "data.path": str(corpus), "diloco.inner_steps": 2, "diloco.outer_steps": 2,
                                "train.batch_size": 2, "pipeline.stages": 2, "pipeline.balance": "params",
                                "membership.min_peers": 2})
    swarm = LocalSwarm(tmp_path / "swarm", procs)
    with logs_on_failure(swarm):
        swarm.start_coordinator(cfg)
        swarm.start_peer()
        swarm.start_peer()
        state = swarm.wait_state(lambda s: s["run"]["finished"] and s["history"][-1]["eval_loss"] is not None,
                                 300, "2 outer steps of the 2-stage llama-20m run")
        final = journal / "checkpoints" / "ckpt-000002.json"
        swarm.wait_for(final.exists, 60, f"the final checkpoint {final.name}")
        export = [potluck_exe(), *readme_command("potluck", "export", having="model-hf")[1:]]
        done = subprocess.run(export, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        generate = [potluck_exe(), *readme_command("potluck", "generate")[1:], "--max-new-tokens", "8"]
        done = subprocess.run(generate, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.startswith("Peers find each other"), done.stdout + done.stderr
        for block in (b for b in BLOCKS if b.lang == "python" and "model-hf" in b.text):
            done = subprocess.run([sys.executable, "-c", block.text], cwd=tmp_path, capture_output=True, text=True,
                                  timeout=300)
            assert done.returncode == 0, f"{block}:\n{done.stderr}"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model-hf").eval()
    data = Dataset(cfg.data, cfg.model)
    ids = data.eval_ids()
    with torch.no_grad():
        total = sum(float(torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())) * len(c)
                    for c in (ids[k:k + 64] for k in range(0, len(ids), 64)) for x, y in [data.batch(c)])
    assert total / len(ids) == pytest.approx(state["history"][-1]["eval_loss"], abs=1e-4)


@pytest.mark.slow
def test_a_self_signed_status_page_reads_with_the_printed_fingerprint(procs: ProcessGroup, tmp_path: Path) -> None:
    """The README's HTTPS lines: a coordinator with a self-signed status page prints its fingerprint, and
    `potluck status https://... --fingerprint ...` reads the page with it (and refuses it without)."""
    argv = readme_command("potluck", "coordinator", having="self-signed")
    argv = [str(REPO / a) if a.endswith(".toml") else a for a in argv[1:]]
    ready, log = tmp_path / "ready.json", tmp_path / "coordinator.log"
    coord = procs.spawn_potluck([*argv, "--journal-dir", str(tmp_path / "potluck-run"), "--ready-file", str(ready)], log)
    try:
        wait_for(lambda: ready.exists() or coord.poll() is not None, 120, "the coordinator's ready file")
        assert coord.poll() is None, log.read_text()
        url = json.loads(ready.read_text())["status_url"]
        printed = re.search(r"status TLS: +SHA-256 ([0-9A-F:]{95})", log.read_text())
        assert url.startswith("https://") and printed, log.read_text()
        status = readme_command("potluck", "status", having="--fingerprint")
        status = [potluck_exe(), *status[1:]]
        status[status.index("--fingerprint") + 1] = printed[1]
        status[[a.startswith("https://") for a in status].index(True)] = url
        done = subprocess.run(status, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "first-run" in done.stdout, done.stdout + done.stderr
        unpinned = subprocess.run(status[:status.index("--fingerprint")], cwd=tmp_path, capture_output=True,
                                  text=True, timeout=60)
        assert unpinned.returncode != 0 and "certificate" in unpinned.stderr, unpinned.stdout + unpinned.stderr
    finally:
        procs.stop()
