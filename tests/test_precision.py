"""Mixed precision, activation checkpointing, gradient accumulation and torch.compile on a peer's stage:
each changes how the math runs, never what the outer loop sees (fp32 master weights and outer state)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from potluck.models import stage_bounds
from potluck.peer.outer.diloco import nesterov_step
from potluck.peer.outer.outer import pseudo_gradient
from potluck.peer.pipeline.pipeline import Neighbour, Pipeline
from potluck.peer.pipeline.pipewire import Outbound
from potluck.peer.training.data import Dataset
from potluck.peer.training.runner import StageRunner, resolve_precision
from potluck.peer.training.stage import StageWorker
from potluck.protos import potluck_pb2 as pb
from potluck.protos.config.files import apply_overrides, parse_config
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.config.section import ConfigError

BASE = {
    "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 2, "model.seq_len": 32,
    "train.batch_size": 16, "train.warmup_steps": 5, "diloco.inner_steps": 40,
    "data.num_samples": 2048, "data.eval_samples": 64,
}


def config(**over: object) -> RunConfig:
    return apply_overrides(RunConfig(), {**BASE, **over})


def worker(cfg: RunConfig) -> StageWorker:
    """A single-stage peer's worker, with the data path the peer uses."""
    data = Dataset(cfg.data, cfg.model)
    return StageWorker(cfg, 0, stage_bounds(cfg.model, cfg.pipeline)[0], torch.device("cpu"), data, link=None)


def train(w: StageWorker) -> list[float]:
    """One inner phase of ``diloco.inner_steps`` steps over the run's first samples; the train losses."""
    losses: list[float] = []
    steps = w.rc.diloco.inner_steps
    phase = w.inner_phase([(0, steps * w.rc.train.batch_size)], threading.Event(), lambda i, loss, s: losses.append(loss))
    assert phase.steps == steps, phase
    return losses


@contextlib.contextmanager
def grads_at_each_step(params: list[torch.nn.Parameter]) -> Iterator[list[list[torch.Tensor]]]:
    """The gradients each applied optimizer step sees (after unscaling and clipping)."""
    seen: list[list[torch.Tensor]] = []
    handle = register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: seen.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]))
    try:
        yield seen
    finally:
        handle.remove()


