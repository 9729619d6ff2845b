"""One round of a stage's pipeline and its incoming store.

A :class:`Round` is one outer step's pipeline as this stage sees it: its neighbours, the mail they sent
for it, and whether it failed. Mail is typed: an :class:`Activations` (a forward or eval micro-batch
from the previous stage) or a :class:`Gradient` (a backward one from the next stage), filed under a
:class:`MailKey`.

:class:`Inbox` is the gRPC side of the store: it admits a message only from this round's neighbour
for this round (a message for a later round waits, bounded, for it to begin; one for an earlier round
is refused as stale), refuses a head whose shapes are not this run's before its body is read, decodes
(advancing the AC-SGD receiver's buffers only if all of the message is valid) and files it. The compute
thread takes what it needs with :meth:`Inbox.take`, which never waits past its deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
import torch

from potluck.compression.acsgd import AcsgdMessage, AcsgdReceiver, BufferMissError
from potluck.compression.actcodec import ActCodec, CodecError, wire_sizes
from potluck.peer.pipeline import pipewire
from potluck.protos import potluck_pb2 as pb
from potluck.protos.config.runconfig import ModelConfig, PipelineConfig
from potluck.protos.runtime.log import get_logger, short_id
from potluck.protos.wire.refusals import Rejected

log = get_logger(__name__)


class PipelineStall(RuntimeError):
    """A neighbour did not deliver (or accept) a micro-batch in time; this replica cannot go on."""


class PipelineBroken(PipelineStall):
    """A send that can never succeed: not a stall to wait out, but an error this peer stops on."""


@dataclass(frozen=True)
class Neighbour:
    peer_id: str
    address: str


class MailKey(NamedTuple):
    kind: str  # forward | backward | eval
    inner: int  # the inner step (for eval: the version evaluated)
    micro: int


@dataclass(frozen=True)
class Landing:
    """A received tensor being copied to the GPU on the receiving thread's stream; ``event`` marks its end."""

    tensor: torch.Tensor
    event: torch.cuda.Event


@dataclass(frozen=True)
class Activations:
    """A forward or eval micro-batch from the previous stage: its samples, their activations and labels."""

    ids: list[int]
    acts: torch.Tensor | Landing
    labels: torch.Tensor
    last: bool = False  # forward: the sender's inner phase ends with this inner step


@dataclass(frozen=True)
class Gradient:
    """A backward micro-batch from the next stage: the gradient of this stage's output, and its loss share."""

    grad: torch.Tensor | Landing
    loss: float


Incoming = Activations | Gradient


@dataclass
class Round:
    """One outer step's pipeline. ``mail``, ``error`` and ``broken`` are guarded by the condition of the
    :class:`Inbox` that began it: handler threads file mail and the sending threads record failures,
    the compute thread takes mail and reads failures."""

    step: int
    epoch: int
    replica: int
    prev: Neighbour | None
    next: Neighbour | None
    mail: dict[MailKey, Incoming] = field(default_factory=dict)
    error: str = ""
    broken: bool = False  # error is this peer's own send that can never succeed (PipelineBroken)


def raise_for(r: Round) -> None:
    if r.error:
        raise (PipelineBroken if r.broken else PipelineStall)(r.error)


def arrived(t: torch.Tensor | Landing) -> torch.Tensor:
    """The tensor, usable on the current stream: it waits (on the device, not here) for the copy to land."""
    if not isinstance(t, Landing):
        return t
    stream = torch.cuda.current_stream(t.tensor.device)
    stream.wait_event(t.event)
    t.tensor.record_stream(stream)  # its memory is not handed out again before this stream is done with it
    return t.tensor


def kind_codecs(cfg: PipelineConfig) -> dict[str, ActCodec]:
    """The codec of each message kind (without AC-SGD); both sides of a boundary build the same ones."""
    mode = {"none": "fp32", "fp16": "fp16", "direct": "quant", "acsgd": "fp16"}[cfg.compression]
    return {
        "forward": ActCodec(mode, cfg.bits, rounding=cfg.rounding),
        "eval": ActCodec("fp32" if cfg.compression == "none" else "fp16"),
        "backward": (ActCodec("quant", cfg.grad_bits, rounding=cfg.rounding) if cfg.grad_bits in (4, 8)
                     else ActCodec("fp32")),
    }


