"""The conv-window kernel: its reference against float64 on CPU, the native kernel on CUDA, the
Metal mirror, and the self-check that keeps a wrong native kernel out."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtpcli import kernels
from mtpcli.kernels import conv_window as cw

cuda = pytest.mark.skipif(not kernels.available("cuda"), reason="needs MLX's CUDA backend")


def _inputs(T=4, B=2, C=48, K=4, dtype=mx.bfloat16, seed=0):
    ks = mx.random.split(mx.random.key(seed), 3)
    whole = mx.random.normal((B, T, C + 24), key=ks[0]).astype(dtype)
    x = whole[..., 8 : 8 + C]  # [B, T, C], a strided view as the model passes it
    window = mx.random.normal((B, K - 1, C), key=ks[1]).astype(dtype)
    weight = (mx.random.normal((C, K, 1), key=ks[2]) * 0.5).astype(dtype)
    return x, window, weight


def _chain(fn, x, window, weight):
    """T one-position calls, each on the window the last one left."""
    outs, rows = [], [window]
    for t in range(x.shape[1]):
        out, inputs, window = fn(x[:, t : t + 1], window, weight)
        outs.append(out)
        rows.append(inputs[:, -1:])
    return mx.concatenate(outs, axis=1), mx.concatenate(rows, axis=1), window


def _bitwise(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()


def test_reference_matches_a_float64_convolution():
    x, window, weight = _inputs(dtype=mx.float32)
    out, inputs, new_window = cw.conv_silu_ops(x, window, weight)
    X = np.concatenate([np.array(window, np.float64), np.array(x, np.float64)], axis=1)
    W = np.array(weight, np.float64)[:, :, 0]  # [C, K]
    K, T = W.shape[1], x.shape[1]
    conv = np.stack([(X[:, t : t + K] * W.T[None]).sum(axis=1) for t in range(T)], axis=1)
    want = conv / (1 + np.exp(-conv))
    assert np.allclose(np.array(out), want, atol=1e-5)
    assert np.array_equal(np.array(inputs), X.astype(np.float32))
    assert np.array_equal(np.array(new_window), X[:, -(K - 1) :].astype(np.float32))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_reference_block_equals_chain_of_single_positions(dtype):
    args = _inputs(dtype=dtype)
    got = cw.conv_silu_ops(*args)
    want = _chain(cw.conv_silu_ops, *args)
    assert all(_bitwise(a, b) for a, b in zip(got, want, strict=True))


def test_the_model_uses_it_and_a_wrong_one_breaks_exactness_vs_mlx_lm(monkeypatch, tiny_mixer):
    """Where the gated-delta kernel does not make the convolution itself (the CPU, or a shape
    it does not take on a GPU), the gated-delta layer's goes through ``conv_silu``: a wrong
    result there changes the layer output (so the mlx-lm parity tests cover this path)."""
    from mtpcli.kernels import gated_delta as gd
    from mtpcli.models import qwen3_5 as tm

    # On CUDA the folded kernel would make the convolution and never call conv_silu.
    monkeypatch.setattr(gd, "_native_dims", lambda *heads: False)
    m, x, conv_state, state, want = tiny_mixer  # the norm left out here: identity
    got = tm._gated_delta(m, x, lambda h: h, conv_state, state, False, "auto")[0]
    assert mx.allclose(got, want, atol=1e-5).item()

    def wrong(x, window, weight, mode="auto"):
        out, inputs, new_window = cw.conv_silu_ops(x, window, weight)
        return out * 1.01, inputs, new_window

    monkeypatch.setattr(gd, "conv_silu", wrong)
    broken = tm._gated_delta(m, x, lambda h: h, conv_state, state, False, "auto")[0]
    assert not mx.allclose(broken, want, atol=1e-5).item()


def test_wrong_native_kernel_is_caught_and_replaced(monkeypatch):
    kernels.reset_verdicts()
    monkeypatch.setattr(cw, "backend", lambda: "cuda")

    def broken(x, window, weight):
        out, inputs, new_window = cw.conv_silu_ops(x, window, weight)
        return out, inputs, new_window + 1

    monkeypatch.setattr(cw, "conv_silu_native", broken)
    args = _inputs()
    with pytest.warns(RuntimeWarning, match="disagrees with the ops reference"):
        got = cw.conv_silu(*args)
    assert all(_bitwise(a, b) for a, b in zip(got, cw.conv_silu_ops(*args), strict=True))
    kernels.reset_verdicts()


def test_metal_source_mirrors_cuda_line_by_line():
    """One text, spelled for each backend: only the spelled tokens differ."""
    metal_to_cuda = [
        ("thread_position_in_grid.x", "blockIdx.x * blockDim.x + threadIdx.x"),
        ("thread_position_in_grid.y", "blockIdx.y"),
        ("device ", ""),
        ("exp(", "expf("),
    ]
    metal = cw.source(True)
    for a, b in metal_to_cuda:
        metal = metal.replace(a, b)
    assert metal.splitlines() == cw.source(False).splitlines()


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_cuda_kernel_passes_its_check_and_matches_the_reference(dtype):
    assert cw._self_check(dtype, 4) is None
    args = _inputs(T=5, C=10240, dtype=dtype, seed=3)  # the 27B shape's conv width
    got, want = cw.conv_silu_native(*args), cw.conv_silu_ops(*args)
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    for a, b in zip(got, want, strict=True):
        assert mx.allclose(a.astype(mx.float32), b.astype(mx.float32), rtol=tol, atol=tol).item()
    assert _bitwise(got[1], want[1]) and _bitwise(got[2], want[2])  # inputs and window: copies


@cuda
@pytest.mark.parametrize("T", [1, 2, 3, 8])
def test_cuda_kernel_chain_parity(T):
    """T positions in one launch == T one-position launches, bitwise."""
    args = _inputs(T=T, C=10240, seed=T)
    got = cw.conv_silu_native(*args)
    want = _chain(cw.conv_silu_native, *args)
    assert all(_bitwise(a, b) for a, b in zip(got, want, strict=True))
