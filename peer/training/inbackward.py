"""The inner update inside the backward pass (``train.step_in_backward``): no stage-sized gradient is ever held.

A plain inner step holds every parameter's gradient at once: the backward pass fills them all, then the optimizer
reads them. That is 4 bytes a parameter in fp32 (2 with bf16 weights), a fifth of the device's share with fp32
AdamW and a third with bf16 weights and 8-bit AdamW. Here each parameter has an optimizer of its own, stepped by a
hook as soon as autograd has accumulated that parameter's gradient, and the gradient is dropped at once: the device
holds one parameter's gradient at a time (and the activations' gradients autograd holds anyway). The update is the
same AdamW (or 8-bit AdamW) arithmetic on the same gradient, per tensor, as the whole-stage optimizer's.

What it rules out, each refused by the config (:mod:`potluck.protos.config.runconfig`) or the peer: clipping by
the stage's gradient norm (``train.grad_clip``, which needs every gradient before any update), summing the
gradients of several micro-batches (``pipeline.micro_batches`` or ``train.grad_accum`` over 1: the first
micro-batch's backward would already update), a multi-device peer (which averages the gradients over its
processes after the backward), and fp16's loss scaling (which decides to skip a step after the whole backward).
torchtune's ``optimizer_in_bwd`` makes the same trade.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


class StepInBackward:
    """Per-parameter optimizers made by ``make([p])``, each stepped by ``p``'s post-accumulate-grad hook.

    Enough of :class:`torch.optim.Optimizer`'s face for the stage worker: ``param_groups`` (its lr schedule sets
    each group's ``lr``), ``zero_grad``, ``step`` (nothing left to do: the updates ran in the backward) and
    ``state`` (the optimizers' states by parameter, for counting what they hold). ``peak_grad_bytes``: the most
    gradient bytes the parameters held at once (one parameter's; autograd's own buffers are not counted).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter],
                 make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.params = list(params)
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("a parameter appears twice: each must have exactly one optimizer to step it")
        self.optimizers = {p: make([p]) for p in self.params}
        self.param_groups = [g for opt in self.optimizers.values() for g in opt.param_groups]
        self.peak_grad_bytes = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._step) for p in self.params]

    def _step(self, p: torch.Tensor) -> None:
        assert isinstance(p, torch.nn.Parameter) and p.grad is not None
        nbytes = p.grad.numel() * p.grad.element_size()
        self.peak_grad_bytes = max(self.peak_grad_bytes, nbytes)
        self.optimizers[p].step()
        p.grad = None

    @property
    def state(self) -> dict[torch.Tensor, dict]:
        return {p: opt.state[p] for p, opt in self.optimizers.items() if p in opt.state}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self, closure: Callable[[], float] | None = None) -> None:
        """Nothing: every parameter was updated as its gradient came in."""

    def close(self) -> None:
        """Take the hooks off (a worker that builds another optimizer must not step these too)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
