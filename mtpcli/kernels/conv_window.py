"""The gated-delta layer's causal depthwise convolution over its rolling window, then SiLU.

mlx-lm builds it from four ops (concatenate the cached window with the new inputs, the grouped
convolution, SiLU, and a copy of the new window): on a GPU each is a launch per layer per step,
and at one token per step a launch costs more than its work. One launch here reads the window
and the new inputs and writes the activations, the concatenated inputs (what a verify's
rollback restores the window from) and the new window. Each output position is computed from
its K inputs in the same order whatever T is, so T positions in one launch equal T one-position
launches bitwise (chain parity), as for the gated-delta kernel.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import RCP1, backend, built, constant, fill, kernel_name, spell, use_native


def conv_silu_ops(x: mx.array, window: mx.array, weight: mx.array):
    """Ops reference (mlx-lm's arithmetic).

    x [B, T, C] (the new inputs); window [B, K-1, C] (the last K-1 inputs before them);
    weight [C, K, 1] (depthwise, MLX's layout). Returns silu(conv) [B, T, C], the inputs
    [B, K-1+T, C] (window then x) and the new window [B, K-1, C].
    """
    K = weight.shape[1]
    inputs = mx.concatenate([window, x], axis=1)  # [B, K-1+T, C]
    out = nn.silu(mx.conv1d(inputs, weight, groups=x.shape[-1]))  # [B, T, C]
    return out, inputs, mx.contiguous(inputs[:, inputs.shape[1] - (K - 1) :])


# One thread per (batch row, channel): it keeps the channel's last K inputs in registers and
# walks the T positions. x and the window are read through their strides (x is a view into
# the fused input projection; after a rollback the window is a view into the last verify's
# inputs); the weight is row-contiguous. The conv sums its K products in float32 from the
# oldest input, rounds to the input dtype, and SiLU rounds as MLX's x * sigmoid(x) does (its
# 1 / x as the folded kernel's, RCP1). One text for both backends (``kernels.spell``).
_TEMPLATE = """
    #define CONV_RD(v) static_cast<float>(static_cast<InT>(v))
    const int T = x_shape[1];
    const int C = x_shape[2];
    {{THREAD_INDICES}}
    if (c < C) {
      DEVICE const InT* x_ = x + b * x_strides[0] + c * x_strides[2];
      DEVICE const InT* win_ = window + b * window_strides[0] + c * window_strides[2];
      DEVICE InT* y_ = y + (size_t)b * T * C + c;
      DEVICE InT* in_ = inputs + (size_t)b * (K - 1 + T) * C + c;
      DEVICE InT* wout_ = window_out + (size_t)b * (K - 1) * C + c;
      float wk[K];
      for (int k = 0; k < K; ++k) wk[k] = static_cast<float>(weight[(size_t)c * K + k]);
      InT last[K];
      for (int j = 0; j < K - 1; ++j) {
        last[j] = win_[j * window_strides[1]];
        in_[(size_t)j * C] = last[j];
      }
      for (int t = 0; t < T; ++t) {
        last[K - 1] = x_[t * x_strides[1]];
        in_[(size_t)(K - 1 + t) * C] = last[K - 1];
        float acc = 0.0f;
        for (int k = 0; k < K; ++k) acc = acc + wk[k] * static_cast<float>(last[k]);
        const float h = CONV_RD(acc);
        const float sg = CONV_RD(RCP1(1.0f + expf(-h)));
        y_[(size_t)t * C] = static_cast<InT>(h * sg);
        for (int k = 0; k < K - 1; ++k) last[k] = last[k + 1];
      }
      for (int j = 0; j < K - 1; ++j) wout_[(size_t)j * C] = last[j];
    }
    #undef CONV_RD
"""
_THREAD_INDICES = {
    False: """const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int b = blockIdx.y;""",
    True: """const int c = thread_position_in_grid.x;
    const int b = thread_position_in_grid.y;""",
}


def source(metal: bool) -> str:
    """The kernel body for one backend."""
    return RCP1 + spell(fill(_TEMPLATE, THREAD_INDICES=_THREAD_INDICES[metal]), metal)


_THREADS = 256
_kernels: dict = {}


def _spec(source: str) -> dict:
    return {
        "name": kernel_name("mtp_conv_silu", source),
        "input_names": ["x", "window", "weight"],
        "output_names": ["y", "inputs", "window_out"],
        "source": source,
        "ensure_row_contiguous": False,  # x and the window through their strides
    }


def _kernel():
    return built(_kernels, (), lambda metal: _spec(source(metal)))


def conv_silu_native(x: mx.array, window: mx.array, weight: mx.array):
    """The native kernel (same contract as ``conv_silu_ops``); None where there is none."""
    kernel = _kernel()
    if kernel is None:
        return None
    B, T, C = x.shape
    K = weight.shape[1]
    return tuple(
        kernel(
            inputs=[x, window, constant(weight)],
            template=[("InT", x.dtype), ("K", K)],
            grid=(-(-C // _THREADS) * _THREADS, B, 1),
            threadgroup=(_THREADS, 1, 1),
            output_shapes=[(B, T, C), (B, K - 1 + T, C), (B, K - 1, C)],
            output_dtypes=[x.dtype] * 3,
        )
    )


def _self_check(dtype, K: int) -> str | None:
    kx, kw, kc = mx.random.split(mx.random.key(4321), 3)
    C, T = 96, 3
    whole = mx.random.normal((2, T, C + 32), key=kx).astype(dtype)  # [B, T, C + 32]
    x = whole[..., 16 : 16 + C]  # a strided view, as the model passes it
    inputs = mx.random.normal((2, K + 1, C), key=kc).astype(dtype)  # [B, K - 1 + 2, C]
    window = inputs[:, 2:]  # a view, as a rollback leaves it
    weight = (mx.random.normal((C, K, 1), key=kw) * 0.5).astype(dtype)
    try:
        got = conv_silu_native(x, window, weight)
        want = conv_silu_ops(x, window, weight)
        mx.eval(got, want)
    except Exception as e:  # noqa: BLE001 - a kernel that fails to build is not trusted
        return f"{type(e).__name__}: {e}"
    tol = 1e-2 if dtype != mx.float32 else 1e-4
    for name, a, b in zip(("out", "inputs", "window"), got, want, strict=True):
        a, b = a.astype(mx.float32), b.astype(mx.float32)
        if a.shape != b.shape or not mx.allclose(a, b, rtol=tol, atol=tol).item():
            return f"{name} differs"
    return None


def conv_silu(x: mx.array, window: mx.array, weight: mx.array, mode: str = "auto"):
    """The convolution on the best trusted path under kernel ``mode`` (see ``conv_silu_ops``
    for shapes)."""
    K = weight.shape[1]
    if (
        backend() != "cpu"
        and weight.shape[2] == 1
        and use_native(
            "conv_silu", (backend(), str(x.dtype), K), lambda: _self_check(x.dtype, K), mode
        )  # fmt: skip
    ):
        out = conv_silu_native(x, window, weight)
        if out is not None:
            return out
    return conv_silu_ops(x, window, weight)
