"""scripts/qmm_experiments.py's kernel (the group's scale and bias applied in float32 after the
mma), run on the CPU by tests/cuda_emulation.py: its logic against x times the exactly
dequantized weights, and its rows M-invariant, bitwise."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import cuda_emulation  # tests/cuda_emulation.py
import mlx.core as mx
import numpy as np
import pytest

from mtpcli.kernels import quantized_matmul as qm

pytestmark = pytest.mark.skipif(not cuda_emulation.available(), reason="needs g++")

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "qmm_experiments.py"
_spec = importlib.util.spec_from_file_location("qmm_experiments", _PATH)
qx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qx)


def _bits16(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16))


def _emulated(x: mx.array, w, scales, biases, group_size: int, bits: int, warps: int = 8):
    n, m = w.shape[0], math.prod(x.shape[:-1])
    return cuda_emulation.run(
        qx.SOURCE,
        {"x": _bits16(x), "w": np.array(w), "scales": _bits16(scales), "biases": _bits16(biases)},
        {"y": (m, n)},
        {"XT": "__nv_bfloat16", "ST": "__nv_bfloat16", "BITS": bits, "GS": group_size,
         "WARPS": warps},
        grid=(32 * warps * ((n + 15) // 16), 1, 1),
        threadgroup=(32 * warps, 1, 1),
        header=cuda_emulation.emulated_mma(qx.HEADER),
        types={"x": "XT", "scales": "ST", "biases": "ST"},
    )["y"]  # fmt: skip


def _exact(x, w, scales, biases, group_size: int, bits: int) -> np.ndarray:
    """x times scale * q + bias, all in float64 (no rounding of the weights)."""
    n, k = w.shape[0], x.shape[-1]
    q = (np.array(w)[..., None] >> (bits * np.arange(32 // bits, dtype=np.uint32))) & (2**bits - 1)
    s, b = (np.array(a.astype(mx.float32), np.float64)[..., None] for a in (scales, biases))
    dense = (q.reshape(n, k // group_size, group_size) * s + b).reshape(n, k)
    return np.array(x.astype(mx.float32), np.float64) @ dense.T


@pytest.mark.parametrize("bits", qm.BITS)
@pytest.mark.parametrize("group_size", qm.GROUP_SIZES)
def test_emulated_grouped_product_matches_the_exact_product(bits, group_size):
    n, k = 40, 512  # a partial last tile; 2 stretches a warp with 2 warps at 4 bits
    w, scales, biases = qm.random_quantized(n, k, group_size, bits, mx.bfloat16, seed=bits)
    x = mx.random.normal((8, k), key=mx.random.key(group_size)).astype(mx.bfloat16)
    got = {m: _emulated(x[:m], w, scales, biases, group_size, bits, warps=2) for m in (1, 3, 8)}
    want = _exact(x, w, scales, biases, group_size, bits)
    np.testing.assert_allclose(got[8], want, rtol=2**-7, atol=2e-3)  # bf16 outputs
    assert np.array_equal(got[1], got[8][:1]) and np.array_equal(got[3], got[8][:3])
    # the wrong per-chunk group (every chunk scaled by the stretch's first group) would not pass
    assert np.abs(got[8] - want).max() < 0.05 * np.abs(want).max()
