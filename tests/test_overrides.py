"""Every override counts (an invalid one is refused in one line naming the field: tests/test_config.py): each field
of the run file, set on the command line (``--set``) over a run file that sets its neighbours (a preset, sizes of
its own), reads back from the config the journal keeps and the manifest peers build from; ``model.preset`` over
another preset builds that preset (its parameters counted: before, llama-20m's were kept)."""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

import pytest

from potluck.models import entry_costs
from potluck.protos.config.files import apply_overrides, parse_config
from potluck.protos.config.runconfig import LLAMA_PRESETS, RunConfig

# a run file a user might have: a preset beside other sections' own choices
FILE: dict[str, Any] = {"model": {"preset": "llama-20m", "seq_len": 128},
                        "train": {"batch_size": 8}, "diloco": {"inner_steps": 20, "outer_steps": 10}}
# fields whose other value needs a word more than its type says (what a user would pass, and what the field then is)
SPECIAL: dict[str, tuple[str, Any]] = {
    "model.family": ("tiny", "tiny"), "model.preset": ("llama-150m", "llama-150m"), "model.hf_model": ("", None),
    "model.n_heads": ("12", 12), "model.n_kv_heads": ("3", 3), "model.d_model": ("768", 768),
    "data.source": ("markov", "markov"), "data.path": ("corpus.txt", "corpus.txt"), "data.hf_dataset": ("", None),
    "data.hf_config": ("", None), "data.cache_dir": ("/tmp/potluck-cache", "/tmp/potluck-cache"),
    "data.tokenizer": ("gpt2", "gpt2"), "data.markov_order": ("2", 2),
    "train.grad_accum": ("2", 2), "train.compile": ("true", True), "sync.group_size": ("4", 4),
    "pipeline.layers": ("[7, 7]", [7, 7]), "pipeline.in_flight": ("2", 2), "pipeline.grad_bits": ("4", 4),
    "membership.heartbeat_s": ("2.0", 2.0), "coordinator.announce_host": ("203.0.113.7", "203.0.113.7"),
    "coordinator.status_tls_cert": ("", None), "coordinator.status_tls_key": ("", None),
    "admission.allow": ('["12D3KooWabc"]', ["12D3KooWabc"]), "train.beta1": ("0.8", 0.8), "train.beta2": ("0.95", 0.95),
    "diloco.outer_momentum": ("0.5", 0.5), "sync.audit_fraction": ("0.5", 0.5), "sync.fragment_alpha": ("0.25", 0.25),
    "train.checkpoint_activations": ("\"auto\"", "auto"), "sync.pace": ("0.3", 0.3),
    "coordinator.trackers": ("tensorboard,mlflow", ["tensorboard", "mlflow"]),
}
CONTEXT: dict[str, dict[str, Any]] = {  # what else the override needs to be a valid run (set beside it)
    "pipeline.layers": {"pipeline.stages": 2}, "pipeline.in_flight": {"pipeline.schedule": "1f1b"},
    "data.path": {"data.source": "bytes", "model.vocab_size": 256},
    "coordinator.status_tls_cert": {}, "model.family": {"model.preset": ""}, "sync.pace": {"diloco.overlap": True},
    "train.step_in_backward": {"train.grad_clip": 0.0},
}
NOT_ON_THE_COMMAND_LINE = {"model.hf_model", "data.hf_dataset", "data.hf_config",  # (these need a model or dataset here)
                           "coordinator.status_tls_cert", "coordinator.status_tls_key"}


def fields() -> list[str]:
    out = []
    for section, info in RunConfig.model_fields.items():
        sub = info.annotation
        if isinstance(sub, type) and hasattr(sub, "model_fields"):
            out += [f"{section}.{name}" for name in sub.model_fields]
    return out


def other_value(dotted: str, current: Any, annotation: Any) -> tuple[str, Any]:
    """A valid value other than ``current``, as typed on a command line, and what the field then holds."""
    if dotted in SPECIAL:
        return SPECIAL[dotted]
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is Literal:
        choice = next(a for a in get_args(annotation) if a != current)
        return (f'"{choice}"' if isinstance(choice, str) else str(choice)), choice
    if annotation is bool:
        return str(not current).lower(), not current
    if annotation is int or int in args:
        return str((current or 0) + 1), (current or 0) + 1
    if annotation is float:
        value = current * 2 if current else 0.5
        return repr(value), value
    if annotation is str:
        return '"something-else"', "something-else"
    raise AssertionError(f"{dotted}: no value for {annotation!r}; add one to SPECIAL")


@pytest.mark.parametrize("dotted", [f for f in fields() if f not in NOT_ON_THE_COMMAND_LINE])
def test_every_field_set_on_the_command_line_reads_back_or_is_refused(dotted: str) -> None:
    base = parse_config(FILE, source="the run file")
    section, name = dotted.split(".")
    annotation = type(getattr(base, section)).model_fields[name].annotation
    typed, want = other_value(dotted, getattr(getattr(base, section), name), annotation)
    cfg = apply_overrides(base, {**CONTEXT.get(dotted, {}), dotted: typed})
    got = getattr(getattr(cfg, section), name)
    assert got == want, f"--set {dotted}={typed} over the run file gave {got!r}"
    if section not in ("coordinator", "admission"):  # (the coordinator's own; the rest is what peers build from)
        assert cfg.manifest_sections()[section][name] == want


@pytest.mark.parametrize("preset", sorted(LLAMA_PRESETS))
def test_a_preset_set_over_another_builds_that_preset(preset: str) -> None:
    """The issue's case: a run file on llama-20m, ``--set model.preset=llama-1b``: the peers built llama-20m."""
    base = parse_config(FILE, source="the run file")
    cfg = apply_overrides(base, {"model.preset": preset})
    sizes = LLAMA_PRESETS[preset]
    assert {k: getattr(cfg.model, k) for k in sizes} == sizes, cfg.model
    direct = parse_config({**FILE, "model": {"preset": preset, "seq_len": 128}}, source="a file naming it")
    assert sum(entry_costs(cfg.model)) == sum(entry_costs(direct.model))  # the same model, parameter for parameter
    if preset != "llama-20m":
        assert sum(entry_costs(cfg.model)) != sum(entry_costs(base.model))
