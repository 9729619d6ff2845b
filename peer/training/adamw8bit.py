"""AdamW with its two moments kept in 8 bits (``train.optimizer = "adamw8bit"``): 10 bytes a parameter on the
device where fp32 AdamW takes 16 (weight 4, gradient 4, moments 2 + a scale per block).

Each step, per parameter tensor and a block of ``BLOCK`` elements at a time::

    m, v   <- dequantize(m_codes, m_scales), dequantize(v_codes, v_scales)     (float32)
    m      <- beta1 m + (1 - beta1) g
    v      <- beta2 v + (1 - beta2) g^2
    p      <- p (1 - lr wd) - lr (m / bc1) / (sqrt(v / bc2) + eps)          (from the float32 m and v)
    codes  <- quantize(m), quantize(v)                                      (kept for the next step)

so a step's own update uses its exact moments, and only what is carried to the next step is rounded:

* ``m``, signed: ``absmax x (1 / 127)`` per block, codes -127..127, rounded half to even;
* ``v``, in its square root's domain (whose range is the square root of v's, as the update uses it): ``max
  sqrt(v) x (1 / 255)`` per block, codes 0..255, rounded **up**. A rounded-down ``v`` of a small element next to large
  ones would become 0, and ``m / sqrt(v)`` a step of ``m / eps``: rounded up, an element's ``v`` is never
  under its true value, so its step is never larger than fp32 AdamW's would be (the known failure of naive
  8-bit Adam, which block-wise dynamic quantization avoids in bitsandbytes; this one avoids it by rounding).

**bf16 weights** (``train.weights = "bf16"``, with either optimizer: ``eight_bit=False`` keeps every moment in
float32): the update is computed on the weight as float32 and written back **rounded stochastically**
(:func:`round_stochastic`: up with the probability of the fraction bf16 drops), so an update smaller than half a
bf16 ulp, which rounding to nearest would lose every step, moves the weight by it on average. The noise comes from
a generator seeded by the caller, so the processes of a multi-device peer, seeded alike, round alike.

Tensors smaller than ``MIN_8BIT`` elements (norms, biases) keep float32 moments, as bitsandbytes does: they are a
sliver of the memory and the most sensitive to rounding. Every operation is a correctly rounded float32 add, multiply,
divide or square root (:func:`sqrt32`), in the order written here, so ``tests/test_adamw8bit.py``'s numpy reference
gets the same bits. Works on any device; the blocks are processed ``CHUNK`` elements at a time to bound the
temporary float32 moments.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

BLOCK = 256  # elements per quantization scale
MIN_8BIT = 4096  # tensors with fewer elements keep float32 moments
CHUNK = 1 << 20  # elements dequantized at a time (a multiple of BLOCK)


def sqrt32(x: torch.Tensor) -> torch.Tensor:
    """float32 square root, correctly rounded on every device: a GPU's is; torch's vectorized one on a CPU can be an
    ulp off, so there it goes through float64 (whose root, rounded to float32, is the correctly rounded one)."""
    return torch.sqrt(x) if x.is_cuda else torch.sqrt(x.double()).float()


def quantize_signed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float32, a multiple of BLOCK long) as int8 codes and one float32 ``absmax / 127`` per block."""
    blocks = x.view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1).mul_(1.0 / 127)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.view(-1), scales


