"""The sizes the wire holds to, in one place: what a process accepts in one gRPC message, and how a
pipeline message is cut so that no model's size ever meets that limit.

Every limit here has a test at 4x what it guards, and the one that grows with a run's shapes (a
pipeline message's head: its sample ids and versions) is checked when the run is checked
(:func:`potluck.protos.config.runcheck.check_run`), before anything is published.
"""

from __future__ import annotations

import os

# Test knobs, never needed to run: POTLUCK_MAX_MESSAGE_BYTES and POTLUCK_PIPE_CHUNK_BYTES change the two sizes
# below in one process, so that a test can compare a run whose pipeline messages cross in many pieces with the
# same run sending every message's body whole (tests/test_pipeline_size.py).
MAX_ENV, CHUNK_ENV = "POTLUCK_MAX_MESSAGE_BYTES", "POTLUCK_PIPE_CHUNK_BYTES"


def _env_bytes(name: str, default: int, low: int, high: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of bytes") from None
    if not low <= value <= high:
        raise ValueError(f"{name}={value} is outside [{low}, {high}]")
    return value


# 8 MiB bounds any single gRPC message we accept or send, whatever a misbehaving sender claims. An
# all-reduce chunk carries at most SyncConfig.chunk_bytes (<= 4 MiB) of payload, a piece of a pipeline
# message at most PIPE_CHUNK_BYTES; state transfer streams chunks too.
MAX_MESSAGE_BYTES = _env_bytes(MAX_ENV, 8 << 20, 8 << 20, 1 << 30)

# a pipeline message's body (labels, scales, payloads) travels in pieces of at most this many bytes
PIPE_CHUNK_BYTES = _env_bytes(CHUNK_ENV, 1 << 20, 4 << 10, MAX_MESSAGE_BYTES - (64 << 10))
# a pipeline evaluation sends the held-out samples in batches of at most this many
EVAL_BATCH = 64
# a head's fixed part (header, kind, steps, packet shapes and modes) is a few hundred bytes: this is generous
PIPE_HEAD_FIXED_BYTES = 4096
# a sample id and its version are varints of at most 10 bytes each, plus a byte of tag or length apiece
PIPE_HEAD_BYTES_PER_SAMPLE = 22


def pipe_head_bound(samples: int) -> int:
    """The most bytes the head of a pipeline message of ``samples`` samples can take."""
    return PIPE_HEAD_FIXED_BYTES + PIPE_HEAD_BYTES_PER_SAMPLE * samples


def pipe_max_samples(batch_size: int, micro_batches: int, eval_samples: int) -> int:
    """The most samples one pipeline message of a run carries: a training micro-batch or an eval batch."""
    return max(batch_size // max(micro_batches, 1), min(EVAL_BATCH, eval_samples))
