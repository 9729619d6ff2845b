"""The activation codec Q and AC-SGD buffers: golden numbers, error bounds, bitwise-equal buffers, bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from potluck.compression.acsgd import (
    AcsgdConfig,
    AcsgdMessage,
    AcsgdReceiver,
    AcsgdSender,
    BufferMissError,
    make_grad_codec,
)
from potluck.compression.actcodec import ActCodec, CodecError, Packet, decode, encode
from potluck.kernels.quant import pack_bits, unpack_bits


def numpy_q(x: np.ndarray, bits: int) -> tuple[bytes, np.ndarray, np.ndarray]:
    """Independent reference: per-channel absmax / qmax, round half to even, LSB-first bit stream."""
    qmax = (1 << (bits - 1)) - 1
    x2 = x.reshape(-1, x.shape[-1]).astype(np.float32)
    scales = (np.abs(x2).max(axis=0) / np.float32(qmax)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1))
    codes = np.clip(np.round(x2 / safe), -qmax, qmax).astype(np.int8)
    if bits == 8:
        payload = codes.tobytes()
    else:
        unsigned = (codes.astype(np.int16) + qmax).astype(np.uint8).reshape(-1)
        planes = ((unsigned[:, None] >> np.arange(bits, dtype=np.uint8)) & 1).astype(np.uint8)
        payload = np.packbits(planes.reshape(-1), bitorder="little").tobytes()
    decoded = (codes.astype(np.float32) * scales).reshape(x.shape)
    return payload, scales, decoded


def test_golden_two_bit_packet() -> None:
    # channel 0: scale 1, codes [1, 0, 0] (0.5 rounds to even); channel 1: scale 2, codes [-1, 0, 0]
    x = torch.tensor([[1.0, -2.0], [0.5, 0.0], [-0.25, 1.0]])
    p = encode(x, "quant", 2)
    assert p.payload == bytes([82, 5])  # unsigned 2,0,1,1 | 1,1 packed LSB first
    assert np.frombuffer(p.scales, np.float32).tolist() == [1.0, 2.0]
    assert decode(p).tolist() == [[1.0, -2.0], [0.0, 0.0], [0.0, 0.0]]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(3, 5, 7), (1, 1), (13, 4)])
def test_quant_equals_numpy_reference(bits: int, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(bits * 100 + len(shape))
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 30, size=shape[-1])).astype(np.float32)
    if shape[-1] > 1:
        x[..., 1] = 0.0  # an all-zero channel decodes to zeros
    p = encode(torch.from_numpy(x), "quant", bits)
    payload, scales, decoded = numpy_q(x, bits)
    assert p.payload == payload
    assert np.frombuffer(p.scales, np.float32).tolist() == scales.tolist()
    assert decode(p).numpy().tolist() == decoded.tolist()
    packet, recon = ActCodec("quant", bits).encode_with_reconstruction(torch.from_numpy(x))
    assert packet == p and torch.equal(recon, decode(p))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_unpack_round_trip_every_length(bits: int) -> None:
    qmax = (1 << (bits - 1)) - 1
    gen = torch.Generator().manual_seed(bits)
    for n in range(0, 26):
        codes = torch.randint(-qmax, qmax + 1, (n,), generator=gen).to(torch.int8)
        packed = pack_bits(codes, bits)
        assert packed.numel() == (n * bits + 7) // 8
        assert torch.equal(unpack_bits(packed, bits, n), codes)


@pytest.mark.parametrize("mode", ["quant", "quant_fp16_scales"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_error_bound_half_a_scale(mode: str, bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(6, 32, 24, generator=gen) * torch.logspace(-3, 2, 24)
    p = encode(x, mode, bits)
    scales = torch.from_numpy(np.frombuffer(p.scales, np.float16 if mode != "quant" else np.float32).astype(np.float32))
    exact = x.abs().amax(dim=(0, 1)) / ((1 << (bits - 1)) - 1)
    assert bool((scales >= exact).all())  # fp16 scales are rounded up, never down
    err = (decode(p) - x).abs().amax(dim=(0, 1))
    assert bool((err <= scales / 2 * (1 + 1e-6)).all())
    stoch = encode(x, mode, bits, stochastic=True, generator=gen)
    assert bool(((decode(stoch) - x).abs().amax(dim=(0, 1)) <= scales * (1 + 1e-6)).all())


def test_stochastic_rounding_is_unbiased() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=gen)
    codec = ActCodec("quant", 2, rounding="stochastic", generator=gen)
    draws = 400
    mean = sum(codec.decode(codec.encode(x)) for _ in range(draws)) / draws
    scale = x.abs().amax(dim=0)  # qmax = 1 at 2 bits
    # each draw is off by at most one scale, so the mean's std is <= scale / (2 sqrt(draws))
    assert bool(((mean - x).abs() <= 6 * scale / (2 * draws**0.5)).all())
    deterministic_bias = (decode(encode(x, "quant", 2)) - x).abs().mean()
    assert (mean - x).abs().mean() < deterministic_bias / 5


def test_raw_modes_and_dtypes() -> None:
    x = torch.randn(4, 6)
    assert torch.equal(decode(encode(x, "fp32", 0)), x)
    half = decode(encode(x, "fp16", 0))
    assert half.dtype == torch.float32 and torch.equal(half, x.half().float())
    bf = x.to(torch.bfloat16)
    out = decode(encode(bf, "quant", 8))
    assert out.dtype == torch.bfloat16 and out.shape == bf.shape
    assert torch.equal(decode(encode(bf, "fp32", 0)), bf)
    with pytest.raises(CodecError, match="float16 range"):
        encode(torch.full((2, 2), 1e6), "fp16", 0)


@pytest.mark.parametrize("shape", [(0, 4), (2, 0), (0,)])
def test_empty_tensors_round_trip(shape: tuple[int, ...]) -> None:
    for mode, bits in (("quant", 3), ("quant_fp16_scales", 2), ("fp16", 0), ("fp32", 0)):
        assert decode(encode(torch.zeros(shape), mode, bits)).shape == shape


def test_packet_dict_round_trip_is_tolerant() -> None:
    p = encode(torch.randn(3, 4), "quant", 3)
    d = p.to_dict()
    assert set(d) == {"mode", "bits", "shape", "dtype", "scales", "payload"}
    assert Packet.from_dict({**d, "future_field": 1}) == p
    with pytest.raises(CodecError, match="lacks field 'payload'"):
        Packet.from_dict({k: v for k, v in d.items() if k != "payload"})
    with pytest.raises(CodecError, match="shape"):
        Packet.from_dict({**d, "shape": "3x4"})


def _bad_packets(p: Packet) -> dict[str, Packet]:
    nan_scales = np.frombuffer(p.scales, np.float32).copy()
    nan_scales[0] = np.nan
    neg_scales = np.frombuffer(p.scales, np.float32).copy()
    neg_scales[0] = -1.0
    return {
        "unsupported bit width": dataclasses.replace(p, bits=5),
        "needs 9 bytes": dataclasses.replace(p, payload=p.payload[:-1]),
        "channels need": dataclasses.replace(p, scales=p.scales[:-4]),
        "finite and non-negative": dataclasses.replace(p, scales=nan_scales.tobytes()),
        "non-negative": dataclasses.replace(p, scales=neg_scales.tobytes()),
        "unsupported dtype": dataclasses.replace(p, dtype="int32"),
        "unknown mode": dataclasses.replace(p, mode="zstd"),
    }


def test_bad_packets_and_inputs_rejected() -> None:
    p = encode(torch.randn(3, 6), "quant", 4)  # 18 codes -> 9 bytes
    for reason, bad in _bad_packets(p).items():
        with pytest.raises(CodecError, match=reason):
            decode(bad)
    with pytest.raises(CodecError, match="expected mode 'quant' at 4 bits"):
        ActCodec("quant", 4).decode(encode(torch.randn(3, 6), "quant", 8))
    for x in (torch.tensor([[1.0, float("nan")]]), torch.tensor([[float("inf"), 0.0]])):
        with pytest.raises(CodecError, match="NaN or Inf"):
            encode(x)
    with pytest.raises(CodecError, match="unsupported dtype"):
        encode(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(CodecError, match="unsupported bit width"):
        encode(torch.ones(2, 2), "quant", 5)


def test_grad_codec_is_direct_quantization() -> None:
    codec = make_grad_codec(AcsgdConfig(grad_bits=4))
    g = torch.randn(2, 5, 8) * 1e-3
    p = codec.encode(g)
    assert p.bits == 4 and p.shape == (2, 5, 8)
    assert bool(((codec.decode(p) - g).abs() <= g.abs().amax(dim=(0, 1)) / 14 * (1 + 1e-6)).all())


# -- AC-SGD ------------------------------------------------------------------------------------

SEQ, D = 8, 16


def drifting(num_samples: int, seed: int = 0) -> tuple[torch.Tensor, torch.Generator]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_samples, SEQ, D, generator=gen) * torch.logspace(-1, 1, D), gen


def wire(msg: AcsgdMessage) -> AcsgdMessage:
    """What crosses the network: the plain dict, copied."""
    return AcsgdMessage.from_dict(msg.to_dict())


def run_steps(sender: AcsgdSender, receivers: list[AcsgdReceiver], acts: torch.Tensor, gen: torch.Generator,
              steps: int, batch: int = 4) -> None:
    for _ in range(steps):
        ids = torch.randperm(acts.shape[0], generator=gen)[:batch]
        acts[ids] += 0.05 * torch.randn(batch, SEQ, D, generator=gen)  # training moves them a little
        msg = wire(sender.encode(ids, acts[ids]))
        for receiver in receivers:
            out = receiver.decode(ids, msg)
            assert torch.equal(out, sender.buffer.get(ids.tolist()))


CONFIGS = {
    "det4-fp16-ram": AcsgdConfig(bits=4),
    "stoch2-quant-disk": AcsgdConfig(bits=2, rounding="stochastic", first_visit="quant", memmap_threshold_bytes=0,
                                     scale_dtype="float16"),
    "det3-f16buf-switch": AcsgdConfig(bits=3, buffer_dtype="float16", memmap_threshold_bytes=24 * SEQ * D * 2),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_buffers_stay_bitwise_equal(name: str, tmp_path) -> None:
    cfg = CONFIGS[name].model_copy(update={"memmap_dir": str(tmp_path)})
    sender, receiver = AcsgdSender(cfg), AcsgdReceiver(cfg)
    acts, gen = drifting(40)
    run_steps(sender, [receiver], acts, gen, steps=200)
    assert sender.buffer.digest() == receiver.buffer.digest()
    assert len(receiver.buffer) == 40 and min(receiver.buffer.version(i) for i in range(40)) > 1
    fp = receiver.footprint()
    if cfg.memmap_threshold_bytes < 40 * SEQ * D * 4:
        assert receiver.buffer.on_disk and fp.disk_bytes >= 40 * SEQ * D * 2 and fp.memory_bytes == 0
    else:
        assert fp.disk_bytes == 0 and fp.memory_bytes >= 40 * SEQ * D * 4
    assert list(tmp_path.iterdir()) == []  # memmap files are unlinked at creation


def test_delta_for_unknown_sample_rejected_without_change() -> None:
    sender, receiver = AcsgdSender(), AcsgdReceiver()
    acts, gen = drifting(8)
    run_steps(sender, [receiver], acts, gen, steps=10)
    newcomer = AcsgdReceiver()
    newcomer.decode([100], sender.encode([100], acts[:1]))  # a first visit is fine anywhere
    before = newcomer.buffer.digest()
    ids = [100, 3, 101]  # 3 is a delta the newcomer has no buffer for
    msg = sender.encode(ids, acts[:3])
    with pytest.raises(BufferMissError, match="no buffer for sample id 3 \\(handover\\?\\)") as e:
        newcomer.decode(ids, msg)
    assert e.value.sample_ids == [3]
    assert newcomer.buffer.digest() == before and 101 not in newcomer.buffer
    sender.forget(ids)  # fall back to first visits for the whole micro-batch
    out = newcomer.decode(ids, sender.encode(ids, acts[:3]))
    assert torch.equal(out, sender.buffer.get(ids)) and sender.buffer.digest(ids) == newcomer.buffer.digest(ids)


def test_lost_message_detected_by_version() -> None:
    sender, receiver = AcsgdSender(), AcsgdReceiver()
    acts, _ = drifting(4)
    receiver.decode([0, 1], sender.encode([0, 1], acts[:2]))
    sender.encode([0], acts[:1] + 0.1)  # lost in transit
    before = receiver.buffer.digest()
    with pytest.raises(BufferMissError, match="version 1, the message builds on version 2"):
        receiver.decode([1, 0], sender.encode([1, 0], acts[[1, 0]] + 0.2))
    assert receiver.buffer.digest() == before
    sender.reset()
    receiver.decode([1, 0], sender.encode([1, 0], acts[[1, 0]] + 0.2))
    assert sender.buffer.digest() == receiver.buffer.digest()


def test_bad_messages_rejected_without_change() -> None:
    cfg = AcsgdConfig(bits=4)
    sender, receiver = AcsgdSender(cfg), AcsgdReceiver(cfg)
    acts, gen = drifting(6)
    ids = list(range(6))
    receiver.decode(ids, sender.encode(ids, acts))
    good = sender.encode(ids[:3], acts[:3] + 0.01)  # deltas; sender is now one version ahead on 0..2
    before = receiver.buffer.digest()
    delta = good.delta
    assert delta is not None
    wider = encode(torch.randn(3, SEQ, D + 1), "quant", 4)
    bad = {
        "expected mode 'quant' at 4 bits": encode(torch.randn(3, SEQ, D), "quant", 8),
        "unsupported bit width": dataclasses.replace(delta, bits=6),
        "needs": dataclasses.replace(delta, payload=delta.payload[:-1]),
        "do not match the buffer": wider,
        "delta packet of shape": encode(torch.randn(2, SEQ, D), "quant", 4),
        "finite": dataclasses.replace(delta, scales=np.full(D, np.nan, np.float32).tobytes()),
    }
    for reason, packet in bad.items():
        with pytest.raises(CodecError, match=reason):
            receiver.decode(ids[:3], dataclasses.replace(good, delta=packet))
        assert receiver.buffer.digest() == before
    with pytest.raises(CodecError, match="no delta packet"):
        receiver.decode(ids[:3], dataclasses.replace(good, delta=None))
    with pytest.raises(CodecError, match="3 sample ids for a micro-batch of 2"):
        receiver.decode(ids[:3], dataclasses.replace(good, versions=good.versions[:2]))
    assert receiver.buffer.digest() == before
    receiver.decode(ids[:3], good)  # the genuine message still applies
    assert receiver.buffer.digest() == sender.buffer.digest()
    state = sender.buffer.digest()
    nan_acts = acts[:2].clone()
    nan_acts[1, 0, 0] = float("nan")
    with pytest.raises(CodecError, match="NaN"):
        sender.encode([0, 1], nan_acts)
    with pytest.raises(CodecError, match="shape"):
        sender.encode([0, 1], torch.randn(2, SEQ, D + 1))
    with pytest.raises(CodecError, match="twice"):
        sender.encode([0, 0], acts[:2])
    assert sender.buffer.digest() == state and sender.buffer.version(0) == 2


def test_handover_export_import_then_continue() -> None:
    cfg = AcsgdConfig(bits=2, rounding="stochastic")
    sender, old = AcsgdSender(cfg), AcsgdReceiver(cfg)
    acts, gen = drifting(16)
    run_steps(sender, [old], acts, gen, steps=40)
    new = AcsgdReceiver(cfg.model_copy(update={"memmap_threshold_bytes": 0}))
    new.import_state(old.export_state())
    shard = AcsgdReceiver(cfg)
    shard.import_state(sender.export_state([0, 2, 4, 6, 99]))  # a shard from the sender; 99 it never saw
    assert shard.buffer.ids() == [0, 2, 4, 6]
    assert shard.buffer.digest() == old.buffer.digest([0, 2, 4, 6])
    run_steps(sender, [old, new], acts, gen, steps=40)
    assert new.buffer.digest() == old.buffer.digest() == sender.buffer.digest()


def test_import_rejects_hash_mismatch_and_bad_shards() -> None:
    sender, receiver = AcsgdSender(), AcsgdReceiver()
    acts, gen = drifting(4)
    run_steps(sender, [receiver], acts, gen, steps=5, batch=2)
    state = sender.export_state()
    flipped = bytearray(state["data"])
    flipped[7] ^= 1
    target = AcsgdReceiver()
    target.decode([9], AcsgdSender().encode([9], acts[:1]))
    before = target.buffer.digest()
    cases = [
        ("hash mismatch", {**state, "data": bytes(flipped)}),
        ("hash mismatch", {**state, "versions": [v + 1 for v in state["versions"]]}),
        ("float16 entries", {**state, "dtype": "float16"}),
        ("malformed", {k: v for k, v in state.items() if k != "ids"}),
        ("shape", _one_sample(D + 1)),
    ]
    for reason, bad in cases:
        with pytest.raises(CodecError, match=reason):
            target.import_state(bad)
        assert target.buffer.digest() == before


def _one_sample(d: int) -> dict:
    s = AcsgdSender()
    s.encode([0], torch.randn(1, SEQ, d))
    return s.export_state()


def test_acsgd_error_much_smaller_than_direct_on_slow_drift() -> None:
    gen = torch.Generator().manual_seed(1)
    n, epochs = 16, 8
    acts = torch.randn(n, SEQ, D, generator=gen) * torch.logspace(-1, 1, D)
    sender, receiver = AcsgdSender(AcsgdConfig(bits=4)), AcsgdReceiver(AcsgdConfig(bits=4))
    direct = ActCodec("quant", 4)
    err_ac = err_direct = 0.0
    for epoch in range(epochs):
        acts += 0.01 * acts.abs().mean() * torch.randn(n, SEQ, D, generator=gen)
        for start in range(0, n, 4):
            ids = list(range(start, start + 4))
            a = acts[start : start + 4]
            rec = receiver.decode(ids, wire(sender.encode(ids, a)))
            if epoch == epochs - 1:
                err_ac += float((rec - a).norm() / a.norm())
                err_direct += float((direct.decode(direct.encode(a)) - a).norm() / a.norm())
    assert err_ac < err_direct / 10


@pytest.mark.parametrize("threshold", [1 << 30, 0, 100 * 6 * 4])
def test_a_buffer_growing_over_many_pages_holds_what_a_dict_holds(threshold: int, tmp_path) -> None:
    """Samples arrive, are overwritten and forgotten over several doublings (pages of 16, 16, 32, 64... slots), in
    RAM, on disk from the start, or moving to disk on the way (``threshold``): every entry reads back as a plain
    dict of the same puts holds it, a handed-over shard too, and growing never copies a page held before."""
    from potluck.compression.actbuffer import ActivationBuffer

    buf = ActivationBuffer(memmap_threshold_bytes=threshold, memmap_dir=str(tmp_path))
    ref: dict[int, np.ndarray] = {}
    gen = np.random.default_rng(0)
    first_page = None
    for step in range(40):
        ids = [int(i) for i in gen.choice(400, size=12, replace=False)]
        values = torch.from_numpy(gen.standard_normal((12, 2, 3)).astype(np.float32))
        buf.put(ids, values, [step + 1] * 12)
        ref.update({i: values[k].numpy().copy() for k, i in enumerate(ids)})
        if step % 7 == 6:
            gone = sorted(ref)[::5]
            buf.forget(gone)
            for i in gone:
                del ref[i]
        if first_page is None:
            first_page = buf._pages[0]  # (the test looks at the storage itself)
        if not buf.on_disk:
            assert buf._pages[0] is first_page
    assert len(buf._pages) >= 4 and buf.on_disk == (threshold < 1 << 30)
    ids = sorted(ref)
    assert torch.equal(buf.get(ids), torch.from_numpy(np.stack([ref[i] for i in ids])))
    other = ActivationBuffer()
    other.import_state(buf.export_state(ids[::3]))
    assert torch.equal(other.get(ids[::3]), buf.get(ids[::3])) and other.digest() == buf.digest(ids[::3])
    assert list(tmp_path.iterdir()) == []  # memmap files are unlinked at creation
