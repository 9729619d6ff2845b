"""What a peer reports about itself: its progress, its last outer steps, and its heartbeat record.

The same figures reach the logs, Ping replies, the DHT record the coordinator reads, and through it
the status page and ``/metrics`` (every byte and wait a peer measures is shown somewhere). The
inner steps also reach the volunteer's own screen, through :mod:`potluck.peer.swarm.progress`.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from potluck import __version__
from potluck.peer.reduce.allreduce import AllReduceStats
from potluck.peer.swarm.progress import ProgressReporter
from potluck.peer.training.window import Ended
from potluck.protos import potluck_pb2 as pb
from potluck.protos.net.transport import Traffic
from potluck.protos.runtime.log import get_logger, short_id
from potluck.protos.testkit.faults import tamper
from potluck.protos.wire.envelope import next_seq
from potluck.protos.wire.records import AuditReport, PeerRecord, StepReport
from potluck.protos.wire.states import PeerState

log = get_logger(__name__)

KEEP_STEPS = 8


@dataclass
class Progress:
    """The moving parts of a peer's record."""

    state: PeerState = PeerState.JOINING
    inner_step: int = 0
    inner_steps: int = 0  # H of the current outer step
    loss: float | None = None
    eval_loss: float | None = None
    eval_version: int = -1
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    tokens_total: int = 0
    step_time_s: float = 0.0
    last_outer_s: float = 0.0
    last_outer_bytes: int = 0
    outer_wait_s: float = 0.0
    compute_s: float = 0.0
    sync_s: float = 0.0
    hidden_s: float = 0.0
    last_pipe: dict[str, int] = field(default_factory=dict)  # pipeline bytes of the last outer step, by kind
    round_steps: int = 0  # inner steps the last inner phase trained
    window_s: float | None = None  # where it expected the round's window to end


