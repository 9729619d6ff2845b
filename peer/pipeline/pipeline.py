"""Pipeline tasklets: one stage of the model, micro-batches in and out over gRPC.

A run is a grid of S stages x R replicas. The peer at (stage s, replica r) holds layers
``stage_bounds(...)[s]`` of the model; replica r's peers form one pipeline. Per inner step
(``pipeline.schedule = "gpipe"``; ``"1f1b"`` interleaves the two halves, see :meth:`Pipeline.schedule`)::

    stage 0:      forward every micro-batch, send activations to s+1 as soon as each is computed;
                  then backward each micro-batch with the gradient s+1 sends back
    middle:       receive, forward, send on; then receive the gradient, backward, send it back
    last stage:   receive, forward, loss, backward at once, send the input gradient back

Sends run off the compute thread, so a stage computes the next micro-batch while the previous one
is on the wire and waits for the network only when it has nothing else to do. Each direction encodes
on one thread, in order; the encoded messages are pushed by a small pool (:mod:`potluck.peer.pipeline.pipesend`), so a
micro-batch does not wait for the one before it to be acknowledged: a step pays the link's round trip
once, not once per micro-batch. Sample ids and next-token labels travel with the activations.

Activations are compressed per ``pipeline.compression``: ``none`` (fp32), ``fp16``, ``direct``
(quantized at ``bits``), or ``acsgd`` (:mod:`potluck.compression.acsgd`: first visits in fp16, then
quantized *changes* against a per-sample buffer both sides keep bit-identical). Gradients travel
directly quantized at ``grad_bits`` (or fp32).

**Buffers never silently go stale.** Each AC-SGD message says which buffer version it builds on; a
receiver lacking that version (a new peer after a handover, a lost message) rejects it unchanged,
and the sender forgets those samples and resends them as first visits. When a boundary's
neighbour changes between rounds, both sides drop their buffers for it.

**Any size.** A message travels as a head and a body in pieces of bounded size
(:mod:`potluck.peer.pipeline.pipewire`), so a micro-batch of any model crosses, and the receiver decodes it
only once all of it has arrived.

**No hang.** A stage waits at most ``pipe_timeout_s`` for a neighbour (longer on the first
micro-batch of a round, when the neighbour may still be syncing); then it raises
:class:`~potluck.peer.pipeline.piperound.PipelineStall`, the peer contributes nothing to this outer step (it still receives the
average, so it stays in sync), and the coordinator re-forms the grid at the next boundary.

**No retry loop.** A send that can never succeed (the receiver refuses the message for good, or it
cannot be put on the wire) raises :class:`~potluck.peer.pipeline.piperound.PipelineBroken`: the peer tells its neighbours at once
(an ``abort`` message, so they stop waiting for it) and stops with that reason, which reaches the
coordinator's page, the log and the exit code.

What arrives is checked, decoded and queued by :mod:`potluck.peer.pipeline.piperound`; what leaves is encoded
and pushed by :mod:`potluck.peer.pipeline.pipesend`; this module runs the compute of each round between them.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

from potluck.compression.acsgd import AcsgdConfig, AcsgdReceiver, AcsgdSender
from potluck.peer.pipeline.piperound import (
    Activations,
    Gradient,
    Inbox,
    Neighbour,
    Round,
    arrived,
    kind_codecs,
)
from potluck.peer.pipeline.pipesend import PipeTraffic, Sends
from potluck.peer.swarm.links import Bursts
from potluck.peer.training.model import forward_layers, lm_loss
from potluck.protos import potluck_pb2 as pb
from potluck.protos.config.runconfig import ModelConfig, PipelineConfig
from potluck.protos.net.transport import PeerClient
from potluck.protos.runtime.log import get_logger, short_id
from potluck.protos.wire.limits import EVAL_BATCH

log = get_logger(__name__)


class Pipeline:
    """This peer's side of its replica's pipeline, for one stage: the compute of each round, in the order of
    :meth:`schedule`. What arrives is the :class:`~potluck.peer.pipeline.piperound.Inbox`'s (``inbox``); what leaves,
    :class:`~potluck.peer.pipeline.pipesend.Sends`' (``sends``). Its own state (``in_flight``) is the compute thread's."""

    def __init__(
        self,
        *,
        run_id: str,
        me: str,
        stage: int,
        stages: int,
        model: ModelConfig,
        cfg: PipelineConfig,
        client: PeerClient,
        num_samples: int,
        stopping: threading.Event | None = None,
        on_transfer: Callable[[str, int, float], None] | None = None,
        max_samples: int = EVAL_BATCH,
        device: torch.device | None = None,
    ) -> None:
        self.run_id, self.me, self.stage, self.stages = run_id, me, stage, stages
        self.model_cfg, self.cfg = model, cfg
        self.first, self.last = stage == 0, stage == stages - 1
        self.stopping = stopping or threading.Event()
        self.traffic = PipeTraffic()
        acfg = AcsgdConfig(bits=cfg.bits, rounding=cfg.rounding, first_visit=cfg.first_visit,
                           grad_bits=cfg.grad_bits if cfg.grad_bits in (4, 8) else 8,
                           memmap_threshold_bytes=cfg.buffer_memmap_bytes)
        acsgd = cfg.compression == "acsgd"
        self.sender = AcsgdSender(acfg) if acsgd and not self.last else None
        self.receiver = AcsgdReceiver(acfg) if acsgd and not self.first else None
        codecs = kind_codecs(cfg)
        self.inbox = Inbox(run_id=run_id, model=model, cfg=cfg, codecs=codecs, receiver=self.receiver,
                           num_samples=num_samples, max_samples=max_samples, stopping=self.stopping, device=device)
        self.sends = Sends(run_id=run_id, me=me, stage=stage, cfg=cfg, client=client, codecs=codecs,
                           sender=self.sender, inbox=self.inbox, traffic=self.traffic, stopping=self.stopping,
                           bursts=Bursts(on_transfer) if on_transfer is not None else None)
        self.in_flight = 0  # 1f1b with pipeline.in_flight unset: extra forwards ahead, measured each inner step
        self.ended = False  # the inner step trained last ends the inner phase (stage 0 marked it so)
        self.busy_s = 0.0  # seconds of the inner step trained last spent computing (not waiting for neighbours)

    # ------------------------------------------------------------------ rounds

    def begin_round(self, step: int, replica: int, prev: Neighbour | None, nxt: Neighbour | None, epoch: int = 0) -> None:
        """Start outer step ``step`` (of ``epoch``) with these neighbours; buffers of a changed
        neighbour are dropped."""
        with self.inbox.cond:  # one step for both sides, as a handler sees it
            old = self.inbox.begin(Round(step, epoch, replica, prev, nxt))
            self.sends.begin(next_changed=old is None or old.next != nxt)
        log.debug("round %d: replica %d, prev %s, next %s", step, replica,
                  short_id(prev.peer_id) if prev else "-", short_id(nxt.peer_id) if nxt else "-")

    def on_message(self, chunks: Iterator[pb.PipeChunk]) -> pb.Ack:
        """gRPC handler for a neighbour's message: see :meth:`Inbox.on_message`."""
        return self.inbox.on_message(chunks)

    def close(self) -> None:
        self.inbox.close()
        self.sends.close()

    def footprint(self) -> dict[str, int]:
        """Bytes the AC-SGD buffers of this stage hold in memory and on disk."""
        mem = disk = 0
        for side in (self.sender, self.receiver):
            if side is not None:
                f = side.footprint()
                mem, disk = mem + f.memory_bytes, disk + f.disk_bytes
        return {"memory_bytes": mem, "disk_bytes": disk}

    # ------------------------------------------------------------------ one inner step

    def train_step(
        self,
        layers: nn.ModuleList,
        inner: int,
        batch: tuple[list[int], torch.Tensor, torch.Tensor] | None,
        device: torch.device,
        forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
        last: bool = False,
    ) -> float:
        """Forward and backward of one inner step over ``micro_batches``, in the order of
        :meth:`schedule`; returns the loss.

        Stage 0 gets ``batch = (sample ids, tokens, targets)``; the other stages receive theirs. Stage 0's
        ``last`` (this step ends its inner phase: the round's window is over) travels with its forwards, and
        each stage after it passes it on and ends its phase with the same step (:attr:`ended`).
        Gradients accumulate in ``layers``; the caller steps the optimizer. ``forward`` runs the
        layers (a :class:`potluck.peer.training.runner.StageRunner`: autocast, checkpointing, compiled layers);
        by default plainly in fp32. Whatever it computes in, activations and gradients go on the wire
        as fp32 tensors, so neighbours never need to agree on a precision.
        """
        run = forward if forward is not None else lambda x: forward_layers(layers, x)
        r = self.inbox.current()
        m = self.cfg.micro_batches
        timeout = self.cfg.pipe_timeout_s * (3 if inner == 0 else 1)
        held: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        loss_total: float | torch.Tensor = 0.0  # the last stage's stays on the device until the step ends
        forward_s, waited_s, backward_s = 0.0, 0.0, 0.0
        ended = last if self.first else False
        for op, k in self.schedule(m):
            if op == "F":
                t0 = time.monotonic()
                if self.first:
                    assert batch is not None
                    ids, x, y = batch
                    size = len(ids) // m
                    mids, inp = ids[k * size:(k + 1) * size], x[k * size:(k + 1) * size].to(device)
                    labels = y[k * size:(k + 1) * size]
                    inp_grad_holder = None
                else:
                    got = self.inbox.take(r, "forward", inner, k, timeout)
                    assert isinstance(got, Activations)
                    t0 = time.monotonic()
                    mids, labels = got.ids, got.labels
                    ended = ended or got.last
                    inp = arrived(got.acts).to(device).requires_grad_(True)
                    inp_grad_holder = inp
                out = run(inp)
                if self.last:  # the loss at once: forward and backward of each micro-batch in turn
                    loss = lm_loss(out, labels.to(device).long()) / m
                    loss.backward()
                    loss_total = loss_total + loss.detach()
                    assert inp_grad_holder is not None and inp_grad_holder.grad is not None
                    self.sends.send(r, "backward", inner, k, mids, inp_grad_holder.grad, loss=loss.detach())
                else:
                    self.sends.send(r, "forward", inner, k, mids, out.detach(), labels=labels, last=ended)
                    held[k] = (out, inp_grad_holder)
                forward_s += time.monotonic() - t0
            else:
                t0 = time.monotonic()
                back = self.inbox.take(r, "backward", inner, k, timeout)
                assert isinstance(back, Gradient)
                waited_s += time.monotonic() - t0
                loss_k = back.loss
                out, holder = held.pop(k)
                t_back = time.monotonic()
                out.backward(arrived(back.grad).to(device, out.dtype))
                backward_s += time.monotonic() - t_back
                loss_total += loss_k
                if holder is not None:
                    assert holder.grad is not None
                    self.sends.send(r, "backward", inner, k, None, holder.grad, loss=loss_k)
            if inner > 0:
                timeout = self.cfg.pipe_timeout_s
        if self.cfg.schedule == "1f1b" and self.cfg.in_flight is None and not self.last:
            # cover the wait for gradients with forwards: as many more as fit in it, next time
            per_forward = forward_s / m if forward_s > 0 else float("inf")
            self.in_flight = min(m, math.ceil(waited_s / m / per_forward)) if waited_s > 0 else self.in_flight
        self.sends.flush(r)
        self.ended = ended
        self.busy_s = forward_s + backward_s  # (the last stage's backward is in its forwards: loss.backward at once)
        return float(loss_total)

    def schedule(self, m: int) -> list[tuple[str, int]]:
        """The order of this stage's forwards ("F") and backwards ("B") over ``m`` micro-batches.

        GPipe runs every forward, then every backward. 1F1B runs ``S - s - 1`` forwards (the
        micro-batches in flight to the stages after this one), plus ``in_flight`` more to cover the
        network, then one forward and one backward in turn, then the remaining backwards: it holds
        the activations of at most that many micro-batches, not of all ``m``. The last stage runs
        forward and backward of each micro-batch at once either way. Gradients add up to the same
        sums in any order (float rounding aside).
        """
        if self.last:
            return [("F", k) for k in range(m)]
        if self.cfg.schedule == "gpipe":
            return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
        extra = self.cfg.in_flight if self.cfg.in_flight is not None else self.in_flight
        warm = min(m, self.stages - self.stage - 1 + extra)
        order = [("F", k) for k in range(warm)]
        for k in range(m):
            if k + warm < m:
                order.append(("F", k + warm))
            order.append(("B", k))
        return order

    @torch.no_grad()
    def evaluate(self, layers: nn.ModuleList, version: int, batches: list[tuple[list[int], torch.Tensor, torch.Tensor]] | None,
                 n_batches: int, device: torch.device,
                 forward: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float | None:
        """Eval loss of version ``version`` through the whole pipeline; the last stage returns it."""
        run = forward if forward is not None else lambda x: forward_layers(layers, x)
        r = self.inbox.current()
        total, n = 0.0, 0
        for k in range(n_batches):
            if self.first:
                assert batches is not None
                ids, x, y = batches[k]
                inp, labels = x.to(device), y
            else:
                got = self.inbox.take(r, "eval", version, k, self.cfg.pipe_timeout_s * 2)
                assert isinstance(got, Activations)
                ids, inp, labels = got.ids, arrived(got.acts).to(device), got.labels
            out = run(inp)
            if self.last:
                total += float(lm_loss(out, labels.to(device).long())) * len(ids)
                n += len(ids)
            else:
                self.sends.send(r, "eval", version, k, ids, out, labels=labels)
        self.sends.flush(r)
        return total / n if self.last and n else None