def dequantize_signed(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (codes.view(-1, BLOCK).to(torch.float32) * scales[:, None]).view(-1)


def quantize_root(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``v`` (float32, >= 0) as uint8 codes of ``sqrt(v)``, rounded up, and one ``max sqrt(v) / 255`` per block."""
    root = sqrt32(v).view(-1, BLOCK)
    scales = root.amax(dim=1).mul_(1.0 / 255)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.ceil(root / safe[:, None]).clamp_(0, 255).to(torch.uint8)
    return codes.view(-1), scales


def dequantize_root(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    r = codes.view(-1, BLOCK).to(torch.float32) * scales[:, None]
    return (r * r).view(-1)


def round_stochastic(w: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """float32 ``w`` as bfloat16, rounded stochastically: ``noise`` (int32 in [0, 65536), one per element) is added
    to the 16 low bits bf16 drops, and they are cut; so an element goes to the bf16 neighbour away from zero with
    probability (dropped bits) / 65536, and the rounding is unbiased. Exact for values bf16 holds."""
    bits = (w.contiguous().view(torch.int32) + noise) & -65536
    return bits.view(torch.float32).to(torch.bfloat16)


def noise_for(n: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """``n`` int32 draws in [0, 65536) from ``gen`` (a CPU generator: the same draws on every device)."""
    return torch.randint(0, 1 << 16, (n,), generator=gen, dtype=torch.int32).to(device)


def padded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


class AdamW8bit(torch.optim.Optimizer):
    """torch.optim.AdamW's arguments and update (decoupled weight decay, bias correction), moments in 8 bits."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, eight_bit: bool = True, seed: int = 0) -> None:
        """``eight_bit=False``: every moment in float32 (AdamW, for bf16 weights); ``seed``: bf16 weights' rounding noise."""
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"AdamW8bit: bad lr {lr}, betas {betas}, eps {eps} or weight_decay {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.min_8bit = MIN_8BIT if eight_bit else float("inf")
        self.rounding = torch.Generator().manual_seed(seed)

    def _write(self, flat: torch.Tensor, w: torch.Tensor) -> None:
        """The float32 update ``w`` into the weight ``flat`` (a slice of it): as is, or rounded stochastically to bf16."""
        if flat.dtype == torch.float32:
            if w.data_ptr() != flat.data_ptr():  # (the 8-bit path updates a float32 weight in place)
                flat.copy_(w)
        elif flat.dtype == torch.bfloat16:
            flat.copy_(round_stochastic(w, noise_for(w.numel(), self.rounding, w.device)))
        else:
            flat.copy_(w.to(flat.dtype))

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            n = p.numel()
            state["step"] = 0
            if n < self.min_8bit:
                state["m"] = torch.zeros(n, dtype=torch.float32, device=p.device)
                state["v"] = torch.zeros(n, dtype=torch.float32, device=p.device)
            else:
                k = padded(n)
                state["m_codes"] = torch.zeros(k, dtype=torch.int8, device=p.device)
                state["m_scales"] = torch.zeros(k // BLOCK, dtype=torch.float32, device=p.device)
                state["v_codes"] = torch.zeros(k, dtype=torch.uint8, device=p.device)
                state["v_scales"] = torch.zeros(k // BLOCK, dtype=torch.float32, device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p)
                state["step"] += 1
                t = state["step"]
                bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
                flat, grad = p.data.view(-1), p.grad.detach().reshape(-1).to(torch.float32)
                if "m" in state:
                    if flat.dtype == torch.float32:
                        adam_update(flat, grad, state["m"], state["v"], lr, b1, b2, eps, wd, bc1, bc2)
                    else:
                        w = flat.to(torch.float32)
                        adam_update(w, grad, state["m"], state["v"], lr, b1, b2, eps, wd, bc1, bc2)
                        self._write(flat, w)
                    continue
                n = flat.numel()
                for lo in range(0, n, CHUNK):
                    hi = min(n, lo + CHUNK)
                    k = padded(hi - lo)
                    bl, bh = lo // BLOCK, lo // BLOCK + k // BLOCK
                    m = dequantize_signed(state["m_codes"][lo:lo + k], state["m_scales"][bl:bh])
                    v = dequantize_root(state["v_codes"][lo:lo + k], state["v_scales"][bl:bh])
                    g = torch.zeros(k, dtype=torch.float32, device=p.device)
                    g[: hi - lo] = grad[lo:hi]  # (the padding's gradient is 0: its moments stay 0)
                    w = flat[lo:hi].to(torch.float32)
                    adam_update(w, g[: hi - lo], m[: hi - lo], v[: hi - lo], lr, b1, b2, eps, wd, bc1, bc2)
                    self._write(flat[lo:hi], w)
                    state["m_codes"][lo:lo + k], state["m_scales"][bl:bh] = quantize_signed(m)
                    state["v_codes"][lo:lo + k], state["v_scales"][bl:bh] = quantize_root(v)
        return loss


def adam_update(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, lr: float, b1: float, b2: float,
                eps: float, wd: float, bc1: float, bc2: float) -> None:
    """One AdamW step of ``w`` in place, its float32 moments ``m`` and ``v`` updated in place (the order of
    operations is the numpy reference's)."""
    m.mul_(b1).add_(g * (1.0 - b1))
    v.mul_(b2).add_(g * g * (1.0 - b2))
    if wd:
        w.mul_(1.0 - lr * wd)
    denom = sqrt32(v * (1.0 / bc2)).add_(eps)  # (scalars multiply: torch divides by one as a reciprocal anyway)
    w.sub_((m * (1.0 / bc1)) / denom * lr)


def state_bytes_per_param(n: int) -> float:
    """Device bytes of this optimizer's state for an ``n``-element tensor, per element."""
    if n < MIN_8BIT:
        return 8.0
    k = padded(n)
    return (2 * k + 8 * (k // BLOCK)) / n

