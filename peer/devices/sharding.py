"""One stage sharded over the processes of a multi-device peer (FSDP2): ``potluck peer --devices shard``.

In the default mode (``replicate``) every process of a torchrun peer holds the whole stage: its
weights, gradients and AdamW state N times over. Sharded, each holds 1/N of them: every layer is
``fully_shard``-ed over the peer's device mesh, so its parameters are DTensors split by rows (dim 0),
a forward pass all-gathers a layer's weights just before it runs and frees them after, and a
backward pass reduce-scatters (averages) the gradients, so each process keeps and updates only its
rows. A layer that shares a parameter with another (tied embeddings) is left whole on every process,
and its gradients are averaged as in the replicated mode.

The swarm still sees one member. The stage's theta, which DiLoCo's outer step needs whole, is
assembled on the leader's host (into the pinned vector the outer step reads, never onto a device):
each process sends its rows over the peer's host (gloo) group, and the leader puts them at their
places in the flat vector (:func:`pieces` says where). A load goes the other way: the leader
broadcasts the vector over the host group and each process copies out its rows. The flat layout is
the unsharded one (parameter after parameter, row-major), so snapshots, checkpoints and the outer
all-reduce do not know a peer was sharded.

Where a shard starts: FSDP2 splits dim 0 as ``torch.chunk`` does (chunks of ``ceil(rows / N)``, the
last ones shorter or empty); :func:`pieces` computes the same from the global shapes, and
:func:`local_vector` checks each local shard against it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from potluck.protos.config.section import ConfigError


def is_sharded(p: torch.Tensor) -> bool:
    """A DTensor parameter (FSDP2 holds its rows on each process), as opposed to a whole one."""
    return hasattr(p, "to_local") and hasattr(p, "device_mesh")


def shard(layers: nn.ModuleList, mesh: object) -> int:
    """``fully_shard`` each layer of ``layers`` over ``mesh`` (in place: the layers' parameters become
    DTensors, so callers list them again); a layer sharing a parameter with another stays whole.
    Returns the number of layers sharded."""
    from torch.distributed.fsdp import fully_shard

    owners: dict[int, int] = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            owners.setdefault(id(p), i)
    shared = {i for i, layer in enumerate(layers) for p in layer.parameters() if owners[id(p)] != i}
    shared |= {owners[id(p)] for i in shared for p in layers[i].parameters()}
    n = 0
    for i, layer in enumerate(layers):
        if i not in shared and any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)  # type: ignore[call-overload]
            n += 1
    return n


def rows_of(dim0: int, rank: int, world: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a dim-0 extent ``dim0`` that ``rank`` of ``world`` holds (torch.chunk's split)."""
    chunk = -(-dim0 // world) if dim0 else 0
    start = min(rank * chunk, dim0)
    return start, min(start + chunk, dim0)


def pieces(params: Iterable[torch.Tensor], rank: int, world: int) -> list[tuple[int, int]]:
    """Where ``rank``'s rows of each sharded parameter sit in the stage's flat vector: ``(offset, count)``
    in parameter order (whole parameters are the leader's alone and not listed)."""
    out: list[tuple[int, int]] = []
    offset = 0
    for p in params:
        if is_sharded(p) and p.shape[0]:  # (FSDP2 shards dim 0 of every parameter it holds)
            row = p.numel() // p.shape[0]
            start, stop = rows_of(p.shape[0], rank, world)
            if stop > start:
                out.append((offset + start * row, (stop - start) * row))
        offset += p.numel()
    return out


def local_vector(params: list[nn.Parameter], rank: int, world: int) -> torch.Tensor:
    """This process's rows of the sharded parameters, concatenated as float32 on the host."""
    parts, want = [], iter(pieces(params, rank, world))
    for p in params:
        if not is_sharded(p):
            continue
        local = p.detach().to_local()  # type: ignore[attr-defined]
        if local.numel():
            _, count = next(want)
            if local.numel() != count:
                raise RuntimeError(f"a shard of {tuple(p.shape)} holds {tuple(local.shape)} here (rank {rank} of "
                                   f"{world}); its rows were expected to be torch.chunk's ({count} values)")
            parts.append(local.reshape(-1).to("cpu", torch.float32))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32)


