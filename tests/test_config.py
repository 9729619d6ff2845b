"""Run config: defaults, validation that names the field, TOML files and CLI overrides."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from potluck.protos.config.files import (
    apply_overrides,
    dump_toml,
    known_fields_only,
    load_config,
    parse_config,
)
from potluck.protos.config.runconfig import PeerConfig, RunConfig
from potluck.protos.config.section import ConfigError


def test_defaults_are_valid_and_round_trip_through_toml() -> None:
    cfg = RunConfig()
    assert parse_config(tomllib.loads(dump_toml(cfg))) == cfg
    assert cfg.diloco.outer_lr == 0.7 and cfg.diloco.outer_momentum == 0.9



def test_robust_aggregation_can_be_switched_off_in_a_run_file() -> None:
    """A plain mean must be expressible in TOML (which has no null): clip_factor 0, reject_below -1."""
    cfg = apply_overrides(RunConfig(), {"sync.clip_factor": 0.0, "sync.reject_below": -1.0})
    back = parse_config(tomllib.loads(dump_toml(cfg)))
    assert (back.sync.clip_factor, back.sync.reject_below) == (0.0, -1.0)

@pytest.mark.parametrize(
    "data,field",
    [
        ({"diloco": {"outer_lr": 0}}, "diloco.outer_lr"),
        ({"diloco": {"inner_steps": -1}}, "diloco.inner_steps"),
        ({"model": {"d_model": 30, "n_heads": 4}}, "model"),
        ({"model": {"width": 3}}, "model.width: unknown field"),
        ({"sync": {"codec": "zstd"}}, "sync.codec"),
        ({"sync": {"group_size": 1}}, "sync.group_size: group_size 1: a group must hold at least 2 members"),
        ({"sync": {"group_size": -2}}, "sync.group_size"),
        ({"sync": {"group_size": 33}}, "sync.group_size: group_size 33: a group holds at most 32 members"),
        ({"data": {"source": "bytes"}}, "data"),
        ({"membership": {"heartbeat_s": 5, "heartbeat_timeout_s": 6}}, "membership"),
        # records outliving what every DHT node accepts (300 s) would be refused, silently, at every heartbeat
        ({"membership": {"heartbeat_timeout_s": 301}}, "membership.heartbeat_timeout_s"),
        ({"links": {"probe_period_s": 101}}, "links.probe_period_s"),
        ({"run_id": "has space"}, "run_id"),
        ({"nonsense": 1}, "nonsense: unknown field"),
    ],
)
def test_invalid_values_name_the_field(data, field) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert field in str(err.value)


def test_toml_file_errors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[diloco\ninner_steps = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    good = tmp_path / "run.toml"
    good.write_text("[diloco]\ninner_steps = 7\n")
    assert load_config(good).diloco.inner_steps == 7


def test_overrides_coerce_and_validate() -> None:
    cfg = apply_overrides(RunConfig(), {"diloco.outer_lr": "0.5", "sync.codec": "raw", "model.tie_embeddings": "true"})
    assert cfg.diloco.outer_lr == 0.5 and cfg.sync.codec == "raw" and cfg.model.tie_embeddings is True
    with pytest.raises(ConfigError, match="unknown field"):
        apply_overrides(RunConfig(), {"diloco.nope": 1})
    with pytest.raises(ConfigError, match="unknown section"):
        apply_overrides(RunConfig(), {"nope.x": 1})
    with pytest.raises(ConfigError, match="diloco.outer_steps"):
        apply_overrides(RunConfig(), {"diloco.outer_steps": "0"})


def test_manifest_from_a_newer_coordinator_is_read_tolerantly() -> None:
    data = RunConfig().manifest_sections()
    data["diloco"]["future_knob"] = 3
    data["new_section"] = {}
    clean, dropped = known_fields_only(RunConfig, data)
    assert sorted(dropped) == ["diloco.future_knob", "new_section"]
    parse_config(clean)


def test_peer_config_rejects_bad_device() -> None:
    with pytest.raises(ValueError, match="device"):
        PeerConfig(device="tpu")
    assert PeerConfig(device="cuda:1").device == "cuda:1"


def test_cli_reports_bad_config_without_traceback(tmp_path) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "run.toml"
    run.write_text("[diloco]\nouter_lr = -1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "potluck", "coordinator", "--config", str(run), "--journal-dir", str(tmp_path / "j")],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    assert "diloco.outer_lr" in proc.stderr and "Traceback" not in proc.stderr


def test_byte_data_decides_the_vocabulary_unless_the_run_file_does() -> None:
    assert parse_config({"data": {"source": "bytes", "path": "c.txt"}}).model.vocab_size == 256
    assert parse_config({"data": {"source": "bytes", "path": "c.txt"}, "model": {"vocab_size": 256}}).model.vocab_size == 256
    with pytest.raises(ConfigError, match="set model.vocab_size = 256, or leave it out"):
        parse_config({"data": {"source": "bytes", "path": "c.txt"}, "model": {"vocab_size": 64}})
    # --set data.source=bytes on a file that never named a vocabulary: what was not set stays unset
    cfg = apply_overrides(RunConfig(), {"data.source": "bytes", "data.path": "c.txt"})
    assert cfg.model.vocab_size == 256 and cfg.model.model_fields_set == set()
    assert parse_config(tomllib.loads(dump_toml(cfg))) == cfg
    assert apply_overrides(cfg, {"data.source": "markov"}).model.vocab_size == 64


def test_overlapped_outer_steps_need_a_single_stage() -> None:
    assert apply_overrides(RunConfig(), {"diloco.overlap": "true"}).diloco.overlap is True
    with pytest.raises(ConfigError, match="diloco.overlap needs pipeline.stages = 1"):
        apply_overrides(RunConfig(), {"diloco.overlap": True, "pipeline.stages": 2})


def test_fp32_gradients_survive_a_run_file() -> None:
    """TOML has no null: fp32 gradients are written as 32 (None, the Python spelling, means the same)."""
    for value in (None, 32, "32"):
        cfg = apply_overrides(RunConfig(), {"pipeline.grad_bits": value})
        assert cfg.pipeline.grad_bits == 32
        assert parse_config(tomllib.loads(dump_toml(cfg))).pipeline.grad_bits == 32
    assert parse_config(tomllib.loads(dump_toml(RunConfig()))).pipeline.grad_bits == 8
    with pytest.raises(ConfigError, match="pipeline.grad_bits"):
        apply_overrides(RunConfig(), {"pipeline.grad_bits": 16})


def test_an_unknown_field_says_which_was_meant() -> None:
    """A typo, or a field of another section: the name meant, in the one line (issue 27)."""
    from potluck.protos.config.files import parse_config
    from potluck.protos.config.section import ConfigError

    with pytest.raises(ConfigError) as err:
        parse_config({"diloco": {"inner_step": 3}, "modle": {}, "train": {"outer_steps": 2}, "data": {"zzz": 1}})
    parts = set(str(err.value).removeprefix("invalid config: ").split("; "))
    assert parts == {"diloco.inner_step: unknown field (did you mean diloco.inner_steps?)",
                     "modle: unknown field (did you mean model?)",
                     "train.outer_steps: unknown field (did you mean diloco.outer_steps?)", "data.zzz: unknown field"}
