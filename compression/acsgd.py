"""AC-SGD: send the *change* of each sample's activation, not the activation (Wang et al. 2022).

In multi-epoch fine-tuning every sample crosses a stage boundary once per epoch, and its activation
changes little between visits. Both sides of the boundary keep a buffer ``m[sample_id]`` (shape
``[seq, d]``). For a micro-batch of activations ``a`` with sample ids ``ids``:

* first visit of a sample: send ``a`` itself (float16, or directly quantized) and set ``m[id]`` to
  what the receiver will reconstruct;
* later visits: send ``Q(a - m[id])`` and set ``m[id] += deQ(Q(a - m[id]))``; the receiver hands
  ``m[id]`` (after the update) to the next stage as the activation.

The quantization error is that of the *delta*, whose per-channel scale shrinks as training
converges, so 2-4 bits reach the quality of uncompressed activations (O(1/sqrt(T)) convergence).

**Invariant: both buffers are bit-identical, forever.** The sender updates its buffer with exactly
the floats the receiver decodes (:meth:`ActCodec.encode_with_reconstruction`), both add in float32
on CPU, and both store in the same dtype. Each buffer entry also carries a *version* (the number of
updates it has had), and every message says per sample which version it expects (0 = first visit).
A receiver that has no entry for a sample (after a handover) or a different version (a lost message)
raises :class:`~potluck.compression.actbuffer.BufferMissError` naming those samples, and changes nothing: the whole message is
checked before any entry is touched. The fix is always the same: the sender, whose own buffer has
already moved on for every sample of that micro-batch, calls :meth:`AcsgdSender.forget` on all of
its ids and encodes it again; they go as first visits and overwrite whatever the receiver had.

Buffers live in RAM until they would exceed ``memmap_threshold_bytes``, then move to a numpy memmap
on disk. A shard of a buffer travels as a plain dict with a SHA-256 (:meth:`~potluck.compression.actbuffer.ActivationBuffer.
export_state`), so a replacement peer can take over a stage without first visits.

Backward gradients are not buffered: they are quantized directly with ``grad_bits``
(:func:`make_grad_codec`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from potluck.compression.actbuffer import ActivationBuffer, BufferMissError, Footprint
from potluck.compression.actcodec import ActCodec, CodecError, Packet
from potluck.kernels.device import uses_triton


class AcsgdConfig(BaseModel):
    """Activation compression at one stage boundary; sender and receiver must use the same values."""

    model_config = ConfigDict(extra="forbid")

    bits: Literal[2, 3, 4, 8] = Field(default=4, description="bits per element of the forward delta")
    rounding: Literal["deterministic", "stochastic"] = Field(
        default="deterministic", description="round to nearest, or unbiased stochastic rounding (seeded by `seed`)"
    )
    first_visit: Literal["fp16", "quant"] = Field(
        default="fp16", description="how a sample's first activation travels: float16, or quantized at `bits`"
    )
    grad_bits: Literal[4, 8] = Field(default=8, description="bits per element of backward gradients (no buffer)")
    scale_dtype: Literal["float32", "float16"] = Field(default="float32", description="dtype of per-channel scales")
    buffer_dtype: Literal["float32", "float16"] = Field(
        default="float32", description="dtype of the stored m[id]; float16 halves the footprint"
    )
    memmap_threshold_bytes: int = Field(
        default=1 << 30, ge=0, description="a buffer larger than this moves to a memmap on disk (0: always on disk)"
    )
    memmap_dir: str | None = Field(default=None, description="directory of memmap files (None: the system temp dir)")
    seed: int = Field(default=0, description="seed of the stochastic-rounding generator")

    @property
    def quant_mode(self) -> str:
        return "quant_fp16_scales" if self.scale_dtype == "float16" else "quant"


@dataclass(frozen=True)
class AcsgdMessage:
    """One micro-batch across a boundary (the sample ids travel beside it, in the same order).

    ``versions[k]`` is the version of sample k's buffer entry the message builds on: 0 for a first
    visit (its value is in ``first``), ``v >= 1`` for a delta (in ``delta``). ``first`` holds the
    first-visit samples and ``delta`` the others, each in micro-batch order; either may be None.
    """

    versions: tuple[int, ...]
    first: Packet | None
    delta: Packet | None

    @property
    def first_visit(self) -> list[bool]:
        return [v == 0 for v in self.versions]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in (self.first, self.delta) if p is not None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "versions": list(self.versions),
            "first": None if self.first is None else self.first.to_dict(),
            "delta": None if self.delta is None else self.delta.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AcsgdMessage:
        if not isinstance(d, Mapping) or "versions" not in d:
            raise CodecError("an AC-SGD message needs a 'versions' list")
        versions = d["versions"]
        if isinstance(versions, str | bytes) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in versions
        ):
            raise CodecError(f"'versions' must be a list of non-negative ints, got {versions!r}")
        first, delta = d.get("first"), d.get("delta")
        return cls(
            tuple(versions),
            None if first is None else Packet.from_dict(first),
            None if delta is None else Packet.from_dict(delta),
        )


def _id_list(sample_ids: torch.Tensor | Sequence[int], batch: int | None = None) -> list[int]:
    t = torch.as_tensor(sample_ids)
    if t.dim() != 1 or t.is_floating_point() or t.dtype == torch.bool:
        raise CodecError(f"sample ids must be a 1-D integer tensor, got {t.dtype} of shape {list(t.shape)}")
    ids = t.tolist()
    if not ids:
        raise CodecError("empty micro-batch")
    if batch is not None and len(ids) != batch:
        raise CodecError(f"{len(ids)} sample ids for a micro-batch of {batch}")
    if len(set(ids)) != len(ids):
        raise CodecError("a sample id appears twice in one micro-batch")
    if min(ids) < 0:
        raise CodecError(f"sample ids must be non-negative, got {min(ids)}")
    return ids


class _BoundarySide:
    """What sender and receiver share: the config, the buffer and the two forward codecs."""

    def __init__(self, config: AcsgdConfig | None = None, buffer: ActivationBuffer | None = None) -> None:
        self.config = c = config or AcsgdConfig()
        self.buffer = buffer or ActivationBuffer(
            dtype=c.buffer_dtype, memmap_threshold_bytes=c.memmap_threshold_bytes, memmap_dir=c.memmap_dir
        )
        if self.buffer.dtype != c.buffer_dtype:
            raise ValueError(f"buffer stores {self.buffer.dtype}, config says {c.buffer_dtype}")
        gen = torch.Generator().manual_seed(c.seed)
        first_mode = "fp16" if c.first_visit == "fp16" else c.quant_mode
        self.first_codec = ActCodec(first_mode, c.bits, rounding=c.rounding, generator=gen)
        self.delta_codec = ActCodec(c.quant_mode, c.bits, rounding=c.rounding, generator=gen)

    def footprint(self) -> Footprint:
        return self.buffer.footprint()

    def export_state(self, ids: Sequence[int] | None = None) -> dict[str, Any]:
        """This side's buffer (or a shard of it) for a handover; see :meth:`~potluck.compression.actbuffer.ActivationBuffer.export_state`."""
        return self.buffer.export_state(ids)

    def import_state(self, state: Mapping[str, Any]) -> None:
        self.buffer.import_state(state)


