"""The inner update inside the backward pass (``train.step_in_backward``, peer/training/inbackward.py): AdamW per parameter,
stepped as each gradient is complete, against an independent numpy reference; the same steps as the whole-stage
optimizer's; no stage-sized gradient held; the size check's count; every refusal; a real swarm."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from swarm import run_config
from test_adamw8bit import F, np_step, swarm_trains_with

from potluck.models import sizecheck, stage_bounds
from potluck.peer.training.adamw8bit import AdamW8bit
from potluck.peer.training.data import Dataset
from potluck.peer.training.inbackward import StepInBackward
from potluck.peer.training.runner import resolve_precision
from potluck.peer.training.stage import StageWorker
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.config.section import ConfigError


def test_each_parameter_steps_in_the_backward_as_numpy_adamw_says() -> None:
    """out = x W^T + b, loss = sum(out * r): dW = r^T x and db = sum(r), worked out in numpy, and AdamW on them."""
    rng = np.random.default_rng(3)
    w0, b0 = rng.standard_normal((5, 4)).astype(F), rng.standard_normal(5).astype(F)
    layer = torch.nn.Linear(4, 5)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w0))
        layer.bias.copy_(torch.from_numpy(b0))
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.95, 1e-8, 0.1
    opt = StepInBackward(layer.parameters(), lambda ps: torch.optim.AdamW(ps, lr=lr, betas=(b1, b2), eps=eps,
                                                                           weight_decay=wd, foreach=False))
    w, b = w0.copy(), b0.copy()
    mw, vw, mb, vb = (np.zeros_like(w), np.zeros_like(w), np.zeros_like(b), np.zeros_like(b))
    for t in range(1, 5):
        x, r = rng.standard_normal((3, 4)).astype(F), rng.standard_normal((3, 5)).astype(F)
        (layer(torch.from_numpy(x)) * torch.from_numpy(r)).sum().backward()
        assert layer.weight.grad is None and layer.bias.grad is None  # (updated and dropped in the backward)
        w, mw, vw = np_step(w, (r.T @ x).astype(F), mw, vw, lr, b1, b2, eps, wd, t)
        b, mb, vb = np_step(b, r.sum(axis=0).astype(F), mb, vb, lr, b1, b2, eps, wd, t)
        opt.step()  # (nothing left to do)
        np.testing.assert_allclose(layer.weight.detach().numpy(), w, rtol=1e-5, atol=1e-6, err_msg=f"step {t}")
        np.testing.assert_allclose(layer.bias.detach().numpy(), b, rtol=1e-5, atol=1e-6, err_msg=f"step {t}")
    assert opt.peak_grad_bytes == 5 * 4 * 4  # the larger parameter's gradient: never the two at once
    assert set(opt.state) == {layer.weight, layer.bias} and int(opt.state[layer.weight]["step"]) == 4
    opt.close()
    (layer(torch.ones(1, 4))).sum().backward()  # hooks off: the gradient stays, nothing steps
    assert layer.weight.grad is not None and int(opt.state[layer.weight]["step"]) == 4


@pytest.mark.parametrize("eight_bit", [False, True])
def test_the_same_steps_as_one_optimizer_over_the_whole_stage(eight_bit: bool) -> None:
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.GELU(), torch.nn.Linear(300, 8))
    b = torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.GELU(), torch.nn.Linear(300, 8))
    b.load_state_dict(a.state_dict())
    whole = AdamW8bit(a.parameters(), lr=1e-2, eight_bit=eight_bit)
    each = StepInBackward(b.parameters(), lambda ps: AdamW8bit(ps, lr=1e-2, eight_bit=eight_bit))
    for _ in range(4):
        x = torch.randn(16, 8)
        whole.zero_grad()
        a(x).square().mean().backward()
        whole.step()
        b(x).square().mean().backward()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)  # (the same per-tensor arithmetic, bit for bit)
        assert each.state[q]["step"] == whole.state[p]["step"] == 4


def test_a_parameter_given_twice_is_refused() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="appears twice"):
        StepInBackward([p, p], lambda ps: torch.optim.AdamW(ps))


def worker(overrides: dict) -> StageWorker:
    rc = run_config({"diloco.inner_steps": 5, "train.warmup_steps": 0, "train.grad_clip": 0.0, **overrides})
    return StageWorker(rc, 0, stage_bounds(rc.model, rc.pipeline)[0], torch.device("cpu"), Dataset(rc.data, rc.model), None)


def test_a_stage_worker_steps_in_the_backward_as_it_would_after_it() -> None:
    """A worker with train.step_in_backward trains H steps to what the same worker without it reaches (AdamW, no
    clipping), holding no gradient once a step is done."""
    plain, fused = worker({}), worker({"train.step_in_backward": True})
    origin = plain.theta().clone()
    fused.load(origin.clone())
    for w in (plain, fused):
        w.inner_phase([(0, 4096)], threading.Event(), lambda i, loss, s: None, 1)
    assert isinstance(fused.optimizer, StepInBackward)
    assert all(p.grad is None for p in fused.params)
    torch.testing.assert_close(fused.theta(), plain.theta(), rtol=1e-5, atol=1e-6)
    assert float((fused.theta() - origin).abs().max()) > 1e-3  # (it trained)


def test_the_size_check_leaves_the_gradient_out() -> None:
    def cfg(**train: object) -> RunConfig:
        return apply_overrides(RunConfig(), {"model.preset": "llama-150m", "train.grad_clip": 0.0,
                                             **{f"train.{k}": v for k, v in train.items()}})

    pairs = [({}, 16.0), ({"weights": "bf16"}, 12.0), ({"weights": "bf16", "optimizer": "adamw8bit"}, 6.0 + 8 / 256)]
    for train, plain in pairs:
        grad = 2.0 if train.get("weights") == "bf16" else 4.0
        assert sizecheck.device_bytes_per_param(cfg(**train)) == plain
        assert sizecheck.device_bytes_per_param(cfg(**train, step_in_backward=True)) == plain - grad
    a, b = sizecheck.estimate(cfg()), sizecheck.estimate(cfg(step_in_backward=True))
    assert a.device_bytes - b.device_bytes == 4 * a.stage_parameters and a.host_bytes == b.host_bytes


@pytest.mark.parametrize(("over", "match"), [
    ({}, r"cannot clip by their norm: set train.grad_clip = 0 \(it is 1.0\)"),
    ({"train.grad_clip": 0.0, "train.grad_accum": 2}, r"first of train.grad_accum = 2 micro-batches: set it to 1"),
    ({"train.grad_clip": 0.0, "train.precision": "fp16"}, r"train.precision = 'fp16'.*'bf16', 'fp32' or 'auto'"),
    ({"train.grad_clip": 0.0, "pipeline.stages": 2}, r"first of pipeline.micro_batches = 2: set pipeline.micro_batches = 1"),
])
def test_what_cannot_step_in_the_backward_is_refused(over: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        apply_overrides(RunConfig(), {"train.step_in_backward": True, **over})
    ok = apply_overrides(RunConfig(), {"train.step_in_backward": True, "train.grad_clip": 0.0, "pipeline.stages": 2,
                                       "pipeline.micro_batches": 1})
    assert ok.train.step_in_backward and ok.pipeline.micro_batches == 1


def test_auto_precision_never_picks_loss_scaling_for_a_step_in_the_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)  # (an older GPU: fp16 is auto's pick)
    cuda = torch.device("cuda")
    assert resolve_precision("auto", cuda, stages=1) == "fp16"
    assert resolve_precision("auto", cuda, stages=1, in_backward=True) == "fp32"


def test_a_multi_device_peer_refuses_it() -> None:
    from potluck.peer.devices.multidevice import Leader

    class Group:  # (the refusal comes before anything is sent to the helpers: one that did fails the test)
        world = 2

        def send(self, command: object) -> None:
            raise AssertionError(f"sent {command!r} to the helpers")

    rc = apply_overrides(RunConfig(), {"train.step_in_backward": True, "train.grad_clip": 0.0})
    for shard in (False, True):
        with pytest.raises(ConfigError, match="before this peer's 2 processes have averaged its gradient"):
            Leader(Group(), shard).setup(rc)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_swarm_stepping_in_the_backward_trains_and_stays_identical(swarm) -> None:  # type: ignore[no-untyped-def]
    """bf16 weights, 8-bit moments, each stepped in the backward, in a real swarm with one peer at half speed."""
    swarm_trains_with(swarm, {"train.weights": "bf16", "train.optimizer": "adamw8bit", "train.step_in_backward": True,
                              "train.grad_clip": 0.0})
