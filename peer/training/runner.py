"""How a peer runs its stage's layers: precision, activation checkpointing, torch.compile.

**Master weights stay fp32.** Mixed precision here is autocast, never ``.half()``: the parameters,
their gradients, AdamW's moments and DiLoCo's outer state (theta_global, momentum, every
pseudo-gradient and its all-reduce sums) are float32 whatever ``train.precision`` says. The one
exception is asked for by name: ``train.weights = "bf16"`` keeps the inner phase's weights and
gradients in bf16 (:class:`~potluck.peer.training.stage.StageWorker`), the master copy being theta_global on
the host. Only the
matmuls of the forward pass (and with them their backward) run in bf16 or fp16; the loss is taken in
fp32 (:func:`potluck.models.lm_loss`), and activations cross between pipeline stages as fp32 (the
pipeline casts before its codec), so the wire format does not depend on the precision either.

**fp16 needs a loss scale.** Its 5-bit exponent flushes small gradients to zero, so the loss is
multiplied by a :class:`torch.amp.GradScaler` factor before the backward pass and the gradients are
divided by it (``unscale``) before they are clipped or applied; a step whose gradients overflowed is
skipped and the factor lowered. bf16 has fp32's exponent and needs none. One scale must cover the
whole backward pass, so fp16 runs single-stage only.

**Compilation may fail** (no C++ compiler, an unsupported op, an old GPU): each layer is compiled on
the first forward, and that first forward and its backward are tried once on a copy of the real
input before training uses them. On any error the runner says so once and goes on eager, which is
slower, never wrong.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from potluck.peer.training.model import forward_layers
from potluck.protos.config.runconfig import TrainConfig
from potluck.protos.runtime.log import get_logger

log = get_logger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def wants_compile(requested: bool | str, device: torch.device) -> bool:
    """``train.compile`` on this device: 'auto' compiles on a GPU (fewer, fused kernels and launches: most of a
    small model's step there), not on a CPU (compiling costs more than it saves)."""
    return device.type == "cuda" if requested == "auto" else bool(requested)


def resolve_precision(requested: str, device: torch.device, stages: int = 1, weights: str = "fp32",
                      in_backward: bool = False) -> str:
    """``train.precision`` on this device: 'fp32', 'bf16' or 'fp16' ('auto' decided here, per peer; bf16
    whatever the device with ``train.weights = "bf16"``, whose weights only autocast's bf16 math can use; never
    fp16 with ``train.step_in_backward``, whose updates run before a loss scaler could skip them)."""
    if requested != "auto":
        return requested
    if weights == "bf16":
        return "bf16"
    if device.type != "cuda":
        return "fp32"  # CPU bf16 is slower than fp32 on most CPUs without AMX: asked for, never assumed
    if torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp16" if stages == 1 and not in_backward else "fp32"


@dataclass
class Precision:
    """Autocast and (fp16) loss scaling for one device."""

    mode: str  # 'fp32', 'bf16' or 'fp16'
    device_type: str
    scaler: torch.amp.GradScaler | None = None

    @classmethod
    def build(cls, requested: str, device: torch.device, stages: int = 1, weights: str = "fp32",
              in_backward: bool = False) -> Precision:
        mode = resolve_precision(requested, device, stages, weights, in_backward)
        scaler = torch.amp.GradScaler(device.type) if mode == "fp16" else None
        return cls(mode, device.type, scaler)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.mode == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=DTYPES[self.mode])

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale now (before clipping: the norm must be the true one)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply the gradients (with fp16: unless they overflowed; then adjust the scale)."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()


class StageRunner:
    """A stage's forward pass as the run asks for it; call it like the layers, ``runner(x)``.

    ``layers`` stay the modules the optimizer, checkpoints and the outer step see (their parameter
    names unchanged); compiled versions of them are kept here, beside them.
    """

    def __init__(self, layers: nn.ModuleList, train: TrainConfig, device: torch.device, stages: int = 1,
                 compile_backend: str = "inductor", compile_scope: str = "layer", checkpoint: bool | None = None) -> None:
        """``checkpoint``: whether to checkpoint activations, as the peer decided (``train.checkpoint_activations =
        "auto"``: :func:`potluck.models.sizecheck.checkpointing`); None: as the config says (off for 'auto')."""
        self.layers = layers
        self.precision = Precision.build(train.precision, device, stages, train.weights, train.step_in_backward)
        self.checkpoint = checkpoint if checkpoint is not None else train.checkpoint_activations is True
        self.compile_backend = compile_backend
        self.compile_scope = compile_scope  # 'layer': each layer its own graph; 'stage': the stage's layers as one
        self._want_compile = wants_compile(train.compile, device)
        self._compiled: list[Callable[[torch.Tensor], torch.Tensor]] | None = None

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast():
            if self._want_compile and self._compiled is None:
                self._compiled = self._compile(x)
            if self._compiled is not None:
                try:
                    if self.compile_scope == "stage":  # (its graph checkpoints each layer itself)
                        return self._compiled[0](x)
                    return forward_layers(self._compiled, x, self.checkpoint)
                except torch.OutOfMemoryError:
                    raise  # not the compiler's fault: eager would not fit either
                except Exception as err:  # a recompile for a new shape failed: the forward is redone eager
                    self._give_up(err)
            return forward_layers(self.layers, x, self.checkpoint)

    def _compile(self, x: torch.Tensor) -> list[Callable[[torch.Tensor], torch.Tensor]] | None:
        """Each layer compiled, and tried forward and backward on a copy of ``x`` (the backward graph is
        compiled on its first use: a failure there must not happen in the middle of a training step)."""
        compiled: list[Callable[[torch.Tensor], torch.Tensor]]
        try:
            if self.compile_scope == "stage":  # one graph: fusions across layers, one guard check a forward
                whole = torch.compile(lambda t: forward_layers(self.layers, t, self.checkpoint), backend=self.compile_backend)
                compiled = [whole]
            else:
                compiled = [torch.compile(layer, backend=self.compile_backend) for layer in self.layers]
            probe = x.detach().clone().requires_grad_(x.is_floating_point())
            params = [p for p in self.layers.parameters() if p.requires_grad]
            with torch.enable_grad():
                out = compiled[0](probe) if self.compile_scope == "stage" else forward_layers(compiled, probe,
                                                                                               self.checkpoint)
                torch.autograd.grad(out.float().sum(), params, allow_unused=True)  # leaves every .grad alone
        except torch.OutOfMemoryError:
            raise
        except Exception as err:
            self._give_up(err)
            return None
        log.info("compiled %s (torch.compile, backend %s)", "the stage" if self.compile_scope == "stage" else
                 f"{len(compiled)} layers", self.compile_backend)
        return compiled

    def _give_up(self, err: BaseException) -> None:
        log.warning("torch.compile failed (%s: %s); this stage runs eager from now on",
                    type(err).__name__, str(err).strip().splitlines()[0][:200] if str(err).strip() else "")
        self._want_compile, self._compiled = False, None

