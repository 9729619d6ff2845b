"""What a coordinator checks before it loads anything heavy or writes anything.

``potluck coordinator`` runs :func:`preflight` right after reading its config, before torch, hivemind
or gRPC load and before its journal directory is touched, so a run that cannot work is refused in one
line in well under a second: a corpus its peers could not train on (:func:`~potluck.protos.config.runcheck.check_run`),
a model no peer could hold (:mod:`~potluck.models.sizecheck`), a journal directory that holds
another run (:func:`~potluck.coordinator.store.journal.changed_sections`), a tracker whose library is not
installed (:func:`~potluck.coordinator.trackers.backends.missing`), a ``checkpoint_url`` that cannot name a store
(:func:`~potluck.coordinator.store.offbox.open_store`: its bucket is asked about when the coordinator starts). The coordinator runs it again when
it opens the run (:func:`potluck.coordinator.bootstrap.open_journal`), where it logs what it found.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from potluck.coordinator.store.journal import changed_sections, read_journal
from potluck.coordinator.store.offbox import open_store
from potluck.coordinator.trackers.backends import missing
from potluck.models import sizecheck
from potluck.protos.config.runcheck import check_run
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.config.section import ConfigError


@dataclass
class Checked:
    """A run that passed: lines for the operator (``notes``), and ``warnings`` about its size."""

    estimate: sizecheck.Estimate
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def preflight(cfg: RunConfig) -> Checked:
    """Refuse (ConfigError or JournalError, one line naming the fix) a run that cannot work; writes nothing."""
    notes = check_run(cfg).notes
    if absent := missing(cfg.coordinator.trackers):
        extras = ",".join(absent)
        raise ConfigError(f"coordinator.trackers names {', '.join(absent)}, not installed here: pip install "
                          f"'potluck[{extras}]' (or leave {'them' if len(absent) > 1 else 'it'} out)")
    if cfg.coordinator.checkpoint_url:
        open_store(cfg.coordinator.checkpoint_url)
    estimate = sizecheck.check_size(cfg)
    state = read_journal(cfg.coordinator.journal_dir)
    if state is not None:
        changed_sections(Path(cfg.coordinator.journal_dir) / "journal.json", state, cfg)
    return Checked(estimate, notes, sizecheck.notes(cfg, estimate))
