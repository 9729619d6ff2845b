"""The outer step against an independent numpy reference and a stored golden fixture."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from potluck.peer.outer.diloco import CHUNK, flatten_params, load_flat, nesterov_step, outer_snapshot

FIXTURE = Path(__file__).parent / "fixtures" / "outer_step_golden.json"


def numpy_outer(theta, momentum, delta, lr, mu, nesterov):  # type: ignore[no-untyped-def]
    """torch.optim.SGD(nesterov=True, dampening=0) written out in float32 numpy, one op at a time."""
    f32 = np.float32
    m = (momentum * f32(mu)).astype(f32) + delta
    update = (delta + (m * f32(mu)).astype(f32)).astype(f32) if nesterov else m
    return (theta - (update * f32(lr)).astype(f32)).astype(f32), m.astype(f32)


def make_fixture() -> dict:
    rng = np.random.default_rng(1234)
    n, steps = 37, 4
    theta = rng.standard_normal(n).astype(np.float32)
    momentum = np.zeros(n, np.float32)
    deltas = [(rng.standard_normal(n) * 0.1).astype(np.float32) for _ in range(steps)]
    out = {"lr": 0.7, "mu": 0.9, "theta0": theta.tolist(), "deltas": [d.tolist() for d in deltas], "steps": []}
    for nesterov in (True, False):
        t, m = theta.copy(), momentum.copy()
        seq = []
        for d in deltas:
            t, m = numpy_outer(t, m, d, 0.7, 0.9, nesterov)
            seq.append({"theta": t.tolist(), "momentum": m.tolist()})
        out["steps"].append({"nesterov": nesterov, "sequence": seq})
    return out


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(FIXTURE.read_text())


def test_fixture_matches_numpy_reference(golden: dict) -> None:
    assert make_fixture() == golden, "the numpy reference no longer reproduces the stored fixture"


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_steps_equal_golden(golden: dict, nesterov: bool) -> None:
    theta = torch.tensor(golden["theta0"], dtype=torch.float32)
    momentum = torch.zeros_like(theta)
    expected = next(s for s in golden["steps"] if s["nesterov"] == nesterov)["sequence"]
    for delta, want in zip(golden["deltas"], expected, strict=True):
        theta, momentum = nesterov_step(theta, momentum, torch.tensor(delta), golden["lr"], golden["mu"], nesterov)
        # bit-for-bit: separate float32 ops, no fused multiply-add
        assert theta.tolist() == want["theta"]
        assert momentum.tolist() == want["momentum"]


def test_chunked_step_is_the_whole_vector_formula_bit_for_bit() -> None:
    """A step over several cache-sized chunks, its new momentum written into a given buffer, gives the
    bits of the plain whole-vector float32 formula (what the golden fixture checks on a short vector)."""
    gen = torch.Generator().manual_seed(7)
    n = 2 * CHUNK + 12_345
    theta, m, d = (torch.randn(n, generator=gen) for _ in range(3))
    mu, lr = torch.tensor(0.9), torch.tensor(0.7)
    want_m = torch.mul(m, mu) + d
    want_theta = theta - torch.mul(d + torch.mul(want_m, mu), lr)
    out = torch.full((n,), float("nan"))
    got_theta, got_m = nesterov_step(theta, m, d.clone(), 0.7, 0.9, consume=True, momentum_out=out)
    assert got_m is out and torch.equal(got_m, want_m) and torch.equal(got_theta, want_theta)
    got_theta, got_m = nesterov_step(theta, m, d, 0.7, 0.9, nesterov=False)
    assert torch.equal(got_theta, theta - torch.mul(want_m, lr)) and torch.equal(got_m, want_m)


def test_nesterov_matches_torch_sgd() -> None:
    """Our formula is torch.optim.SGD(nesterov=True) applied to the pseudo-gradient."""
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(100, generator=gen)
    p = torch.nn.Parameter(theta.clone())
    opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    ours_t, ours_m = theta.clone(), torch.zeros(100)
    for _ in range(3):
        delta = torch.randn(100, generator=gen) * 0.1
        p.grad = delta.clone()
        opt.step()
        ours_t, ours_m = nesterov_step(ours_t, ours_m, delta, 0.7, 0.9)
        torch.testing.assert_close(ours_t, p.detach(), rtol=0, atol=1e-6)


def test_outer_step_refuses_nan_and_shape_mismatch() -> None:
    t, m = torch.zeros(4), torch.zeros(4)
    with pytest.raises(ValueError, match="NaN"):
        nesterov_step(t, m, torch.tensor([0.0, float("nan"), 0.0, 0.0]), 0.7, 0.9)
    with pytest.raises(ValueError, match="shapes differ"):
        nesterov_step(t, m, torch.zeros(5), 0.7, 0.9)


def test_flatten_and_load_round_trip() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    flat = flatten_params(model.parameters())
    assert flat.numel() == sum(p.numel() for p in model.parameters())
    load_flat(model.parameters(), flat * 2)
    torch.testing.assert_close(flatten_params(model.parameters()), flat * 2)
    with pytest.raises(ValueError):
        load_flat(model.parameters(), torch.zeros(flat.numel() + 1))


def test_snapshot_hash_tracks_content() -> None:
    a = outer_snapshot(torch.ones(8), torch.zeros(8), 1)
    b = outer_snapshot(torch.ones(8), torch.zeros(8), 1)
    c = outer_snapshot(torch.ones(8), torch.full((8,), 1e-30), 1)
    assert a.hash == b.hash != c.hash


if __name__ == "__main__":  # regenerate the fixture (only when the reference itself changes)
    FIXTURE.write_text(json.dumps(make_fixture(), indent=1) + "\n")
    print(f"wrote {FIXTURE}", file=sys.stderr)


def test_all_finite_finds_one_nan_or_inf_anywhere() -> None:
    from potluck.peer.outer.diloco import all_finite

    x = torch.randn(100_003)
    assert all_finite(x)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 50_000, 100_002):
            y = x.clone()
            y[where] = bad
            assert not all_finite(y), (bad, where)
