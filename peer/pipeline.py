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
on one thread, in order; the encoded messages are pushed by a small pool (``SENDS_IN_FLIGHT``), so a
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
(:mod:`potluck.peer.pipewire`), so a micro-batch of any model crosses, and the receiver decodes it
only once all of it has arrived.

**No hang.** A stage waits at most ``pipe_timeout_s`` for a neighbour (longer on the first
micro-batch of a round, when the neighbour may still be syncing); then it raises
:class:`PipelineStall`, the peer contributes nothing to this outer step (it still receives the
average, so it stays in sync), and the coordinator re-forms the grid at the next boundary.

**No retry loop.** A send that can never succeed (the receiver refuses the message for good, or it
cannot be put on the wire) raises :class:`PipelineBroken`: the peer tells its neighbours at once
(an ``abort`` message, so they stop waiting for it) and stops with that reason, which reaches the
coordinator's page, the log and the exit code.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch
from torch import nn

from potluck.compression.acsgd import AcsgdConfig, AcsgdMessage, AcsgdReceiver, AcsgdSender, BufferMissError
from potluck.compression.actcodec import ActCodec, CodecError, Packet, wire_sizes
from potluck.peer import pipewire
from potluck.peer.links import Bursts
from potluck.peer.model import forward_layers, lm_loss
from potluck.protos import potluck_pb2 as pb
from potluck.protos.config.runconfig import ModelConfig, PipelineConfig
from potluck.protos.net.transport import PeerClient, Rejected, refusal_of, refused, rpc_reason
from potluck.protos.runtime.log import get_logger, short_id
from potluck.protos.testkit.faults import injected
from potluck.protos.wire.limits import EVAL_BATCH, MAX_MESSAGE_BYTES

log = get_logger(__name__)

# micro-batch pushes on the wire at once, per direction: enough to cover a round trip, and both directions
# together under a server's per-caller limit (PER_CLIENT_CALLS) when both neighbours sit behind one relay
SENDS_IN_FLIGHT = 4
# messages a direction holds encoded and not yet delivered: those on the wire and one ready for the next free
# push. A slow receiver (gRPC's flow control paces each stream) holds the encoder here, so what the sender
# keeps in memory beyond its activations is bounded by this many messages, whatever the micro-batch count
ENCODED_AHEAD = SENDS_IN_FLIGHT + 1


class PipelineStall(RuntimeError):
    """A neighbour did not deliver (or accept) a micro-batch in time; this replica cannot go on."""


class PipelineBroken(PipelineStall):
    """A send that can never succeed: not a stall to wait out, but an error this peer stops on."""


# refusals that say the message itself is wrong for the receiver, so sending it again cannot help
_FOR_GOOD = (pb.BAD_MESSAGE, pb.UNSUPPORTED, pb.UNKNOWN_RUN)
_FOR_GOOD_STATUS = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL)


@dataclass(frozen=True)
class Neighbour:
    peer_id: str
    address: str


@dataclass
class PipeTraffic:
    """Bytes of tensor payload (codes + scales) this stage sent, and what fp32 would have cost."""

    activations: int = 0
    activations_fp32: int = 0
    gradients: int = 0
    gradients_fp32: int = 0

    def ratio(self) -> float | None:
        return self.activations / self.activations_fp32 if self.activations_fp32 else None


@dataclass
class _Round:
    step: int
    epoch: int
    replica: int
    prev: Neighbour | None
    next: Neighbour | None
    mail: dict[tuple[str, int, int], tuple] = field(default_factory=dict)
    error: str = ""
    broken: bool = False  # error is this peer's own send that can never succeed (PipelineBroken)


@dataclass(frozen=True)
class _Outgoing:
    """One micro-batch on its way out: what to encode, and where to."""

    r: _Round
    to: Neighbour
    kind: str  # forward | backward | eval
    inner: int
    micro: int
    ids: list[int] | None
    tensor: torch.Tensor  # where the stage computed it (its device and dtype): encoded there, off the compute thread
    labels: torch.Tensor | None
    loss: float | torch.Tensor  # the last stage's, still on its device: read by the encoder, not the compute thread

    @property
    def direction(self) -> str:
        return "backward" if self.kind == "backward" else "forward"


