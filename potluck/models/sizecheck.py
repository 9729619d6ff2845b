"""Will the run fit on a peer? The parameter count and a per-peer memory estimate, before anything is published.

A peer holds one pipeline stage (the whole model when ``pipeline.stages = 1``) and, for each of its
parameters, ``BYTES_PER_PARAM`` bytes: the fp32 weight and its gradient (4 + 4), AdamW's two moments
(8), and the outer state (theta_global and Nesterov momentum, 8, plus the previous version, 8, kept
for peers that roll back). ``benchmarks/stage_memory.py`` measured a peak of 1.67x the 20 bytes of
weights, AdamW and outer state on llama-1b's stage, 33 bytes a parameter, which this is (1.50x, 30 bytes, in a
later run).

Where they live: the weights, gradients, AdamW's moments and the activations are on the peer's device
(``DEVICE_BYTES_PER_PARAM``); the outer state is in host memory on every peer (pinned on a GPU peer:
``peer/training/stage.py``, ``peer/reduce/allreduce.py``; the outer step is rare and its copies run at the bus's speed), so a
GPU's memory needs :attr:`Estimate.device_bytes` only and the host the rest (:attr:`Estimate.host_bytes`; a CPU
peer holds both in one memory, :attr:`Estimate.bytes`). :func:`plan` is the fewest pipeline stages at which
each stage fits a card.

Activations are estimated for the run's batch and sequence, in fp32 (a GPU peer under bf16 autocast
needs less): per token and block about ``10 d_model + 4 d_ff`` values kept for the backward pass (its
inputs, norms, q/k/v, the attention and MLP outputs; attention runs as torch's fused kernels, linear in
the sequence: 20 MB more for 4 heads at 4,096 tokens, 25 MB at 8,192, where the scores would be 256 MB
and 1 GB), with ``train.checkpoint_activations`` only each block's input plus one block recomputed;
the last stage adds the logits and their gradient (``2 x vocab_size``). A pipeline stage keeps every
micro-batch of a GPipe step; a single stage splits the batch by ``train.grad_accum``. Evaluation (64
samples at a time, no gradients: about ``4 d_model + 2 d_ff`` values a token in the widest block, and the
logits) is counted too; the larger of the two is what a peer needs.

:func:`check_size` refuses, in one line naming the field to lower, a run no machine can hold (more
than ``REFUSE_BYTES`` a peer: ``--set model.d_model=1000000`` used to be published, and crash every
peer with a 50-line traceback); :func:`notes` are the one-line warnings for a run bigger than a
volunteer's GPU, :func:`peer_note` the one for a joined peer whose device is smaller than the run
needs, and a peer itself refuses a run its device cannot hold (:func:`fits`) before it builds anything.
The coordinator and the peers both read it: it is a function of the run config, like the stage cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from potluck.protos.config.runconfig import ModelConfig, RunConfig
from potluck.protos.config.section import ConfigError

DEVICE_BYTES_PER_PARAM = 16  # on the device: weight 4 + gradient 4 + AdamW's two moments 8
# train.optimizer's moments, a parameter: fp32 AdamW's 8; adamw8bit's 2 codes + a float32 scale a block of 256 each
OPTIMIZER_BYTES_PER_PARAM = {"adamw": 8.0, "adamw8bit": 2.0 + 8 / 256}
# train.weights: a weight and its gradient, a parameter (bf16: the fp32 master copy is theta_global, on the host)
WEIGHT_BYTES_PER_PARAM = {"fp32": 8.0, "bf16": 4.0}
# of which the gradient, which train.step_in_backward never holds for the whole stage (one parameter's at a time)
GRAD_BYTES_PER_PARAM = {"fp32": 4.0, "bf16": 2.0}
HOST_BYTES_PER_PARAM = 16  # in host memory: outer state (theta_global, momentum) 8 + the previous outer state 8
BYTES_PER_PARAM = DEVICE_BYTES_PER_PARAM + HOST_BYTES_PER_PARAM
OVERLAP_BYTES_PER_PARAM = 4  # diloco.overlap: the phase's starting point, in host memory
MAX_PLAN_STAGES = 64  # pipeline.stages a plan tries before it says no number of stages is enough
ACT_BYTES = 4  # activations counted in fp32
EVAL_BATCH = 64  # samples a peer evaluates at once (peer/training/stage.py)
GiB = 1 << 30
REFUSE_BYTES = 2 * 10**12  # more than any machine a volunteer lends one process (8 x H200 hold 1.1 TB together)
WARN_BYTES = 24 * GiB  # more than a volunteer's GPU (an RTX 4090's 24 GB) holds
# the fields a run's size comes from: a refusal or warning names the one whose default would shrink it most
SIZE_FIELDS = ("model.d_model", "model.n_layers", "model.d_ff", "model.vocab_size", "model.seq_len",
               "train.batch_size")


@dataclass(frozen=True)
class Estimate:
    """What the biggest stage of a run needs on one peer."""

    parameters: int  # the whole model's
    stage_parameters: int  # the biggest stage's
    state_bytes: int  # its parameters' weights, gradients, AdamW and outer state
    activation_bytes: int  # its training (or evaluation) activations, whichever is larger
    host_state_bytes: int = 0  # the part of state_bytes a GPU peer keeps in host memory: the outer state

    @property
    def bytes(self) -> int:
        """All of it: what a CPU peer, whose device is its host, needs."""
        return self.state_bytes + self.activation_bytes

    @property
    def device_bytes(self) -> int:
        """What a GPU peer's device needs: weights, gradients, AdamW and activations."""
        return self.bytes - self.host_state_bytes

    @property
    def host_bytes(self) -> int:
        """What a GPU peer's host memory needs besides: the outer state."""
        return self.host_state_bytes

    def describe(self, cfg: RunConfig) -> str:
        stage = (f", {count(self.stage_parameters)} in the biggest of {cfg.pipeline.stages} stages"
                 if cfg.pipeline.stages > 1 else "")
        each = self.state_bytes / max(self.stage_parameters, 1)
        return (f"{human(self.bytes)} a peer: {count(self.parameters)} parameters{stage} at {each:.3g} "
                f"bytes each (weights, gradients, AdamW, outer state) = {human(self.state_bytes)}, plus "
                f"{human(self.activation_bytes)} of activations at train.batch_size = {cfg.train.batch_size} x "
                f"model.seq_len = {cfg.model.seq_len}")


