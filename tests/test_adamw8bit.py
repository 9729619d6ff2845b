"""8-bit AdamW (peer/training/adamw8bit.py) against an independent numpy reference of the same algorithm, bit for bit over
several steps (weights and the moments' codes); its quantizers' rules; that it tracks fp32 AdamW; bad arguments
refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from potluck.peer.training.adamw8bit import BLOCK, MIN_8BIT, AdamW8bit, state_bytes_per_param

F = np.float32


def np_quantize_signed(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    b = x.reshape(-1, BLOCK)
    scales = (np.abs(b).max(axis=1) * F(1.0 / 127)).astype(F)
    safe = np.where(scales > 0, scales, F(1)).astype(F)
    codes = np.clip(np.round(b / safe[:, None]), -127, 127).astype(np.int8)
    return codes.reshape(-1), scales


def np_quantize_root(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r = np.sqrt(v).reshape(-1, BLOCK)
    scales = (r.max(axis=1) * F(1.0 / 255)).astype(F)
    safe = np.where(scales > 0, scales, F(1)).astype(F)
    codes = np.clip(np.ceil(r / safe[:, None]), 0, 255).astype(np.uint8)
    return codes.reshape(-1), scales


def np_step(w, g, m, v, lr, b1, b2, eps, wd, t):  # type: ignore[no-untyped-def]
    bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
    m = (m * F(b1) + g * F(1.0 - b1)).astype(F)
    v = (v * F(b2) + (g * g) * F(1.0 - b2)).astype(F)
    if wd:
        w = (w * F(1.0 - lr * wd)).astype(F)
    denom = (np.sqrt(v * F(1.0 / bc2)) + F(eps)).astype(F)
    w = (w - (m * F(1.0 / bc1)) / denom * F(lr)).astype(F)
    return w, m, v


class NumpyAdamW8bit:
    """The reference: moments dequantized, stepped in float32, quantized again (padded to whole blocks)."""

    def __init__(self, n: int) -> None:
        self.n, self.k = n, -(-n // BLOCK) * BLOCK
        self.small = n < MIN_8BIT
        self.m = np.zeros(n if self.small else self.k, F)
        self.v = np.zeros(n if self.small else self.k, F)
        self.t = 0

    def step(self, w: np.ndarray, g: np.ndarray, lr: float, b1: float, b2: float, eps: float, wd: float) -> np.ndarray:
        self.t += 1
        if self.small:
            w, self.m, self.v = np_step(w, g, self.m, self.v, lr, b1, b2, eps, wd, self.t)
            return w
        gp = np.zeros(self.k, F)
        gp[: self.n] = g
        w2, m, v = np_step(w, gp[: self.n], self.m[: self.n], self.v[: self.n], lr, b1, b2, eps, wd, self.t)
        full_m, full_v = self.m.copy(), self.v.copy()
        full_m[: self.n], full_v[: self.n] = m, v
        full_m[self.n:] *= F(b1)  # (the padding: zeros stay zeros)
        full_v[self.n:] *= F(b2)
        mc, ms = self.mc, _ = np_quantize_signed(full_m)
        vc, vs = self.vc, _ = np_quantize_root(full_v)
        self.m = (mc.reshape(-1, BLOCK).astype(F) * ms[:, None]).reshape(-1).astype(F)
        r = (vc.reshape(-1, BLOCK).astype(F) * vs[:, None]).astype(F)
        self.v = (r * r).reshape(-1).astype(F)
        return w2


@pytest.mark.parametrize("n", [300, MIN_8BIT, 3 * BLOCK * 7 + 5])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_the_steps_match_the_numpy_reference_bit_for_bit(n: int, wd: float) -> None:
    rng = np.random.default_rng(n)
    w0 = rng.standard_normal(n).astype(F)
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = AdamW8bit([p], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    ref, w = NumpyAdamW8bit(n), w0.copy()
    for step in range(5):
        g = (rng.standard_normal(n) * (10.0 ** rng.uniform(-4, 0, n))).astype(F)  # magnitudes over 4 decades
        p.grad = torch.from_numpy(g.copy())
        opt.step()
        w = ref.step(w, g, 3e-3, 0.9, 0.95, 1e-8, wd)
        assert np.array_equal(p.detach().numpy(), w), f"step {step + 1}"
        st = opt.state[p]
        if "m_codes" in st:  # the kept moments: the reference's, code for code, but for a boundary case or two
            assert np.array_equal(st["m_codes"].numpy(), ref.mc) and np.array_equal(st["v_codes"].numpy(), ref.vc)
        else:
            assert np.array_equal(st["v"].numpy(), ref.v)


def test_quantized_moments_are_8_bits_and_a_small_v_is_never_rounded_down() -> None:
    n = 2 * BLOCK * 16
    p = torch.nn.Parameter(torch.zeros(n))
    opt = AdamW8bit([p], lr=1e-3)
    g = torch.full((n,), 1e-6)
    g[::BLOCK] = 10.0  # one huge element per block next to tiny ones
    p.grad = g
    opt.step()
    st = opt.state[p]
    assert st["m_codes"].dtype == torch.int8 and st["v_codes"].dtype == torch.uint8
    from potluck.peer.training.adamw8bit import dequantize_root
    v = dequantize_root(st["v_codes"], st["v_scales"])
    true_v = (1 - 0.999) * g * g
    assert bool((v >= true_v).all())  # rounded up: a tiny element's step is never blown up by a zero v
    assert state_bytes_per_param(n) < 2.1 and state_bytes_per_param(100) == 8.0


def test_it_trains_like_fp32_adamw() -> None:
    """A least-squares problem, 200 steps: the 8-bit moments end within a few percent of fp32 AdamW's loss."""
    gen = torch.Generator().manual_seed(0)
    a, target = torch.randn(256, 64, generator=gen), torch.randn(256, 128, generator=gen)

    def train(make) -> float:  # type: ignore[no-untyped-def]
        w = torch.nn.Parameter(torch.zeros(64, 128))
        opt = make([w])
        for _ in range(200):
            opt.zero_grad()
            loss = ((a @ w - target) ** 2).mean()
            loss.backward()
            opt.step()
        return float(((a @ w - target) ** 2).mean())

    fp32 = train(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0))
    q8 = train(lambda ps: AdamW8bit(ps, lr=1e-2, weight_decay=0.0))
    assert abs(q8 / fp32 - 1) < 0.03, (q8, fp32)


