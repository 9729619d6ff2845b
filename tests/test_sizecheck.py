"""The size check (potluck/models/sizecheck.py): parameter counts, the per-peer memory estimate, and what
is refused or warned, in one line naming the field (issue 27: ``--set model.d_model=1000000`` was
published and crashed every peer with a 50-line traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from potluck.models import entry_costs, stage_bounds
from potluck.models.sizecheck import (
    BYTES_PER_PARAM,
    REFUSE_BYTES,
    WARN_BYTES,
    check_size,
    entry_parameters,
    estimate,
    fits,
    notes,
    peer_note,
    stage_entries,
)
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.config.section import ConfigError


def run(**over: object) -> RunConfig:
    return apply_overrides(RunConfig(), {k.replace("__", "."): v for k, v in over.items()})


@pytest.mark.parametrize("over", [{}, {"model__preset": "llama-20m"}, {"model__preset": "llama-1b"},
                                  {"model__family": "llama", "model__d_model": 96, "model__n_heads": 6,
                                   "model__n_kv_heads": 2, "model__d_ff": 200},
                                  {"model__tie_embeddings": True, "model__seq_len": 300, "model__vocab_size": 1000}])
def test_the_formula_counts_what_the_model_builds(over: dict) -> None:
    """Counted without torch (so a refusal is at once), equal to the parameters the meta device builds."""
    m = run(**over).model
    assert entry_parameters(m) == [int(c) for c in entry_costs(m, "params")]


@pytest.mark.parametrize("over", [{"pipeline__stages": 2}, {"pipeline__stages": 3, "model__n_layers": 5},
                                  {"pipeline__stages": 2, "pipeline__balance": "params", "model__n_layers": 3},
                                  {"pipeline__stages": 2, "pipeline__layers": [1, 3]}])
def test_stages_are_cut_as_the_peers_cut_them(over: dict) -> None:
    cfg = run(**over)
    assert stage_entries(cfg, entry_parameters(cfg.model)) == stage_bounds(cfg.model, cfg.pipeline)


def test_the_estimate_is_the_biggest_stage_with_its_state_and_activations() -> None:
    # grad_accum fixed at 1: with 'auto' (the default) a single stage's estimate is one sample's activations,
    # the least a peer short of memory splits its batch down to
    whole = estimate(run(**{"model__preset": "llama-20m", "model__seq_len": 256, "train__batch_size": 8,
                            "train__grad_accum": 1}))
    assert whole.parameters == whole.stage_parameters == 18_933_120  # at vocab 64; the README's 19.1M at 256:
    assert estimate(run(**{"model__preset": "llama-20m", "model__vocab_size": 256})).parameters == 19_080_576
    assert whole.state_bytes == BYTES_PER_PARAM * whole.parameters
    auto = estimate(run(**{"model__preset": "llama-20m", "model__seq_len": 256, "train__batch_size": 8}))
    assert auto.activation_bytes < whole.activation_bytes and auto.state_bytes == whole.state_bytes
    split = estimate(run(**{"model__preset": "llama-20m", "model__seq_len": 256, "train__batch_size": 8,
                            "pipeline__stages": 2}))
    assert split.stage_parameters < whole.stage_parameters and split.bytes < whole.bytes
    lean = estimate(run(**{"model__preset": "llama-20m", "model__seq_len": 256, "train__batch_size": 8,
                           "train__grad_accum": 1, "train__checkpoint_activations": True}))
    assert lean.activation_bytes < whole.activation_bytes and lean.state_bytes == whole.state_bytes
    assert estimate(run(**{"diloco__overlap": True})).state_bytes > estimate(run()).state_bytes


@pytest.mark.parametrize("over, field", [({"model__d_model": 1_000_000}, "model.d_model"),
                                         ({"model__n_layers": 2_000_000}, "model.n_layers"),
                                         ({"model__seq_len": 10_000_000}, "model.seq_len"),
                                         ({"train__batch_size": 100_000_000, "train__grad_accum": 1},
                                          "train.batch_size")])
def test_a_run_no_peer_can_hold_is_refused_in_one_line_naming_the_field(over: dict, field: str) -> None:
    cfg = run(**over)
    with pytest.raises(ConfigError) as err:
        check_size(cfg)
    text = str(err.value)
    assert text.startswith(f"{field} = ") and text.endswith(f"lower {field}") and "\n" not in text, text
    assert estimate(cfg).bytes > REFUSE_BYTES


def test_a_big_run_is_warned_in_one_line_and_a_small_one_is_not() -> None:
    assert notes(run(), estimate(run())) == []  # the demo's and the README's runs: not a word
    readme = run(**{"model__preset": "llama-20m", "model__seq_len": 256, "train__batch_size": 8})
    assert check_size(readme) and notes(readme, estimate(readme)) == []
    long = run(**{"model__seq_len": 100_000})  # fused attention is linear in the sequence: 28 GB, not absurd
    est = check_size(long)
    assert WARN_BYTES < est.bytes < REFUSE_BYTES
    [line] = notes(long, est)
    assert line.startswith("model.seq_len = 100000: this run needs about 28.1 GB a peer") and "\n" not in line


def test_a_peer_is_told_when_its_device_is_too_small() -> None:
    est = estimate(run(**{"model__seq_len": 100_000}))
    assert "it may run out of memory" in peer_note(est, "NVIDIA RTX 3060", 12.0)
    assert peer_note(est, "NVIDIA H100", 80.0) == "" and peer_note(est, "cpu", 0.0) == ""  # (0: unknown)
    with pytest.raises(ConfigError, match="this peer's cpu holds 16.0 GB: lend a device with more memory"):
        fits(run(**{"model__seq_len": 100_000}), "cpu", 16 * 10**9)
    fits(run(), "cpu", 16 * 10**9)
    fits(run(**{"model__seq_len": 100_000}), "mps", 0)  # unknown: not refused


def test_the_estimate_loads_no_torch() -> None:
    code = ("import sys; from potluck.models.sizecheck import check_size; from potluck.protos.config.runconfig import RunConfig;"
            " check_size(RunConfig()); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=Path.home())
    assert done.stdout == "False\n", done.stderr
