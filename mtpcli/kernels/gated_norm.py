"""The gated-delta layer's output norm: each head's values RMS-normalised, times SiLU of the gate.

mlx-lm's ``Qwen3NextRMSNormGated`` is two launches on a GPU (``mx.fast.rms_norm``, then
``precise_swiglu``, a compiled elementwise kernel); at one token a step each costs more than
its work, and the host more than the GPU. One launch here. Each row (one head of one position)
is computed by one warp in the same order whatever the number of rows, so a verify block's rows
equal its positions' one-row launches bitwise.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.activations import precise_swiglu

from . import backend, built, constant, fill, kernel_name, spell, use_native


def gated_norm_ops(y: mx.array, z: mx.array, weight: mx.array, eps: float) -> mx.array:
    """Ops reference (mlx-lm's arithmetic): y, z [B, S, H, D] (z may be a view), weight [D].
    Returns silu(z) * rms_norm(y) [B, S, H, D] in y's dtype (the product in float32)."""
    return precise_swiglu(y, z, mx.fast.rms_norm(y, weight, eps))


# One warp / SIMD-group a row: lane l holds D/32 values; the squares are summed by fma, then a
# butterfly over the 32 lanes, 1, 2, 4, 8, 16 apart. The norm rounds as MLX's rms_norm does
# (x * rsqrt to the input dtype, times the weight in it), the gate's SiLU and the product are
# float32, as mlx-lm's precise_swiglu; y and z are read through their strides (z is a view into
# the layer's fused input projection). One text for both backends (``kernels.spell``).
_TEMPLATE = """
    constexpr int NPT = D / 32;
    {{THREAD_INDICES}}
    const int S = y_shape[1];
    const int H = y_shape[2];
    if (row < y_shape[0] * S * H) {
      const int h = row % H;
      const int s = (row / H) % S;
      const int b = row / (H * S);
      DEVICE const InT* y_ = y + b * y_strides[0] + s * y_strides[1] + h * y_strides[2]
          + lane * NPT * y_strides[3];
      {{Z_ROW}}
      float v[NPT];
      float ss = 0.0f;
      for (int i = 0; i < NPT; ++i) {
        v[i] = static_cast<float>(y_[i * y_strides[3]]);
        ss = fmaf(v[i], v[i], ss);
      }
      for (LANE_OFFSET off = 1; off < 32; off <<= 1) ss = ss + XOR_SHUFFLE(ss, off);
      const float inv = rsqrtf(ss / D + {{EPS}});
      for (int i = 0; i < NPT; ++i) {
        const float xn = static_cast<float>(static_cast<InT>(
            static_cast<float>(weight[lane * NPT + i])
            * static_cast<float>(static_cast<InT>(v[i] * inv))));
        const float gz = static_cast<float>({{Z_I}});
        const float sg = 1.0f / (1.0f + expf(-gz));
        out[(size_t)row * D + lane * NPT + i] = static_cast<InT>(gz * sg * xn);
      }
    }
"""
# Where a row's gate values are: z [B, S, H, D] (a view) through its strides, or, "in place",
# z the fused input projection's output [B, S, W] with the gate at columns Z_OFF + h * D: no
# slice and no reshape in the graph before the launch.
_Z_ROWS = {
    False: (
        """DEVICE const InT* z_ = z + b * z_strides[0] + s * z_strides[1] + h * z_strides[2]
          + lane * NPT * z_strides[3];""",
        "z_[i * z_strides[3]]",
    ),
    True: (
        """DEVICE const InT* z_ = z + b * z_strides[0] + s * z_strides[1]
          + (Z_OFF + h * D + lane * NPT) * z_strides[2];""",
        "z_[i * z_strides[2]]",
    ),
}
_THREAD_INDICES = {
    False: """const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * WARPS + (threadIdx.x >> 5);""",
    True: """const int lane = thread_index_in_simdgroup;
    const int row = threadgroup_position_in_grid.x * WARPS + simdgroup_index_in_threadgroup;""",
}
_WARPS = 4  # rows a threadgroup
_kernels: dict = {}


def _source(metal: bool, eps: float, in_place: bool = False) -> str:
    z_row, z_i = _Z_ROWS[in_place]
    text = fill(_TEMPLATE, THREAD_INDICES=_THREAD_INDICES[metal], Z_ROW=z_row, Z_I=z_i,
                EPS=f"{eps:.9e}f")  # fmt: skip
    return spell(text, metal)


def _spec(metal: bool, eps: float, in_place: bool = False) -> dict:
    source = _source(metal, eps, in_place)
    return {
        "name": kernel_name("mtp_gated_norm" + "_in_place" * in_place, source),
        "input_names": ["y", "z", "weight"],
        "output_names": ["out"],
        "source": source,
        "ensure_row_contiguous": False,  # y and z through their strides
    }


def _kernel(eps: float, in_place: bool = False):
    return built(_kernels, (eps, in_place), lambda metal: _spec(metal, eps, in_place))


def gated_norm_native(y: mx.array, z: mx.array, weight: mx.array, eps: float,
                      z_at: int | None = None):  # fmt: skip
    """The native kernel (same contract as ``gated_norm_ops``); None where there is none. With
    ``z_at`` (``gated_norm_in_place``'s contract) z is the source [B, S, W] of the gate at
    columns [z_at, z_at + H * D), and the result comes as [B, S, H * D]."""
    kernel = _kernel(eps, z_at is not None)
    if kernel is None:
        return None
    B, S, H, D = y.shape
    rows = B * S * H
    return kernel(
        inputs=[y, z, constant(weight)],
        template=[("InT", y.dtype), ("D", D), ("WARPS", _WARPS)]
        + ([("Z_OFF", z_at)] if z_at is not None else []),
        grid=(32 * _WARPS * -(-rows // _WARPS), 1, 1),
        threadgroup=(32 * _WARPS, 1, 1),
        output_shapes=[(B, S, H, D) if z_at is None else (B, S, H * D)],
        output_dtypes=[y.dtype],
    )[0]


def _self_check(dtype, wdtype, D: int, eps: float, in_place: bool = False) -> str | None:
    """Agreement with the reference, and a position's rows the same alone as in a block."""
    ky, kz, kw = mx.random.split(mx.random.key(2468), 3)
    y = (mx.random.normal((2, 3, 5, D), key=ky) * 2).astype(dtype)
    whole = mx.random.normal((2, 3, 5 * D + 32), key=kz).astype(dtype)
    z = whole[..., 16 : 16 + 5 * D].reshape(2, 3, 5, D)  # a strided view, as the model has it
    weight = mx.random.uniform(0.5, 1.5, (D,), key=kw).astype(wdtype)

    def native(y, z, whole):
        if not in_place:
            return gated_norm_native(y, z, weight, eps)
        return gated_norm_native(y, whole, weight, eps, z_at=16).reshape(y.shape)

    try:
        got = native(y, z, whole)
        one = native(y[:, 1:2], z[:, 1:2], whole[:, 1:2])
        want = gated_norm_ops(y, z, weight, eps)
        mx.eval(got, one, want)
    except Exception as e:  # noqa: BLE001 - a kernel that fails to build is not trusted
        return f"{type(e).__name__}: {e}"
    a, b = got.astype(mx.float32), want.astype(mx.float32)
    tol = 1e-2 if dtype != mx.float32 else 1e-4
    if a.shape != b.shape or not mx.allclose(a, b, rtol=tol, atol=tol).item():
        return f"differs from the reference by up to {mx.abs(a - b).max().item():.3g}"
    if not mx.array_equal(one, got[:, 1:2]).item():
        return "a position's rows differ alone and in a block"
    return None


def _trusted(y: mx.array, z: mx.array, weight: mx.array, eps: float, in_place: bool,
             mode: str) -> bool:  # fmt: skip
    D = y.shape[-1]
    return (
        backend() != "cpu"
        and y.ndim == 4
        and z.dtype == y.dtype
        and D % 32 == 0
        and D <= 1024
        and use_native(
            "gated_norm" + "_in_place" * in_place,
            (backend(), str(y.dtype), str(weight.dtype), D, eps),
            lambda: _self_check(y.dtype, weight.dtype, D, eps, in_place),
            mode,
        )
    )


def gated_norm(y: mx.array, z: mx.array, weight: mx.array, eps: float,
               mode: str = "auto") -> mx.array:  # fmt: skip
    """The gated norm on the best trusted path under kernel ``mode`` (see ``gated_norm_ops``
    for shapes)."""
    if z.shape == y.shape and _trusted(y, z, weight, eps, False, mode):
        out = gated_norm_native(y, z, weight, eps)
        if out is not None:
            return out
    return gated_norm_ops(y, z, weight, eps)


def gated_norm_in_place(y: mx.array, source: mx.array, offset: int, weight: mx.array,
                        eps: float, mode: str = "auto") -> mx.array:  # fmt: skip
    """The gated norm of y [B, S, H, D] whose gate is the columns [offset, offset + H * D) of
    ``source`` [B, S, W] (the layer's fused input projection), as [B, S, H * D]: where the
    native kernel runs, it reads the gate in place, so the graph has no slice or reshape around
    the launch (three nodes a layer fewer); elsewhere ``gated_norm`` on the gate's view."""
    k = y.shape[-2] * y.shape[-1]
    if (source.shape[:-1] == y.shape[:-2] and 0 <= offset <= source.shape[-1] - k
            and _trusted(y, source, weight, eps, True, mode)):  # fmt: skip
        out = gated_norm_native(y, source, weight, eps, z_at=offset)
        if out is not None:
            return out
    z = source if (offset, k) == (0, source.shape[-1]) else source[..., offset : offset + k]
    return gated_norm(y, z.reshape(y.shape), weight, eps, mode).reshape(*y.shape[:-2], k)
