"""scripts/qmm_splitk.py's kernel (K split across blocks, the partial tiles added in block order
by the tile's last block), run on the CPU by tests/cuda_emulation.py: one block a tile gives our
product's bits; two and three give its values, rows M-invariant, and leave the counters at 0."""

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

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "qmm_splitk.py"
_spec = importlib.util.spec_from_file_location("qmm_splitk", _PATH)
qs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qs)


def _bits16(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16))


def _run(source: str, x, w, scales, biases, bits: int, ks: int, warps: int = 2,
         counter: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
    n, m = w.shape[0], math.prod(x.shape[:-1])
    tiles = (n + 15) // 16
    inputs = {"x": _bits16(x), "w": np.array(w), "scales": _bits16(scales),
              "biases": _bits16(biases)}  # fmt: skip
    outputs = {"y": (m, n)}
    if ks:  # the split kernel
        inputs["counter"] = counter if counter is not None else np.zeros(tiles, np.uint32)
        outputs["partials"] = (tiles * ks * 128,)
    return cuda_emulation.run(
        source, inputs, outputs,
        {"XT": "__nv_bfloat16", "ST": "__nv_bfloat16", "BITS": bits, "GS": 64, "WARPS": warps}
        | ({"KS": ks} if ks else {}),
        grid=(32 * warps * tiles * max(ks, 1), 1, 1),
        threadgroup=(32 * warps, 1, 1),
        header=cuda_emulation.emulated_mma(qm._HEADER_CUDA),
        types={"x": "XT", "scales": "ST", "biases": "ST"},
    )["y"]  # fmt: skip


@pytest.mark.parametrize("bits", qm.BITS)
def test_emulated_split_product(bits):
    n, k = 40, 1024  # a partial last tile; 8 stretches a row at 4 bits (16 at 8)
    w, scales, biases = qm.random_quantized(n, k, 64, bits, mx.bfloat16, seed=bits)
    x = mx.random.normal((8, k), key=mx.random.key(5)).astype(mx.bfloat16)
    ours = _run(qm.source(False), x, w, scales, biases, bits, ks=0)
    assert np.array_equal(_run(qs.SOURCE, x, w, scales, biases, bits, ks=1), ours)
    for ks in (2, 3):  # 3: the last block's share is shorter
        counter = np.zeros((n + 15) // 16, np.uint32)
        got = {m: _run(qs.SOURCE, x[:m], w, scales, biases, bits, ks, counter=counter)
               for m in (1, 3, 8)}  # fmt: skip
        np.testing.assert_allclose(got[8], ours, rtol=2**-7, atol=1e-3)
        assert np.array_equal(got[1], got[8][:1]) and np.array_equal(got[3], got[8][:3])
        assert not counter.any()  # each tile's last block set its counter back
