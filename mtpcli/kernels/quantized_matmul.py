"""Affine-quantized matmul for 1-8 rows that reads each weight once, row-invariant by construction.

MLX's quantized matrix-vector kernel re-reads the weights for every row of a 2-8 row input, so
a verify block of T positions costs about T decode steps in the matmuls. Here one launch serves
M = 1..8 rows: the weights are dequantized once (to the activations' dtype, one rounding) and
multiplied with a tensor-core ``mma.m16n8k16`` whose 8 columns are the M rows of x (unused
columns are zeros). Every output row is computed by the same instructions in the same order
whatever M is, so a verify row equals the decode row bitwise; the self-check confirms that on
the running GPU before the kernel is trusted.

Layout (MLX's affine quantization, as mlx-community checkpoints store it): ``w`` [N, K*bits/32]
uint32, value i of a word in bits [bits*i, bits*(i+1)); ``scales``, ``biases`` [N, K/group];
weight = scale * q + bias.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu as _swiglu

from . import available, backend, built, changed, kernel_name, launch_bounds, spell, use_native
from .gated_norm import gated_norm_in_place, gated_norm_ops
from .gated_norm import on_view as gated_norm_on_view
from .gated_norm import row as gated_norm_row

MAX_ROWS = 8  # the mma's n dimension
WARPS = 8  # split-K warps per 16-row tile, reduced in a fixed order
GROUP_SIZES = (32, 64, 128)
BITS = (4, 8)


@dataclass(frozen=True, eq=False)  # arrays: compared by identity
class Gate:
    """A gated-delta layer's output norm (``gated_norm``) for a product's x [..., K]: each head
    of D = ``weight.size`` values RMS-normalised with ``eps``, times ``weight`` [D], times SiLU
    of z, which is ``source``'s columns [offset, offset + K) (source [..., >= offset + K], x's
    rows: a fused projection's output, read in place)."""

    source: mx.array
    offset: int
    weight: mx.array
    eps: float

    def apply(self, y: mx.array, norm: Callable | None = None) -> mx.array:
        """y [..., H, D] normed and gated, as [..., H * D]: by ``gated_norm_in_place`` (the gate
        read from the source in place), or by ``norm`` (a ``gated_norm_ops``-like function of
        y and the gate's view [..., H, D]: the reference, a kernel under test)."""
        if norm is None:
            return gated_norm_in_place(y, self.source, self.offset, self.weight, self.eps)
        return gated_norm_on_view(norm, y, self.source, self.offset, self.weight, self.eps)

    def apply_flat(self, x: mx.array, norm: Callable | None = None) -> mx.array:
        """``apply`` to x [..., K] (heads side by side), [..., K]."""
        heads = (*x.shape[:-1], x.shape[-1] // self.weight.shape[-1], self.weight.shape[-1])
        return self.apply(x.reshape(heads), norm)


def quantized_matmul_ops(
    x, w, scales, biases, *, group_size: int, bits: int, residual: mx.array | None = None,
    norm_weight: mx.array | None = None, eps: float = 1e-6, swiglu: bool = False,
    x_sums: mx.array | None = None, next_norm: mx.array | None = None, gate: Gate | None = None,
):  # fmt: skip
    """Ops reference: x [..., K] times the dequantized w [N, K] transposed -> [..., N].

    Options, as MLX and mlx-lm compute them: ``norm_weight`` [K] RMS-normalises x first
    (``mx.fast.rms_norm`` with ``eps``); ``swiglu`` gives swiglu(first half, second half) of
    the outputs, [..., N/2] (gate and up projections as one weight); ``residual`` is added.
    A norm in two launches: with ``next_norm`` [N] (and a residual) the result is the tuple
    (y, y times next_norm, ``tile_sums(y)``), the norm begun; ``x_sums`` [..., K/16] finishes
    one: x is already times the norm's weight, and the outputs are scaled by
    rsqrt(sum(x_sums) / K + eps). ``gate`` applies a gated-delta layer's norm to x first.
    """
    if gate is not None:
        x = gate.apply_flat(x, gated_norm_ops)
    if norm_weight is not None:
        x = mx.fast.rms_norm(x, norm_weight, eps)
    y = mx.quantized_matmul(
        x, w, scales=scales, biases=biases, transpose=True, group_size=group_size, bits=bits
    )
    if x_sums is not None:
        y = finish_norm(y, x_sums, x.shape[-1], eps)
    if swiglu:
        y = _swiglu(*mx.split(y, 2, axis=-1))
    y = y if residual is None else residual + y
    return y if next_norm is None else (y, y * next_norm, tile_sums(y))


def finish_norm(y: mx.array, x_sums: mx.array, k: int, eps: float) -> mx.array:
    """The product y [..., N] of a norm begun before, scaled by its rsqrt(mean square + eps),
    the mean from x's tile sums [..., tiles] over its k features."""
    inv = mx.rsqrt(x_sums.sum(axis=-1, keepdims=True) / k + eps)
    return (y.astype(mx.float32) * inv).astype(y.dtype)


TILE = 16  # a plain product's output rows a threadgroup


def tile_sums(y: mx.array) -> mx.array:
    """y [..., N] -> each TILE of y's last axis summed in squares, [..., ceil(N / TILE)] float32."""
    n = y.shape[-1]
    sq = mx.square(y.astype(mx.float32))
    if n % TILE:
        sq = mx.pad(sq, [(0, 0)] * (y.ndim - 1) + [(0, -n % TILE)])
    return sq.reshape(*y.shape[:-1], -(-n // TILE), TILE).sum(axis=-1)


_HEADER_CUDA = """
__device__ __forceinline__ uint32_t qm_as_u32(__nv_bfloat162 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t qm_as_u32(__half2 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}

// N consecutive 32-bit words (16 or 8 bytes, aligned) in one load.
template <int N>
__device__ __forceinline__ void qm_load(uint32_t* dst, const uint32_t* src) {
  if constexpr (N == 4) {
    const uint4 v = *reinterpret_cast<const uint4*>(src);
    dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    dst[0] = v.x, dst[1] = v.y;
  }
}

// (w & mask) | bits as one LOP3: with both constants immediate, ptxas spends two (measured in
// the H200's SASS: 64 LOP3 a stretch where 32 do).
__device__ __forceinline__ uint32_t qm_and_or(uint32_t w, uint32_t mask, uint32_t bits) {
#ifdef __CUDA_ARCH__
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "r"(mask), "r"(bits));
  return r;
#else
  return (w & mask) | bits;
#endif
}

// Two quantized integers of a word as a pair of the activation type: values i and i + VPW/2.
template <int BITS>
__device__ __forceinline__ __nv_bfloat162 qm_ints(uint32_t w, int i, __nv_bfloat16) {
  constexpr uint32_t MASK = ((1u << BITS) - 1u) * 0x00010001u;
  if constexpr (BITS == 4) {  // 128 + q is exact in bfloat16 for q < 128
    const uint32_t m = qm_and_or(w >> (BITS * i), MASK, 0x43004300u);
    const uint32_t c = 0x43004300u;
    return __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&m),
                   *reinterpret_cast<const __nv_bfloat162*>(&c));
  } else {
    const uint32_t u = (w >> (BITS * i)) & MASK;
    return __floats2bfloat162_rn(static_cast<float>(u & 0xFFFFu), static_cast<float>(u >> 16));
  }
}

template <int BITS>
__device__ __forceinline__ __half2 qm_ints(uint32_t w, int i, __half) {
  constexpr uint32_t MASK = ((1u << BITS) - 1u) * 0x00010001u;
  const uint32_t m = qm_and_or(w >> (BITS * i), MASK, 0x64006400u);  // 1024 + q, exact
  const uint32_t c = 0x64006400u;
  return __hsub2(*reinterpret_cast<const __half2*>(&m), *reinterpret_cast<const __half2*>(&c));
}

// A value rounded to the activations' type XT (the kernel's template type), as MLX's ops round.
#define QM_RD(v) static_cast<float>(static_cast<XT>(v))

// A word of two activations as a pair of their type.
__device__ __forceinline__ __nv_bfloat162 qm_pair(uint32_t u, __nv_bfloat16) {
  return *reinterpret_cast<__nv_bfloat162*>(&u);
}
__device__ __forceinline__ __half2 qm_pair(uint32_t u, __half) {
  return *reinterpret_cast<__half2*>(&u);
}

__device__ __forceinline__ void qm_mma(
    float* c, const uint32_t* a, const uint32_t* b, __nv_bfloat16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void qm_mma(
    float* c, const uint32_t* a, const uint32_t* b, __half) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

"""

# A warp owns a 16-row tile and every WARPS-th 16-word stretch of K. Lane (g, t) = (lane / 4,
# lane % 4) dequantizes 4 words of rows g and g + 8 and loads x row g at the same k: exactly the
# A and B fragments of m16n8k16, up to a permutation of k inside each mma, which is the same for
# A and B and so leaves each product's terms unchanged. The warps' partial tiles are added in
# warp order. x rows g >= M are zeros; nothing else depends on M.
_CUDA_TEMPLATE = """
    constexpr int VPW = 32 / BITS;              // values per word
    constexpr int STEPS = VPW / 4;              // mma k-steps per word
    constexpr int XW = VPW / 2;                 // x words (2 values each) per weight word
    using XT2 = decltype(qm_ints<BITS>(0u, 0, XT{}));
    const int K = x_shape[x_ndim - 1];
    int M = 1;  // x [..., K]: its leading axes are rows, so no reshape is needed around a call
    for (int d = 0; d + 1 < x_ndim; ++d) M *= x_shape[d];
    const int N = w_shape[0];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    ROWS
    const int words = K / VPW;
    const int groups = K / GS;
    const int stretches = words / 16;
    const uint32_t* w_lo = w + lo * words;
    const uint32_t* w_hi = w + hi * words;
    const ST* s_lo = scales + lo * groups;
    const ST* b_lo = biases + lo * groups;
    const ST* s_hi = scales + hi * groups;
    const ST* b_hi = biases + hi * groups;
    const uint32_t* x_g = reinterpret_cast<const uint32_t*>(x) + (size_t)min(g, M - 1) * (K / 2);
    NORM_INIT
    GATE_INIT
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    auto pair = [](ST v) {  // a scale or bias as a pair of x's type
      const XT h = static_cast<XT>(static_cast<float>(v));
      return XT2{h, h};
    };
    // A stretch's weights, scales and biases are requested one stretch ahead, into registers.
    uint4 ql = {0u, 0u, 0u, 0u}, qh = ql;
    ST sl{}, bl{}, sh{}, bh{};
    auto fetch = [&](int st) {
      ql = *reinterpret_cast<const uint4*>(w_lo + st * 16 + t * 4);
      qh = *reinterpret_cast<const uint4*>(w_hi + st * 16 + t * 4);
      const int grp = ((st * 16 + t * 4) * VPW) / GS;
      sl = s_lo[grp];
      bl = b_lo[grp];
      sh = s_hi[grp];
      bh = b_hi[grp];
    };
    if (warp < stretches) fetch(warp);
    for (int st = warp; st < stretches; st += WARPS) {
      const int word0 = st * 16 + t * 4;
      const uint32_t wl[4] = {ql.x, ql.y, ql.z, ql.w};
      const uint32_t wh[4] = {qh.x, qh.y, qh.z, qh.w};
      const XT2 s2_lo = pair(sl), b2_lo = pair(bl), s2_hi = pair(sh), b2_hi = pair(bh);
      if (st + WARPS < stretches) fetch(st + WARPS);
      GATE_STRETCH
      for (int j = 0; j < 4; ++j) {
        uint32_t xv[XW];
        if (g < M) {
          qm_load<XW>(xv, x_g + (word0 + j) * XW);
        } else {
          for (int i = 0; i < XW; ++i) xv[i] = 0u;
        }
        NORM_X
        for (int s = 0; s < STEPS; ++s) {
          uint32_t a[4], b[2];
          a[0] = qm_as_u32(__hfma2(qm_ints<BITS>(wl[j], 2 * s, XT{}), s2_lo, b2_lo));
          a[1] = qm_as_u32(__hfma2(qm_ints<BITS>(wh[j], 2 * s, XT{}), s2_hi, b2_hi));
          a[2] = qm_as_u32(__hfma2(qm_ints<BITS>(wl[j], 2 * s + 1, XT{}), s2_lo, b2_lo));
          a[3] = qm_as_u32(__hfma2(qm_ints<BITS>(wh[j], 2 * s + 1, XT{}), s2_hi, b2_hi));
          b[0] = __byte_perm(xv[s], xv[s + STEPS], 0x5410);
          b[1] = __byte_perm(xv[s], xv[s + STEPS], 0x7632);
          qm_mma(c, a, b, XT{});
        }
      }
    }
    __shared__ float part[WARPS * 32 * 4];
    for (int i = 0; i < 4; ++i) part[(warp * 32 + lane) * 4 + i] = c[i];
    NORM_PART
    __syncthreads();
    if (warp == 0) {
      float acc[4];  // rows r_lo (0, 1) and r_hi (2, 3), x rows 2t and 2t + 1
      for (int i = 0; i < 4; ++i) {
        acc[i] = part[lane * 4 + i];
        for (int v = 1; v < WARPS; ++v) acc[i] = acc[i] + part[(v * 32 + lane) * 4 + i];
      }
      NORM_SCALE
      STORE
    }
"""
# The plain product's rows and store: a tile is 16 consecutive rows.
_CUDA_ROWS = """const int r_lo = blockIdx.x * 16 + g;
    const int r_hi = r_lo + 8;
    const size_t lo = min(r_lo, N - 1), hi = min(r_hi, N - 1);  // rows past N: any row, unused"""
_CUDA_STORE = """for (int i = 0; i < 4; ++i) {
        const int row = i < 2 ? r_lo : r_hi;
        const int m = 2 * t + (i & 1);
        if (row < N && m < M) y[(size_t)m * N + row] = static_cast<XT>(acc[i]);
      }"""
# The swiglu variant: a tile is 8 gate rows and their 8 up rows (the weight's second half),
# so each lane holds both halves of its outputs, and the store makes swiglu(gate, up) [M, N/2]
# with mlx-lm's roundings (silu(gate) * up, each op rounded to x's dtype).
_CUDA_ROWS_SWIGLU = """const int NY = N / 2;  // outputs: gate row r, up row r + NY
    const int r_lo = blockIdx.x * 8 + g;
    const size_t lo = min(r_lo, NY - 1), hi = lo + NY;  // rows past NY: any pair, unused"""
_CUDA_STORE_SWIGLU = """for (int i = 0; i < 2; ++i) {
        const int m = 2 * t + i;
        if (r_lo < NY && m < M) {
          const float gt = QM_RD(acc[i]), up = QM_RD(acc[i + 2]);
          const float sg = QM_RD(1.0f / (1.0f + expf(-gt)));
          y[(size_t)m * NY + r_lo] = static_cast<XT>(QM_RD(gt * sg) * up);
        }
      }"""
# The norm variant takes the un-normed x and an RMSNorm's weight [K] (x's dtype): it
# multiplies x by the weight as it loads it (one rounding, as the product's inputs are) and
# sums each row's squares on the way (a group's 4 lanes, then the warps, in a fixed order),
# and scales the row's outputs by rsqrt(mean + eps) at the end: the norm's launch saved.
_CUDA_NORM = {
    "NORM_INIT": """const uint32_t* nw = reinterpret_cast<const uint32_t*>(norm_w);
    float ss = 0.0f;  // x row g's squares over this lane's words""",
    "NORM_X": """{
          const uint32_t* nw_j = nw + (word0 + j) * XW;  // word by word: 3 registers fewer
          for (int i = 0; i < XW; ++i) {
            const XT2 p = qm_pair(xv[i], XT{});
            const float x0 = static_cast<float>(p.x), x1 = static_cast<float>(p.y);
            ss = fmaf(x0, x0, ss);
            ss = fmaf(x1, x1, ss);
            xv[i] = qm_as_u32(__hmul2(p, qm_pair(nw_j[i], XT{})));
          }
        }""",
    "NORM_PART": """ss = ss + __shfl_xor_sync(0xffffffffu, ss, 1);
    ss = ss + __shfl_xor_sync(0xffffffffu, ss, 2);
    __shared__ float ss_part[WARPS * 8];
    if (t == 0) ss_part[warp * 8 + g] = ss;""",
    "NORM_SCALE": """for (int i = 0; i < 2; ++i) {
        const int m = 2 * t + i;
        float sq = ss_part[m];
        for (int v = 1; v < WARPS; ++v) sq = sq + ss_part[v * 8 + m];
        const float inv = rsqrtf(sq / K + NORM_EPS);
        acc[i] = acc[i] * inv;
        acc[i + 2] = acc[i + 2] * inv;
      }""",
}

# Metal has no m16n8k16; the same tile, split-K and warp-order reduction, with lane (g, t)
# accumulating its rows' products for every x row itself and the 4 lanes of a row added last.
# The variants' splices are the CUDA ones' (``_METAL_*``): same rows, same roundings, and the
# squares of each x row summed in the same order.
_METAL_TEMPLATE = """
    constexpr int VPW = 32 / BITS;
    constexpr uint MASK = (1u << BITS) - 1u;
    const int K = x_shape[x_ndim - 1];
    int M = 1;  // x [..., K]: its leading axes are rows, so no reshape is needed around a call
    for (int d = 0; d + 1 < x_ndim; ++d) M *= x_shape[d];
    const int N = w_shape[0];
    const int lane = thread_index_in_simdgroup;
    const int warp = simdgroup_index_in_threadgroup;
    const int g = lane >> 2;
    const int t = lane & 3;
    ROWS
    const int words = K / VPW;
    const int groups = K / GS;
    const int stretches = words / 16;
    device const uint32_t* w_lo = w + lo * words;
    device const uint32_t* w_hi = w + hi * words;
    float c_lo[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    float c_hi[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    NORM_INIT
    GATE_INIT
    for (int st = warp; st < stretches; st += WARPS) {
      const int word0 = st * 16 + t * 4;
      const int grp = (word0 * VPW) / GS;
      const float s_lo = static_cast<float>(scales[lo * groups + grp]);
      const float b_lo = static_cast<float>(biases[lo * groups + grp]);
      const float s_hi = static_cast<float>(scales[hi * groups + grp]);
      const float b_hi = static_cast<float>(biases[hi * groups + grp]);
      GATE_STRETCH
      for (int j = 0; j < 4; ++j) {
        const uint32_t ql = w_lo[word0 + j];
        const uint32_t qh = w_hi[word0 + j];
        for (int i = 0; i < VPW; ++i) {
          const int k = (word0 + j) * VPW + i;
          // dequantized and rounded to x's dtype, as the CUDA kernel's A fragments are
          const float wl = float(XT(fma(float((ql >> (BITS * i)) & MASK), s_lo, b_lo)));
          const float wh = float(XT(fma(float((qh >> (BITS * i)) & MASK), s_hi, b_hi)));
          for (int m = 0; m < 8; ++m) {
            if (m < M) {
              float xm = static_cast<float>(x[(size_t)m * K + k]);
              NORM_X
              c_lo[m] = fma(xm, wl, c_lo[m]);
              c_hi[m] = fma(xm, wh, c_hi[m]);
            }
          }
        }
      }
    }
    for (int m = 0; m < 8; ++m) {
      for (ushort off = 1; off < 4; off <<= 1) {
        c_lo[m] = c_lo[m] + simd_shuffle_xor(c_lo[m], off);
        c_hi[m] = c_hi[m] + simd_shuffle_xor(c_hi[m], off);
      }
    }
    threadgroup float part[WARPS * 16 * 8];
    if (t == 0) {
      for (int m = 0; m < 8; ++m) {
        part[(warp * 16 + g) * 8 + m] = c_lo[m];
        part[(warp * 16 + g + 8) * 8 + m] = c_hi[m];
      }
    }
    NORM_PART
    threadgroup_barrier(mem_flags::mem_threadgroup);
    STORE
"""
# The rows are the CUDA kernel's; only the threadgroup index is spelled differently.
_METAL_ROWS, _METAL_ROWS_SWIGLU = (
    rows.replace("blockIdx.x", "threadgroup_position_in_grid.x")
    for rows in (_CUDA_ROWS, _CUDA_ROWS_SWIGLU)
)
_METAL_STORE = """if (warp == 0 && lane < 16) {
      const int row = threadgroup_position_in_grid.x * 16 + lane;
      for (int m = 0; m < M; ++m) {
        float acc = part[lane * 8 + m];
        for (int v = 1; v < WARPS; ++v) acc = acc + part[(v * 16 + lane) * 8 + m];
        NORM_SCALE
        if (row < N) y[(size_t)m * N + row] = static_cast<XT>(acc);
      }
    }"""
_METAL_STORE_SWIGLU = """if (warp == 0 && lane < 8) {
      const int row = threadgroup_position_in_grid.x * 8 + lane;
      for (int m = 0; m < M; ++m) {
        float acc = part[lane * 8 + m];  // the gate row
        float up_acc = part[(lane + 8) * 8 + m];  // its up row
        for (int v = 1; v < WARPS; ++v) {
          acc = acc + part[(v * 16 + lane) * 8 + m];
          up_acc = up_acc + part[(v * 16 + lane + 8) * 8 + m];
        }
        NORM_SCALE
        const float gt = float(XT(acc)), up = float(XT(up_acc));
        const float sg = float(XT(1.0f / (1.0f + exp(-gt))));
        if (row < NY) y[(size_t)m * NY + row] = static_cast<XT>(float(XT(gt * sg)) * up);
      }
    }"""
_METAL_NORM = {
    "NORM_INIT": "float ss[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // x rows' squares, this lane's k",
    "NORM_X": """ss[m] = fma(xm, xm, ss[m]);
              xm = float(XT(xm * static_cast<float>(norm_w[k])));""",
    "NORM_PART": """threadgroup float ss_part[WARPS * 8];
    for (int m = 0; m < 8; ++m) {
      for (ushort off = 1; off < 4; off <<= 1) ss[m] = ss[m] + simd_shuffle_xor(ss[m], off);
      if (lane == 0) ss_part[warp * 8 + m] = ss[m];
    }""",
    "NORM_SCALE": """float sq = ss_part[m];
        for (int v = 1; v < WARPS; ++v) sq = sq + ss_part[v * 8 + m];
        const float inv = rsqrt(sq / K + NORM_EPS);
        acc = acc * inv;
        SCALE_UP""",
}

# The gated variant takes the gated-delta layer's output y as x, and applies that layer's norm
# (kernels/gated_norm.py) to it: each head of D = 16 * VPW values (one stretch) RMS-normalised,
# times the norm's weight ``gate_w`` [D], times SiLU of z (``z``'s columns [Z_OFF, Z_OFF + K):
# a fused projection's output, read in place). Before a stretch's products the warp runs the
# standalone kernel's row code (``gated_norm.ROW``, the same text) on the stretch's head, lane
# l its D / 32 values of each x row, into its own rows of shared memory; the products then
# read x there. So x is that kernel's output bitwise, and its launch is saved.
# (Every tile redoes the norm: M * D values a stretch, D / 32 a lane, instead of 4 * VPW * M a
# lane had each lane gated the values it multiplies.) One text for both backends.
_GATE_STRETCH = """WARP_SYNC;  // the last stretch's x is read
      for (int m = 0; m < M; ++m) {
        constexpr int D = 16 * VPW;  // a head: the stretch's values
        constexpr int NPT = D / 32;  // the standalone kernel's values a lane
        DEVICE const XT* y_m = x + (size_t)m * K + st * D + lane * NPT;
        DEVICE const XT* z_m = z + (size_t)m * z_shape[z_ndim - 1] + Z_OFF + st * D + lane * NPT;
        GATED_ROW
      }
      WARP_SYNC;  // and this stretch's written""".replace("GATED_ROW", gated_norm_row(
    "y_m[i]", "z_m[i]", "gate_w[lane * NPT + i]", "gx[(warp * 8 + m) * D + lane * NPT + i]",
    "XT"))  # fmt: skip
_X_LOADS = (  # CUDA, Metal: x's load in the products' loop, and the gated variant's
    ("qm_load<XW>(xv, x_g + (word0 + j) * XW);",
     "qm_load<XW>(xv, reinterpret_cast<const uint32_t*>(gx + (warp * 8 + g) * 16 * VPW)"
     " + (t * 4 + j) * XW);"),
    ("float xm = static_cast<float>(x[(size_t)m * K + k]);",
     "float xm = static_cast<float>(gx[(warp * 8 + m) * 16 * VPW + k - st * 16 * VPW]);"),
)  # fmt: skip
_GATE = {  # CUDA, Metal: the splices, and x's load replaced
    metal: {
        "GATE_INIT": ("threadgroup XT gx[WARPS * 8 * 16 * VPW];  // x rows, a SIMD-group's"
                      if metal else
                      "__align__(16) __shared__ XT gx[WARPS * 8 * 16 * VPW];  // x rows, a warp's"),
        _X_LOADS[metal][0]: _X_LOADS[metal][1],
    }
    for metal in (False, True)
}  # fmt: skip

# The norm can also be split across two launches, out of the product's loop: the launch that
# makes a residual sum h (the layer's previous product, ``Variant.emits``) also stores h times
# the next RMSNorm's weight (``y_w``, rounded as x is when the norm variant loads it) and, per
# 16-row tile, each row's sum of h's squares (``y_sums`` [M, tiles]); the next product then
# runs the plain loop on y_w and scales its outputs by rsqrt(mean + eps), the mean from those
# partial sums added in a fixed order (``Variant.sums_eps``). A tile's squares: lane (g, t)
# holds rows g and g + 8 of x rows 2t and 2t + 1, added over g by three shuffles.
_CUDA_STORE_EMITS = """float sq[2] = {0.0f, 0.0f};  // x rows 2t, 2t + 1: this lane's rows' squares
      for (int i = 0; i < 4; ++i) {
        const int row = i < 2 ? r_lo : r_hi;
        const int m = 2 * t + (i & 1);
        if (row < N && m < M) {
          const XT h = static_cast<XT>(QM_RD(acc[i])
            + static_cast<float>(residual[(size_t)m * N + row]));
          y[(size_t)m * N + row] = h;
          y_w[(size_t)m * N + row] =
              static_cast<XT>(static_cast<float>(h) * static_cast<float>(norm_w[row]));
          sq[i & 1] = fmaf(static_cast<float>(h), static_cast<float>(h), sq[i & 1]);
        }
      }
      for (int off = 4; off < 32; off <<= 1) {
        sq[0] = sq[0] + __shfl_xor_sync(0xffffffffu, sq[0], off);
        sq[1] = sq[1] + __shfl_xor_sync(0xffffffffu, sq[1], off);
      }
      const int tiles = (N + 15) / 16;
      for (int i = 0; i < 2; ++i) {
        const int m = 2 * t + i;
        if (g == 0 && m < M) y_sums[(size_t)m * tiles + blockIdx.x] = sq[i];
      }"""
# x row m's partial sums, added by warp m (lanes apart, then a fixed tree) while the first
# stretch's weights are on their way; read back in the store's scaling. (One text for both
# backends: ``kernels.spell``.)
_SUMS_INIT = """    SHARED float row_ss[8];
    for (int m = warp; m < M; m += WARPS) {
      const int P = x_sums_shape[x_sums_ndim - 1];
      float s = 0.0f;
      for (int p = lane; p < P; p += 32) s = s + x_sums[(size_t)m * P + p];
      for (LANE_OFFSET off = 16; off > 0; off >>= 1) s = s + XOR_SHUFFLE(s, off);
      if (lane == 0) row_ss[m] = s;
    }
"""
_CUDA_SUMS_SCALE = """for (int i = 0; i < 2; ++i) {
        const float inv = rsqrtf(row_ss[2 * t + i] / K + NORM_EPS);  // rows >= M: unused
        acc[i] = acc[i] * inv;
        acc[i + 2] = acc[i + 2] * inv;
      }"""
_METAL_STORE_EMITS = """if (warp == 0) {  // all 32 lanes (the shuffles); lane l < 16 stores row l
      const int l = lane & 15;
      const int row = threadgroup_position_in_grid.x * 16 + l;
      const int tiles = (N + 15) / 16;
      for (int m = 0; m < M; ++m) {
        float acc = part[l * 8 + m];
        for (int v = 1; v < WARPS; ++v) acc = acc + part[(v * 16 + l) * 8 + m];
        float hf = 0.0f;
        if (row < N) {
          const XT h = static_cast<XT>(float(XT(acc))
            + static_cast<float>(residual[(size_t)m * N + row]));
          hf = float(h);
          if (lane < 16) {
            y[(size_t)m * N + row] = h;
            y_w[(size_t)m * N + row] = static_cast<XT>(hf * static_cast<float>(norm_w[row]));
          }
        }
        // rows l and l + 8 in lane l < 8, then lanes 1, 2, 4 apart: CUDA's order
        const float h8 = simd_shuffle(hf, ushort((lane + 8) & 31));
        float sq = fma(h8, h8, fma(hf, hf, 0.0f));
        for (ushort off = 1; off < 8; off <<= 1) sq = sq + simd_shuffle_xor(sq, off);
        if (lane == 0) y_sums[(size_t)m * tiles + threadgroup_position_in_grid.x] = sq;
      }
    }"""
_METAL_SUMS_SCALE = """const float inv = rsqrt(row_ss[m] / K + NORM_EPS);
        acc = acc * inv;
        SCALE_UP"""
# Where the sums are added: before the loop (CUDA: after the first stretch is requested).
_LOOP_STARTS = (  # CUDA, Metal
    "    if (warp < stretches) fetch(warp);\n",
    "    for (int st = warp; st < stretches; st += WARPS) {\n",
)

# The residual variant adds a residual [M, N] (x's dtype) to the rounded product in its store,
# as MLX's add would (float sum of two x-dtype values, rounded once): a layer's ``h + proj(x)``
# in one launch instead of two, with the same bits.
_STORES = ("= static_cast<XT>(acc[i]);", "= static_cast<XT>(acc);")  # CUDA, Metal


def with_residual(source: str) -> str:
    """A product's source with the residual added in its store (CUDA or Metal)."""
    for store in _STORES:
        if source.count(store) == 1:
            added = (
                f"= static_cast<XT>(static_cast<float>({store[2:-1]})\n"
                "            + static_cast<float>(residual[(size_t)m * N + row]));"
            )
            return source.replace(store, added)
    raise AssertionError("the product's store is not where it was")


@dataclass(frozen=True)
class Variant:
    """What one launch does besides the product: RMS-normalise x first (with this eps), or
    finish a norm that the previous launch began (``sums_eps``); swiglu the two halves of its
    outputs; add a residual in its store, and begin the next norm there (``emits``)."""

    norm_eps: float | None = None
    swiglu: bool = False
    residual: bool = False
    emits: bool = False  # with ``residual``: also the sum times a norm weight, its tile sums
    sums_eps: float | None = None  # x comes normed but unscaled, with its tile sums (this eps)
    gate_eps: float | None = None  # x is a gated-delta output, given its gated norm (this eps)

    def eps(self) -> float | None:
        return next((e for e in (self.norm_eps, self.sums_eps, self.gate_eps) if e is not None),
                    None)  # fmt: skip

    def suffix(self) -> str:
        return ("_norm" * (self.norm_eps is not None) + "_sums" * (self.sums_eps is not None)
                + "_gated" * (self.gate_eps is not None) + "_swiglu" * self.swiglu
                + "_add" * self.residual + "_emits" * self.emits)  # fmt: skip


PLAIN = Variant()


def launch_shape(n: int, swiglu: bool) -> tuple[int, int]:
    """(outputs, threadgroups) of a product over n weight rows: a threadgroup makes 16 rows'
    outputs, or with swiglu 8 (a tile holds 8 gate rows and their 8 up rows)."""
    n_out, tile = (n // 2, 8) if swiglu else (n, 16)
    return n_out, (n_out + tile - 1) // tile


def source(metal: bool, variant: Variant = PLAIN) -> str:
    """One variant's kernel body for one backend, its splices filled in."""
    norm, sums = variant.norm_eps is not None, variant.sums_eps is not None
    gated = variant.gate_eps is not None
    assert norm + sums + gated <= 1, "x is normed one way"
    assert variant.residual or not variant.emits, "only a residual sum begins a norm"
    if metal:
        text, splices = _METAL_TEMPLATE, _METAL_NORM
        rows, store = ((_METAL_ROWS_SWIGLU, _METAL_STORE_SWIGLU) if variant.swiglu
                       else (_METAL_ROWS, _METAL_STORE_EMITS if variant.emits
                             else _METAL_STORE))  # fmt: skip
        sums_scale, start = _METAL_SUMS_SCALE, _LOOP_STARTS[1]
    else:
        text, splices = _CUDA_TEMPLATE, _CUDA_NORM
        rows, store = ((_CUDA_ROWS_SWIGLU, _CUDA_STORE_SWIGLU) if variant.swiglu
                       else (_CUDA_ROWS, _CUDA_STORE_EMITS if variant.emits
                             else _CUDA_STORE))  # fmt: skip
        sums_scale, start = _CUDA_SUMS_SCALE, _LOOP_STARTS[0]
    text = text.replace("ROWS", rows).replace("STORE", store)
    if sums:
        assert text.count(start) == 1
        sums_init = spell(_SUMS_INIT, metal)
        text = text.replace(start, start + sums_init if not metal else sums_init + start)
        text = text.replace("NORM_SCALE", sums_scale)
    for token, code in splices.items():
        text = text.replace(token, code if norm else "")
    for token, code in ({"GATE_STRETCH": spell(_GATE_STRETCH, metal)} | _GATE[metal]).items():
        assert text.count(token) == 1, token
        if gated:
            text = text.replace(token, code)
        elif token.startswith("GATE_"):  # (the x load stays)
            text = text.replace(token, "")
    text = text.replace("SCALE_UP", "up_acc = up_acc * inv;" if variant.swiglu else "")
    if norm or sums or gated:
        text = text.replace("NORM_EPS", f"{variant.eps():.9e}f")
    if variant.residual and not variant.emits:
        assert not variant.swiglu, "a swiglu output has no residual"
        text = with_residual(text)
    return text


_CUDA_SOURCE, _METAL_SOURCE = source(False), source(True)  # the plain product's
_kernels: dict = {}


def _spec(metal: bool, header: str, variant: Variant = PLAIN) -> dict:
    text = source(metal, variant)
    return {
        "name": kernel_name("mtp_qmm" + variant.suffix(), text, header),
        "input_names": ["x", "w", "scales", "biases"]
        + ["norm_w"] * (variant.norm_eps is not None or variant.emits)
        + ["x_sums"] * (variant.sums_eps is not None)
        + ["residual"] * variant.residual
        + ["z", "gate_w"] * (variant.gate_eps is not None),
        "output_names": ["y"] + ["y_w", "y_sums"] * variant.emits,
        "source": text,
        "header": header,
    }


def _build_cuda(variant: Variant, header: str = _HEADER_CUDA):
    if not available("cuda"):
        return None
    return mx.fast.cuda_kernel(**_spec(False, header, variant))


def _build_metal(variant: Variant):
    if not available("metal"):
        return None
    return mx.fast.metal_kernel(**_spec(True, "", variant))


# The norm and swiglu variants take 66-68 registers unbounded (3 blocks of 8 warps a
# multiprocessor); bounded to 4 blocks, ptxas fits them in 64 without spills
# (tests/test_cuda_compile.py).
NORM_MIN_BLOCKS = 4


def header(variant: Variant, warps: int = WARPS, min_blocks: int | None = None) -> str:
    """The CUDA header a variant's kernel is built with (``min_blocks``: launch bounds)."""
    in_loop = variant.norm_eps is not None or variant.gate_eps is not None or variant.swiglu
    if min_blocks is None and in_loop and warps == WARPS:
        min_blocks = NORM_MIN_BLOCKS
    return _HEADER_CUDA + (launch_bounds(warps, min_blocks) if min_blocks else "")


def _kernel(variant: Variant, warps: int = WARPS, min_blocks: int | None = None):
    text = header(variant, warps, min_blocks)
    return built(_kernels, (variant, text), lambda: _build_cuda(variant, text),
                 lambda: _build_metal(variant))  # fmt: skip


def _variant(norm_weight, eps: float, swiglu: bool, residual, x_sums, next_norm,
             gate: Gate | None = None) -> Variant:  # fmt: skip
    return Variant(eps if norm_weight is not None else None, swiglu, residual is not None,
                   next_norm is not None, eps if x_sums is not None else None,
                   gate.eps if gate is not None else None)  # fmt: skip


def quantized_matmul_native(
    x, w, scales, biases, *, group_size: int, bits: int, residual: mx.array | None = None,
    norm_weight: mx.array | None = None, eps: float = 1e-6, swiglu: bool = False,
    x_sums: mx.array | None = None, next_norm: mx.array | None = None, gate: Gate | None = None,
    warps: int = WARPS, min_blocks: int | None = None,
):  # fmt: skip
    """The native kernel for x [..., K] of M <= 8 rows (the leading axes): y [..., N] in x's
    dtype, or with ``next_norm`` the tuple of ``quantized_matmul_ops`` (see there for the
    options; ``norm_weight``, ``next_norm`` and ``residual`` in x's dtype, ``x_sums`` [..., K/16]
    float32, a gate's source [..., >= offset + K] in x's dtype and its heads of 16 words'
    values, each with x's rows); None where there is none. ``warps`` and ``min_blocks`` (launch
    bounds, CUDA) are for benchmarks."""
    variant = _variant(norm_weight, eps, swiglu, residual, x_sums, next_norm, gate)
    kernel = _kernel(variant, warps, min_blocks)
    if kernel is None:
        return None
    lead, N = x.shape[:-1], w.shape[0]
    n_out, groups = launch_shape(N, swiglu)
    nw = norm_weight if norm_weight is not None else next_norm
    extra = [a for a in (nw, x_sums, residual) if a is not None]
    extra += [gate.source, gate.weight] if gate is not None else []
    emits = next_norm is not None
    out = kernel(
        inputs=[x, w, scales, biases, *extra],
        template=[
            ("XT", x.dtype),
            ("ST", scales.dtype),
            ("BITS", bits),
            ("GS", group_size),
            ("WARPS", warps),
        ]
        + ([("Z_OFF", gate.offset)] if gate is not None else []),
        grid=(32 * warps * groups, 1, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(*lead, n_out)] + [(*lead, N), (*lead, groups)] * emits,
        output_dtypes=[x.dtype] + [x.dtype, mx.float32] * emits,
    )
    return tuple(out) if emits else out[0]


def random_quantized(n: int, k: int, group_size: int, bits: int, dtype, seed: int):
    """Random affine-quantized weights [N, K] (packed words, scales, biases) for checks."""
    kh, kl, ks, kb = mx.random.split(mx.random.key(seed), 4)
    shape = (n, k * bits // 32)
    w = (mx.random.randint(0, 2**16, shape, dtype=mx.uint32, key=kh) << 16) | mx.random.randint(
        0, 2**16, shape, dtype=mx.uint32, key=kl
    )  # all 32 bits random
    scales = (mx.random.uniform(0.5, 1.5, (n, k // group_size), key=ks) * 0.02).astype(dtype)
    biases = (mx.random.normal((n, k // group_size), key=kb) * 0.1).astype(dtype)
    return w, scales, biases


def _self_check(dtype, sdtype, group_size: int, bits: int, variant: Variant = PLAIN,
                gate_dtype=None) -> str | None:  # fmt: skip
    """Agreement with the reference and row invariance (M = 1, 3, 8) of one variant, on 40
    weight rows of K = 1024 (a gate's weight in ``gate_dtype``)."""
    n, k = 40, 1024  # 40 rows: a partial last tile (of 16 rows; with swiglu, of 8 pairs)
    w, scales, biases = random_quantized(n, k, group_size, bits, sdtype, seed=7)
    x = (mx.random.normal((8, k), key=mx.random.key(8)) * 3).astype(dtype)
    opts: dict = {"group_size": group_size, "bits": bits, "swiglu": variant.swiglu}
    # small enough that float16 holds swiglu of 8-bit products (their weights are large)
    nw = mx.random.uniform(0.1, 0.3, (k,), key=mx.random.key(10)).astype(dtype)
    sums = None
    if variant.norm_eps is not None:
        opts |= {"eps": variant.norm_eps, "norm_weight": nw}
    if variant.sums_eps is not None:  # x as a norm begun before: times the weight, its sums
        x, sums, opts = x * nw, tile_sums(x), opts | {"eps": variant.sums_eps}
    n_out = n // 2 if variant.swiglu else n
    r = mx.random.normal((8, n_out), key=mx.random.key(9)).astype(dtype)
    next_w = mx.random.uniform(0.5, 1.5, (n,), key=mx.random.key(11)).astype(dtype)
    z = (mx.random.normal((8, k + 48), key=mx.random.key(12)) * 2).astype(dtype)  # z at 16
    gw = mx.random.uniform(0.5, 1.5, (16 * 32 // bits,), key=mx.random.key(13))

    def rows(m: int) -> dict:
        return ({"residual": r[:m]} if variant.residual else {}) | (
            {"x_sums": sums[:m]} if sums is not None else {}
        ) | ({"next_norm": next_w} if variant.emits else {}) | (
            {"gate": Gate(z[:m], 16, gw.astype(gate_dtype), variant.gate_eps)}
            if variant.gate_eps is not None else {}
        )  # fmt: skip

    try:
        got = {m: quantized_matmul_native(x[:m], w, scales, biases, **opts, **rows(m))
               for m in (1, 3, 8)}  # fmt: skip
        want = quantized_matmul_ops(x, w, scales, biases, **opts, **rows(8))
        mx.eval(got, want)
    except Exception as e:  # noqa: BLE001 - a kernel that fails to build is not trusted
        return f"{type(e).__name__}: {e}"
    parts = lambda y: y if isinstance(y, tuple) else (y,)  # noqa: E731 - (y, y_w, y_sums)
    names = ("outputs", "outputs times the next norm", "tile sums")[: len(parts(want))]
    for m in (1, 3, 8):
        if len(parts(got[m])) != len(names):
            return f"gives {len(parts(got[m]))} outputs, not {len(names)}"
    for name, a, b in zip(names, parts(got[8]), parts(want), strict=True):
        if a.shape != b.shape:
            return f"{name} have the shape {a.shape}, not {b.shape}"
        a, b = a.astype(mx.float32), b.astype(mx.float32)
        err = mx.abs(a - b).max().item()
        if not err <= 2e-2 * mx.abs(b).max().item():
            return f"{name} differ from the reference by up to {err:.3g}"
    for m in (1, 3):
        for a, b in zip(parts(got[m]), parts(got[8]), strict=True):
            if not mx.array_equal(a, b[:m]).item():
                return f"rows of an {m}-row product differ from the same rows of an 8-row product"
    return None


def supported(x: mx.array, w: mx.array, group_size: int, bits: int) -> bool:
    """Whether the native kernel's layout covers this product (else the reference runs)."""
    k = x.shape[-1]
    return (
        x.dtype in (mx.bfloat16, mx.float16)
        and bits in BITS
        and group_size in GROUP_SIZES
        and k % (16 * 32 // bits) == 0
        and w.ndim == 2
    )


def _native(
    x, w, scales, biases, *, group_size: int, bits: int, residual: mx.array | None = None,
    norm_weight: mx.array | None = None, eps: float = 1e-6, swiglu: bool = False,
    x_sums: mx.array | None = None, next_norm: mx.array | None = None, gate: Gate | None = None,
):  # fmt: skip
    """The product as one trusted native launch (x [..., K], the options' arrays shaped as x's
    rows), or None where the variant does not run natively here."""
    rows, n, k = math.prod(x.shape[:-1]), w.shape[0], x.shape[-1]
    variant = _variant(norm_weight, eps, swiglu, residual, x_sums, next_norm, gate)
    n_out = n // 2 if swiglu else n

    def fits(a, shape, dtype) -> bool:
        return a is None or (a.shape == shape and a.dtype == dtype)

    gate_dtype = gate.weight.dtype if gate is not None else None

    def gate_fits() -> bool:  # a head is a stretch; no other norm of x
        src = gate.source
        return (norm_weight is None and x_sums is None and src.dtype == x.dtype
                and src.shape[:-1] == x.shape[:-1] and 0 <= gate.offset <= src.shape[-1] - k
                and gate.weight.shape == (16 * 32 // bits,))  # fmt: skip

    if not (
        backend() != "cpu"
        and 1 <= rows <= MAX_ROWS
        and biases is not None
        and supported(x, w, group_size, bits)
        and (not swiglu or (n % 2 == 0 and residual is None))
        and fits(residual, (*x.shape[:-1], n_out), x.dtype)
        and fits(norm_weight, (k,), x.dtype)
        and fits(next_norm, (n,), x.dtype)
        and fits(x_sums, (*x.shape[:-1], -(-k // TILE)), mx.float32)
        and (gate is None or gate_fits())
        and use_native(
            "quantized_matmul" + variant.suffix(),
            (backend(), str(x.dtype), str(scales.dtype), group_size, bits, variant.eps())
            + ((str(gate_dtype),) if gate is not None else ()),
            lambda: _self_check(x.dtype, scales.dtype, group_size, bits, variant, gate_dtype),
        )  # fmt: skip
    ):
        return None
    # The kernel takes x [..., K] and the options with x's leading axes as they are: a reshape
    # is a graph node that MLX builds and encodes (530 of a 27B decode step's 1,281, counted).
    return quantized_matmul_native(
        x, w, scales, biases, group_size=group_size, bits=bits, norm_weight=norm_weight,
        eps=eps, swiglu=swiglu, next_norm=next_norm, x_sums=x_sums, residual=residual, gate=gate,
    )  # fmt: skip


def quantized_matmul(
    x, w, scales, biases, *, group_size: int, bits: int, residual: mx.array | None = None,
    norm_weight: mx.array | None = None, eps: float = 1e-6, swiglu: bool = False,
    x_sums: mx.array | None = None, gate: Gate | None = None,
) -> mx.array:  # fmt: skip
    """``quantized_matmul_ops`` (same options, but for ``next_norm``: see ``linear_add``) on
    the best trusted path: one native launch where the variant runs natively here, else the
    options as their own ops around the product, which may still run natively."""
    opts = {"norm_weight": norm_weight, "eps": eps, "swiglu": swiglu, "x_sums": x_sums}
    out = _native(x, w, scales, biases, group_size=group_size, bits=bits, residual=residual,
                  gate=gate, **opts)  # fmt: skip
    if out is not None:
        return out
    if gate is not None:  # the gated norm in its own launch
        return quantized_matmul(gate.apply_flat(x), w, scales, biases, group_size=group_size,
                                bits=bits, residual=residual, **opts)  # fmt: skip
    if _variant(norm_weight, eps, swiglu, residual, x_sums, None) == PLAIN:
        return quantized_matmul_ops(x, w, scales, biases, group_size=group_size, bits=bits)
    if norm_weight is not None:
        x = mx.fast.rms_norm(x, norm_weight, eps)
    y = quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits)
    if x_sums is not None:
        y = finish_norm(y, x_sums, x.shape[-1], eps)
    if swiglu:
        y = _swiglu(*mx.split(y, 2, axis=-1))
    return y if residual is None else residual + y


# Whether ``linear_add`` lets our product add the residual (benchmarks turn it off to compare),
# and begin the norm that follows. The latter is off: on the H200 it took 0.85 ms of GPU time
# off a 27B decode step (8.51 -> 7.66 ms), yet decode ran slower where the host set the pace
# (docs/benchmark_results/README.md, session 14); bench_verify's ``ours_norm_begun`` arm.
FUSE_RESIDUAL = True
BEGIN_NORMS = False
# Whether the out projection of a gated-delta layer applies the layer's gated norm to its input
# itself (``Gate``), saving the norm's launch (48 a step of the 27B). Off: on the H200 the
# folded launch took 31.3 us in a 3-token verify against 11.9 + 3.1 for the two (every tile
# redoes the norm), and classic decode, paced by the host there, did not run measurably faster
# for the 48 launches saved (docs/benchmark_results/README.md, session 16); bench_verify's
# ``ours_gate_folded`` arm.
FUSE_GATE = False


@dataclass(frozen=True, eq=False)  # arrays and a module: compared by identity
class NormBegun:
    """A residual sum whose next RMSNorm the launch that made it has begun (``Variant.emits``):
    ``h`` [..., N], ``scaled`` h times ``norm``'s weight, ``sums`` h's tile sums of squares
    [..., N/16] float32. A ``FusedProjection`` called with that norm finishes it."""

    h: mx.array
    scaled: mx.array
    sums: mx.array
    norm: nn.Module


def linear_add(
    layer: nn.Module, x: mx.array, residual: mx.array, then: nn.Module | None = None,
    gate: Gate | None = None,
) -> mx.array | NormBegun:  # fmt: skip
    """``residual + layer(x)``: one launch where ``layer`` runs through our product, which adds
    the residual in its store with MLX's rounding; otherwise the two ops. With ``then`` (the
    RMSNorm that the sum feeds) the launch also begins that norm, where it can: a NormBegun.
    With ``gate``, x is a gated-delta layer's output y [..., H, D], normed by ``gate`` first:
    in the product's launch (``FUSE_GATE``) where it can, else in the norm's own."""
    ours = FUSE_RESIDUAL and type(layer) is KernelQuantizedLinear and "bias" not in layer
    if gate is not None:  # x [..., H, D] -> [..., H * D], normed unless the product norms it
        if ours and FUSE_GATE:
            x = x.reshape(*x.shape[:-2], -1)
        else:
            x, gate = gate.apply(x), None
    if not ours:
        return residual + layer(x)
    opts = {"group_size": layer.group_size, "bits": layer.bits, "residual": residual,
            "gate": gate}  # fmt: skip
    parts = (layer["weight"], layer["scales"], layer.get("biases"))
    if then is not None and BEGIN_NORMS and isinstance(then, nn.RMSNorm):
        out = _native(x, *parts, next_norm=then.weight, **opts)
        if out is None and gate is not None:  # the gate does not fold: its own launch first
            x, opts["gate"] = gate.apply_flat(x), None
            out = _native(x, *parts, next_norm=then.weight, **opts)
        if out is not None:
            return NormBegun(*out, then)
    return quantized_matmul(x, *parts, **opts)


def residual_of(h: mx.array | NormBegun) -> mx.array:
    """The residual sum itself, whether or not its next norm was begun."""
    return h.h if isinstance(h, NormBegun) else h


class KernelQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose product runs through ``quantized_matmul``."""

    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_matmul(
            x, self["weight"], self["scales"], self.get("biases"),
            group_size=self.group_size, bits=self.bits,
        )  # fmt: skip
        return y + self["bias"] if "bias" in self else y


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose tied-head product runs through ``quantized_matmul``."""

    def as_linear(self, x: mx.array) -> mx.array:
        return quantized_matmul(
            x, self["weight"], self["scales"], self.get("biases"),
            group_size=self.group_size, bits=self.bits,
        )  # fmt: skip


# Whether fused projections take their input norm / make their swiglu in the product's launch
# (benchmarks turn them off to compare).
FUSE_NORM = True
FUSE_SWIGLU = True


class FusedProjection(nn.Module):
    """Sibling quantized projections of one input as one product (one launch, one weight read).

    The siblings' weights are concatenated along the output axis once; the siblings keep views
    of their rows, so no weight is stored twice. Our kernel computes each output row the same
    way whatever the other rows are, so the fused outputs equal the separate ones bitwise.
    With ``swiglu`` the two siblings are an MLP's gate and up, and the product returns
    swiglu(gate, up). Called with the RMSNorm that precedes it, the product normalises its
    input itself (the norm's launch saved, its rounding the product's).
    """

    def __init__(self, linears: list[nn.QuantizedLinear], swiglu: bool = False):
        super().__init__()
        first = linears[0]
        self.group_size, self.bits = first.group_size, first.bits
        self.sizes = [m.weight.shape[0] for m in linears]
        if swiglu and (len(self.sizes) != 2 or self.sizes[0] != self.sizes[1]):
            raise ValueError(f"swiglu needs a gate and an up of one size, got {self.sizes}")
        self.swiglu = swiglu
        self._cuts = [sum(self.sizes[: i + 1]) for i in range(len(self.sizes) - 1)]
        for name in ("weight", "scales", "biases"):
            fused = mx.concatenate([m[name] for m in linears])  # [sum(N), ...]
            mx.eval(fused)
            self[name] = fused
            start = 0
            for m, n in zip(linears, self.sizes, strict=True):
                m[name] = fused[start : start + n]  # a view: the sibling's own rows
                start += n
        mx.eval([m.parameters() for m in linears])

    @staticmethod
    def fusable(linears: list) -> bool:
        first = linears[0]
        return all(
            isinstance(m, nn.QuantizedLinear)
            and getattr(m, "mode", "affine") == "affine"
            and "bias" not in m
            and "biases" in m
            and (m.group_size, m.bits, m.weight.shape[1]) == (
                first.group_size, first.bits, first.weight.shape[1])
            for m in linears
        )  # fmt: skip

    def __call__(self, x: mx.array | NormBegun, norm: nn.RMSNorm | None = None) -> mx.array:
        """x [..., K] (normed by ``norm`` first, if given; a NormBegun of that norm finishes
        it) -> the siblings' outputs side by side, [..., sum(N)] (see ``split``); with
        ``swiglu``, swiglu(gate, up) [..., N/2]."""
        opts: dict = {}
        if norm is not None and not FUSE_NORM:
            x, norm = norm(residual_of(x)), None
        elif isinstance(x, NormBegun) and x.norm is norm:
            x, opts = x.scaled, {"x_sums": x.sums, "eps": norm.eps}
        else:
            x = residual_of(x)
            if norm is not None:
                opts = {"norm_weight": norm.weight, "eps": norm.eps}
        fold = self.swiglu and FUSE_SWIGLU
        y = quantized_matmul(
            x, self["weight"], self["scales"], self["biases"],
            group_size=self.group_size, bits=self.bits, swiglu=fold, **opts,
        )  # fmt: skip
        return _swiglu(*self.split(y)) if self.swiglu and not fold else y

    def split(self, y: mx.array) -> list[mx.array]:
        return mx.split(y, self._cuts, axis=-1)

    def start(self, i: int) -> int:
        """Where sibling i's outputs begin in the fused outputs' last axis."""
        return ([0] + self._cuts)[i]


_OURS = {nn.QuantizedLinear: KernelQuantizedLinear, nn.QuantizedEmbedding: KernelQuantizedEmbedding}
_STOCK = {v: k for k, v in _OURS.items()}


def install(module: nn.Module, enabled: bool = True) -> int:
    """Route every affine-quantized linear layer of ``module`` through ``quantized_matmul``.

    The classes are swapped in place (they add no state), so parameters, names and the
    checkpoint layout stay mlx-lm's; ``enabled=False`` swaps mlx's own classes back. Returns
    how many layers were swapped.
    """
    table = _OURS if enabled else _STOCK
    swapped = 0
    for _, m in module.named_modules():
        cls = table.get(type(m))
        if cls is not None and getattr(m, "mode", "affine") == "affine":
            m.__class__ = cls
            swapped += 1
    if swapped:
        changed()
    return swapped


@contextmanager
def stock_layers(module: nn.Module) -> Iterator[None]:
    """Run a block with mlx's own quantized layers (for a peer measured on the same weights);
    the layers that were ours are ours again afterwards, and only those."""
    ours = [m for _, m in module.named_modules() if type(m) in _STOCK]
    install(module, enabled=False)
    try:
        yield
    finally:
        for m in ours:
            m.__class__ = _OURS[type(m)]
        if ours:
            changed()
