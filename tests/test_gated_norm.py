"""The gated-delta layer's output norm as one launch: the kernel's logic in CPU emulation (CUDA
and Metal spellings of one text), its self-check and fallback (with fakes, on any machine), and
on CUDA the kernel itself."""

from __future__ import annotations

import cuda_emulation  # tests/cuda_emulation.py
import mlx.core as mx
import numpy as np
import pytest

from mtpcli import kernels
from mtpcli.kernels import gated_norm as gn

cuda = pytest.mark.skipif(not kernels.available("cuda"), reason="needs MLX's CUDA backend")
emulated = pytest.mark.skipif(not cuda_emulation.available(), reason="needs g++")
EPS = 1e-6


@pytest.fixture(autouse=True)
def fresh_verdicts():
    kernels.reset_verdicts()
    yield
    kernels.reset_verdicts()


def _inputs(dtype=mx.bfloat16, B=2, S=3, H=5, D=128, seed=0):
    """y [B, S, H, D]; z the same shape, a strided view into a wider array (as the layer's
    fused input projection gives it); the norm's weight [D]."""
    ky, kz, kw = mx.random.split(mx.random.key(seed), 3)
    y = (mx.random.normal((B, S, H, D), key=ky) * 2).astype(dtype)
    whole = (mx.random.normal((B, S, H * D + 64), key=kz) * 3).astype(dtype)
    z = whole[..., 32 : 32 + H * D].reshape(B, S, H, D)
    w = mx.random.uniform(0.5, 1.5, (D,), key=kw).astype(dtype)
    return y, z, w


def _bits16(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16))