class Inbox:
    """This stage's incoming store: the current round and its mail.

    Owned by one :class:`~potluck.peer.pipeline.pipeline.Pipeline`. ``cond`` guards the current round, each round's
    ``mail``/``error``/``broken``, ``closed`` and the newest step a neighbour sent for; gRPC handler threads
    fill the mail and the compute thread empties it. ``receiver_lock`` guards the AC-SGD receiver, since
    messages may arrive together.
    """

    def __init__(
        self,
        *,
        run_id: str,
        model: ModelConfig,
        cfg: PipelineConfig,
        codecs: dict[str, ActCodec],
        receiver: AcsgdReceiver | None,
        num_samples: int,
        max_samples: int,
        stopping: threading.Event,
        device: torch.device | None,
    ) -> None:
        self.run_id, self.model_cfg, self.cfg, self.codecs = run_id, model, cfg, codecs
        self.receiver, self.num_samples, self.stopping = receiver, num_samples, stopping
        self.max_samples = max_samples  # the most samples one message may carry (a micro-batch, an eval batch)
        # on a GPU, what arrives is copied to the device on a stream of its own by the thread that received it:
        # the compute thread neither copies nor waits for the device to drain before a copy (it waits on an event)
        self.device = device
        self._h2d = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None
        self.cond = threading.Condition()
        self.receiver_lock = threading.Lock()
        self._round: Round | None = None
        self.closed = False
        self._ahead = (0, 0)  # the newest (epoch, step) a neighbour sent for: above ours means we fell behind

    def begin(self, new: Round) -> Round | None:
        """Make ``new`` the current round and return the one it replaces. The old round's queued sends are
        dropped, not delivered late; eval mail for this version or later carries over; the AC-SGD receiver's
        buffers are dropped if the previous stage changed."""
        with self.cond:
            old = self._round
            if old is not None and not old.error:
                old.error = f"round {old.step} is over"
            if self.receiver is not None and (old is None or old.prev != new.prev):
                with self.receiver_lock:
                    self.receiver.buffer.forget(None)
            keep = {k: v for k, v in old.mail.items() if k.kind == "eval"} if old else {}
            self._round = new
            new.mail.update({k: v for k, v in keep.items() if k.inner >= new.step})
            self.cond.notify_all()
            return old

    def close(self) -> None:
        with self.cond:
            self.closed = True  # a handler waiting on this (replaced) pipeline lets the sender retry
            self.cond.notify_all()
        if self.receiver is not None:
            with self.receiver_lock:
                self.receiver.buffer.close()

    def current(self) -> Round:
        with self.cond:
            if self._round is None:
                raise PipelineStall("no round has begun")
            return self._round

    def error(self, r: Round, reason: str) -> None:
        """End round ``r`` with ``reason``, unless it already failed: whoever waits on it stops waiting."""
        with self.cond:
            if not r.error:
                r.error = reason
            self.cond.notify_all()

    def mark_broken(self, r: Round, reason: str) -> bool:
        """End round ``r`` as broken (this peer's own send can never succeed); False if it already was."""
        with self.cond:
            if r.broken:
                return False
            r.error, r.broken = reason, True
            self.cond.notify_all()
            return True

    def take(self, r: Round, kind: str, inner: int, micro: int, timeout: float) -> Incoming:
        key = MailKey(kind, inner, micro)
        deadline = time.monotonic() + timeout
        with self.cond:
            while key not in r.mail:
                raise_for(r)
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
                self.cond.wait(min(left, 0.5))
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
        assert isinstance(r, Round)
        if msg.head.kind == "abort":
            log.warning("%s (stage %d) cannot go on with step %d: %s", short_id(h.sender), msg.head.stage, h.step,
                        msg.head.abort[:500])
            self.error(r, f"{short_id(h.sender)} (stage {msg.head.stage}) cannot go on: {msg.head.abort[:500]}")
            return pb.Ack(received_bytes=msg.nbytes)
        try:
            item = self._land(self._decode(msg))
        except BufferMissError as err:
            raise Rejected(pb.BUFFER_MISS, str(err), h.sender) from None
        except CodecError as err:
            raise Rejected(pb.BAD_MESSAGE, f"bad {msg.head.kind} message: {err}", h.sender) from None
        with self.cond:
            r.mail[MailKey(msg.head.kind, msg.head.inner_step, msg.head.micro)] = item
            self.cond.notify_all()
        return pb.Ack(received_bytes=msg.nbytes, handler_s=float(held["waited"]) + time.perf_counter() - t0)  # type: ignore[arg-type]

    def _admit(self, head: pb.PipeMessage) -> Round:
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

    def _await_round(self, step: int, epoch: int, kind: str) -> Round:
        """The round a message belongs to; a message for a later round waits (bounded) for it to begin.

        Rounds are ordered by (epoch, step): after a rollback the step goes back but the epoch up.
        """
        deadline = time.monotonic() + self.cfg.pipe_timeout_s
        with self.cond:
            while True:
                r = self._round
                if r is not None and (r.epoch, r.step) == (epoch, step):
                    return r
                if r is not None and (r.epoch, r.step) > (epoch, step):
                    raise Rejected(pb.WRONG_STEP if r.epoch == epoch else pb.WRONG_EPOCH,
                                   f"stale {kind} message for step {step} (epoch {epoch}); this tasklet is at step "
                                   f"{r.step} (epoch {r.epoch})", at_step=r.step, at_epoch=r.epoch)
                if r is not None and (epoch, step) > self._ahead:
                    self._ahead = (epoch, step)  # wakes a take() waiting for an older round: this peer is behind
                    self.cond.notify_all()
                left = deadline - time.monotonic()
                if left <= 0 or self.stopping.is_set() or self.closed:
                    raise Rejected(pb.NOT_YET, f"{kind} message for step {step}, but this tasklet is not there yet "
                                   f"(at step {r.step if r else 'none'})", at_step=r.step if r else 0)
                self.cond.wait(min(left, 0.5))

    def _decode(self, msg: pipewire.Inbound) -> Incoming:
        m, d, head = self.model_cfg, self.model_cfg.d_model, msg.head
        if head.kind == "backward":
            if msg.first is None:
                raise CodecError("a backward message needs its gradient")
            grad = self.codecs["backward"].decode_float(msg.first)
            if not np.isfinite(head.loss):
                raise CodecError("loss is NaN or Inf")
            self._check_shape(grad, len(grad), d)
            return Gradient(grad, float(head.loss))
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
            with self.receiver_lock:
                acts = self.receiver.decode(ids, AcsgdMessage(tuple(head.versions), msg.first, msg.delta))
        else:
            if head.versions or msg.delta is not None:
                raise CodecError("AC-SGD fields in a message to a stage that does not use AC-SGD")
            if msg.first is None:
                raise CodecError(f"a {head.kind} message needs its activations")
            acts = self.codecs[head.kind].decode_float(msg.first)
        self._check_shape(acts, len(ids), d)
        return Activations(ids, acts, labels, last=head.kind == "forward" and head.last)

    def _land(self, item: Incoming) -> Incoming:
        """A decoded item with its tensor on its way to this stage's GPU (unchanged on a CPU)."""
        if self._h2d is None:
            return item
        host = (item.grad if isinstance(item, Gradient) else item.acts)
        assert isinstance(host, torch.Tensor)
        host = host.pin_memory()
        with torch.cuda.stream(self._h2d):
            tensor = host.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._h2d)
        landing = Landing(tensor, event)
        return replace(item, grad=landing) if isinstance(item, Gradient) else replace(item, acts=landing)

    def _check_shape(self, t: torch.Tensor, batch: int, d: int) -> None:
        want = (batch, self.model_cfg.seq_len, d)
        if tuple(t.shape) != want:
            raise CodecError(f"tensor of shape {list(t.shape)}, expected {list(want)}")