class AcsgdSender(_BoundarySide):
    """The sending side of a boundary: activations in, :class:`AcsgdMessage` out."""

    def encode(self, sample_ids: torch.Tensor | Sequence[int], acts: torch.Tensor) -> AcsgdMessage:
        """Encode ``acts [B, seq, d]`` for samples ``sample_ids [B]`` and update the buffer."""
        if acts.dim() < 2:
            raise CodecError(f"activations must be [B, ...], got shape {list(acts.shape)}")
        ids = _id_list(sample_ids, acts.shape[0])
        # activations the codec kernels can take stay on their device (only packets and buffers come to the host)
        acts = acts.detach().to(acts.device if uses_triton(acts, "channels") else "cpu", torch.float32)
        shape = self.buffer.sample_shape
        if shape is not None and tuple(acts.shape[1:]) != shape:
            raise CodecError(f"activations of shape {list(acts.shape[1:])}, the buffer holds {list(shape)}")
        versions = [self.buffer.version(i) for i in ids]
        first = [k for k, v in enumerate(versions) if v == 0]
        again = [k for k, v in enumerate(versions) if v > 0]
        first_packet = delta_packet = None
        updates: list[tuple[list[int], torch.Tensor, list[int]]] = []
        if first:
            first_packet, value = self.first_codec.encode_with_reconstruction(acts[first])
            updates.append(([ids[k] for k in first], value, [1] * len(first)))
        if again:
            again_ids = [ids[k] for k in again]
            delta_packet, m = self.delta_codec.encode_delta(acts[again], self.buffer.get(again_ids))
            updates.append((again_ids, m, [versions[k] + 1 for k in again]))
        for u_ids, values, u_versions in updates:  # only now that every packet is built
            self.buffer.put(u_ids, values, u_versions)
        return AcsgdMessage(tuple(versions), first_packet, delta_packet)

    def forget(self, ids: Sequence[int] | torch.Tensor | None = None) -> None:
        """Drop entries so these samples (all, when None) go as first visits next time."""
        self.buffer.forget(None if ids is None else torch.as_tensor(ids).reshape(-1).tolist())

    def reset(self) -> None:
        self.forget(None)


