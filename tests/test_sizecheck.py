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
    DEVICE_BYTES_PER_PARAM,
    HOST_BYTES_PER_PARAM,
    REFUSE_BYTES,
    WARN_BYTES,
    GiB,
    check_size,
    entry_parameters,
    estimate,
    fits,
    notes,
    peer_note,
    plan,
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


def test_a_gpu_holds_the_inner_state_and_the_host_the_outer_state() -> None:
    """Weights, gradients, AdamW and activations on the device; theta_global, its momentum and the previous version
    in host memory (pinned on a GPU peer): a CPU peer needs both in one memory, a GPU only the first."""
    est = estimate(run(**{"model__preset": "llama-20m", "pipeline__stages": 2}))
    assert est.host_bytes == HOST_BYTES_PER_PARAM * est.stage_parameters
    assert est.device_bytes == DEVICE_BYTES_PER_PARAM * est.stage_parameters + est.activation_bytes
    assert est.device_bytes + est.host_bytes == est.bytes
    overlap = estimate(run(**{"model__preset": "llama-20m", "diloco__overlap": True}))
    single = estimate(run(**{"model__preset": "llama-20m"}))
    assert overlap.device_bytes == single.device_bytes < single.bytes < overlap.bytes  # (what overlap adds, the phase's start, is in host memory)
    big = run(**{"model__preset": "llama-1b", "model__seq_len": 1024, "train__batch_size": 8})
    b = estimate(big)
    fits(big, "cuda", b.device_bytes)  # a GPU with room for the device part, and not for the outer state: it fits
    with pytest.raises(ConfigError, match="on the device .*of outer state in host memory besides"):
        fits(big, "cuda", b.device_bytes - 1)
    with pytest.raises(ConfigError, match="this peer's cpu holds.*--outer-state-dir DIR"):
        fits(big, "cpu", b.device_bytes)  # a CPU peer holds both
    fits(big, "cpu", b.device_bytes, outer_on_disk=True)  # unless its outer state is in files (--outer-state-dir)
    with pytest.raises(ConfigError, match="this peer's cpu holds") as err:
        fits(big, "cpu", b.device_bytes - 1, outer_on_disk=True)
    assert "--outer-state-dir" not in str(err.value)  # (it is on disk already: no use saying it)
    assert peer_note(b, "NVIDIA RTX 4090", b.device_bytes / GiB + 0.5) == ""


def brute_plan(cfg: RunConfig, memory: int) -> int | None:
    """The reference: every stage count's biggest stage, its device bytes counted from the stage cut directly."""
    costs = entry_parameters(cfg.model)
    for stages in range(cfg.pipeline.stages, len(costs) + 1):
        c = run(**{"model__preset": cfg.model.preset, "model__seq_len": cfg.model.seq_len,
                   "train__batch_size": cfg.train.batch_size, "train__checkpoint_activations": True,
                   "pipeline__stages": stages})
        biggest = max(sum(costs[a:b]) for a, b in stage_entries(c, costs))
        est = estimate(c)
        assert est.stage_parameters == biggest
        if est.device_bytes <= memory:
            return stages
    return None


@pytest.mark.parametrize("preset", ["llama-150m", "llama-1b", "llama-7b"])
@pytest.mark.parametrize("card_gb", [8, 16, 24, 80])
def test_the_plan_is_the_fewest_stages_whose_biggest_stage_fits_the_card(preset: str, card_gb: int) -> None:
    cfg = run(**{"model__preset": preset, "model__seq_len": 1024, "train__batch_size": 8,
                 "train__checkpoint_activations": True})
    got = plan(cfg, card_gb * GiB)
    assert got == brute_plan(cfg, card_gb * GiB)
    if got is not None and got > 1:  # one stage fewer does not fit
        fewer = run(**{"model__preset": preset, "model__seq_len": 1024, "train__batch_size": 8,
                       "train__checkpoint_activations": True, "pipeline__stages": got - 1})
        assert estimate(fewer).device_bytes > card_gb * GiB