@pytest.mark.parametrize("kw", [{"lr": 0.0}, {"betas": (0.9, 1.0)}, {"eps": 0.0}, {"weight_decay": -1.0}])
def test_bad_arguments_are_refused(kw: dict) -> None:
    with pytest.raises(ValueError, match="AdamW8bit: bad"):
        AdamW8bit([torch.nn.Parameter(torch.zeros(3))], **kw)


def swarm_trains_with(swarm, overrides: dict) -> None:  # type: ignore[no-untyped-def]
    """A real swarm with ``overrides``, one peer at half speed: every member holds the same bits after each outer
    step, and the eval loss falls."""
    from test_swarm import hashes_agree

    swarm.start_coordinator({"diloco.outer_steps": 3, "diloco.inner_steps": 10, "membership.min_peers": 3, **overrides})
    swarm.start_peer(env={"POTLUCK_FAULTS": "inner.step@*:slow=2"}, name="slow")
    for _ in range(2):
        swarm.start_peer()
    state = swarm.wait_state(lambda s: s["run"]["finished"] and s["history"] and len(s["history"][-1]["state_hashes"]) == 3
                             and s["history"][-1]["eval_loss"] is not None, 240, "the run to finish")
    hist = state["history"]
    assert [h["step"] for h in hist] == [1, 2, 3] and hashes_agree(state) == []
    evals = [h["eval_loss"] for h in hist if h["eval_loss"] is not None]
    assert len(evals) == 3 and evals[-1] < evals[0], evals


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_swarm_with_8_bit_moments_trains_and_stays_identical(swarm) -> None:  # type: ignore[no-untyped-def]
    swarm_trains_with(swarm, {"train.optimizer": "adamw8bit"})