class Pipeline:
    """This peer's side of its replica's pipeline, for one stage."""

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
        self.model_cfg, self.cfg, self.client, self.num_samples = model, cfg, client, num_samples
        self.max_samples = max_samples  # the most samples one message may carry (a micro-batch, an eval batch)
        # on a GPU, what arrives is copied to the device on a stream of its own by the thread that received it:
        # the compute thread neither copies nor waits for the device to drain before a copy (it waits on an event)
        self.device = device
        self._h2d = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None
        self.first, self.last = stage == 0, stage == stages - 1
        self.stopping = stopping or threading.Event()
        # (peer id, bytes, seconds) of delivered messages: passive link figures, a burst of overlapping pushes at a time
        self._bursts = Bursts(on_transfer) if on_transfer is not None else None
        self.traffic = PipeTraffic()
        acfg = AcsgdConfig(bits=cfg.bits, rounding=cfg.rounding, first_visit=cfg.first_visit,
                           grad_bits=cfg.grad_bits if cfg.grad_bits in (4, 8) else 8,
                           memmap_threshold_bytes=cfg.buffer_memmap_bytes)
        self.acsgd = cfg.compression == "acsgd"
        self.sender = AcsgdSender(acfg) if self.acsgd and not self.last else None
        self.receiver = AcsgdReceiver(acfg) if self.acsgd and not self.first else None
        mode = {"none": "fp32", "fp16": "fp16", "direct": "quant", "acsgd": "fp16"}[cfg.compression]
        self.act_codec = ActCodec(mode, cfg.bits, rounding=cfg.rounding)
        self.eval_codec = ActCodec("fp32" if cfg.compression == "none" else "fp16")
        self.grad_codec = (ActCodec("quant", cfg.grad_bits, rounding=cfg.rounding) if cfg.grad_bits in (4, 8)
                           else ActCodec("fp32"))
        self._cond = threading.Condition()
        self._round: _Round | None = None
        # each direction encodes on one thread, in order; the pushes overlap (a micro-batch does not wait
        # for the one before it to be acknowledged: one round trip per step, not one per micro-batch)
        self._encoders = {d: ThreadPoolExecutor(1, thread_name_prefix=f"pipe-{d[:3]}") for d in ("forward", "backward")}
        self._pushers = {d: ThreadPoolExecutor(SENDS_IN_FLIGHT, thread_name_prefix=f"pipe-{d[:3]}-push")
                         for d in ("forward", "backward")}
        self._encoded = {d: threading.BoundedSemaphore(ENCODED_AHEAD) for d in ("forward", "backward")}
        self.encoded_peak = 0  # the most messages held encoded at once (both directions)
        self._encoded_now = 0
        self._sender_lock = threading.Lock()  # the AC-SGD sender: encoded in order, re-encoded by a push on a miss
        self._receiver_lock = threading.Lock()  # the AC-SGD receiver: messages may now arrive together
        self._pending: list[Future] = []
        self._on_wire: list[tuple[set[int], Future]] = []  # forward pushes and their samples (the forward encoder's)
        self._closed = False
        self._ahead = (0, 0)  # the newest (epoch, step) a neighbour sent for: above ours means we fell behind
        self.in_flight = 0  # 1f1b with pipeline.in_flight unset: extra forwards ahead, measured each inner step

    # ------------------------------------------------------------------ rounds

    def begin_round(self, step: int, replica: int, prev: Neighbour | None, nxt: Neighbour | None, epoch: int = 0) -> None:
        """Start outer step ``step`` (of ``epoch``) with these neighbours; buffers of a changed
        neighbour are dropped."""
        with self._cond:
            old = self._round
            if old is not None and not old.error:
                old.error = f"round {old.step} is over"  # its queued sends are dropped, not delivered late
            self._pending = []
            if self.sender is not None and (old is None or old.next != nxt):
                with self._sender_lock:
                    self.sender.reset()
            if self.receiver is not None and (old is None or old.prev != prev):
                with self._receiver_lock:
                    self.receiver.buffer.forget(None)
            keep = {k: v for k, v in old.mail.items() if k[0] == "eval"} if old else {}
            self._round = _Round(step, epoch, replica, prev, nxt)
            self._round.mail.update({k: v for k, v in keep.items() if k[1] >= step})
            self._cond.notify_all()
        log.debug("round %d: replica %d, prev %s, next %s", step, replica,
                  short_id(prev.peer_id) if prev else "-", short_id(nxt.peer_id) if nxt else "-")

    def close(self) -> None:
        with self._cond:
            self._closed = True  # a handler waiting on this (replaced) pipeline lets the sender retry
            self._cond.notify_all()
        for ex in (*self._encoders.values(), *self._pushers.values()):
            ex.shutdown(wait=False, cancel_futures=True)
        for side, lock in ((self.sender, self._sender_lock), (self.receiver, self._receiver_lock)):
            if side is not None:
                with lock:
                    side.buffer.close()

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
    ) -> float:
        """Forward and backward of one inner step over ``micro_batches``, in the order of
        :meth:`schedule`; returns the loss.

        Stage 0 gets ``batch = (sample ids, tokens, targets)``; the other stages receive theirs.
        Gradients accumulate in ``layers``; the caller steps the optimizer. ``forward`` runs the
        layers (a :class:`potluck.peer.runner.StageRunner`: autocast, checkpointing, compiled layers);
        by default plainly in fp32. Whatever it computes in, activations and gradients go on the wire
        as fp32 tensors, so neighbours never need to agree on a precision.
        """
        run = forward if forward is not None else lambda x: forward_layers(layers, x)
        r = self._current()
        m = self.cfg.micro_batches
        timeout = self.cfg.pipe_timeout_s * (3 if inner == 0 else 1)
        held: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        loss_total: float | torch.Tensor = 0.0  # the last stage's stays on the device until the step ends
        forward_s, waited_s = 0.0, 0.0
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
                    mids, recv, labels = self._take(r, "forward", inner, k, timeout)
                    t0 = time.monotonic()
                    inp = _arrived(recv).to(device).requires_grad_(True)
                    inp_grad_holder = inp
                out = run(inp)
                if self.last:  # the loss at once: forward and backward of each micro-batch in turn
                    loss = lm_loss(out, labels.to(device).long()) / m
                    loss.backward()
                    loss_total = loss_total + loss.detach()
                    assert inp_grad_holder is not None and inp_grad_holder.grad is not None
                    self._send(r, "backward", inner, k, mids, inp_grad_holder.grad, loss=loss.detach())
                else:
                    self._send(r, "forward", inner, k, mids, out.detach(), labels=labels)
                    held[k] = (out, inp_grad_holder)
                forward_s += time.monotonic() - t0
            else:
                t0 = time.monotonic()
                grad, loss_k = self._take(r, "backward", inner, k, timeout)
                waited_s += time.monotonic() - t0
                out, holder = held.pop(k)
                out.backward(_arrived(grad).to(device, out.dtype))
                loss_total += loss_k
                if holder is not None:
                    assert holder.grad is not None
                    self._send(r, "backward", inner, k, None, holder.grad, loss=loss_k)
            if inner > 0:
                timeout = self.cfg.pipe_timeout_s
        if self.cfg.schedule == "1f1b" and self.cfg.in_flight is None and not self.last:
            # cover the wait for gradients with forwards: as many more as fit in it, next time
            per_forward = forward_s / m if forward_s > 0 else float("inf")
            self.in_flight = min(m, math.ceil(waited_s / m / per_forward)) if waited_s > 0 else self.in_flight
        self._flush(r)
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
        r = self._current()
        total, n = 0.0, 0
        for k in range(n_batches):
            if self.first:
                assert batches is not None
                ids, x, y = batches[k]
                inp, labels = x.to(device), y
            else:
                ids, inp, labels = self._take(r, "eval", version, k, self.cfg.pipe_timeout_s * 2)
                inp = _arrived(inp).to(device)
            out = run(inp)
            if self.last:
                total += float(lm_loss(out, labels.to(device).long())) * len(ids)
                n += len(ids)
            else:
                self._send(r, "eval", version, k, ids, out, labels=labels)
        self._flush(r)
        return total / n if self.last and n else None

    # ------------------------------------------------------------------ sending

    def _send(self, r: _Round, kind: str, inner: int, micro: int, ids: list[int] | None, tensor: torch.Tensor,
              labels: torch.Tensor | None = None, loss: float | torch.Tensor = 0.0) -> None:
        to = r.next if kind in ("forward", "eval") else r.prev
        if to is None:
            raise PipelineStall(f"stage {self.stage} has no {'next' if kind != 'backward' else 'previous'} stage")
        # the tensor stays where it was computed: the encoder thread moves (or, on a GPU, encodes) it, so the
        # compute thread never waits for a device-to-host copy
        out = _Outgoing(r, to, kind, inner, micro, ids, tensor.detach(), labels, loss)
        self._pending.append(self._encoders[out.direction].submit(self._dispatch, out))

    def _dispatch(self, out: _Outgoing) -> Future | None:
        """Encode one micro-batch (on its direction's encoder thread, so in order) and put it on the wire.

        A forward message whose samples are still on the wire in an earlier one (a batch that wraps
        round the data holds a sample twice) waits for it: AC-SGD buffers must see them in order."""
        tracked = out.kind == "forward" and self.sender is not None and bool(out.ids)
        if tracked:
            self._on_wire = [(s, f) for s, f in self._on_wire if not f.done()]
            for samples, fut in self._on_wire:
                if not samples.isdisjoint(out.ids or ()):
                    fut.result()  # (before encoding: a resend of that one may reset these samples' buffers)
        slots = self._encoded[out.direction]
        while not slots.acquire(timeout=0.1):  # the receiver is slow: wait for a message to be delivered
            if out.r.error or self._closed:
                return None
        if out.r.error:  # the round is over: its queued messages must not advance the AC-SGD buffers
            slots.release()
            return None
        msg = self._encode_or_fail(out)
        if msg is None:
            slots.release()
            return None
        self._held(+1)
        push = self._pushers[out.direction].submit(self._deliver, msg, out)
        push.add_done_callback(lambda _: (self._held(-1), slots.release()))
        if tracked:
            self._on_wire.append((set(out.ids or ()), push))
        return push

    def _held(self, change: int) -> None:
        with self._cond:
            self._encoded_now += change
            self.encoded_peak = max(self.encoded_peak, self._encoded_now)

    def _encode_or_fail(self, out: _Outgoing) -> pipewire.Outbound | None:
        try:  # encoding advances the AC-SGD buffer: only once per (re)send decision
            with self._sender_lock:
                return self._encode(out)
        except CodecError as err:  # NaN/Inf in what this stage computed: the step is lost, the peer is not
            self._error(out.r, f"{out.kind} micro-batch {out.micro}: {err}")
            return None
        except Exception as err:  # an encoding bug: it will fail the same way next time
            log.exception("encoding %s micro-batch %d failed", out.kind, out.micro)
            self._broken(out.r, f"encoding {out.kind} micro-batch {out.micro} failed: {err}")
            return None

    def _deliver(self, msg: pipewire.Outbound | None, out: _Outgoing) -> None:
        """Push one encoded micro-batch; a receiver not yet in this round is retried until the deadline, a
        refusal for good ends the round as broken (:class:`PipelineBroken`) at once."""
        deadline = time.monotonic() + self.cfg.pipe_timeout_s * 3
        resent = False
        while not out.r.error:
            if msg is None and (msg := self._encode_or_fail(out)) is None:
                return
            if msg.head.ByteSize() > MAX_MESSAGE_BYTES - 1024:
                self._broken(out.r, f"the head of {out.kind} micro-batch {out.micro} is {msg.head.ByteSize()} bytes, "
                                    f"over the {MAX_MESSAGE_BYTES} a gRPC message may hold: lower train.batch_size or "
                                    "raise pipeline.micro_batches")
                return
            oversize = injected("pipe.send", out.r.step, "oversize")
            try:
                self._push(out.to, msg, oversize)
                return
            except grpc.RpcError as err:
                reason = rpc_reason(err)
                if refused(err, pb.BUFFER_MISS) and not resent and self.sender is not None and out.ids is not None:
                    log.info("%s has no AC-SGD buffer for some samples (%s); resending them as first visits",
                             short_id(out.to.peer_id), reason)
                    with self._sender_lock:
                        self.sender.forget(out.ids)
                    msg, resent = None, True
                    continue
                if refused(err, pb.NOT_YET) and time.monotonic() < deadline and not self.stopping.wait(0.1):
                    continue  # the neighbour is still finishing its previous outer step or recovering
                what = (f"{out.kind} micro-batch {out.micro} of inner step {out.inner} to {short_id(out.to.peer_id)} "
                        f"failed: {reason}")
                if _for_good(err, oversize):
                    self._broken(out.r, what)
                else:
                    self._error(out.r, what)
                return

    def _push(self, to: Neighbour, msg: pipewire.Outbound, oversize: bool = False) -> pb.Ack:
        """One message, as its head and body pieces; ``oversize`` (a fault, for tests) adds a piece over the cap
        every gRPC message is held to, as a message sent whole used to be."""
        nbytes, bursts, ack = msg.nbytes, self._bursts, None
        chunks = msg.chunks()
        if oversize:
            chunks = itertools.chain(chunks, [pb.PipeChunk(data=bytes(MAX_MESSAGE_BYTES + 1))])
        if bursts is not None:
            bursts.start(to.peer_id)
        try:
            ack = self.client.push_pipe(to.address, chunks, timeout=self.cfg.pipe_timeout_s * 2, peer=to.peer_id)
            return ack
        finally:
            if bursts is not None:  # network time only: not the receiver's wait for its round
                held = max(0.0, ack.handler_s) if ack is not None else 0.0
                bursts.end(to.peer_id, nbytes if ack is not None else 0, held)

    def _encode(self, out: _Outgoing) -> pipewire.Outbound:
        r, kind, ids, labels = out.r, out.kind, out.ids, out.labels
        tensor = out.tensor.float()  # fp32 on the wire whatever the stage computed in (a no-op for fp32)
        msg = pb.PipeMessage(
            header=pb.Header(run_id=self.run_id, sender=self.me, step=r.step, epoch=r.epoch), kind=kind,
            inner_step=out.inner, micro=out.micro, sample_ids=ids or [], loss=float(out.loss), stage=self.stage,
            replica=r.replica,
        )
        if labels is not None:
            lab = labels.to(torch.int32).contiguous()
            msg.labels, msg.label_shape[:] = lab.numpy().tobytes(), list(lab.shape)
        fp32_bytes = tensor.numel() * 4
        if kind == "forward" and self.sender is not None:
            assert ids is not None
            enc = self.sender.encode(ids, tensor)
            msg.versions[:] = list(enc.versions)
            if enc.first is not None:
                msg.first.CopyFrom(_to_pb(enc.first))
            if enc.delta is not None:
                msg.delta.CopyFrom(_to_pb(enc.delta))
            nbytes = enc.nbytes
        else:
            codec = {"forward": self.act_codec, "eval": self.eval_codec, "backward": self.grad_codec}[kind]
            packet = codec.encode(tensor)
            msg.first.CopyFrom(_to_pb(packet))
            nbytes = packet.nbytes
        if kind == "forward":
            self.traffic.activations += nbytes
            self.traffic.activations_fp32 += fp32_bytes
        elif kind == "backward":
            self.traffic.gradients += nbytes
            self.traffic.gradients_fp32 += fp32_bytes
        return pipewire.outbound(msg)

    def _flush(self, r: _Round) -> None:
        """Wait for this step's sends (so a failure is seen now, not a step later)."""
        pending, self._pending = self._pending, []
        for fut in pending:
            pushed = fut.result()
            if pushed is not None:
                pushed.result()
        _raise_for(r)

    def _error(self, r: _Round, reason: str) -> None:
        with self._cond:
            if not r.error:
                r.error = reason
            self._cond.notify_all()

    def _broken(self, r: _Round, reason: str) -> None:
        """This peer's send can never succeed: end the round as broken, and tell both neighbours at once, so
        they stop waiting for micro-batches that are not coming."""
        with self._cond:
            if r.broken:
                return
            r.error, r.broken = reason, True
            self._cond.notify_all()
        log.error("pipeline of step %d broken: %s", r.step, reason)
        for to in (r.prev, r.next):
            if to is not None:
                threading.Thread(target=self._send_abort, args=(r, to, reason), name="pipe-abort", daemon=True).start()

    def _send_abort(self, r: _Round, to: Neighbour, reason: str) -> None:
        head = pb.PipeMessage(header=pb.Header(run_id=self.run_id, sender=self.me, step=r.step, epoch=r.epoch),
                              kind="abort", stage=self.stage, replica=r.replica, abort=reason[:500])
        try:
            self.client.push_pipe(to.address, pipewire.Outbound(head, (b"",) * len(pipewire.BODY)).chunks(),
                                  timeout=min(10.0, self.cfg.pipe_timeout_s), peer=to.peer_id)
        except grpc.RpcError as err:  # the neighbour learns it from its own deadline instead
            log.warning("could not tell %s that this pipeline is broken: %s", short_id(to.peer_id), rpc_reason(err))

    # ------------------------------------------------------------------ receiving

    def _current(self) -> _Round:
        with self._cond:
            if self._round is None:
                raise PipelineStall("no round has begun")
            return self._round

    def _take(self, r: _Round, kind: str, inner: int, micro: int, timeout: float) -> tuple:
        key = (kind, inner, micro)
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in r.mail:
                _raise_for(r)
                if self.stopping.is_set():
                    raise PipelineStall("stopping")
                if self._round is not r:
                    raise PipelineStall("the round changed")
                if self._ahead > (r.epoch, r.step):
                    raise PipelineStall(f"a neighbour is already at step {self._ahead[1]} (epoch {self._ahead[0]}); "
                                        f"this peer fell behind at step {r.step}")
                left = deadline - time.monotonic()
                if left <= 0:
                    who = r.prev if kind != "backward" else r.next
                    raise PipelineStall(
                        f"no {kind} micro-batch {micro} of inner step {inner} from "
                        f"{short_id(who.peer_id) if who else '?'} within {timeout:.0f} s"
                    )
                self._cond.wait(min(left, 0.5))
            return r.mail.pop(key)

    def on_message(self, chunks: Iterator[pb.PipeChunk]) -> pb.Ack:
        """gRPC handler: check the head, read the body, decode (updating AC-SGD buffers only if all of it is
        valid), queue. ``handler_s`` in the reply is what this side held the call for (its wait for the round,
        decoding), not the body's time on the wire."""
        held: dict[str, object] = {}

        def check(head: pb.PipeMessage, sizes: list[int]) -> None:
            t0 = time.perf_counter()
            held["round"] = self._admit(head)
            if head.kind != "abort":
                self._check_sizes(head, sizes)
            held["waited"] = time.perf_counter() - t0

        msg = pipewire.receive(chunks, check)
        t0 = time.perf_counter()
        h, r = msg.head.header, held["round"]
        assert isinstance(r, _Round)
        if msg.head.kind == "abort":
            log.warning("%s (stage %d) cannot go on with step %d: %s", short_id(h.sender), msg.head.stage, h.step,
                        msg.head.abort[:500])
            self._error(r, f"{short_id(h.sender)} (stage {msg.head.stage}) cannot go on: {msg.head.abort[:500]}")
            return pb.Ack(received_bytes=msg.nbytes)
        try:
            item = self._land(self._decode(msg))
        except BufferMissError as err:
            raise Rejected(pb.BUFFER_MISS, str(err), h.sender) from None
        except CodecError as err:
            raise Rejected(pb.BAD_MESSAGE, f"bad {msg.head.kind} message: {err}", h.sender) from None
        with self._cond:
            r.mail[(msg.head.kind, msg.head.inner_step, msg.head.micro)] = item
            self._cond.notify_all()
        return pb.Ack(received_bytes=msg.nbytes, handler_s=float(held["waited"]) + time.perf_counter() - t0)  # type: ignore[arg-type]

    def _admit(self, head: pb.PipeMessage) -> _Round:
        """The round a message's head belongs to, if it is this tasklet's neighbour's to send; else refused."""
        h = head.header
        if h.run_id != self.run_id:
            raise Rejected(pb.UNKNOWN_RUN, f"unknown run id {h.run_id!r}", h.sender)
        if head.kind not in ("forward", "backward", "eval", "abort"):
            raise Rejected(pb.BAD_MESSAGE, f"unknown pipe message kind {head.kind!r}", h.sender)
        r = self._await_round(h.step, h.epoch, head.kind)
        neighbours = {"backward": [r.next], "abort": [r.prev, r.next]}.get(head.kind, [r.prev])
        if not any(n is not None and n.peer_id == h.sender for n in neighbours):
            raise Rejected(pb.NOT_A_MEMBER,
                           f"{head.kind} message from {short_id(h.sender)}, which is not this tasklet's "
                           f"{'next' if head.kind == 'backward' else 'previous'} stage in step {h.step}", h.sender)
        if head.micro < 0 or head.inner_step < 0:
            raise Rejected(pb.BAD_MESSAGE, "negative micro-batch or inner step", h.sender)
        return r

    def _check_sizes(self, head: pb.PipeMessage, sizes: list[int]) -> None:
        """Refuse a head whose shapes are not this run's, or whose body sizes are not what those shapes need,
        before its body is read: what a receiver allocates is bounded by the run's own shapes."""
        m, sender = self.model_cfg, head.header.sender
        n = len(head.sample_ids)
        if n > self.max_samples:
            raise Rejected(pb.BAD_MESSAGE, f"{n} samples in one message; this run sends at most {self.max_samples}",
                           sender)
        want = [4 * n * m.seq_len if head.kind != "backward" else 0]
        for name in ("first", "delta"):
            if not head.HasField(name):
                want += [0, 0]
                continue
            p = getattr(head, name)
            shape = tuple(p.shape)
            if len(shape) != 3 or shape[1:] != (m.seq_len, m.d_model) or not 0 <= shape[0] <= self.max_samples:
                raise Rejected(pb.BAD_MESSAGE, f"{head.kind} {name} packet of shape {list(shape)}; this run sends "
                               f"[B <= {self.max_samples}, {m.seq_len}, {m.d_model}]", sender)
            try:
                want += list(wire_sizes(p.mode, p.bits, shape))
            except CodecError as err:
                raise Rejected(pb.BAD_MESSAGE, f"bad {head.kind} {name} packet: {err}", sender) from None
        if sizes != want:
            raise Rejected(pb.BAD_MESSAGE, f"a {head.kind} head declares body sizes {sizes}; its shapes need {want} "
                           f"({', '.join(pipewire.BODY)})", sender)

    def _await_round(self, step: int, epoch: int, kind: str) -> _Round:
        """The round a message belongs to; a message for a later round waits (bounded) for it to begin.

        Rounds are ordered by (epoch, step): after a rollback the step goes back but the epoch up.
        """
        deadline = time.monotonic() + self.cfg.pipe_timeout_s
        with self._cond:
            while True:
                r = self._round
                if r is not None and (r.epoch, r.step) == (epoch, step):
                    return r
                if r is not None and (r.epoch, r.step) > (epoch, step):
                    raise Rejected(pb.WRONG_STEP if r.epoch == epoch else pb.WRONG_EPOCH,
                                   f"stale {kind} message for step {step} (epoch {epoch}); this tasklet is at step "
                                   f"{r.step} (epoch {r.epoch})", at_step=r.step, at_epoch=r.epoch)
                if r is not None and (epoch, step) > self._ahead:
                    self._ahead = (epoch, step)  # wakes a _take waiting for an older round: this peer is behind
                    self._cond.notify_all()
                left = deadline - time.monotonic()
                if left <= 0 or self.stopping.is_set() or self._closed:
                    raise Rejected(pb.NOT_YET, f"{kind} message for step {step}, but this tasklet is not there yet "
                                   f"(at step {r.step if r else 'none'})", at_step=r.step if r else 0)
                self._cond.wait(min(left, 0.5))

    def _decode(self, msg: pipewire.Inbound) -> tuple:
        m, d, head = self.model_cfg, self.model_cfg.d_model, msg.head
        if head.kind == "backward":
            if msg.first is None:
                raise CodecError("a backward message needs its gradient")
            grad = self.grad_codec.decode_float(msg.first)
            if not np.isfinite(head.loss):
                raise CodecError("loss is NaN or Inf")
            self._check_shape(grad, len(grad), d)
            return grad, float(head.loss)
        ids = list(head.sample_ids)
        if not ids:
            raise CodecError("a forward message needs its sample ids")
        if head.kind == "forward" and (min(ids) < 0 or max(ids) >= self.num_samples):
            raise CodecError(f"unknown sample id {max(ids) if max(ids) >= self.num_samples else min(ids)} "
                             f"(the run has ids 0..{self.num_samples - 1})")
        if list(head.label_shape) != [len(ids), m.seq_len] or len(msg.labels) != 4 * len(ids) * m.seq_len:
            raise CodecError(f"labels of shape {list(head.label_shape)} ({len(msg.labels)} bytes) for "
                             f"{len(ids)} samples of {m.seq_len} tokens")
        labels = torch.from_numpy(np.frombuffer(msg.labels, dtype=np.int32).copy()).view(len(ids), m.seq_len)
        if bool((labels < 0).any()) or bool((labels >= m.vocab_size).any()):
            raise CodecError(f"labels outside the vocabulary [0, {m.vocab_size})")
        if head.kind == "forward" and self.receiver is not None:
            with self._receiver_lock:
                acts = self.receiver.decode(ids, AcsgdMessage(tuple(head.versions), msg.first, msg.delta))
        else:
            if head.versions or msg.delta is not None:
                raise CodecError("AC-SGD fields in a message to a stage that does not use AC-SGD")
            if msg.first is None:
                raise CodecError(f"a {head.kind} message needs its activations")
            codec = self.act_codec if head.kind == "forward" else self.eval_codec
            acts = codec.decode_float(msg.first)
        self._check_shape(acts, len(ids), d)
        return ids, acts, labels

    def _land(self, item: tuple) -> tuple:
        """A decoded item with its tensor on its way to this stage's GPU (unchanged on a CPU)."""
        if self._h2d is None:
            return item
        k = 0 if len(item) == 2 else 1  # (gradient, loss) or (ids, activations, labels)
        host = item[k].pin_memory()
        with torch.cuda.stream(self._h2d):
            tensor = host.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._h2d)
        return (*item[:k], _Landing(tensor, event), *item[k + 1:])

    def _check_shape(self, t: torch.Tensor, batch: int, d: int) -> None:
        want = (batch, self.model_cfg.seq_len, d)
        if tuple(t.shape) != want:
            raise CodecError(f"tensor of shape {list(t.shape)}, expected {list(want)}")