def gather(params: list[nn.Parameter], rank: int, world: int, out: torch.Tensor | None,
           group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """The stage's flat theta, assembled in ``out`` on the leader (rank 0; every rank calls this, in
    lockstep); None on the other ranks."""
    mine = local_vector(params, rank, world)
    layout = [pieces(params, r, world) for r in range(world)]
    size = max(sum(c for _, c in ranks) for ranks in layout)
    padded = torch.zeros(size, dtype=torch.float32)
    padded[: mine.numel()] = mine
    if rank != 0:
        dist.gather(padded, None, dst=0, group=group)
        return None
    assert out is not None
    bufs = [torch.empty(size, dtype=torch.float32) for _ in range(world)]
    dist.gather(padded, bufs, dst=0, group=group)
    offset = 0
    for p in params:  # whole parameters: the leader's own copy
        if not is_sharded(p):
            out[offset : offset + p.numel()] = p.detach().reshape(-1).to("cpu", torch.float32)
        offset += p.numel()
    for r in range(world):
        at = 0
        for where, count in layout[r]:
            out[where : where + count] = bufs[r][at : at + count]
            at += count
    return out


@torch.no_grad()
def load(params: list[nn.Parameter], theta: torch.Tensor, rank: int, world: int) -> None:
    """Copy this process's rows (and every whole parameter) out of the stage's flat ``theta``."""
    offset = 0
    for p in params:
        n = p.numel()
        if is_sharded(p):
            local = p.to_local()  # type: ignore[attr-defined]
            if local.numel():
                start, _ = rows_of(p.shape[0], rank, world)
                row = n // p.shape[0]
                src = theta[offset + start * row : offset + start * row + local.numel()]
                local.copy_(src.view_as(local))
        else:
            p.copy_(theta[offset : offset + n].view_as(p))
        offset += n


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Scale the gradients so their global L2 norm is at most ``max_norm`` (``clip_grad_norm_`` over the whole
    stage: each rank's rows summed over the group, the whole parameters' once, as they are the same on every
    rank); returns the norm. Torch's own refuses a mix of sharded and whole parameters (tied embeddings)."""
    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() for g in grads if is_sharded(g)]  # type: ignore[attr-defined]
    whole = [g for g in grads if not is_sharded(g)]
    device = (local or whole)[0].device if (local or whole) else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in local:
        sq += g.float().pow(2).sum()
    dist.all_reduce(sq)
    for g in whole:
        sq += g.float().pow(2).sum()
    norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in local + whole:
        g.mul_(coef.to(g.dtype))
    return float(norm)


def held_bytes(params: list[nn.Parameter], optimizer: torch.optim.Optimizer | None) -> tuple[int, int]:
    """``(held, whole)``: the bytes of weights, gradients and optimizer state this process holds for its
    stage, and what it would hold unsharded (a replica's)."""
    held = whole = 0
    for p in params:
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        tensors = [p] + ([p.grad] if p.grad is not None else []) + [
            v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        for t in tensors:
            local = t.to_local() if is_sharded(t) else t  # type: ignore[union-attr]
            held += local.numel() * local.element_size()
            whole += t.numel() * local.element_size()
    return held, whole


def refuse(rc: object) -> None:
    """Raise :class:`ConfigError` for a run a sharded peer cannot train (the reasons in the messages)."""
    train = getattr(rc, "train")  # noqa: B009
    if train.optimizer != "adamw":
        raise ConfigError(f"train.optimizer = {train.optimizer!r} keeps its 8-bit moments in blocks of the whole "
                          "tensor, which a sharded peer does not hold: start it with --devices replicate, or run "
                          "train.optimizer = 'adamw'")
    if train.weights == "bf16":
        raise ConfigError("train.weights = 'bf16' rounds each update into the whole tensor, which a sharded peer does "
                          "not hold: start it with --devices replicate, or run train.weights = 'fp32'")
    if train.precision == "fp16":
        raise ConfigError("train.precision = 'fp16' needs one loss scale over the whole backward pass; a sharded "
                          "peer's is split: use 'bf16' (or --devices replicate)")
