"""Which implementation of a codec kernel runs for a tensor, and how its codes reach the host.

The torch code in :mod:`potluck.kernels.quant` and :mod:`potluck.compression.int8` is the spec and
the CPU path. A tensor on a CUDA device is instead handed to the Triton kernels
(:mod:`potluck.kernels.triton_int8`, :mod:`potluck.kernels.triton_int4`,
:mod:`potluck.kernels.triton_channels`), which return the same
bits, so a peer's choice of device never shows on the wire. Each ``*`` function below returns the
kernel's result, or ``None`` when the caller should run its torch reference: a CPU tensor, no
``triton``, or a kernel that failed to compile or run (logged once, then not tried again).

``POTLUCK_TRITON`` picks the policy: ``auto`` (default: CUDA tensors), ``off`` (never), or
``force`` (every tensor, CPU ones too, and errors are raised instead of falling back). ``force``
with ``TRITON_INTERPRET=1`` set before the kernels are imported runs them on CPU tensors in
Triton's interpreter: how the tests check the kernels bit for bit on machines without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple, TypeVar

import torch

from potluck.protos.runtime.log import get_logger

log = get_logger(__name__)
ENV = "POTLUCK_TRITON"
T = TypeVar("T")



class Kernels(NamedTuple):
    """The Triton kernel modules, one per codec."""

    int8: ModuleType
    int4: ModuleType
    channels: ModuleType


_modules: Kernels | None = None
_import_tried = False
_disabled: set[str] = set()
_side_streams: dict[int, Any] = {}


def policy() -> str:
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in ("1", "force", "on"):
        return "force"
    if value in ("0", "off", "false", "no"):
        return "off"
    return "auto"


def _kernels() -> Kernels | None:
    """The Triton kernel modules, imported on first use (``None`` without a working ``triton``)."""
    global _modules, _import_tried
    if not _import_tried:
        _import_tried = True
        try:
            from potluck.kernels import triton_channels, triton_int4, triton_int8
            _modules = Kernels(triton_int8, triton_int4, triton_channels)
        except Exception as e:  # ImportError, or a triton that cannot initialise here
            if policy() == "force":
                raise
            log.info("Triton codec kernels unavailable (%s); codecs run in torch", e)
    return _modules


def uses_triton(t: torch.Tensor, name: str = "") -> bool:
    """Would kernel ``name`` run in Triton for tensor ``t``?"""
    p = policy()
    if p == "off" or name in _disabled or (p == "auto" and t.device.type != "cuda"):
        return False
    return _kernels() is not None


def _call(name: str, t: torch.Tensor, fn: Callable[[Kernels], T]) -> T | None:
    if not uses_triton(t, name):
        return None
    kernels = _kernels()
    assert kernels is not None
    try:
        return fn(kernels)
    except Exception as e:
        if policy() == "force":
            raise
        _disabled.add(name)
        log.warning("Triton kernel %s failed (%s: %s); using the torch codec from now on", name, type(e).__name__, e)
        return None


def int8_quantize(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Codes and scales of a flat vector, blocks of ``block_size`` (non-finite blocks: scale ``inf``)."""
    return _call("int8_quantize", x, lambda k: k.int8.quantize_blocks(x, block_size))


def int8_dequantize(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor | None:
    return _call("int8_dequantize", codes, lambda k: k.int8.dequantize_blocks(codes, scales, block_size))


def int8_mean_requantize(
    codes: torch.Tensor, scales: torch.Tensor, block_size: int, factors: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The owner's fused decode, float32 mean and re-quantization (:func:`~potluck.kernels.triton_int8.mean_requantize`)."""
    return _call("int8_mean", codes, lambda k: k.int8.mean_requantize(codes, scales, block_size, factors))


def int4_quantize(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Packed 4-bit codes and scales of a flat vector, blocks of ``block_size`` (non-finite blocks: scale ``inf``)."""
    return _call("int4_quantize", x, lambda k: k.int4.quantize_blocks(x, block_size))


def int4_dequantize(packed: torch.Tensor, scales: torch.Tensor, block_size: int, numel: int) -> torch.Tensor | None:
    return _call("int4_dequantize", packed, lambda k: k.int4.dequantize_blocks(packed, scales, block_size, numel))


def int4_mean_requantize(
    packed: torch.Tensor, scales: torch.Tensor, block_size: int, numel: int, factors: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The owner's fused decode, float32 mean and 4-bit re-quantization (:func:`~potluck.kernels.triton_int4.mean_requantize`)."""
    return _call("int4_mean", packed,
                 lambda k: k.int4.mean_requantize(packed, scales, block_size, numel, factors))


def channels_quantize_pack(
    x: torch.Tensor,
    bits: int,
    *,
    m: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    want_out: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """Packed codes, scales and reconstruction (or updated buffer) of per-channel quantization."""
    return _call("channels", x, lambda k: k.channels.quantize_pack(x, bits, m=m, scales=scales, noise=noise,
                                                                   want_out=want_out))


class HostCopy:
    """A device-to-host copy in flight; :meth:`wait` returns the host tensor once it has landed."""

    def __init__(self, host: torch.Tensor, event: Any = None) -> None:
        self.host = host
        self.event = event

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host


def start_host_copy(t: torch.Tensor) -> HostCopy:
    """Start copying ``t`` to host memory without blocking the compute stream.

    A CUDA tensor is copied into pinned memory on a side stream that first waits for the work
    queued so far on the current stream (which produced ``t``); ``t`` is recorded on the side stream,
    so the allocator does not hand its memory out before the copy ends. A CPU tensor is simply
    returned (made contiguous).
    """
    if t.device.type != "cuda":
        return HostCopy(t.contiguous())
    side = _side_stream(t.device)
    side.wait_stream(torch.cuda.current_stream(t.device))
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)  # torch's caching host allocator reuses it
    with torch.cuda.stream(side):
        host.copy_(t, non_blocking=True)
        t.record_stream(side)
        event = torch.cuda.Event()
        event.record(side)
    return HostCopy(host, event)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory, through :func:`start_host_copy` (a plain, contiguous CPU tensor comes back as is)."""
    return start_host_copy(t).wait()


def _side_stream(device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index)
    return _side_streams[index]