def test_a_7b_model_on_24_gb_cards_is_planned_and_the_warning_names_the_stages() -> None:
    cfg = run(**{"model__preset": "llama-7b", "model__seq_len": 1024, "train__batch_size": 8,
                 "train__checkpoint_activations": True})
    est = check_size(cfg)
    assert 6.4e9 < est.parameters < 6.6e9
    stages = plan(cfg, WARN_BYTES)
    assert stages is not None and 4 <= stages <= 16, stages
    [line] = notes(cfg, est)
    assert f"pipeline.stages = {stages} need less" in line and "on a GPU" in line, line
    planned = run(**{"model__preset": "llama-7b", "model__seq_len": 1024, "train__batch_size": 8,
                     "train__checkpoint_activations": True, "pipeline__stages": stages})
    assert notes(planned, estimate(planned)) == []
    with pytest.raises(ConfigError, match=f"at pipeline.stages = {stages} each stage fits it"):
        fits(cfg, "cuda", WARN_BYTES)


def test_the_table_of_what_fits_is_the_size_checks() -> None:
    """docs/operating.md's "What fits on my GPU" holds the plan this module makes, card by card (kept true as the code
    changes)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "operating.md").read_text()
    section = text.split("### What fits on my GPU", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| llama-")]
    header = next(line for line in section.splitlines() if line.startswith("| model |"))
    cards = [int(c.strip().split()[0]) for c in header.strip("|").split("|")[3:]]
    assert len(rows) >= 4 and cards
    lean = {"train__weights": "bf16", "train__optimizer": "adamw8bit"}
    options = {"": {}, "bf16 weights + 8-bit AdamW": lean, "bf16 weights + 8-bit AdamW, stepped in the backward": {
        **lean, "train__step_in_backward": True, "train__grad_clip": 0.0, "pipeline__micro_batches": 1}}
    assert {r[0].strip().partition(", ")[2] for r in rows} == set(options)  # (every kind of row is checked)
    for row in rows:
        preset, _, option = row[0].strip().partition(", ")
        cfg = run(**{"model__preset": preset, "model__seq_len": 1024, "train__batch_size": 8,
                     "train__checkpoint_activations": True, **options[option]})
        want = [str(s) if (s := plan(cfg, gb * GiB)) is not None else "-" for gb in cards]
        assert [c.strip() for c in row[3:]] == want, preset


def test_8_bit_adamw_takes_less_of_the_device_and_nothing_else() -> None:
    fp32 = estimate(run(**{"model__preset": "llama-150m"}))
    lean = estimate(run(**{"model__preset": "llama-150m", "train__optimizer": "adamw8bit"}))
    saved = fp32.device_bytes - lean.device_bytes
    assert saved == pytest.approx((8 - 2 - 8 / 256) * fp32.stage_parameters, rel=1e-6)
    assert lean.host_bytes == fp32.host_bytes and lean.activation_bytes == fp32.activation_bytes


def test_auto_checkpointing_is_each_peers_choice_from_its_memory() -> None:
    """``train.checkpoint_activations = "auto"``: a peer checkpoints when its stage needs more than its device holds
    without it, and not when it fits (or its memory is unknown); the estimate is the checkpointed one (the least a
    peer needs); True and False are kept whatever the memory."""
    from potluck.models.sizecheck import checkpointing

    auto = run(**{"model__preset": "llama-150m", "model__seq_len": 1024, "train__batch_size": 8,
                  "pipeline__stages": 2, "train__checkpoint_activations": "auto"})
    plain = estimate(run(**{"model__preset": "llama-150m", "model__seq_len": 1024, "train__batch_size": 8,
                            "pipeline__stages": 2}))
    ckpt = estimate(run(**{"model__preset": "llama-150m", "model__seq_len": 1024, "train__batch_size": 8,
                           "pipeline__stages": 2, "train__checkpoint_activations": True}))
    assert estimate(auto).bytes == ckpt.bytes < plain.bytes
    assert checkpointing(auto, "cuda", plain.device_bytes - 1) is True
    assert checkpointing(auto, "cuda", plain.device_bytes) is False
    assert checkpointing(auto, "cuda", 0) is False  # (unknown: as the default)
    assert checkpointing(auto, "cpu", plain.device_bytes) is True  # (a CPU peer holds the outer state too)
    for flag in (True, False):
        fixed = run(**{"train__checkpoint_activations": flag})
        assert checkpointing(fixed, "cuda", 1) is flag and checkpointing(fixed, "cuda", 10**15) is flag
    with pytest.raises(ConfigError, match="train.checkpoint_activations"):
        run(**{"train__checkpoint_activations": "sometimes"})
