"""bf16 weights (``train.weights = "bf16"``): stochastic rounding against a numpy reference, bit for bit, and
unbiased; AdamW's step on a bf16 weight against numpy; theta_local exact (the load's rounding is never part of a
pseudo-gradient); the size check's bytes; bad combinations refused; a real swarm with a half-speed peer."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from swarm import run_config
from test_adamw8bit import F, np_step, swarm_trains_with

from potluck.models import sizecheck, stage_bounds
from potluck.peer.training.adamw8bit import AdamW8bit, noise_for, round_stochastic
from potluck.peer.training.data import Dataset
from potluck.peer.training.stage import StageWorker
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig


def np_round_stochastic(w: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """The reference: the float32 bits plus the noise, the low 16 bits cut (a bf16 value, as float32)."""
    bits = (w.astype(F).view(np.int32).astype(np.int64) + noise.astype(np.int64)) & ~0xFFFF
    return ((bits + (1 << 31)) % (1 << 32) - (1 << 31)).astype(np.int32).view(F)


def test_stochastic_rounding_matches_numpy_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    w = np.concatenate([rng.standard_normal(5000) * 10.0 ** rng.uniform(-6, 4, 5000),
                        [0.0, -0.0, 1.0, -1.0, 3.0e38, 1e-40]]).astype(F)
    noise = rng.integers(0, 1 << 16, w.size).astype(np.int32)
    got = round_stochastic(torch.from_numpy(w), torch.from_numpy(noise))
    assert got.dtype == torch.bfloat16
    assert np.array_equal(got.float().numpy().view(np.int32), np_round_stochastic(w, noise).view(np.int32))
    exact = torch.tensor([1.0, -2.5, 0.0], dtype=torch.bfloat16).float()
    assert torch.equal(round_stochastic(exact, torch.full((3,), 65535, dtype=torch.int32)).float(), exact)


def test_stochastic_rounding_is_unbiased_where_rounding_to_nearest_is_not() -> None:
    x = 1.0 + 2.0 ** -10  # an eighth of the way from bf16's 1 to its next value, 1 + 2^-7
    w = torch.full((200_000,), x)
    got = round_stochastic(w, noise_for(w.numel(), torch.Generator().manual_seed(1), w.device)).float()
    assert set(got.unique().tolist()) == {1.0, 1.0 + 2.0 ** -7}
    assert abs(float(got.double().mean()) - x) < 2.0 ** -7 * 0.01  # within 1 % of an ulp of the true value
    assert float(w.to(torch.bfloat16).float()[0]) == 1.0  # (to nearest: the update is lost)


def test_an_adamw_step_on_bf16_weights_matches_numpy() -> None:
    """fp32 moments, the update in fp32 from the bf16 weight, written back with the generator's noise."""
    n, lr, seed = 1000, 3e-3, 7
    rng = np.random.default_rng(3)
    w0 = torch.from_numpy(rng.standard_normal(n).astype(F)).to(torch.bfloat16)
    p = torch.nn.Parameter(w0.clone())
    opt = AdamW8bit([p], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, eight_bit=False, seed=seed)
    gen = torch.Generator().manual_seed(seed)  # the reference draws the same noise
    w, m, v = w0.float().numpy(), np.zeros(n, F), np.zeros(n, F)
    for t in range(1, 4):
        g = torch.from_numpy((rng.standard_normal(n) * 1e-2).astype(F)).to(torch.bfloat16)
        p.grad = g.clone()
        opt.step()
        w32, m, v = np_step(w, g.float().numpy(), m, v, lr, 0.9, 0.95, 1e-8, 0.1, t)
        w = np_round_stochastic(w32, noise_for(n, gen, torch.device("cpu")).numpy())
        assert p.dtype == torch.bfloat16
        assert np.array_equal(p.detach().float().numpy(), w), f"step {t}"
        assert np.array_equal(opt.state[p]["m"].numpy(), m)


