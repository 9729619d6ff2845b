"""Robust aggregation against an independent numpy reference, and the attacks it bounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from potluck.compression.aggregate import reduce_mean, robust_mean


def numpy_reference(xs: dict[str, np.ndarray], clip_factor: float, reject_below: float | None) -> tuple[np.ndarray, set, set]:
    """The rule written out again in numpy: reject opposed (n >= 3, never a majority), clip to
    clip_factor x the lower median norm, average in sender order."""
    senders = sorted(xs)
    rejected = set()
    if reject_below is not None and len(senders) >= 3:
        for s in senders:
            center = np.median(np.stack([xs[o] for o in senders if o != s]), axis=0)
            if len([o for o in senders if o != s]) % 2 == 0:  # torch.median takes the lower middle value
                center = np.sort(np.stack([xs[o] for o in senders if o != s]), axis=0)[(len(senders) - 2) // 2]
            na, nb = np.linalg.norm(xs[s]), np.linalg.norm(center)
            if na and nb and float(xs[s] @ center) / (na * nb) < reject_below:
                rejected.add(s)
        if 2 * len(rejected) >= len(senders):
            rejected = set()
    kept = [s for s in senders if s not in rejected]
    norms = [np.linalg.norm(xs[s]) for s in kept]
    bound = clip_factor * sorted(norms)[(len(kept) - 1) // 2]
    clipped = {s for s, n in zip(kept, norms, strict=True) if n > bound}
    total = np.zeros_like(xs[senders[0]])
    for s, n in zip(kept, norms, strict=True):
        total += xs[s] * (bound / n if n > bound else 1.0)
    return total / len(kept), clipped, rejected


def honest(n: int, numel: int = 512, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    common = rng.standard_normal(numel).astype(np.float32)
    return {f"peer{i}": ((common + 0.5 * rng.standard_normal(numel)) * 0.01).astype(np.float32) for i in range(n)}


def run(xs: dict[str, np.ndarray], **kw: object):  # type: ignore[no-untyped-def]
    return robust_mean({k: torch.from_numpy(v) for k, v in xs.items()}, len(next(iter(xs.values()))), **kw)


@pytest.mark.parametrize("attack", ["none", "x1000", "sign-flip", "zeros"])
def test_matches_the_numpy_reference(attack: str) -> None:
    xs = honest(4)
    if attack == "x1000":
        xs["peer2"] = xs["peer2"] * 1000
    elif attack == "sign-flip":
        xs["peer2"] = -xs["peer2"]
    elif attack == "zeros":
        xs["peer2"] = np.zeros_like(xs["peer2"])
    got = run(xs, clip_factor=4.0, reject_below=-0.1)
    want, clipped, rejected = numpy_reference(xs, 4.0, -0.1)
    np.testing.assert_allclose(got.mean.numpy(), want, rtol=1e-5, atol=1e-8)
    assert set(got.clipped) == clipped and set(got.rejected) == rejected


@pytest.mark.parametrize("n", [3, 4, 5, 6, 7])
@pytest.mark.parametrize("attack", ["x1000", "sign-flip", "ties"])
def test_every_group_size_matches_the_numpy_reference_across_chunks(n: int, attack: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The center of each member (the others' lower median) comes from one sort per chunk, or the smaller
    of the other two when three contribute, or the median of the other three when four do; statistics add up
    over chunks of any size."""
    import potluck.compression.aggregate as aggregate

    monkeypatch.setattr(aggregate, "CHUNK", 100)  # 512 elements: five full chunks and a partial one
    xs = honest(n, seed=n)
    if attack == "x1000":
        xs["peer1"] = xs["peer1"] * 1000
    elif attack == "sign-flip":
        xs["peer0"] = -xs["peer0"]
    else:  # equal values in every column: the center must not depend on how the sort breaks ties
        xs["peer2"] = xs["peer1"].copy()
        xs[f"peer{n - 1}"] = xs["peer1"].copy()
    got = run(xs, clip_factor=4.0, reject_below=-0.1)
    want, clipped, rejected = numpy_reference(xs, 4.0, -0.1)
    np.testing.assert_allclose(got.mean.numpy(), want, rtol=1e-5, atol=1e-8)
    assert set(got.clipped) == clipped and set(got.rejected) == rejected
    if attack == "sign-flip":
        assert rejected == {"peer0"}


def test_four_members_centers_are_the_sorts_bit_for_bit() -> None:
    """Four contributors (R = 4, or a group of 4) take their centers from min/max instead of a sort: the very
    values the sort picks (ties included; a 0.0 may stand for a -0.0, which no sum tells apart), so the statistics (and who is rejected) are unchanged."""
    from potluck.compression.aggregate import median3

    g = torch.Generator().manual_seed(4)
    xs = torch.randn(4, 4096, generator=g)
    xs[1, :512] = xs[2, :512]  # ties
    xs[3, 512:600] = -0.0
    xs[0, 512:600] = 0.0
    values, order = xs.sort(dim=0)
    for i in range(4):
        by_sort = torch.where((order[:2] == i).any(dim=0), values[2], values[1])  # the others' lower median
        fast = median3(*(xs[j] for j in range(4) if j != i))
        assert torch.equal(fast, by_sort), i


