"""One stage of the model on this peer: its layers, the inner AdamW loop, and evaluation.

The stage worker does not know how bytes travel. With one stage it runs forward and backward on its
own batches; with several it runs each inner step through a :class:`PipelineLink` (gRPC between
peers in a run, anything in a test), which moves activations to the next stage and gradients back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from potluck.models import sizecheck
from potluck.peer.devices import sharding
from potluck.peer.outer.diloco import flatten_params, host_vector, load_flat
from potluck.peer.pipeline.piperound import PipelineBroken, PipelineStall
from potluck.peer.swarm.joining import device_memory
from potluck.peer.training.data import Dataset, SpanSampler
from potluck.peer.training.model import build_layers, lm_loss
from potluck.peer.training.runner import StageRunner
from potluck.peer.training.window import Why
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.runtime.log import get_logger
from potluck.protos.testkit.faults import fault, tamper
from potluck.protos.wire.limits import EVAL_BATCH

log = get_logger(__name__)

Batch = tuple[list[int], torch.Tensor, torch.Tensor]  # sample ids, tokens, next-token targets


class PipelineLink(Protocol):
    """How a stage reaches its neighbours (see :class:`potluck.peer.pipeline.pipeline.Pipeline`). ``last``: stage 0 says
    this step ends its inner phase; the stages after it read that from what they receive (``ended``)."""

    ended: bool
    busy_s: float

    def train_step(self, layers: nn.ModuleList, inner: int, batch: Batch | None, device: torch.device,
                   forward: Callable[[torch.Tensor], torch.Tensor] | None = None, last: bool = False) -> float: ...

    def evaluate(self, layers: nn.ModuleList, version: int, batches: list[Batch] | None, n_batches: int,
                 device: torch.device, forward: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float | None: ...


class Devices(Protocol):
    """The devices of a multi-device peer, as its stage workers see them (:mod:`potluck.peer.devices.multidevice`):
    each inner step every device trains on its slice of the batch and they average their gradients, so
    all keep the same parameters; a load outside the inner loop reaches them all. ``sharded``: each
    device holds its rows of the stage only (:mod:`potluck.peer.devices.sharding`), so theta is gathered from
    them, a load is theirs to copy out, and an evaluation's forward passes run on all of them."""

    @property
    def sharded(self) -> bool: ...

    def gather(self, params: list[nn.Parameter], out: torch.Tensor) -> torch.Tensor: ...

    def evaluate(self, inputs: list[torch.Tensor]) -> None: ...

    def begin(self, step: int) -> None: ...

    def split(self, batch: Batch | None) -> Batch: ...

    def average(self, params: list[nn.Parameter], loss: float) -> float: ...

    def load(self, params: list[nn.Parameter], theta: torch.Tensor, steps_done: int) -> None: ...


class Pacer(Protocol):
    """How many inner steps fit the round's window (:class:`potluck.peer.training.window.Pace`)."""

    def next(self, done: int, now: float, ahead: float = 0.0) -> Why | None: ...

    def stepped(self, seconds: float) -> None: ...

    def step_s(self) -> float | None: ...


@dataclass
class InnerPhase:
    """How an inner phase went: steps done, seconds, why it stopped early ('' if it did not), and why it ended
    when the round's window ended it."""

    steps: int
    seconds: float
    stalled: str = ""
    interrupted: bool = False
    why: Why | None = None