def _emulated(y, z, w, metal: bool = False, source: str | None = None) -> np.ndarray:
    """The kernel run in emulation on bf16 inputs (CUDA) or their float32 values (Metal)."""
    B, S, H, D = y.shape
    rows = B * S * H
    if metal:
        arrays = {k: np.array(a.astype(mx.float32)) for k, a in (("y", y), ("z", z), ("weight", w))}
        arrays["z"] = _strided_like(z, arrays["z"])
        constants, types = {"InT": "float"}, None
    else:
        arrays = {"y": _bits16(y), "z": _strided_like(z, _bits16(z)), "weight": _bits16(w)}
        constants = {"InT": "__nv_bfloat16"}
        types = {"y": "InT", "z": "InT", "weight": "InT"}
    return cuda_emulation.run(
        source or gn._source(metal, EPS),
        arrays,
        {"out": (B, S, H, D)},
        constants | {"D": D, "WARPS": gn._WARPS},
        grid=(32 * gn._WARPS * -(-rows // gn._WARPS), 1, 1),
        threadgroup=(32 * gn._WARPS, 1, 1),
        types=types,
    )["out"]


def _strided_like(view: mx.array, values: np.ndarray) -> np.ndarray:
    """``values`` (view's elements, contiguous) as a strided view into a wider array, as the
    kernel meets z."""
    B, S, H, D = values.shape
    wide = np.zeros((B, S, H * D + 64), values.dtype)
    wide[..., 32 : 32 + H * D] = values.reshape(B, S, H * D)
    return wide[..., 32 : 32 + H * D].reshape(B, S, H, D)


@emulated
@pytest.mark.parametrize("metal", [False, True], ids=["cuda", "metal"])
def test_emulated_kernel_matches_the_reference(metal):
    """Against mlx-lm's two ops; z read through its strides (7 rows: a partial threadgroup);
    a position's rows bitwise the same alone as in a block."""
    y, z, w = _inputs(S=1, H=7)
    got = _emulated(y, z, w, metal)
    if metal:  # float32 in: the float32 reference
        y, z, w = (a.astype(mx.float32) for a in (y, z, w))
    want = np.array(gn.gated_norm_ops(y, z, w, EPS).astype(mx.float32))
    tol = 1e-5 if metal else 2**-7  # bf16 outputs: a rounding apart at most
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    y3, z3, w3 = _inputs(S=3, H=7)
    block = _emulated(y3, z3, w3, metal)
    alone = _emulated(y3[:, 1:2], z3[:, 1:2], w3, metal)
    assert np.array_equal(alone, block[:, 1:2])


@emulated
@pytest.mark.parametrize(
    "mistake",
    [
        ("off < 32; off <<= 1", "off < 16; off <<= 1"),  # half the lanes' squares
        ("b * z_strides[0]", "b * y_strides[0]"),  # z read through y's strides
        ("(1.0f + expf(-gz))", "(1.0f + expf(gz))"),  # the wrong gate
    ],
)
def test_emulation_catches_a_broken_kernel(mistake):
    y, z, w = _inputs(S=1, H=3)
    source = gn._source(False, EPS)
    assert source.count(mistake[0]) == 1
    good = _emulated(y, z, w)
    bad = _emulated(y, z, w, source=source.replace(*mistake))
    assert not np.allclose(bad, good, rtol=1e-2, atol=1e-2)


def test_both_spellings_are_one_text():
    """The Metal kernel mirrors the CUDA kernel line by line (only the spelled tokens differ)."""
    cuda_lines = gn._source(False, EPS).splitlines()
    metal_lines = gn._source(True, EPS).splitlines()
    assert len(cuda_lines) == len(metal_lines)
    differ = [(a, b) for a, b in zip(cuda_lines, metal_lines, strict=True) if a != b]
    assert 0 < len(differ) <= 10, differ


def test_a_correct_kernel_is_trusted_and_used(pretend_gpu):
    calls = []

    def native(y, z, w, eps):
        calls.append(y.shape)
        return gn.gated_norm_ops(y, z, w, eps)

    pretend_gpu(gn, "gated_norm_native", native)
    y, z, w = _inputs()
    out = gn.gated_norm(y, z, w, EPS)
    assert calls[-1] == y.shape  # after the self-check's calls
    assert mx.array_equal(out, gn.gated_norm_ops(y, z, w, EPS)).item()


@pytest.mark.parametrize("wrong", ["values", "rows"])
def test_a_wrong_kernel_is_refused_with_a_warning(pretend_gpu, wrong):
    def native(y, z, w, eps):
        out = gn.gated_norm_ops(y, z, w, eps)
        if wrong == "values":
            return out * 1.5
        return out * (1 + 1e-2 * (y.shape[1] > 1))  # rows that depend on the block

    pretend_gpu(gn, "gated_norm_native", native)
    y, z, w = _inputs()
    with pytest.warns(RuntimeWarning, match="gated_norm kernel disagrees"):
        out = gn.gated_norm(y, z, w, EPS)
    assert mx.array_equal(out, gn.gated_norm_ops(y, z, w, EPS)).item()


def test_the_model_runs_the_layer_norm_through_it(monkeypatch, tiny_mixer):
    """The gated-delta layer's norm goes through ``gated_norm`` where the out projection does
    not take it in its launch (on the CPU: mlx-lm's ops, so the mlx-lm parity tests cover it):
    a wrong result there changes the layer's output."""
    from mtpcli.kernels import quantized_matmul as qm
    from mtpcli.models import qwen3_5 as tm

    m, x, conv_state, state, want = tiny_mixer
    got = tm._gated_delta(m, x, lambda h: h, conv_state, state, keep=False)[0]
    assert mx.allclose(got, want, atol=1e-5).item()
    monkeypatch.setattr(qm, "gated_norm", lambda *args: gn.gated_norm_ops(*args) * 1.01)
    broken = tm._gated_delta(m, x, lambda h: h, conv_state, state, keep=False)[0]
    assert not mx.allclose(broken, want, atol=1e-5).item()


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_cuda_kernel_matches_the_reference_and_rows_do_not_depend_on_the_block(dtype):
    assert gn._self_check(dtype, dtype, 128, EPS) is None
    y, z, w = _inputs(dtype, S=4, H=48)
    got = gn.gated_norm_native(y, z, w, EPS)
    want = gn.gated_norm_ops(y, z, w, EPS)
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), rtol=1e-2, atol=1e-2).item()
    for t in range(4):
        alone = gn.gated_norm_native(y[:, t : t + 1], z[:, t : t + 1], w, EPS)
        assert mx.array_equal(alone, got[:, t : t + 1]).item(), f"position {t}"