def count(n: float) -> str:
    """A parameter count as people say it: 0.02M, 19.1M, 974M, 24.0T."""
    for unit, size in (("T", 1e12), ("B", 1e9)):
        if n >= size:
            return f"{n / size:,.1f}{unit}"
    return f"{n / 1e6:.1f}M" if n >= 1e7 else f"{n / 1e6:.2f}M"


def human(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n / 1e3:,.1f} kB"


def entry_parameters(m: ModelConfig) -> list[int]:
    """Parameters of each entry (embedding, blocks, head), counted from the config (no torch): the
    ``tiny`` and ``llama`` families by formula, a Hugging Face model on the meta device."""
    d, f, v = m.d_model, m.ff_width, m.vocab_size
    if m.family == "tiny":  # learned positions; LayerNorms and linear layers with biases; head without bias
        embed, block, head = (v + m.seq_len) * d, 4 * d * d + 2 * d * f + 9 * d + f, 2 * d + d * v
    elif m.family == "llama":  # RMSNorms, no biases, grouped-query attention
        kv = m.kv_heads * (d // m.n_heads)
        embed, block, head = v * d, 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d, d + d * v
    else:
        from potluck.models import entry_costs

        return [int(c) for c in entry_costs(m, "params")]
    return [embed] + [block] * m.n_layers + [head]


def stage_entries(cfg: RunConfig, costs: list[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` of each stage's entries, as :func:`potluck.models.stage_bounds` cuts them (by the
    parameters counted here where it balances by FLOPs: an estimate needs no FLOP counter)."""
    from potluck.models import partition

    p, n = cfg.pipeline, len(costs)
    if p.layers:
        counts = list(p.layers)
    elif p.balance == "layers":
        counts = [n // p.stages] * p.stages
        order = sorted(range(p.stages), key=lambda i: (i in (0, p.stages - 1), abs(i - (p.stages - 1) / 2)))
        for i in order[: n - sum(counts)]:
            counts[i] += 1
    else:
        counts = partition([float(c) for c in costs], p.stages)
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds


def estimate(cfg: RunConfig) -> Estimate:
    m, t, p = cfg.model, cfg.train, cfg.pipeline
    costs = entry_parameters(m)
    total = sum(costs) - (m.vocab_size * m.d_model if m.tie_embeddings else 0)
    per_token_block = 10 * m.d_model + 4 * m.ff_width
    # a pipeline holds its micro-batches' activations (GPipe); a single stage one micro-batch, and with
    # grad_accum 'auto' a peer short of memory splits its batch down to one sample
    batch = t.batch_size if p.stages > 1 else t.batch_size // t.grad_accum if isinstance(t.grad_accum, int) else 1
    need: list[tuple[int, int, int, int]] = []
    for start, stop in stage_entries(cfg, costs):
        params = sum(costs[start:stop])
        blocks = len([i for i in range(start, stop) if 1 <= i <= m.n_layers])
        last = stop == len(costs)
        head = (2 * m.vocab_size + 2 * m.d_model) if last else 0
        # ('auto': a peer short of memory checkpoints, so the least a peer needs is the checkpointed figure)
        kept = (blocks * m.d_model + per_token_block) if t.checkpoint_activations else blocks * per_token_block
        train = batch * m.seq_len * (kept + m.d_model + head) * ACT_BYTES
        evaluate = EVAL_BATCH * m.seq_len * (4 * m.d_model + 2 * m.ff_width + m.d_model + head) * ACT_BYTES
        host = params * (HOST_BYTES_PER_PARAM + (OVERLAP_BYTES_PER_PARAM if cfg.diloco.overlap else 0))
        device = device_bytes_per_param(cfg)
        state = int(params * device) + host
        need.append((state + max(train, evaluate), params, state, host))
    biggest = max(need)
    return Estimate(total, biggest[1], biggest[2], biggest[0] - biggest[2], biggest[3])


def device_bytes_per_param(cfg: RunConfig) -> float:
    """Device bytes a parameter takes with the run's ``train.weights`` and ``train.optimizer`` (16 with the
    defaults; bf16 weights and 8-bit AdamW, about 6), less the gradient's with ``train.step_in_backward``."""
    t = cfg.train
    grad = GRAD_BYTES_PER_PARAM[t.weights] if t.step_in_backward else 0.0
    return WEIGHT_BYTES_PER_PARAM[t.weights] - grad + OPTIMIZER_BYTES_PER_PARAM[t.optimizer]


def _with(cfg: RunConfig, dotted: str, value: Any) -> RunConfig:
    section, name = dotted.split(".")
    changed = getattr(cfg, section).model_copy(update={name: value})  # (not validated: an estimate's what-if)
    return cfg.model_copy(update={section: changed})


def blame(cfg: RunConfig) -> str:
    """The size field whose default value would shrink the run the most: the one to lower."""
    best, field = estimate(cfg).bytes, SIZE_FIELDS[0]
    for dotted in SIZE_FIELDS:
        section, name = dotted.split(".")
        default = type(getattr(cfg, section)).model_fields[name].default
        smaller = _with(cfg, dotted, default)
        if getattr(getattr(cfg, section), name) == default:
            continue
        try:
            size = estimate(smaller).bytes
        except ValueError:  # (a default that does not fit the rest, e.g. fewer layers than stages)
            continue
        if size < best:
            best, field = size, dotted
    return field


def check_size(cfg: RunConfig) -> Estimate:
    """The run's estimate; ConfigError, in one line naming the field to lower, when no peer could hold it."""
    est = estimate(cfg)
    if est.bytes > REFUSE_BYTES:
        field = blame(cfg)
        section, name = field.split(".")
        value = getattr(getattr(cfg, section), name)
        raise ConfigError(f"{field} = {value}: this run needs about {est.describe(cfg)}, more than any peer holds "
                          f"(refused above {human(REFUSE_BYTES)}): lower {field}")
    return est


def notes(cfg: RunConfig, est: Estimate) -> list[str]:
    """One-line warnings (naming the field that adds the most) for a run bigger than a volunteer's GPU."""
    if est.device_bytes <= WARN_BYTES:  # (the outer state is in host memory: it takes none of the GPU's)
        return []
    field = blame(cfg)
    section, name = field.split(".")
    stages = plan(cfg, WARN_BYTES)
    more = f"pipeline.stages = {stages}" if stages is not None else "more pipeline.stages"
    return [f"{field} = {getattr(getattr(cfg, section), name)}: this run needs about {est.describe(cfg)}, "
            f"{human(est.device_bytes)} of it on a GPU, more than a 24 GB GPU holds: peers with less run out of memory "
            f"(train.checkpoint_activations, a smaller train.batch_size or {more} need less)"]


def needs_on(est: Estimate, device: str, outer_on_disk: bool = False) -> int:
    """What ``device`` (a torch device type: 'cuda', 'cpu', ...) must hold of ``est``: a GPU its device bytes, a
    CPU peer everything, less the outer state when it is in files (``--outer-state-dir``, ``outer_on_disk``)."""
    if device not in ("cpu", ""):
        return est.device_bytes
    return est.bytes - (est.stage_parameters * HOST_BYTES_PER_PARAM if outer_on_disk else 0)


def fits(cfg: RunConfig, device: str, memory_bytes: int, outer_on_disk: bool = False) -> None:
    """A peer's own check, before it builds its stage: ConfigError, in one line, when this run needs more
    than its device holds (``memory_bytes``; 0 when unknown), instead of a traceback from the allocator.
    ``outer_on_disk``: the peer keeps its outer state in files (``--outer-state-dir``), not in its memory."""
    est = estimate(cfg)
    need = needs_on(est, device, outer_on_disk)
    if memory_bytes and need > memory_bytes:
        held = "" if device == "cpu" else f" on the device ({human(est.host_bytes)} of outer state in host memory besides)"
        disk = "" if outer_on_disk or device not in ("cpu", "") else \
            f", or keep the outer state ({human(est.stage_parameters * HOST_BYTES_PER_PARAM)}) on disk: --outer-state-dir DIR"
        raise ConfigError(f"this run needs about {human(need)}{held} ({est.describe(cfg)}), and this "
                          f"peer's {device} holds {human(memory_bytes)}: lend a device with more memory, or run a peer "
                          f"elsewhere{_stages_hint(cfg, memory_bytes, device)}{disk}")


def checkpointing(cfg: RunConfig, device: str, memory_bytes: int) -> bool:
    """Does a peer whose ``device`` holds ``memory_bytes`` (0: unknown) checkpoint activations? As
    ``train.checkpoint_activations`` says; with 'auto', when this run's stage needs more than that without it."""
    choice = cfg.train.checkpoint_activations
    if choice != "auto":
        return bool(choice)
    plain = cfg.model_copy(update={"train": cfg.train.model_copy(update={"checkpoint_activations": False})})
    return bool(memory_bytes) and needs_on(estimate(plain), device) > memory_bytes


def plan(cfg: RunConfig, memory_bytes: int, device: str = "cuda") -> int | None:
    """The fewest ``pipeline.stages`` (from the run's own, cut by its ``pipeline.balance``) at which every stage
    of ``cfg`` fits ``memory_bytes`` on ``device`` (:func:`needs_on`), or None if none up to the model's entries
    (or ``MAX_PLAN_STAGES``) does. ``pipeline.layers``, a cut by hand, is left out of the what-if."""
    entries = len(entry_parameters(cfg.model))
    for stages in range(max(cfg.pipeline.stages, 1), min(entries, MAX_PLAN_STAGES) + 1):
        pipe = cfg.pipeline.model_copy(update={"stages": stages, "layers": None})
        if needs_on(estimate(cfg.model_copy(update={"pipeline": pipe})), device) <= memory_bytes:
            return stages
    return None


def _stages_hint(cfg: RunConfig, memory_bytes: int, device: str) -> str:
    stages = plan(cfg, memory_bytes, device)
    if stages is None or stages == cfg.pipeline.stages:
        return ""
    return f" (at pipeline.stages = {stages} each stage fits it)"


def peer_note(est: Estimate, device: str, memory_gb: float) -> str:
    """The warning for a joined peer whose GPU (``memory_gb`` GiB, which only a GPU peer reports; 0 when unknown)
    is smaller than the run needs on it, or ''."""
    if not memory_gb or memory_gb * GiB >= est.device_bytes:  # (a GPU's: the outer state is in host memory)
        return ""
    return (f"its {device} has {memory_gb:.0f} GiB, and this run needs about {human(est.device_bytes)} on a peer's GPU: it "
            "may run out of memory (train.checkpoint_activations, a smaller train.batch_size or more pipeline.stages "
            "need less)")
