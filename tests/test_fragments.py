"""Streaming outer steps (``sync.fragments``): fragment bounds and one fragment's outer step against numpy
references written here, both of a peer's outer-step paths (blocking, overlapped) with fragments against a
reference, and bad configs refused. The swarm tests are in tests/test_fragments_swarm.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_outer_paths import allreduce, session, train

from potluck.peer.outer.diloco import flatten_params
from potluck.peer.outer.fragments import (
    fragment_bounds,
    fragment_delta,
    fragment_of,
    fragment_size,
    fragment_step,
    mix,
)
from potluck.peer.outer.outer import outer_step
from potluck.peer.outer.outersteps import OuterSteps
from potluck.peer.reduce.allreduce import MemberAddr, RoundInfo
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.config.section import ConfigError

ME = "me"


def np_bounds(n: int, f: int, align: int) -> tuple[int, list[tuple[int, int]]]:
    """The reference: m = ceil(n / F) up to a multiple of align; fragment i is [i m, (i + 1) m) cut at n."""
    m = int(np.ceil(n / f))
    m = int(np.ceil(m / align)) * align
    return m, [(min(i * m, n), min((i + 1) * m, n)) for i in range(f)]


@pytest.mark.parametrize("n,f,align", [(10, 4, 1), (1000, 4, 256), (1024, 4, 256), (5, 4, 4), (7, 1, 2048),
                                       (123457, 64, 2048), (3, 3, 1)])
def test_fragment_bounds_and_padding_match_the_reference(n: int, f: int, align: int) -> None:
    m, want = np_bounds(n, f, align)
    assert fragment_size(n, f, align) == m and m % align == 0 and m * f >= n
    assert [fragment_bounds(n, f, align, i) for i in range(f)] == want
    assert sum(hi - lo for lo, hi in want) == n  # the fragments cover the vector once
    assert [fragment_of(s, f) for s in range(1, 2 * f + 2)] == [(s - 1) % f for s in range(1, 2 * f + 2)]
    g = torch.arange(n, dtype=torch.float32)
    local = g * 0.5
    for i, (lo, hi) in enumerate(want):
        d = fragment_delta(g, local, lo, hi, m)
        ref = np.zeros(m, np.float32)
        ref[: hi - lo] = g.numpy()[lo:hi] - local.numpy()[lo:hi]
        assert d.shape == (m,) and np.array_equal(d.numpy(), ref), i


def np_nesterov(theta: np.ndarray, m: np.ndarray, d: np.ndarray, lr: float, mu: float) -> tuple[np.ndarray, np.ndarray]:
    f32 = np.float32
    m2 = (m * f32(mu)).astype(f32) + d
    u = (m2 * f32(mu)).astype(f32) + d
    return (theta - (u * f32(lr)).astype(f32)).astype(f32), m2.astype(f32)


def test_one_fragments_nesterov_step_matches_the_reference() -> None:
    rng = np.random.default_rng(7)
    n, f, align = 5000, 4, 256
    theta, mom = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    m = fragment_size(n, f, align)
    for i in range(f):
        lo, hi = fragment_bounds(n, f, align, i)
        mean = np.zeros(m, np.float32)
        mean[: hi - lo] = rng.standard_normal(hi - lo).astype(np.float32)
        mean[hi - lo:] = 123.0  # padding: never read
        t2, m2 = fragment_step(torch.from_numpy(theta), torch.from_numpy(mom), torch.from_numpy(mean), lo, hi,
                               0.7, 0.9, True)
        rt, rm = theta.copy(), mom.copy()
        rt[lo:hi], rm[lo:hi] = np_nesterov(theta[lo:hi], mom[lo:hi], mean[: hi - lo], 0.7, 0.9)
        assert np.array_equal(t2.numpy(), rt) and np.array_equal(m2.numpy(), rm), i
        assert np.array_equal(t2.numpy()[:lo], theta[:lo]) and np.array_equal(t2.numpy()[hi:], theta[hi:])


def config(overlap: bool, fragments: int, alpha: float = 0.0) -> RunConfig:
    return apply_overrides(RunConfig(), {
        "run_id": "paths", "model.d_model": 32, "model.n_heads": 2, "model.n_layers": 2, "model.seq_len": 16,
        "train.batch_size": 4, "diloco.inner_steps": 2, "diloco.outer_steps": 4, "diloco.overlap": overlap,
        "data.eval_every": 0, "sync.chunk_bytes": 1 << 12, "sync.codec": "raw", "sync.fragments": fragments,
        "sync.fragment_alpha": alpha,
    })


def np_mix(local: np.ndarray, g: np.ndarray, alpha: float) -> np.ndarray:
    return (np.float32(alpha) * local + np.float32(1 - alpha) * g).astype(np.float32)


def adopt(worker_params: np.ndarray, local: np.ndarray, alpha: float) -> np.ndarray:
    """The worker's local vector, checked against the reference: bit for bit when the synced fragment takes the global
    values whole, within float32 rounding when it mixes (torch may fuse the mix's multiply-add), and then adopted so
    that the next steps' global bits are compared exactly."""
    if alpha == 0.0:
        assert np.array_equal(worker_params, local)
    else:
        assert np.allclose(worker_params, local, rtol=1e-6, atol=1e-7), np.abs(worker_params - local).max()
    return worker_params.copy()


@pytest.mark.parametrize("alpha", [0.0, 0.5], ids=["whole", "mixed"])
@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
def test_a_peers_paths_sync_one_fragment_a_step_and_train_the_others_on(overlap: bool, alpha: float) -> None:
    """Three steps of F = 2 through :class:`OuterSteps` (a one-member all-reduce): each commits Nesterov on
    its fragment only, and the worker goes on from the new theta_global there (``sync.fragment_alpha``: mixed with
    its local values) and from its own progress elsewhere (overlapped: plus what the phase since trained, as
    without fragments)."""
    rc = config(overlap, 2, alpha)
    s = session(rc, "cpu")
    s.tasklet.allreduce.close()
    n = s.tasklet.worker.numel
    m = fragment_size(n, 2, 1)  # (raw codec: align 1)
    s.tasklet.allreduce = allreduce(rc, m)
    s.tasklet.expect_next()
    t, outer = s.tasklet, OuterSteps(s)  # type: ignore[arg-type]
    lr, mu = rc.diloco.outer_lr, rc.diloco.outer_momentum
    g, mom = t.states.current.tensors["theta"].numpy().copy(), np.zeros(n, np.float32)
    pending: tuple[int, int, np.ndarray] | None = None  # (overlapped) the step in flight: its fragment and delta
    try:
        for step in (1, 2, 3):
            start = t.worker.start_point().clone() if overlap else None
            local = train(t.worker, step).numpy().copy()
            outer.after_phase(step, 1.0, start, False, True)
            lo, hi = fragment_bounds(n, 2, 1, fragment_of(step, 2))
            if overlap and pending is not None:  # the step before landed: Nesterov on its fragment, and the worker
                plo, phi, pdelta = pending  # has its new theta_global there minus what this phase trained on it
                g[plo:phi], mom[plo:phi] = np_nesterov(g[plo:phi], mom[plo:phi], pdelta, lr, mu)
                assert start is not None
                local[plo:phi] = np_mix(start.numpy()[plo:phi], g[plo:phi], alpha) - (start.numpy()[plo:phi] - local[plo:phi])
            delta = g[lo:hi] - local[lo:hi]
            if overlap:
                pending = (lo, hi, delta)
                local = adopt(flatten_params(t.worker.params).numpy(), local, alpha)  # trains on, unsynced
                assert outer.inflight is not None and outer.inflight.thread is not None
                outer.inflight.thread.join()  # (the step commits on its own thread: waited for, not raced)
                want_g, want_m = g.copy(), mom.copy()
                want_g[lo:hi], want_m[lo:hi] = np_nesterov(g[lo:hi], mom[lo:hi], delta, lr, mu)
            else:
                g[lo:hi], mom[lo:hi] = np_nesterov(g[lo:hi], mom[lo:hi], delta, lr, mu)
                local[lo:hi] = np_mix(local[lo:hi], g[lo:hi], alpha)
                local = adopt(flatten_params(t.worker.params).numpy(), local, alpha)
                want_g, want_m = g, mom
            got = t.states.current
            assert got.version == step
            assert np.array_equal(got.tensors["theta"].numpy(), want_g)
            assert np.array_equal(got.tensors["momentum"].numpy(), want_m)
        if overlap:  # landing the last step (not for training the next): its fragment at theta_global, the rest as trained
            assert outer.inflight is not None and outer.land() and pending is not None
            lo, hi, delta = pending
            g[lo:hi], mom[lo:hi] = np_nesterov(g[lo:hi], mom[lo:hi], delta, lr, mu)
            local[lo:hi] = np_mix(local[lo:hi], g[lo:hi], alpha)
            got = t.states.current
            assert got.version == 3 and np.array_equal(got.tensors["theta"].numpy(), g)
            assert np.array_equal(got.tensors["momentum"].numpy(), mom)
            adopt(flatten_params(t.worker.params).numpy(), local, alpha)
    finally:
        t.allreduce.close()


def test_fragments_one_takes_the_plain_outer_steps_bits() -> None:
    """F = 1 is the outer step as it was: the same function, the same bits as the plain formula."""
    rc = config(False, 1)
    n = 300
    ar = allreduce(rc, n)
    theta, delta = torch.randn(n), torch.randn(n)
    from potluck.peer.outer.diloco import outer_snapshot
    held = outer_snapshot(theta, torch.zeros(n), 0, {"epoch": 0})
    ar.expect(1, held.hash)
    try:
        done = outer_step(rc, ar, RoundInfo(step=1, members=(MemberAddr(ME, "-"),), me=ME, base_hash=held.hash),
                          held, delta.clone(), 1.0, {})
    finally:
        ar.close()
    want_t, want_m = np_nesterov(theta.numpy(), np.zeros(n, np.float32), delta.numpy(), rc.diloco.outer_lr,
                                 rc.diloco.outer_momentum)
    assert done.bounds is None
    assert np.array_equal(done.snapshot.tensors["theta"].numpy(), want_t)
    assert np.array_equal(done.snapshot.tensors["momentum"].numpy(), want_m)


@pytest.mark.parametrize("value,says", [(0, "greater than or equal to 1"), (65, "less than or equal to 64"),
                                        ("many", "valid integer")])
def test_a_bad_fragment_count_is_refused_clearly(value: object, says: str) -> None:
    base = RunConfig()
    with pytest.raises(ConfigError) as err:
        apply_overrides(base, {"sync.fragments": value})
    assert "sync.fragments" in str(err.value) and says in str(err.value)
    assert base.sync.fragments == 1  # nothing changed


def test_fragments_with_grouped_averaging_is_refused() -> None:
    with pytest.raises(ConfigError, match="sync.fragments = 4 needs sync.group_size = 0"):
        apply_overrides(RunConfig(), {"sync.fragments": 4, "sync.group_size": 2})
    assert apply_overrides(RunConfig(), {"sync.fragments": 4, "diloco.overlap": True}).sync.fragments == 4


@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.5, 0.9])
def test_the_mix_matches_the_reference_and_may_write_over_its_local_input(alpha: float) -> None:
    rng = np.random.default_rng(3)
    local, g = rng.standard_normal(1000).astype(np.float32), rng.standard_normal(1000).astype(np.float32)
    got = mix(torch.from_numpy(local.copy()), torch.from_numpy(g), alpha).numpy()
    assert np.allclose(got, np_mix(local, g, alpha), rtol=1e-6, atol=1e-7)
    if alpha == 0.0:
        assert np.array_equal(got, g), "alpha 0: the global values' bits"
    inplace = torch.from_numpy(local.copy())
    mix(inplace, torch.from_numpy(g), alpha, out=inplace)  # (the blocking path mixes into the worker's own vector)
    assert np.array_equal(inplace.numpy(), got)


@pytest.mark.parametrize("value,says", [(-0.1, "greater than or equal to 0"), (1.0, "less than 1"), ("x", "valid number")])
def test_a_bad_fragment_alpha_is_refused_clearly(value: object, says: str) -> None:
    base = RunConfig()
    with pytest.raises(ConfigError) as err:
        apply_overrides(base, {"sync.fragment_alpha": value})
    assert "sync.fragment_alpha" in str(err.value) and says in str(err.value)
    assert base.sync.fragment_alpha == 0.5  # (the default, unchanged)