class AcsgdReceiver(_BoundarySide):
    """The receiving side: :class:`AcsgdMessage` in, the activations the next stage computes on out."""

    def decode(self, sample_ids: torch.Tensor | Sequence[int], message: AcsgdMessage) -> torch.Tensor:
        """Reconstruct ``[B, seq, d]`` float32 activations and update the buffer (only if all is valid)."""
        ids = _id_list(sample_ids, len(message.versions))
        versions = list(message.versions)
        first = [k for k, v in enumerate(versions) if v == 0]
        again = [k for k, v in enumerate(versions) if v > 0]
        stale = [ids[k] for k in again if self.buffer.version(ids[k]) != versions[k]]
        if stale:
            i = stale[0]
            k = ids.index(i)
            if i not in self.buffer:
                raise BufferMissError(f"no buffer for sample id {i} (handover?)", stale)
            raise BufferMissError(
                f"buffer of sample id {i} is at version {self.buffer.version(i)}, the message builds on "
                f"version {versions[k]} (lost message?)",
                stale,
            )
        self._part(message.first, len(first), "first-visit")
        self._part(message.delta, len(again), "delta")
        shapes = [tuple(p.shape[1:]) for p in (message.first, message.delta) if p is not None]
        sample_shape = shapes[0]
        if any(s != sample_shape for s in shapes) or (
            self.buffer.sample_shape is not None and sample_shape != self.buffer.sample_shape
        ):
            raise CodecError(
                f"message samples of shape {[list(s) for s in shapes]} do not match the buffer's "
                f"{list(self.buffer.sample_shape or sample_shape)}"
            )
        first_values = self.first_codec.decode_float(message.first) if message.first is not None else None
        again_ids = [ids[k] for k in again]
        updated = None
        if message.delta is not None:  # m[id] + deQ(delta), a block of rows at a time, into a copy of the entries
            updated = self.delta_codec.add_decoded(message.delta, self.buffer.get(again_ids))
        if first_values is not None:
            self.buffer.put([ids[k] for k in first], first_values, [1] * len(first))
        if updated is not None:
            self.buffer.put(again_ids, updated, [versions[k] + 1 for k in again])
        # a micro-batch of only first visits, or only revisits, is handed on as decoded: no second copy of it
        if updated is None and first_values is not None:
            return self.buffer.storage_round(first_values)
        if first_values is None and updated is not None:
            return self.buffer.storage_round(updated)
        assert first_values is not None and updated is not None
        out = torch.empty((len(ids), *sample_shape))
        out[first] = self.buffer.storage_round(first_values)
        out[again] = self.buffer.storage_round(updated)
        return out

    @staticmethod
    def _part(packet: Packet | None, count: int, what: str) -> None:
        if count == 0:
            if packet is not None:
                raise CodecError(f"message carries a {what} packet but no sample is a {what}")
            return
        if packet is None:
            raise CodecError(f"{count} samples are {what}s but the message has no {what} packet")
        if len(packet.shape) < 2 or packet.shape[0] != count:
            raise CodecError(f"{what} packet of shape {list(packet.shape)} for {count} samples")


def make_grad_codec(config: AcsgdConfig | None = None, generator: torch.Generator | None = None) -> ActCodec:
    """The backward codec: gradients quantized directly at ``grad_bits`` with per-channel scales."""
    c = config or AcsgdConfig()
    return ActCodec(c.quant_mode, c.grad_bits, rounding=c.rounding, generator=generator)
