"""Sending a stage's micro-batches: encode off the compute thread, push several at once, fail loudly.

Each direction encodes on one thread, in order (AC-SGD buffers must see a sample's visits in order); the
encoded messages are pushed by a small pool (``SENDS_IN_FLIGHT``), so a micro-batch does not wait for the
one before it to be acknowledged. A receiver not yet in this round is retried until the deadline; one
lacking an AC-SGD buffer gets those samples again as first visits; a refusal for good ends the round as
broken and tells both neighbours (an ``abort`` message) so they stop waiting.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from potluck.compression.acsgd import AcsgdSender
from potluck.compression.actcodec import ActCodec, CodecError, Packet
from potluck.peer.pipeline import pipewire
from potluck.peer.pipeline.piperound import Inbox, Neighbour, PipelineStall, Round, raise_for
from potluck.peer.swarm.links import Bursts
from potluck.protos import potluck_pb2 as pb
from potluck.protos.config.runconfig import PipelineConfig
from potluck.protos.net.transport import PeerClient
from potluck.protos.runtime.log import get_logger, short_id
from potluck.protos.testkit.faults import injected
from potluck.protos.wire.limits import MAX_MESSAGE_BYTES
from potluck.protos.wire.refusals import refusal_of, refused, rpc_reason

log = get_logger(__name__)

# micro-batch pushes on the wire at once, per direction: enough to cover a round trip, and both directions
# together under a server's per-caller limit (PER_CLIENT_CALLS) when both neighbours sit behind one relay
SENDS_IN_FLIGHT = 4
# messages a direction holds encoded and not yet delivered: those on the wire and one ready for the next free
# push. A slow receiver (gRPC's flow control paces each stream) holds the encoder here, so what the sender
# keeps in memory beyond its activations is bounded by this many messages, whatever the micro-batch count
ENCODED_AHEAD = SENDS_IN_FLIGHT + 1

# refusals that say the message itself is wrong for the receiver, so sending it again cannot help
_FOR_GOOD = (pb.BAD_MESSAGE, pb.UNSUPPORTED, pb.UNKNOWN_RUN)
_FOR_GOOD_STATUS = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL)


@dataclass
class PipeTraffic:
    """Bytes of tensor payload (codes + scales) this stage sent, and what fp32 would have cost."""

    activations: int = 0
    activations_fp32: int = 0
    gradients: int = 0
    gradients_fp32: int = 0

    def ratio(self) -> float | None:
        return self.activations / self.activations_fp32 if self.activations_fp32 else None


@dataclass(frozen=True)
class Outgoing:
    """One micro-batch on its way out: what to encode, and where to."""

    r: Round
    to: Neighbour
    kind: str  # forward | backward | eval
    inner: int
    micro: int
    ids: list[int] | None
    tensor: torch.Tensor  # where the stage computed it (its device and dtype): encoded there, off the compute thread
    labels: torch.Tensor | None
    loss: float | torch.Tensor  # the last stage's, still on its device: read by the encoder, not the compute thread
    last: bool = False  # forward: this inner step ends the sender's inner phase

    @property
    def direction(self) -> str:
        return "backward" if self.kind == "backward" else "forward"


class Sends:
    """This stage's outgoing micro-batches, for one :class:`~potluck.peer.pipeline.pipeline.Pipeline` (which owns it).

    ``_pending`` is the compute thread's (sent, not yet flushed); ``_on_wire`` the forward encoder thread's;
    ``sender_lock`` guards the AC-SGD sender (encoded in order, re-encoded by a push on a miss); ``_count_lock``
    guards the encoded-message counts. A round's failure is recorded through the :class:`Inbox`, whose
    condition guards it.
    """

    def __init__(
        self,
        *,
        run_id: str,
        me: str,
        stage: int,
        cfg: PipelineConfig,
        client: PeerClient,
        codecs: dict[str, ActCodec],
        sender: AcsgdSender | None,
        inbox: Inbox,
        traffic: PipeTraffic,
        stopping: threading.Event,
        bursts: Bursts | None,
    ) -> None:
        self.run_id, self.me, self.stage, self.cfg, self.client = run_id, me, stage, cfg, client
        self.codecs, self.sender, self.inbox, self.traffic = codecs, sender, inbox, traffic
        self.stopping = stopping
        # (peer id, bytes, seconds) of delivered messages: passive link figures, a burst of overlapping pushes at a time
        self._bursts = bursts
        # each direction encodes on one thread, in order; the pushes overlap (a micro-batch does not wait
        # for the one before it to be acknowledged: one round trip per step, not one per micro-batch)
        self._encoders = {d: ThreadPoolExecutor(1, thread_name_prefix=f"pipe-{d[:3]}") for d in ("forward", "backward")}
        self._pushers = {d: ThreadPoolExecutor(SENDS_IN_FLIGHT, thread_name_prefix=f"pipe-{d[:3]}-push")
                         for d in ("forward", "backward")}
        self._encoded = {d: threading.BoundedSemaphore(ENCODED_AHEAD) for d in ("forward", "backward")}
        self._count_lock = threading.Lock()
        self.encoded_peak = 0  # the most messages held encoded at once (both directions)
        self._encoded_now = 0
        self.sender_lock = threading.Lock()
        self._pending: list[Future] = []
        self._on_wire: list[tuple[set[int], Future]] = []  # forward pushes and their samples

    def begin(self, next_changed: bool) -> None:
        """A new round: the old round's unflushed sends are forgotten; AC-SGD buffers of a changed next stage
        are dropped."""
        self._pending = []
        if self.sender is not None and next_changed:
            with self.sender_lock:
                self.sender.reset()

    def close(self) -> None:
        for ex in (*self._encoders.values(), *self._pushers.values()):
            ex.shutdown(wait=False, cancel_futures=True)
        if self.sender is not None:
            with self.sender_lock:
                self.sender.buffer.close()

    def send(self, r: Round, kind: str, inner: int, micro: int, ids: list[int] | None, tensor: torch.Tensor,
             labels: torch.Tensor | None = None, loss: float | torch.Tensor = 0.0, last: bool = False) -> None:
        to = r.next if kind in ("forward", "eval") else r.prev
        if to is None:
            raise PipelineStall(f"stage {self.stage} has no {'next' if kind != 'backward' else 'previous'} stage")
        # the tensor stays where it was computed: the encoder thread moves (or, on a GPU, encodes) it, so the
        # compute thread never waits for a device-to-host copy
        out = Outgoing(r, to, kind, inner, micro, ids, tensor.detach(), labels, loss, last)
        self._pending.append(self._encoders[out.direction].submit(self._dispatch, out))

    def flush(self, r: Round) -> None:
        """Wait for this step's sends (so a failure is seen now, not a step later)."""
        pending, self._pending = self._pending, []
        for fut in pending:
            pushed = fut.result()
            if pushed is not None:
                pushed.result()
        raise_for(r)

    def _dispatch(self, out: Outgoing) -> Future | None:
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
            if out.r.error or self.inbox.closed:
                return None
        if out.r.error:  # the round is over: its queued messages must not advance the AC-SGD buffers
            slots.release()
            return None
        msg = self._encode_or_fail(out)
        if msg is None:
            slots.release()
            return None
        self._held(+1)

        def delivered(_: Future) -> None:
            self._held(-1)
            slots.release()

        push = self._pushers[out.direction].submit(self._deliver, msg, out)
        push.add_done_callback(delivered)
        if tracked:
            self._on_wire.append((set(out.ids or ()), push))
        return push

    def _held(self, change: int) -> None:
        with self._count_lock:
            self._encoded_now += change
            self.encoded_peak = max(self.encoded_peak, self._encoded_now)

    def _encode_or_fail(self, out: Outgoing) -> pipewire.Outbound | None:
        try:  # encoding advances the AC-SGD buffer: only once per (re)send decision
            with self.sender_lock:
                return self._encode(out)
        except CodecError as err:  # NaN/Inf in what this stage computed: the step is lost, the peer is not
            self.inbox.error(out.r, f"{out.kind} micro-batch {out.micro}: {err}")
            return None
        except Exception as err:  # an encoding bug: it will fail the same way next time
            log.exception("encoding %s micro-batch %d failed", out.kind, out.micro)
            self.broken(out.r, f"encoding {out.kind} micro-batch {out.micro} failed: {err}")
            return None

    def _deliver(self, msg: pipewire.Outbound | None, out: Outgoing) -> None:
        """Push one encoded micro-batch; a receiver not yet in this round is retried until the deadline, a
        refusal for good ends the round as broken (:class:`PipelineBroken`) at once."""
        deadline = time.monotonic() + self.cfg.pipe_timeout_s * 3
        resent = False
        # a message too big is too big at every try: a receiver that answers NOT_YET from the head alone must
        # not let a retry go out without the fault's piece
        oversize = injected("pipe.send", out.r.step, "oversize")
        while not out.r.error:
            if msg is None and (msg := self._encode_or_fail(out)) is None:
                return
            if msg.head.ByteSize() > MAX_MESSAGE_BYTES - 1024:
                self.broken(out.r, f"the head of {out.kind} micro-batch {out.micro} is {msg.head.ByteSize()} bytes, "
                                   f"over the {MAX_MESSAGE_BYTES} a gRPC message may hold: lower train.batch_size or "
                                   "raise pipeline.micro_batches")
                return
            try:
                self._push(out.to, msg, oversize)
                return
            except grpc.RpcError as err:
                reason = rpc_reason(err)
                if refused(err, pb.BUFFER_MISS) and not resent and self.sender is not None and out.ids is not None:
                    log.info("%s has no AC-SGD buffer for some samples (%s); resending them as first visits",
                             short_id(out.to.peer_id), reason)
                    with self.sender_lock:
                        self.sender.forget(out.ids)
                    msg, resent = None, True
                    continue
                if refused(err, pb.NOT_YET) and time.monotonic() < deadline and not self.stopping.wait(0.1):
                    continue  # the neighbour is still finishing its previous outer step or recovering
                what = (f"{out.kind} micro-batch {out.micro} of inner step {out.inner} to {short_id(out.to.peer_id)} "
                        f"failed: {reason}")
                if _for_good(err, oversize):
                    self.broken(out.r, what)
                else:
                    self.inbox.error(out.r, what)
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

    def _encode(self, out: Outgoing) -> pipewire.Outbound:
        r, kind, ids, labels = out.r, out.kind, out.ids, out.labels
        tensor = out.tensor.float()  # fp32 on the wire whatever the stage computed in (a no-op for fp32)
        msg = pb.PipeMessage(
            header=pb.Header(run_id=self.run_id, sender=self.me, step=r.step, epoch=r.epoch), kind=kind,
            inner_step=out.inner, micro=out.micro, sample_ids=ids or [], loss=float(out.loss), stage=self.stage,
            replica=r.replica, last=out.last,
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
            packet = self.codecs[kind].encode(tensor)
            msg.first.CopyFrom(_to_pb(packet))
            nbytes = packet.nbytes
        if kind == "forward":
            self.traffic.activations += nbytes
            self.traffic.activations_fp32 += fp32_bytes
        elif kind == "backward":
            self.traffic.gradients += nbytes
            self.traffic.gradients_fp32 += fp32_bytes
        return pipewire.outbound(msg)

    def broken(self, r: Round, reason: str) -> None:
        """This peer's send can never succeed: end the round as broken, and tell both neighbours at once, so
        they stop waiting for micro-batches that are not coming."""
        if not self.inbox.mark_broken(r, reason):
            return
        log.error("pipeline of step %d broken: %s", r.step, reason)
        for to in (r.prev, r.next):
            if to is not None:
                threading.Thread(target=self._send_abort, args=(r, to, reason), name="pipe-abort", daemon=True).start()

    def _send_abort(self, r: Round, to: Neighbour, reason: str) -> None:
        head = pb.PipeMessage(header=pb.Header(run_id=self.run_id, sender=self.me, step=r.step, epoch=r.epoch),
                              kind="abort", stage=self.stage, replica=r.replica, abort=reason[:500])
        try:
            self.client.push_pipe(to.address, pipewire.Outbound(head, (b"",) * len(pipewire.BODY)).chunks(),
                                  timeout=min(10.0, self.cfg.pipe_timeout_s), peer=to.peer_id)
        except grpc.RpcError as err:  # the neighbour learns it from its own deadline instead
            log.warning("could not tell %s that this pipeline is broken: %s", short_id(to.peer_id), rpc_reason(err))


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