class StageWorker:
    def __init__(self, rc: RunConfig, stage: int, bounds: tuple[int, int], device: torch.device, data: Dataset,
                 link: PipelineLink | None) -> None:
        self.rc, self.stage, self.bounds, self.device, self.data, self.link = rc, stage, bounds, device, data, link
        self.first = stage == 0
        self.layers = build_layers(rc.model, rc.train.seed, *bounds).to(device)
        self.params = list(self.layers.parameters())
        self.bf16 = rc.train.weights == "bf16"  # the weights (and their gradients) in bf16: see theta()
        if self.bf16:
            for p in self.params:
                p.data = p.data.to(torch.bfloat16)
        self._origin: torch.Tensor | None = None  # bf16 weights: the fp32 vector they were last loaded from
        self.numel = sum(p.numel() for p in self.params)
        self.pinned = self.device.type == "cuda"  # theta moves to and from the GPU through page-locked vectors
        self._loaded: torch.Tensor | None = None  # the vector the parameters hold, until a step changes them
        checkpoint = sizecheck.checkpointing(rc, device.type, device_memory(device))
        if rc.train.checkpoint_activations == "auto":
            log.info("train.checkpoint_activations = 'auto': %s on this %s", "checkpointing activations" if checkpoint
                     else "keeping every activation (it fits)", device.type)
        self.runner = StageRunner(self.layers, rc.train, device, rc.pipeline.stages,  # precision, checkpointing, compile
                                  checkpoint=checkpoint)
        self.optimizer: torch.optim.Optimizer | None = None  # built on the first inner step (it imports torch._dynamo)
        self.sampler: SpanSampler | None = None
        self.steps_done = 0  # inner steps this worker trained (and the states it recovered), over the whole run
        self.clock = 0  # the run's inner step the lr schedule is at: the swarm's, not this member's (see _lr)
        self.busy_s = 0.0  # seconds an inner step of this stage computes (a pipeline's waits left out), averaged
        self.devices: Devices | None = None  # the other devices of a multi-device peer (torchrun)
        self._told_memory = False  # (a multi-device peer's processes each say once what they hold)
        # micro-batches a batch is split into (single stage): train.grad_accum, or with 'auto' 1 until a batch
        # does not fit the device's memory, then doubled until one does
        self.accum = rc.train.grad_accum if isinstance(rc.train.grad_accum, int) else 1

    def theta(self) -> torch.Tensor:
        """theta_local as one flat float32 CPU vector (the caller's to keep or overwrite); from a GPU, one
        asynchronous copy per parameter into a pinned vector and one wait.

        With bf16 weights it is the fp32 vector they were loaded from plus what the inner steps changed
        since, ``origin + (weights - bf16(origin))`` (the difference of two bf16 values is exact in fp32): so
        the rounding of the load is never part of a pseudo-gradient, and with no step since a load, theta is
        that vector, bit for bit."""
        out = host_vector(self.numel, self.pinned)
        if self.devices is not None and self.devices.sharded:
            flat = self.devices.gather(self.params, out)
        else:
            flat = flatten_params(self.params, out=out)
        if self._origin is not None:
            flat.sub_(self._origin.to(torch.bfloat16)).add_(self._origin)  # (bf16 -> fp32 exactly, in the subtraction)
        return flat

    def start_point(self) -> torch.Tensor:
        """theta_local as the caller only reads it (where an inner phase starts): the vector last loaded,
        when no step changed the parameters since (no copy back from the device), else :meth:`theta`."""
        return self._loaded if self._loaded is not None else self.theta()

    def load(self, theta: torch.Tensor, steps_done: int | None = None) -> None:
        """The parameters from a flat vector, which the caller never writes afterwards (a committed
        theta_global, or a vector of its own) and may get back from :meth:`start_point`."""
        if self.devices is not None:  # a multi-device peer's other devices load the same (sharded: this one too)
            self.devices.load(self.params, theta, self.steps_done if steps_done is None else steps_done)
        if self.devices is None or not self.devices.sharded:
            load_flat(self.params, theta)  # (bf16 weights: rounded to nearest)
        self._origin = theta if self.bf16 else None
        self._loaded = theta if self.bf16 or all(p.dtype == torch.float32 for p in self.params) else None
        if steps_done is not None:
            self.steps_done = steps_done

    def meta(self) -> dict:
        """What a snapshot of this stage records: counters and each parameter's name in the whole model,
        so checkpoints re-split into any number of stages."""
        start, stop = self.bounds
        return {"inner_steps": self.steps_done, "stage": self.stage, "layers": [start, stop],
                "layout": [[f"layers.{start + int(n.split('.', 1)[0])}.{n.split('.', 1)[1]}", list(p.shape)]
                           for n, p in self.layers.named_parameters()]}

    def cap(self, spans: list[tuple[int, int]]) -> int:
        """The most inner steps this phase may train: H, or fewer batches if the replica's share holds fewer
        (stage 0 reads them; the stages after it follow stage 0)."""
        h, b = self.rc.diloco.inner_steps, self.rc.train.batch_size
        return min(h, sum(y - x for x, y in spans) // b) if self.first else h

    def inner_phase(self, spans: list[tuple[int, int]], stopping: threading.Event,
                    on_step: Callable[[int, float, float], None], step: int = 0, pace: Pacer | None = None,
                    ) -> InnerPhase:
        """Inner AdamW steps on the samples at ``spans`` (global positions: this replica's share of the step,
        which only stage 0 reads); ``on_step(i, loss, seconds)``. Without ``pace``, H of them; with it, as many as
        fit the round's window (:mod:`potluck.peer.training.window`). In a pipeline stage 0 decides, and the stages
        after it end with the step it marked its last."""
        rc = self.rc
        cap = self.cap(spans)
        if self.first:
            self.sampler = SpanSampler(spans, self.data.num_samples, rc.data.seed, cap * rc.train.batch_size)
        if self.devices is not None:
            self.devices.begin(step)
        if stopping.is_set():  # building the optimizer may wait seconds for torch._dynamo's import
            return InnerPhase(0, 0.0, interrupted=True)
        self.layers.train()
        t0, h = time.monotonic(), rc.diloco.inner_steps
        self.clock = (step - 1) * h if step >= 1 else self.steps_done
        ended: Why | None = Why.DONE
        fault("inner.start", step)
        i = 0
        while i < cap:
            if stopping.is_set():
                return InnerPhase(i, time.monotonic() - t0, interrupted=True)
            last = i + 1 >= cap  # (a pipeline's stages after the first end with the step the first marks last)
            if pace is not None and self.first:
                if self.link is None:
                    if (stop := pace.next(i, time.monotonic())) is not None:
                        if i < h // 2:
                            fault("inner.mid", step)  # (a phase its window ends early still passes its middle)
                        ended = stop
                        break
                elif (stop := pace.next(i + 1, time.monotonic(), ahead=pace.step_s() or 0.0)) is not None:
                    last, ended = True, stop  # (decided a step ahead, so the stages after it know in time)
            if i == h // 2 or (last and i < h // 2):
                fault("inner.mid", step)
            self._loaded = None  # the step below changes the parameters
            t_step = time.monotonic()
            try:
                loss = self.train_step(self._next_batch(), i, last)
            except PipelineBroken:
                raise  # not a stall to wait out: the peer stops on it (Peer.run)
            except PipelineStall as err:
                return InnerPhase(i, time.monotonic() - t0, stalled=str(err))
            seconds = time.monotonic() - t_step
            busy = self.link.busy_s if self.link is not None else seconds  # (a pipeline's: without the waits)
            if (slow := float(tamper("inner.step", step, 1.0))) > 1.0:  # a slower device, in tests (POTLUCK_FAULTS)
                time.sleep((slow - 1.0) * busy)
                seconds, busy = seconds + (slow - 1.0) * busy, busy * slow
            self.busy_s = busy if self.busy_s == 0 else 0.9 * self.busy_s + 0.1 * busy
            if pace is not None:
                pace.stepped(seconds)
            on_step(i, loss, seconds)
            i += 1
            if self.link is not None and (last if self.first else self.link.ended):
                break
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)  # the outer step needs the memory more than the next step
        return InnerPhase(i, time.monotonic() - t0, why=ended if pace is not None else None)

    def train_step(self, batch: Batch | None, i: int = 0, last: bool = False) -> float:
        """One inner AdamW step on ``batch`` (stage 0's; other stages of a pipeline receive theirs): forward and
        backward (in micro-batches, or through the pipeline), gradient clipping, the update. Returns the loss,
        read off the device once a step (never once a micro-batch: each read waits for the device to drain)."""
        if self.optimizer is None:
            self.optimizer = self._make_optimizer()
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._forward_backward(batch, i, last)
        if self.devices is not None:  # the whole batch's gradients (and loss), on every device
            loss = self.devices.average(self.params, loss)
        if self.rc.train.grad_clip > 0:
            self.runner.precision.unscale(self.optimizer)  # fp16: clip the true gradients, not the scaled ones
            if self.devices is not None and self.devices.sharded:  # (the norm over every rank's rows)
                sharding.clip_grad_norm(self.params, self.rc.train.grad_clip)
            else:
                torch.nn.utils.clip_grad_norm_(self.params, self.rc.train.grad_clip)
        self.runner.precision.step(self.optimizer)  # fp16: skipped if they overflowed
        if self.devices is not None and not self._told_memory:
            self._told_memory = True
            held, whole = sharding.held_bytes(self.params, self.optimizer)
            log.info("this process holds %.2f MB of its stage's weights, gradients and optimizer state: %.2f of the "
                     "%.2f MB a whole replica holds", held / 1e6, held / max(whole, 1), whole / 1e6)
        self.steps_done += 1
        self.clock += 1
        return loss

    def _make_optimizer(self) -> torch.optim.Optimizer:
        """AdamW; on a GPU its fused kernel (one launch a step for every parameter, instead of a few per tensor). With
        ``train.optimizer = "adamw8bit"``, its moments in 8 bits (:mod:`potluck.peer.training.adamw8bit`)."""
        t = self.rc.train
        seed = t.seed * 1000 + self.stage

        def make(params: list[nn.Parameter], seed: int = seed) -> torch.optim.Optimizer:
            if t.optimizer == "adamw8bit" or self.bf16:  # (bf16 weights: fp32 moments unless 8-bit, stochastic rounding)
                from potluck.peer.training.adamw8bit import AdamW8bit

                return AdamW8bit(params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                                 eight_bit=t.optimizer == "adamw8bit", seed=seed)
            fused = self.device.type == "cuda" and all(p.is_cuda and p.is_floating_point() for p in params)
            return torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                                     **({"fused": True} if fused else {}))

        if t.step_in_backward:  # one optimizer a parameter, stepped in the backward (each its own rounding noise)
            from potluck.peer.training.inbackward import StepInBackward

            index = {id(p): k for k, p in enumerate(self.params)}
            return StepInBackward(self.params, lambda ps: make(ps, seed * 100_003 + index[id(ps[0])]))  # type: ignore[return-value]
        return make(self.params)

    def _next_batch(self) -> Batch | None:
        if not self.first:
            return None
        assert self.sampler is not None
        ids = self.sampler.next_ids(self.rc.train.batch_size)
        return (ids, *self.data.batch(ids))

    def _forward_backward(self, batch: Batch | None, i: int, last: bool = False) -> float:
        if self.devices is not None:  # this device's rows of the batch
            batch = self.devices.split(batch)
        if self.link is not None:
            return self.link.train_step(self.layers, i, batch, self.device, forward=self.runner, last=last)
        assert batch is not None
        _, x, y = batch
        while True:
            k = min(self.accum, len(x))
            try:
                return self._accumulate(x, y, k)
            except torch.OutOfMemoryError:
                if self.rc.train.grad_accum != "auto" or k >= len(x) or self.rc.train.step_in_backward:
                    raise  # (stepping in the backward: the first micro-batch would update alone)
                assert self.optimizer is not None
                self.optimizer.zero_grad(set_to_none=True)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                self.accum = min(len(x), 2 * k)
                log.info("a micro-batch of %d samples does not fit %s's memory: trying %d micro-batches of about "
                         "%d (train.grad_accum = 'auto')", -(-len(x) // k), self.device, self.accum,
                         -(-len(x) // self.accum))

    def _accumulate(self, x: torch.Tensor, y: torch.Tensor, k: int) -> float:
        """Forward and backward of ``k`` micro-batches, each loss weighted by its share of the rows: the summed
        gradients are those of the whole batch's mean loss (a device's slice need not divide evenly)."""
        total: torch.Tensor | float = 0.0
        for xs, ys in zip(x.tensor_split(k), y.tensor_split(k), strict=True):
            loss = lm_loss(self.runner(xs.to(self.device, non_blocking=True)), ys.to(self.device, non_blocking=True))
            loss = loss * (len(xs) / len(x))
            self.runner.precision.backward(loss)
            total = total + loss.detach()
        return float(total)

    def _lr(self) -> float:
        """The inner lr: a linear warm-up over ``train.warmup_steps`` of the *run's* inner steps (``clock``: H per
        outer step before this one, and this phase's own): a member that trains fewer steps per round, being
        slower, warms up with the model it trains, not over rounds of its own (at 3 steps a round it would still
        be at a tenth of the lr when its pseudo-gradients met the others', clipped for being short)."""
        t = self.rc.train
        if t.warmup_steps and self.clock < t.warmup_steps:
            return t.lr * (self.clock + 1) / t.warmup_steps
        return t.lr

    def evaluate_global(self, version: int, theta: torch.Tensor) -> float | None:
        """Eval loss of ``theta``, a committed theta_global, whatever the parameters hold: with streaming outer steps
        a member trains on its own values of the fragments not synced, and an overlapped one on the next phase's,
        so they are not theta_global. Then ``theta`` is loaded for the evaluation and this member's own vector
        loaded back (exact in fp32; bf16 weights are rounded from it anew, within an ulp of where they were, and
        the pseudo-gradient stays exact: :meth:`theta` counts from that vector)."""
        if self._loaded is theta:
            return self.evaluate(version)
        own = self.theta()
        self.load(theta)
        try:
            return self.evaluate(version)
        finally:
            self.load(own)

    @torch.no_grad()
    def evaluate(self, version: int) -> float | None:
        """Eval loss of the held parameters (through the whole pipeline when S > 1; the last stage reports it)."""
        self.layers.eval()
        try:
            ids = self.data.eval_ids()
            chunks = [ids[k : k + EVAL_BATCH] for k in range(0, len(ids), EVAL_BATCH)]
            if self.link is not None:
                batches = [(list(c), *self.data.batch(c)) for c in chunks] if self.first else None
                try:
                    return self.link.evaluate(self.layers, version, batches, len(chunks), self.device, forward=self.runner)
                except PipelineBroken:
                    raise
                except PipelineStall as err:
                    log.warning("evaluation of v%d skipped: %s", version, err)
                    return None
            total, n = 0.0, 0
            inputs = [self.data.batch(c) for c in chunks]
            if self.devices is not None:  # (sharded: the other devices run the same forward passes)
                self.devices.evaluate([x for x, _ in inputs])
            for x, y in inputs:
                total += float(lm_loss(self.runner(x.to(self.device)), y.to(self.device))) * len(x)
                n += len(x)
            return total / max(n, 1)
        finally:
            self.layers.train()