@pytest.fixture
def caplog_sees_potluck(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging.getLogger("potluck"), "propagate", True)  # its own handler stops it at "potluck"


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "data,message",
    [
        ({"train": {"precision": "fp8"}}, "train.precision"),
        ({"train": {"grad_accum": 0}}, "train.grad_accum"),
        ({"train": {"batch_size": 16, "grad_accum": 3}}, "train: batch_size 16 is not a multiple of grad_accum 3"),
        ({"train": {"compile": "sometimes"}}, "train.compile"),
        ({"train": {"checkpoint_activations": 2}}, "train.checkpoint_activations"),
        ({"train": {"grad_accum": 2}, "pipeline": {"stages": 2}}, "pipeline.micro_batches"),
        ({"train": {"precision": "fp16"}, "pipeline": {"stages": 2}}, "'fp16' needs pipeline.stages = 1"),
    ],
)
def test_bad_precision_settings_are_refused_naming_the_field(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert message in str(err.value)


def test_auto_precision_is_fp32_on_a_cpu_and_explicit_choices_are_kept() -> None:
    assert RunConfig().train.precision == "auto"
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == "fp32"
    assert [resolve_precision(p, cpu) for p in ("fp32", "bf16", "fp16")] == ["fp32", "bf16", "fp16"]
    assert parse_config({"train": {"precision": "bf16", "grad_accum": 4, "compile": True,
                                   "checkpoint_activations": True}}).train.grad_accum == 4


# ---------------------------------------------------------------------------------------------- precision


def test_bf16_training_reaches_the_fp32_eval_loss() -> None:
    """CPU bf16 autocast, 40 inner steps of the built-in model: eval loss within 2% of fp32's."""
    results = {}
    for precision in ("fp32", "bf16"):
        w = worker(config(**{"train.precision": precision}))
        untrained = w.evaluate(0)
        train(w)
        results[precision] = (untrained, w.evaluate(1))
    (untrained, fp32), (_, bf16) = results["fp32"], results["bf16"]
    assert untrained is not None and fp32 is not None and bf16 is not None
    assert fp32 < untrained - 1.0  # it learned something, so the comparison means something
    assert abs(bf16 - fp32) / fp32 < 0.02, (fp32, bf16)


def test_the_outer_state_stays_fp32_under_bf16() -> None:
    w = worker(config(**{"train.precision": "bf16", "diloco.inner_steps": 4}))
    seen: list[torch.dtype] = []
    w.layers[1].fc.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    start = w.theta()
    train(w)
    assert torch.bfloat16 in seen  # the matmuls did run in bf16
    assert all(p.dtype == torch.float32 for p in w.params)
    assert w.optimizer is not None
    assert all(t.dtype == torch.float32 for s in w.optimizer.state.values() for t in s.values() if t.is_floating_point())
    theta_local = w.theta()
    assert theta_local.dtype == torch.float32
    delta = pseudo_gradient(start, theta_local.clone())
    theta, momentum = nesterov_step(start, torch.zeros_like(start), delta, 0.7, 0.9)
    assert delta.dtype == theta.dtype == momentum.dtype == torch.float32
    assert bool(torch.isfinite(theta).all()) and float(delta.abs().max()) > 0


def test_fp16_with_a_loss_scale_clips_the_unscaled_gradients() -> None:
    if not torch.amp.autocast_mode.is_autocast_available("cpu"):
        pytest.skip("this torch has no CPU autocast")
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            torch.ones(2, 2) @ torch.ones(2, 2)
        torch.amp.GradScaler("cpu")
    except (RuntimeError, ValueError) as err:
        pytest.skip(f"this torch has no CPU fp16 autocast or GradScaler: {err}")
    clip = 0.05  # far below the true gradient norm: every applied step is clipped to exactly this
    fp32 = worker(config(**{"train.precision": "fp32", "train.grad_clip": 0.0, "diloco.inner_steps": 1}))
    with grads_at_each_step(fp32.params) as ref:
        train(fp32)
    assert float(torch.cat([g.flatten() for g in ref[0]]).norm()) > 10 * clip

    w = worker(config(**{"train.precision": "fp16", "train.grad_clip": clip, "diloco.inner_steps": 4}))
    assert w.runner.precision.scaler is not None
    with grads_at_each_step(w.params) as seen:
        losses = train(w)
    assert seen, "every step overflowed"
    for grads in seen:  # clipped after unscaling; clipping scaled ones would leave clip / 65536 here
        assert float(torch.cat([g.flatten() for g in grads]).norm()) == pytest.approx(clip, rel=1e-3)
    if w.runner.precision.scaler.get_scale() == 65536.0:  # no step skipped: the first one saw fp32's batch
        a, b = torch.cat([g.flatten() for g in seen[0]]), torch.cat([g.flatten() for g in ref[0]])
        assert float(torch.nn.functional.cosine_similarity(a, b, dim=0)) > 0.99
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(p.dtype == torch.float32 for p in w.params)


# ---------------------------------------------------------------------------------------------- memory


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    """Bitwise: the backward recomputes each layer's forward with the same kernels on the same inputs
    (no dropout, so no RNG), and the autograd graph downstream of each layer is unchanged, so every
    gradient is summed in the same order."""
    grads = {}
    for flag in (False, True):
        w = worker(config(**{"train.checkpoint_activations": flag, "train.grad_clip": 0.0, "diloco.inner_steps": 2}))
        with grads_at_each_step(w.params) as seen:
            train(w)
        grads[flag] = seen
    for plain, ckpt in zip(grads[False], grads[True], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(plain, ckpt, strict=True))


def test_checkpointing_is_used_in_training_and_skipped_in_evaluation(monkeypatch: pytest.MonkeyPatch) -> None:
    import potluck.peer.training.model as model

    calls: list[int] = []
    real = model.checkpoint

    def counted(fn, x, **kw):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(fn, x, **kw)

    monkeypatch.setattr(model, "checkpoint", counted)
    w = worker(config(**{"train.checkpoint_activations": True, "diloco.inner_steps": 1}))
    train(w)
    assert len(calls) == BASE["model.n_layers"] + 1  # every block and the head; not the embedding
    calls.clear()
    w.evaluate(1)
    assert calls == []


def test_gradient_accumulation_gives_the_whole_batch_gradients() -> None:
    """allclose, not bitwise: four partial sums added in turn round differently from one sum."""
    seen, losses = {}, {}
    for k in (1, 4):
        w = worker(config(**{"train.grad_accum": k, "train.grad_clip": 0.0, "diloco.inner_steps": 2}))
        with grads_at_each_step(w.params) as grads:
            losses[k] = train(w)
        seen[k] = grads
    for whole, accumulated in zip(seen[1], seen[4], strict=True):
        for a, b in zip(whole, accumulated, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert losses[4] == pytest.approx(losses[1], rel=1e-6)


def test_auto_accumulation_splits_a_batch_that_does_not_fit_and_keeps_the_gradients() -> None:
    """train.grad_accum = 'auto' (the default): the whole batch first; a micro-batch that runs out of device
    memory (here: a runner that refuses more than 2 samples, as a small GPU would) is split, the step redone,
    and the gradients and losses are the whole batch's."""
    seen, losses, accum = {}, {}, {}
    for name, k in (("whole", 1), ("auto", "auto")):
        w = worker(config(**{"train.grad_accum": k, "train.grad_clip": 0.0, "diloco.inner_steps": 2}))
        if name == "auto":
            run = w.runner.__class__.__call__

            def small_device(self, x, run=run):  # type: ignore[no-untyped-def]
                if len(x) > 2:
                    raise torch.OutOfMemoryError("CUDA out of memory (a test's small device)")
                return run(self, x)

            w.runner.__class__ = type("SmallDevice", (w.runner.__class__,), {"__call__": small_device})
        with grads_at_each_step(w.params) as grads:
            losses[name] = train(w)
        seen[name], accum[name] = grads, w.accum
    assert accum == {"whole": 1, "auto": 8}  # 16 samples: 1 -> 2 -> 4 -> 8 micro-batches, the first that fits
    for whole, auto in zip(seen["whole"], seen["auto"], strict=True):
        for a, b in zip(whole, auto, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert losses["auto"] == pytest.approx(losses["whole"], rel=1e-6)


def test_auto_compile_is_on_for_a_gpu_only() -> None:
    from potluck.peer.training.runner import wants_compile

    assert wants_compile("auto", torch.device("cuda")) and not wants_compile("auto", torch.device("cpu"))
    assert wants_compile(True, torch.device("cpu")) and not wants_compile(False, torch.device("cuda"))


# ---------------------------------------------------------------------------------------------- compile


def test_a_failing_compile_falls_back_to_eager_and_says_so_once(monkeypatch: pytest.MonkeyPatch, caplog,  # type: ignore[no-untyped-def]
                                                                caplog_sees_potluck) -> None:
    eager = worker(config(**{"diloco.inner_steps": 3}))
    expected = train(eager)

    def broken(layer: torch.nn.Module, **kw: object):  # type: ignore[no-untyped-def]
        def run(x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("InductorError: no working C++ compiler")
        return run

    for fake in (broken, lambda layer, **kw: (_ for _ in ()).throw(RuntimeError("dynamo is not supported"))):
        monkeypatch.setattr(torch, "compile", fake)
        caplog.clear()
        w = worker(config(**{"train.compile": True, "diloco.inner_steps": 3}))
        assert train(w) == expected  # eager from the first step: bit-identical
        assert w.evaluate(1) == eager.evaluate(1)
        assert not w.runner.compiled
        assert caplog.text.count("torch.compile failed") == 1, caplog.text


def test_compiled_layers_train_like_eager_ones() -> None:
    """A real compile (dynamo capture + AOTAutograd forward and backward graphs; the ``aot_eager``
    backend, 2 s here; inductor's C++ code generation takes 20 s to over a minute on a 2-core machine: set
    POTLUCK_TEST_INDUCTOR=1 to run that too). Its parameter names and the optimizer's view stay those
    of the plain layers."""
    eager = worker(config(**{"diloco.inner_steps": 3}))
    expected = train(eager)
    backends = ["aot_eager"] + (["inductor"] if os.environ.get("POTLUCK_TEST_INDUCTOR") else [])
    for backend in backends:
        w = worker(config(**{"train.compile": True, "diloco.inner_steps": 3}))
        w.runner.compile_backend = backend
        losses = train(w)
        assert w.runner.compiled, backend
        assert losses == pytest.approx(expected, rel=1e-4), backend
        torch.testing.assert_close(w.theta(), eager.theta(), rtol=1e-4, atol=1e-5)
        assert [n for n, _ in w.layers.named_parameters()] == [n for n, _ in eager.layers.named_parameters()]


# ---------------------------------------------------------------------------------------------- pipeline


class Loopback:
    """Delivers pipe messages straight to the addressed stage's handler (no sockets)."""

    def __init__(self) -> None:
        self.pipes: dict[str, Pipeline] = {}

    def push_pipe(self, address: str, chunks: Iterable[pb.PipeChunk], timeout: float, peer: str) -> pb.Ack:
        return self.pipes[address].on_message(iter(chunks))


def recording(encode: Callable[..., Outbound], sent: list[str]) -> Callable[..., Outbound]:
    """``Pipeline._encode``, noting the dtype each message's tensor crosses the wire in."""
    def wrapped(out):  # type: ignore[no-untyped-def]
        msg = encode(out)
        sent.append(msg.head.first.dtype)
        return msg
    return wrapped


def pipeline_losses(precision: str, steps: int = 4) -> tuple[list[float], list[str]]:
    cfg = config(**{"pipeline.stages": 2, "pipeline.micro_batches": 2, "pipeline.compression": "none",
                    "pipeline.grad_bits": 32, "pipeline.pipe_timeout_s": 10.0, "train.precision": precision,
                    "train.checkpoint_activations": True, "diloco.inner_steps": steps})
    data, net = Dataset(cfg.data, cfg.model), Loopback()
    workers: list[StageWorker] = []
    pipes: list[Pipeline] = []
    sent: list[str] = []
    for s, bounds in enumerate(stage_bounds(cfg.model, cfg.pipeline)):
        pipe = Pipeline(run_id=cfg.run_id, me=f"peer{s}", stage=s, stages=2, model=cfg.model, cfg=cfg.pipeline,
                        client=net, num_samples=cfg.data.num_samples)  # type: ignore[arg-type]
        net.pipes[f"addr{s}"] = pipe
        pipe.sends._encode = recording(pipe.sends._encode, sent)  # type: ignore[method-assign]
        pipes.append(pipe)
        workers.append(StageWorker(cfg, s, bounds, torch.device("cpu"), data, pipe))
    for s, pipe in enumerate(pipes):
        pipe.begin_round(1, 0, Neighbour("peer0", "addr0") if s else None, None if s else Neighbour("peer1", "addr1"))
    losses: list[float] = []
    errors: list[BaseException] = []

    def run(w: StageWorker) -> None:
        try:
            w.inner_phase([(0, steps * cfg.train.batch_size)], threading.Event(),
                          lambda i, loss, sec: losses.append(loss) if w.first else None)
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for pipe in pipes:
        pipe.close()
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert all(p.dtype == torch.float32 for w in workers for p in w.params)
    return losses, sent


def test_a_bf16_pipeline_sends_fp32_and_trains_like_fp32() -> None:
    fp32, _ = pipeline_losses("fp32")
    bf16, sent = pipeline_losses("bf16")
    assert len(bf16) == len(fp32) == 4
    assert set(sent) == {"float32"}  # activations and gradients cross in the wire format they always had
    assert bf16 == pytest.approx(fp32, rel=0.02)


def test_auto_precision_on_a_gpu_follows_its_bf16_support(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decided by each peer for its own device (no GPU needed to check the rule)."""
    assert StageRunner(worker(config()).layers, config().train, torch.device("cpu")).precision.scaler is None
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_precision("auto", torch.device("cuda"), stages=1) == "fp16"
    assert resolve_precision("auto", torch.device("cuda"), stages=2) == "fp32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_precision("auto", torch.device("cuda"), stages=2) == "bf16"


def test_auto_checkpointing_is_decided_by_the_peer_from_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """``train.checkpoint_activations = "auto"``: on this box's RAM the small model fits, so the worker keeps every
    activation; told its device holds less than the stage needs without checkpointing, it checkpoints."""
    import potluck.peer.training.stage as stage

    cfg = config(**{"train.checkpoint_activations": "auto", "diloco.inner_steps": 1})
    assert worker(cfg).runner.checkpoint is False
    monkeypatch.setattr(stage, "device_memory", lambda device: 1 << 20)  # 1 MiB: nothing fits whole
    small = worker(cfg)
    assert small.runner.checkpoint is True
    train(small)  # (and trains so)