def test_a_scaled_up_update_counts_like_a_large_honest_one() -> None:
    xs = honest(4)
    honest_mean = run({k: v for k, v in xs.items() if k != "peer2"}).mean
    xs["peer2"] = xs["peer2"] * 1000
    plain = reduce_mean({k: torch.from_numpy(v) for k, v in xs.items()}, 512)
    robust = run(xs)
    assert robust.clipped == ["peer2"] and not robust.rejected
    assert float((plain - honest_mean).norm()) > 100 * float(honest_mean.norm())  # the plain mean is ruined
    assert float((robust.mean - honest_mean).norm()) < 1.5 * float(honest_mean.norm())  # bounded


def test_a_sign_flipped_update_is_left_out() -> None:
    xs = honest(4)
    xs["peer1"] = -xs["peer1"]
    out = run(xs)
    assert out.rejected == ["peer1"] and "peer1" not in out.contributors
    want = reduce_mean({k: torch.from_numpy(v) for k, v in xs.items() if k != "peer1"}, 512)
    assert torch.equal(out.mean, want)


def test_no_majority_no_rejection_and_two_members_are_only_clipped() -> None:
    xs = honest(4)
    for k in ("peer0", "peer1"):
        xs[k] = -xs[k]  # half against half: nobody can tell who is right
    assert run(xs).rejected == []
    pair = honest(2)
    pair["peer1"] = -pair["peer1"] * 10
    out = run(pair)
    assert out.rejected == [] and out.clipped == ["peer1"]


def test_order_of_arrival_does_not_change_the_bits() -> None:
    xs = honest(5, seed=3)
    xs["peer4"] = xs["peer4"] * 50
    a = run(xs)
    b = run(dict(reversed(list(xs.items()))))
    assert torch.equal(a.mean, b.mean) and a.clipped == b.clipped


# ---------------------------------------------------------------------- weighted by the work in each contribution


def numpy_weighted(xs: dict[str, np.ndarray], w: dict[str, int], clip_factor: float,
                   reject_below: float | None) -> tuple[np.ndarray, set, set]:
    """The weighted rule written out again: the same rejection; clipping of each norm per weight ** 0.75 to
    clip_factor x the lower median of those; a mean weighted by the kept weights, in float64."""
    _, _, rejected = numpy_reference(xs, clip_factor, reject_below)
    kept = [s for s in sorted(xs) if s not in rejected]
    units = {s: np.linalg.norm(xs[s].astype(np.float64)) / w[s] ** 0.75 for s in kept}
    bound = clip_factor * sorted(units.values())[(len(kept) - 1) // 2]
    clipped = {s for s in kept if units[s] > bound}
    total_w = sum(w[s] for s in kept)
    mean = sum(xs[s].astype(np.float64) * (bound / units[s] if s in clipped else 1.0) * w[s] / total_w for s in kept)
    return mean, clipped, rejected


@pytest.mark.parametrize("attack", ["none", "x1000", "sign-flip"])
def test_weighted_mean_matches_the_numpy_reference(attack: str) -> None:
    xs = honest(4, seed=3)
    w = {"peer0": 160, "peer1": 40, "peer2": 80, "peer3": 8}
    if attack == "x1000":
        xs["peer2"] = xs["peer2"] * 1000
    elif attack == "sign-flip":
        xs["peer1"] = -xs["peer1"]
    got = run(xs, clip_factor=4.0, reject_below=-0.1, weights=w)
    want, clipped, rejected = numpy_weighted(xs, w, 4.0, -0.1)
    np.testing.assert_allclose(got.mean.numpy(), want, rtol=1e-5, atol=1e-8)
    assert set(got.clipped) == clipped and set(got.rejected) == rejected


def test_weights_count_work_not_senders() -> None:
    """Two members, one with four times the other's samples: the mean sits four fifths of the way to it."""
    a, b = np.full(64, 1.0, np.float32), np.full(64, 2.0, np.float32)
    got = run({"a": a, "b": b}, clip_factor=0.0, reject_below=None, weights={"a": 32, "b": 128})
    np.testing.assert_allclose(got.mean.numpy(), np.full(64, 1.8), rtol=1e-6)


def test_equal_weights_give_the_unweighted_bits() -> None:
    """Every member with the same samples (every homogeneous round) averages exactly as before weights existed."""
    xs = honest(5, seed=7)
    xs["peer3"] = xs["peer3"] * 50  # clipped either way
    plain = run(xs, clip_factor=4.0, reject_below=-0.1)
    same = run(xs, clip_factor=4.0, reject_below=-0.1, weights=dict.fromkeys(xs, 160))
    assert torch.equal(plain.mean, same.mean) and plain.clipped == same.clipped == ["peer3"]


def test_a_faster_honest_member_is_not_clipped_for_its_speed() -> None:
    """A pseudo-gradient of 16x the steps is up to 16x longer (steps that agree): per work ** 0.75 it stays within
    clip_factor 4 of the median, so it is averaged, not flagged (a flag counts toward eviction)."""
    rng = np.random.default_rng(11)
    direction = rng.standard_normal(256).astype(np.float32)
    xs = {"fast": direction * 16, "mid": direction * 4 + 0.1 * rng.standard_normal(256).astype(np.float32),
          "slow": direction * 1}
    got = run(xs, clip_factor=4.0, reject_below=-0.1, weights={"fast": 16, "mid": 4, "slow": 1})
    assert got.clipped == [] and got.rejected == []
    scaled = run({**xs, "slow": direction * 100}, clip_factor=4.0, reject_below=-0.1,
                 weights={"fast": 16, "mid": 4, "slow": 1})
    assert scaled.clipped == ["slow"]  # a small claim with a long vector still is
