"""The rollback's pick at a device count (``kernels.pick_kept``): its reference against numpy
indexing at every kept count, the CUDA and Metal sources run on the CPU by the emulator, one
launch per kind for every layer under CUDA's structure, and the native path on CUDA."""

from __future__ import annotations

import cuda_emulation  # tests/cuda_emulation.py
import mlx.core as mx
import numpy as np
import pytest

from mtpcli import kernels, launches
from mtpcli.kernels import pick_kept as pk

LAYERS, B, W, C, T, STATE = 3, 2, 3, 40, 4, (2, 4, 8)  # STATE: [Hv, Dv, Dk]


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    convs = [rng.standard_normal((B, W + T, C), dtype=np.float32) for _ in range(LAYERS)]
    steps = [rng.standard_normal((T - 1, B, *STATE), dtype=np.float32) for _ in range(LAYERS)]
    finals = [rng.standard_normal((B, *STATE), dtype=np.float32) for _ in range(LAYERS)]
    return convs, steps, finals


def _want(convs, steps, finals, n):
    """numpy's indexing: inputs n..n+W-1, and the state after position n - 1."""
    windows = [c[:, n : n + W] for c in convs]
    kept = [f if n == T else s[n - 1] for s, f in zip(steps, finals, strict=True)]
    return windows, kept


@pytest.mark.parametrize("n", range(1, T + 1))
def test_reference_picks_the_window_and_state_after_n_keep(n):
    convs, steps, finals = _arrays()
    got = pk.pick_kept_ops(*([mx.array(a) for a in x] for x in (convs, steps, finals)),
                           mx.array([n], mx.int32), T)  # fmt: skip
    want = _want(convs, steps, finals, n)
    for g, w in zip(got[0] + got[1], want[0] + want[1], strict=True):
        assert np.array_equal(np.array(g), w)


@pytest.mark.parametrize("n", [(1, 4), (3, 2), (4, 4), (2, 1)])
def test_reference_picks_each_rows_own_count(n):
    """A batch of requests' rollback: row b keeps n[b] positions."""
    convs, steps, finals = _arrays(4)
    got = pk.pick_kept_ops(*([mx.array(a) for a in x] for x in (convs, steps, finals)),
                           mx.array(n, mx.int32), T)  # fmt: skip
    for c, s, f, window, state in zip(convs, steps, finals, *got, strict=True):
        for b in range(B):
            assert np.array_equal(np.array(window)[b], c[b, n[b] : n[b] + W])
            assert np.array_equal(np.array(state)[b], f[b] if n[b] == T else s[n[b] - 1, b])