class Telemetry:
    def __init__(self, peer_id: str, name: str, started_at: float, progress: str = "auto") -> None:
        """``progress``: how inner steps are shown, one of :data:`potluck.peer.swarm.progress.MODES`."""
        self.peer_id, self.name, self.started_at = peer_id, name, started_at
        self.progress = Progress()
        self.reporter = ProgressReporter(progress)
        self.steps: deque[StepReport] = deque(maxlen=KEEP_STEPS)
        self._hashing: dict[int, Future[str]] = {}  # steps whose state hash was still being computed
        self._lock = threading.Lock()  # steps: written by the training loop, read by the heartbeat
        self.audits: deque[AuditReport] = deque(maxlen=KEEP_STEPS)  # this peer's latest audit verdicts (its record)
        self.first_step_logged = False
        self._pipe_before: dict[str, int] = {}  # the pipeline's byte counters at the last outer step
        self.error = ""  # why this peer stopped, when it stops on an error it cannot heal (state "failed")
        self.too_slow = ""  # why this peer contributes nothing while one inner step is longer than the window
        self._phases: dict[int, tuple[Ended, int, float]] = {}  # step -> its inner phase, its samples and seconds

    def set_state(self, state: PeerState) -> bool:
        """Change the reported state; True if it changed (the caller heartbeats at once)."""
        p = self.progress
        if state == p.state:
            return False
        p.state = state
        if state != PeerState.TRAINING:
            p.inner_step = 0
            self.reporter.clear()
        return True

    def begin_inner(self, step: int, inner_steps: int, device: Any) -> None:
        """Outer step ``step``'s inner phase of H = ``inner_steps`` starts on ``device``."""
        self.progress.inner_steps = inner_steps
        self.reporter.begin(step, inner_steps, device_label(device))

    def inner_step(self, i: int, loss: float, seconds: float, samples: int, tokens: int) -> None:
        p = self.progress
        p.loss = loss if p.loss is None or not math.isfinite(p.loss) else 0.9 * p.loss + 0.1 * loss
        p.inner_step = i + 1
        p.step_time_s = seconds if p.step_time_s == 0 else 0.9 * p.step_time_s + 0.1 * seconds
        p.tokens_total += tokens
        p.tokens_per_s = tokens / max(p.step_time_s, 1e-9)
        p.samples_per_s = samples / max(p.step_time_s, 1e-9)
        self.reporter.step(i, p.loss, seconds, tokens)

    def phase_ended(self, step: int, ended: Ended, samples: int, seconds: float) -> None:
        """The inner phase of ``step`` ended after ``ended.steps`` steps on ``samples`` samples in ``seconds`` (its
        window, why)."""
        p = self.progress
        p.round_steps, p.window_s = ended.steps, ended.window_s
        self._phases[step] = (ended, samples, seconds)
        for old in sorted(self._phases)[:-KEEP_STEPS]:
            del self._phases[old]
        if ended.steps < ended.cap and ended.why is not None and ended.steps:
            log.info("inner phase of step %d: %d of %d steps (%s; window %s)", step, ended.steps, ended.cap,
                     ended.why.value, f"{ended.window_s:.2f} s" if ended.window_s is not None else "unknown")

    def outer_step(self, stats: AllReduceStats, seconds: float, mean_norm: float, epoch: int, stage: int, replica: int,
                   state_hash: str | Future[str], pipe_total: dict[str, int] | None) -> None:
        """A committed outer step: its figures, logged and kept for the next heartbeats (``state_hash``
        may still be under way: the record waits for it, never reports it empty)."""
        done = state_hash if isinstance(state_hash, str) else ""
        flags = stats.flags
        if tamper("outer.report", stats.step, False) is True:  # a lying reporter (tests): every owner flagged the others
            flags = {owner: sorted(set(stats.flags) - {owner, self.peer_id}) for owner in stats.flags}
        phase = self._phases.get(stats.step)
        report = StepReport(step=stats.step, epoch=epoch, stage=stage, replica=replica, state_hash=done,
                            outer_s=seconds, allreduce_s=stats.seconds, outer_bytes=stats.bytes_sent, members=stats.members,
                            contributors=min(stats.contributors.values(), default=0), dropped=stats.dropped,
                            clipped=stats.clipped, rejected=stats.rejected, included=stats.included,
                            samples=[stats.samples.get(r, 0) for r in stats.included], flags=flags, t=time.time(),
                            trained=phase[1] if phase else 0, inner_steps=phase[0].steps if phase else 0,
                            window_s=phase[0].window_s if phase else None, phase_s=phase[2] if phase else 0.0)
        p = self.progress
        p.last_outer_s, p.outer_wait_s, p.last_outer_bytes = seconds, stats.wait_seconds, stats.bytes_sent
        p.sync_s += seconds
        p.hidden_s += max(0.0, stats.seconds - seconds)  # the all-reduce's own time the training loop did not wait
        if pipe_total is not None:  # the pipeline counts bytes since it started: this step's are the difference
            p.last_pipe = {k: v - self._pipe_before.get(k, 0) for k, v in pipe_total.items()}
            self._pipe_before = dict(pipe_total)
        with self._lock:
            self.steps.append(report.model_copy(update={"loss": p.loss, "pipe": dict(p.last_pipe)}))
            if not isinstance(state_hash, str):
                self._hashing[stats.step] = state_hash
        dropped = f", dropped {', '.join(short_id(d) for d in stats.dropped)}" if stats.dropped else ""
        paced = (f" (paced at {stats.pace_bps / 1e3:.0f} kB/s: sends held back {stats.paced_s:.2f} s in all)"
                 if stats.pace_bps else "")
        log.info("outer step %d: %d members, %.2f s (all-reduce %.2f s, waited %.2f s for members), sent %.2f MB%s, "
                 "|mean delta| %.3g, loss %.4f%s", stats.step, stats.members, seconds, stats.seconds, stats.wait_seconds,
                 stats.bytes_sent / 1e6, paced, mean_norm, p.loss or float("nan"), dropped)

    def audited(self, report: AuditReport) -> None:
        """An audit this peer ran ended: its verdict rides on the next heartbeats (the coordinator acts on a lie)."""
        self.audits.append(report)

    def evaluated(self, version: int, loss: float) -> None:
        log.info("eval loss of v%d: %.4f", version, loss)
        self.progress.eval_loss, self.progress.eval_version = loss, version
        with self._lock:
            for i, report in enumerate(self.steps):
                if report.step == version:
                    self.steps[i] = report.model_copy(update={"eval_loss": loss})

    def _recent(self) -> list[StepReport]:
        """The last steps' reports, every state hash in them computed (waited for outside the lock)."""
        with self._lock:
            pending = dict(self._hashing)
        hashes = {step: f.result() for step, f in pending.items()}
        with self._lock:
            for i, report in enumerate(self.steps):
                if report.step in hashes and not report.state_hash:
                    self.steps[i] = report.model_copy(update={"state_hash": hashes[report.step]})
            for step in hashes:
                self._hashing.pop(step, None)
            return list(self.steps)

    def ping_reply(self, request: pb.PingRequest, version: int, epoch: int) -> pb.PingReply:
        p = self.progress
        left = max(0, p.inner_steps - p.inner_step) if p.state == PeerState.TRAINING else 0
        padding = b"\0" * max(0, min(request.reply_bytes, 64 << 10))  # no amplifier: at most 64 KiB back
        return pb.PingReply(peer_id=self.peer_id, state=p.state, version=version, inner_step=p.inner_step,
                            eta_s=left * p.step_time_s, sent_at=request.sent_at, padding=padding, epoch=epoch)

    def record(self, *, address: str, version: int, state_hash: str, epoch: int, prev: tuple[int, str], stage: int,
               replica: int, device: Any, numel: int, loss_floor: float | None, maddrs: list[str],
               traffic: Traffic, extras: dict[str, Any], busy_s: float = 0.0,
               step_s: float | None = None) -> PeerRecord:
        """``step_s``: what one inner step takes (the window's measure: its first step's warm-up left out); else the
        progress's running mean. ``traffic``: the peer's byte counters, its send rate over the last seconds, and its
        peak second with what filled it."""
        p = self.progress
        sent, received = traffic.snapshot()
        peak, peak_kinds = traffic.peak_second()  # (read together: a second may end between two reads)
        cuda = getattr(device, "type", "cpu") == "cuda"
        import torch  # already loaded by the peer; kept out of this module's import time

        return PeerRecord(
            peer_id=self.peer_id, address=address, state=p.state, version=version, state_hash=state_hash,
            epoch=epoch, prev_version=prev[0], prev_hash=prev[1], inner_step=p.inner_step,
            device=getattr(device, "type", "cpu"),
            device_name=device_label(device),
            memory_gb=torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else 0.0,
            name=self.name, loss=p.loss if p.loss is None or math.isfinite(p.loss) else None,
            eval_loss=p.eval_loss, eval_version=p.eval_version, samples_per_s=p.samples_per_s,
            tokens_per_s=p.tokens_per_s, tokens_total=p.tokens_total, bytes_sent=sent, bytes_received=received,
            last_outer_s=p.last_outer_s, last_outer_bytes=p.last_outer_bytes, compute_s=p.compute_s, sync_s=p.sync_s,
            send_bps=traffic.send_rate()[0], peak_send_bps=peak, peak_send_kinds=peak_kinds,
            hidden_s=p.hidden_s,
            parameters=numel, loss_floor=loss_floor, software=__version__, started_at=self.started_at,
            seq=next_seq(), ts=time.time(), stage=stage, dht_maddrs=maddrs, replica=replica,
            recent=self._recent(),
            extras={"outer_wait_s": p.outer_wait_s, "step_time_s": p.step_time_s,
                    **({"pipe": p.last_pipe} if p.last_pipe else {}), **extras},
            error=self.error[:500], audits=list(self.audits), round_steps=p.round_steps, window_s=p.window_s,
            step_s=step_s if step_s is not None else p.step_time_s, busy_s=busy_s, too_slow=self.too_slow[:500],
        )

    def refusal(self, device: Any, memory_bytes: int, why: str) -> PeerRecord:
        """This peer's one record when, admitted, it finds it cannot take part (state ``refused``): the
        coordinator's page lists it with ``why``, its device and the memory it has."""
        return PeerRecord(peer_id=self.peer_id, address="", state=PeerState.REFUSED, device=getattr(device, "type", "cpu"),
                          device_name=device_label(device), memory_gb=memory_bytes / 2**30, name=self.name,
                          software=__version__, started_at=self.started_at, seq=next_seq(), ts=time.time(),
                          error=why[:500])

    def first_step(self, joined_at: float, phases: dict[str, float]) -> None:
        """When this peer's first optimizer step is done, and where the time before it went (logged once)."""
        if self.first_step_logged:
            return
        self.first_step_logged = True
        now = time.time()
        log.info("first training step %.1f s after the process started (%.1f s after joining the DHT; %s)",
                 now - process_started_at(), now - joined_at,
                 ", ".join(f"{k} {v:.1f} s" for k, v in phases.items() if v or not k.startswith("of which")))


def device_label(device: Any) -> str:
    """A device as a volunteer names it: the GPU's model, or ``cpu x16`` (its core count)."""
    kind = getattr(device, "type", "cpu")
    if kind == "cuda":
        import torch  # already loaded by the peer; kept out of this module's import time

        return torch.cuda.get_device_name(device)
    return f"cpu x{os.cpu_count()}" if kind == "cpu" else kind


def process_started_at() -> float:
    """Wall-clock start of this process (Linux /proc; else the time this module was imported)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()
