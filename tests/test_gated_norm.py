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


def _inputs(dtype=mx.bfloat16, B=2, S=3, H=5, D=128, seed=0, whole=False):
    """y [B, S, H, D]; z the same shape, a strided view into a wider array (as the layer's
    fused input projection gives it; with ``whole``, that array [B, S, H * D + 64] too, the
    gate at column 32); the norm's weight [D]."""
    ky, kz, kw = mx.random.split(mx.random.key(seed), 3)
    y = (mx.random.normal((B, S, H, D), key=ky) * 2).astype(dtype)
    source = (mx.random.normal((B, S, H * D + 64), key=kz) * 3).astype(dtype)
    z = source[..., 32 : 32 + H * D].reshape(B, S, H, D)
    w = mx.random.uniform(0.5, 1.5, (D,), key=kw).astype(dtype)
    return (y, z, w, source) if whole else (y, z, w)


def _bits16(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16))


def _emulated(y, z, w, metal: bool = False, source: str | None = None,
              z_at: int | None = None) -> np.ndarray:  # fmt: skip
    """The kernel run in emulation on bf16 inputs (CUDA) or their float32 values (Metal); with
    ``z_at``, the in-place variant, z the source [B, S, W] of the gate at that column."""
    B, S, H, D = y.shape
    rows = B * S * H
    place = _strided_like if z_at is None else (lambda _, values: values)
    if metal:
        arrays = {k: np.array(a.astype(mx.float32)) for k, a in (("y", y), ("z", z), ("weight", w))}
        arrays["z"] = place(z, arrays["z"])
        constants, types = {"InT": "float"}, None
    else:
        arrays = {"y": _bits16(y), "z": place(z, _bits16(z)), "weight": _bits16(w)}
        constants = {"InT": "__nv_bfloat16"}
        types = {"y": "InT", "z": "InT", "weight": "InT"}
    if z_at is not None:
        constants |= {"Z_OFF": z_at}
    return cuda_emulation.run(
        source or gn._source(metal, EPS, z_at is not None),
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


@emulated
@pytest.mark.parametrize("metal", [False, True], ids=["cuda", "metal"])
def test_emulated_in_place_variant_is_the_view_variant_bitwise(metal):
    """The gate read in place from the fused projection's output (column 32 of [B, S, W]) gives
    the bits of the same gate read through its view; a block's rows those of one position."""
    y, z, w, source = _inputs(S=3, H=7, whole=True)
    want = _emulated(y, z, w, metal)
    got = _emulated(y, source, w, metal, z_at=32)
    assert np.array_equal(got, want)
    alone = _emulated(y[:, 1:2], source[:, 1:2], w, metal, z_at=32)
    assert np.array_equal(alone, got[:, 1:2])
    text = gn._source(metal, EPS, True)
    assert text.count("(Z_OFF + h * D") == 1
    bad = _emulated(y, source, w, metal, text.replace("(Z_OFF + h * D", "(h * D"), z_at=32)
    assert not np.allclose(bad, want, rtol=1e-2, atol=1e-2)  # the gate from the wrong columns


def test_in_place_on_the_reference_path_is_the_norm_of_the_view():
    """Where no kernel runs (here, the CPU), ``gated_norm_in_place`` is mlx-lm's ops on the
    gate's view, [B, S, H * D]; a gate that is the whole source takes no slice."""
    y, z, w, source = _inputs(whole=True)
    want = gn.gated_norm_ops(y, z, w, EPS).reshape(2, 3, -1)
    assert mx.array_equal(gn.gated_norm_in_place(y, source, 32, w, EPS), want).item()
    exact = source[..., 32 : 32 + 5 * 128]
    assert mx.array_equal(gn.gated_norm_in_place(y, exact, 0, w, EPS), want).item()


def test_in_place_kernel_gets_the_source_itself_and_a_wrong_one_is_refused(pretend_gpu):
    """On a GPU the in-place kernel is handed the fused projection's output itself and the
    gate's column (nothing sliced or reshaped first); a wrong in-place kernel is refused with a
    warning and the gate's view goes to ``gated_norm`` instead, same values."""
    calls = []

    def native(y, z, w, eps, z_at=None, scale=1.0):
        calls.append((z, z_at))
        if z_at is None:
            return gn.gated_norm_ops(y, z, w, eps)
        view = z[..., z_at : z_at + y.shape[-2] * y.shape[-1]].reshape(y.shape)
        return gn.gated_norm_ops(y, view, w, eps).reshape(*y.shape[:-2], -1) * scale

    y, z, w, source = _inputs(whole=True)
    want = gn.gated_norm_ops(y, z, w, EPS).reshape(2, 3, -1)
    pretend_gpu(gn, "gated_norm_native", native)
    out = gn.gated_norm_in_place(y, source, 32, w, EPS)
    assert calls[-1][0] is source and calls[-1][1] == 32
    assert mx.array_equal(out, want).item()
    kernels.reset_verdicts()
    pretend_gpu(gn, "gated_norm_native", lambda *a, **k: native(*a, **k, scale=1.5))
    with pytest.warns(RuntimeWarning, match="gated_norm_in_place kernel disagrees"):
        out = gn.gated_norm_in_place(y, source, 32, w, EPS)
    assert calls[-1][1] is None  # the view kernel, which passed its own check
    assert mx.array_equal(out, want).item()


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
    """The gated-delta layer's norm goes through ``gated_norm_in_place`` (on the CPU: mlx-lm's
    ops, so the mlx-lm parity tests cover it): a wrong result there changes the layer's
    output."""
    from mtpcli.models import qwen3_5 as tm

    m, x, conv_state, state, want = tiny_mixer
    got = tm._gated_delta(m, x, lambda h: h, conv_state, state, False, "auto")[0]
    assert mx.allclose(got, want, atol=1e-5).item()
    monkeypatch.setattr(tm, "gated_norm_in_place", lambda *a: gn.gated_norm_in_place(*a) * 1.01)
    broken = tm._gated_delta(m, x, lambda h: h, conv_state, state, False, "auto")[0]
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


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_cuda_in_place_variant_is_the_view_variant_bitwise(dtype):
    assert gn._self_check(dtype, dtype, 128, EPS, in_place=True) is None
    y, z, w, source = _inputs(dtype, S=4, H=48, whole=True)
    got = gn.gated_norm_native(y, source, w, EPS, z_at=32)
    assert got.shape == (2, 4, 48 * 128)
    assert mx.array_equal(got, gn.gated_norm_native(y, z, w, EPS).reshape(got.shape)).item()