def _emulate(convs, steps, finals, n, metal=False, states_source=None, windows_source=None):
    keep = {"keep": np.array(n if isinstance(n, tuple) else [n], np.int32)}
    R = keep["keep"].size
    N = finals[0].size
    states = cuda_emulation.run(
        states_source or pk.source("states", LAYERS, metal),
        keep | {f"s{i}": a for i, a in enumerate(steps)}
        | {f"f{i}": a for i, a in enumerate(finals)},
        {f"o{i}": finals[0].shape for i in range(LAYERS)},
        {"T": T, "N": N, "R": R},
        grid=(-(-N // 64) * 64, LAYERS, 1),
        threadgroup=(64, 1, 1),
    )  # fmt: skip
    windows = cuda_emulation.run(
        windows_source or pk.source("windows", LAYERS, metal),
        keep | {f"c{i}": c for i, c in enumerate(convs)},
        {f"w{i}": (B, W, C) for i in range(LAYERS)},
        {"T": T, "W": W, "B": B, "C": C, "R": R},
        grid=(-(-(B * W * C) // 64) * 64, LAYERS, 1),
        threadgroup=(64, 1, 1),
    )
    return list(windows.values()), list(states.values())


@pytest.mark.parametrize("metal", [False, True], ids=["cuda", "metal"])
def test_emulated_kernels_copy_what_the_reference_picks(metal):
    convs, steps, finals = _arrays(1)
    for n in range(1, T + 1):
        got = _emulate(convs, steps, finals, n, metal)
        want = _want(convs, steps, finals, n)
        for g, w in zip(got[0] + got[1], want[0] + want[1], strict=True):
            assert np.array_equal(g, w)


@pytest.mark.parametrize("metal", [False, True], ids=["cuda", "metal"])
def test_emulated_kernels_pick_each_rows_own_count(metal):
    convs, steps, finals = _arrays(5)
    for n in [(1, 4), (3, 2), (4, 4)]:
        got = _emulate(convs, steps, finals, n, metal)
        want = pk.pick_kept_ops(*([mx.array(a) for a in x] for x in (convs, steps, finals)),
                                mx.array(n, mx.int32), T)  # fmt: skip
        for g, w in zip(got[0] + got[1], want[0] + want[1], strict=True):
            assert np.array_equal(g, np.array(w))


@pytest.mark.parametrize("kind", ["states", "windows"])
def test_an_emulated_kernel_that_reads_the_first_rows_count_for_all_is_caught(kind):
    convs, steps, finals = _arrays(6)
    broken = pk.source(kind, LAYERS, False).replace("R == 1 ? 0 :", "true ? 0 :")
    n = (1, 4)
    sources = {f"{kind}_source": broken}
    got = _emulate(convs, steps, finals, n, **sources)[kind == "states"]
    want = pk.pick_kept_ops(*([mx.array(a) for a in x] for x in (convs, steps, finals)),
                            mx.array(n, mx.int32), T)[kind == "states"]  # fmt: skip
    assert not all(np.array_equal(g, np.array(w)) for g, w in zip(got, want, strict=True))


def test_an_emulated_kernel_that_never_takes_the_final_state_is_caught():
    convs, steps, finals = _arrays(2)
    broken = pk.source("states", LAYERS, False).replace("kept == T - 1", "kept == T")
    got = _emulate(convs, steps, finals, T, states_source=broken)[1]
    assert not all(np.array_equal(g, f) for g, f in zip(got, finals, strict=True))


def test_one_launch_per_kind_for_every_layer_under_cuda_and_groups_on_metal():
    convs, steps, finals = ([mx.array(a) for a in x] for x in _arrays())
    mx.eval(convs, steps, finals)
    keep = mx.array([2], mx.int32)
    for backend, want in (("cuda", 2), ("metal", 2)):
        with launches.structure_of(backend):
            out = pk.pick_kept(convs, steps, finals, keep, T, "auto")
            assert launches.graph(out[0] + out[1]).launches == want
    # 48 layers: all at once on CUDA; in groups of 10 on Metal (31 buffers a kernel)
    many = [c for c in convs for _ in range(16)], [s for s in steps for _ in range(16)], \
        [f for f in finals for _ in range(16)]  # fmt: skip
    for backend, want in (("cuda", 2), ("metal", 2 * 5)):
        with launches.structure_of(backend):
            out = pk.pick_kept(*many, keep, T, "auto")
            assert launches.graph(out[0] + out[1]).launches == want


@pytest.mark.skipif(not kernels.available("cuda"), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_native_pick_equals_the_reference_on_cuda(dtype):
    convs, steps, finals = ([mx.array(a) for a in x] for x in _arrays(3))
    convs = [c.astype(dtype) for c in convs]
    kernels.reset_verdicts()
    for n in [[n] for n in range(1, T + 1)] + [[n, T + 1 - n] for n in range(1, T + 1)]:
        keep = mx.array(n, mx.int32)  # every row's count, then each row's own
        got = pk.pick_kept(convs, steps, finals, keep, T, "native")
        want = pk.pick_kept_ops(convs, steps, finals, keep, T)
        for g, w in zip(got[0] + got[1], want[0] + want[1], strict=True):
            assert g.dtype == w.dtype and mx.array_equal(g, w).item()
    pk.pick_kept(convs, steps, finals, mx.array([1], mx.int32), T, "auto")
    assert kernels._verdicts[("pick_kept", ("cuda", LAYERS, T, str(dtype)))]