@dataclass(frozen=True)
class _Landing:
    """A received tensor being copied to the GPU on the receiving thread's stream; ``event`` marks its end."""

    tensor: torch.Tensor
    event: torch.cuda.Event


def _arrived(t: torch.Tensor | _Landing) -> torch.Tensor:
    """The tensor, usable on the current stream: it waits (on the device, not here) for the copy to land."""
    if not isinstance(t, _Landing):
        return t
    stream = torch.cuda.current_stream(t.tensor.device)
    stream.wait_event(t.event)
    t.tensor.record_stream(stream)  # its memory is not handed out again before this stream is done with it
    return t.tensor


def _raise_for(r: _Round) -> None:
    if r.error:
        raise (PipelineBroken if r.broken else PipelineStall)(r.error)


def _for_good(err: grpc.RpcError, oversize: bool) -> bool:
    """Whether a failed send can never succeed: the receiver refused the message itself, or gRPC refused a
    piece over its size cap (RESOURCE_EXHAUSTED is otherwise a server's passing overload)."""
    info = refusal_of(err)
    if info is not None:
        return info.code in _FOR_GOOD
    code = err.code()  # type: ignore[attr-defined]
    return code in _FOR_GOOD_STATUS or (code == grpc.StatusCode.RESOURCE_EXHAUSTED and oversize)


def _to_pb(p: Packet) -> pb.ActPacket:
    return pb.ActPacket(mode=p.mode, bits=p.bits, shape=list(p.shape), dtype=p.dtype, scales=p.scales, payload=p.payload)