def worker(overrides: dict) -> StageWorker:
    rc = run_config({"diloco.inner_steps": 6, "train.warmup_steps": 0, **overrides})
    return StageWorker(rc, 0, stage_bounds(rc.model, rc.pipeline)[0], torch.device("cpu"), Dataset(rc.data, rc.model), None)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
def test_theta_is_the_loaded_vector_plus_exactly_what_the_steps_changed(optimizer: str) -> None:
    w = worker({"train.weights": "bf16", "train.optimizer": optimizer})
    assert all(p.dtype == torch.bfloat16 for p in w.params) and w.runner.precision.mode == "bf16"
    origin = w.theta() + torch.randn(w.numel) * 1e-4  # not a bf16 vector: the load rounds it
    w.load(origin)
    assert torch.equal(w.theta(), origin)  # bit for bit: the rounding is not a change
    losses: list[float] = []
    w.inner_phase([(0, 4096)], threading.Event(), lambda i, loss, s: losses.append(loss), 1)
    weights = torch.cat([p.detach().float().reshape(-1) for p in w.params])
    changed = weights - origin.to(torch.bfloat16).float()
    assert torch.equal(w.theta() - origin, (origin + changed) - origin)
    assert float(changed.abs().max()) > 0 and losses[-1] < losses[0]


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_the_eval_of_theta_global_leaves_the_members_own_values_as_they_were(weights: str) -> None:
    """A streaming or overlapped member trains on values that are not theta_global: ``evaluate_global`` gives the
    eval loss of theta_global (as a worker holding it gives) and puts the member's own vector back: theta bit for
    bit; nothing loaded when the worker holds theta_global already."""
    w = worker({"train.weights": weights})
    w.inner_phase([(0, 4096)], threading.Event(), lambda i, loss, s: None, 1)
    own = w.theta()
    theta_global = own + torch.randn(w.numel) * 1e-2
    other = worker({"train.weights": weights})
    other.load(theta_global)
    assert w.evaluate_global(3, theta_global) == other.evaluate(3) != w.evaluate(3)
    assert torch.equal(w.theta(), own)
    loads: list[torch.Tensor] = []
    other.load = lambda theta, steps_done=None: loads.append(theta)  # type: ignore[method-assign]
    assert other.evaluate_global(3, theta_global) == w.evaluate_global(3, theta_global) and loads == []


def test_the_size_check_counts_bf16_weights_and_gradients() -> None:
    def cfg(**train: str) -> RunConfig:
        return apply_overrides(RunConfig(), {"model.preset": "llama-150m", **{f"train.{k}": v for k, v in train.items()}})

    base, lean, leanest = cfg(), cfg(weights="bf16"), cfg(weights="bf16", optimizer="adamw8bit")
    assert [sizecheck.device_bytes_per_param(c) for c in (base, lean, leanest)] == [16.0, 12.0, 4.0 + 2.0 + 8 / 256]
    a, b = sizecheck.estimate(base), sizecheck.estimate(lean)
    assert a.device_bytes - b.device_bytes == 4 * a.stage_parameters and a.host_bytes == b.host_bytes


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_bf16_weights_refuse_another_precision(precision: str) -> None:
    with pytest.raises(ValueError, match=f"train.weights = 'bf16'.*'{precision}'.*'bf16' or 'auto'"):
        apply_overrides(RunConfig(), {"train.weights": "bf16", "train.precision": precision})
    with pytest.raises(ValueError, match="weights"):
        apply_overrides(RunConfig(), {"train.weights": "fp16"})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_swarm_with_bf16_weights_trains_and_stays_identical(swarm) -> None:  # type: ignore[no-untyped-def]
    """bf16 weights with 8-bit moments in a real swarm, one peer at half speed (same bits after each outer step)."""
    swarm_trains_with(swarm, {"train.weights": "bf16", "train.optimizer": "adamw8bit"})
