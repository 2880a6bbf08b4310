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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu as _swiglu

from . import available, backend, built, changed, kernel_name, use_native

MAX_ROWS = 8  # the mma's n dimension
WARPS = 8  # split-K warps per 16-row tile, reduced in a fixed order
GROUP_SIZES = (32, 64, 128)
BITS = (4, 8)


def quantized_matmul_ops(
    x, w, scales, biases, *, group_size: int, bits: int, residual: mx.array | None = None,
    norm_weight: mx.array | None = None, eps: float = 1e-6, swiglu: bool = False,
) -> mx.array:  # fmt: skip
    """Ops reference: x [..., K] times the dequantized w [N, K] transposed -> [..., N].

    Options, as MLX and mlx-lm compute them: ``norm_weight`` [K] RMS-normalises x first
    (``mx.fast.rms_norm`` with ``eps``); ``swiglu`` gives swiglu(first half, second half) of
    the outputs, [..., N/2] (gate and up projections as one weight); ``residual`` is added.
    """
    if norm_weight is not None:
        x = mx.fast.rms_norm(x, norm_weight, eps)
    y = mx.quantized_matmul(
        x, w, scales=scales, biases=biases, transpose=True, group_size=group_size, bits=bits
    )
    if swiglu:
        y = _swiglu(*mx.split(y, 2, axis=-1))
    return y if residual is None else residual + y


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
    const int M = x_shape[0];
    const int K = x_shape[1];
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
    const int M = x_shape[0];
    const int K = x_shape[1];
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
    for (int st = warp; st < stretches; st += WARPS) {
      const int word0 = st * 16 + t * 4;
      const int grp = (word0 * VPW) / GS;
      const float s_lo = static_cast<float>(scales[lo * groups + grp]);
      const float b_lo = static_cast<float>(biases[lo * groups + grp]);
      const float s_hi = static_cast<float>(scales[hi * groups + grp]);
      const float b_hi = static_cast<float>(biases[hi * groups + grp]);
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
    """What one launch does besides the product: RMS-normalise x first (with this eps),
    swiglu the two halves of its outputs, add a residual in its store."""

    norm_eps: float | None = None
    swiglu: bool = False
    residual: bool = False

    def suffix(self) -> str:
        return ("_norm" * (self.norm_eps is not None) + "_swiglu" * self.swiglu
                + "_add" * self.residual)  # fmt: skip


PLAIN = Variant()


def launch_shape(n: int, swiglu: bool) -> tuple[int, int]:
    """(outputs, threadgroups) of a product over n weight rows: a threadgroup makes 16 rows'
    outputs, or with swiglu 8 (a tile holds 8 gate rows and their 8 up rows)."""
    n_out, tile = (n // 2, 8) if swiglu else (n, 16)
    return n_out, (n_out + tile - 1) // tile


def source(metal: bool, variant: Variant = PLAIN) -> str:
    """One variant's kernel body for one backend, its splices filled in."""
    norm = variant.norm_eps is not None
    if metal:
        text, splices = _METAL_TEMPLATE, _METAL_NORM
        rows, store = ((_METAL_ROWS_SWIGLU, _METAL_STORE_SWIGLU) if variant.swiglu
                       else (_METAL_ROWS, _METAL_STORE))  # fmt: skip
    else:
        text, splices = _CUDA_TEMPLATE, _CUDA_NORM
        rows, store = ((_CUDA_ROWS_SWIGLU, _CUDA_STORE_SWIGLU) if variant.swiglu
                       else (_CUDA_ROWS, _CUDA_STORE))  # fmt: skip
    text = text.replace("ROWS", rows).replace("STORE", store)
    for token, code in splices.items():
        text = text.replace(token, code if norm else "")
    text = text.replace("SCALE_UP", "up_acc = up_acc * inv;" if variant.swiglu else "")
    if norm:
        text = text.replace("NORM_EPS", f"{variant.norm_eps:.9e}f")
    if variant.residual:
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
        + ["norm_w"] * (variant.norm_eps is not None)
        + ["residual"] * variant.residual,
        "output_names": ["y"],
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


def launch_bounds(warps: int, min_blocks: int) -> str:
    """A header tail that gives the kernel CUDA launch bounds: ``min_blocks`` blocks of
    ``warps`` warps must fit a multiprocessor, so ptxas caps the registers a thread (at 5
    blocks of 8 warps, 51). MLX writes the kernel's signature after the header, so the bounds
    ride on ``__global__``."""
    return (f"#undef __global__\n#define __global__ __location__(global) "
            f"__launch_bounds__({32 * warps}, {min_blocks})\n")  # fmt: skip


# The norm and swiglu variants take 66-68 registers unbounded (3 blocks of 8 warps a
# multiprocessor); bounded to 4 blocks, ptxas fits them in 64 without spills
# (tests/test_cuda_compile.py).
NORM_MIN_BLOCKS = 4


def header(variant: Variant, warps: int = WARPS, min_blocks: int | None = None) -> str:
    """The CUDA header a variant's kernel is built with (``min_blocks``: launch bounds)."""
    if min_blocks is None and (variant.norm_eps is not None or variant.swiglu) and warps == WARPS:
        min_blocks = NORM_MIN_BLOCKS
    return _HEADER_CUDA + (launch_bounds(warps, min_blocks) if min_blocks else "")


def _kernel(variant: Variant, warps: int = WARPS, min_blocks: int | None = None):
    text = header(variant, warps, min_blocks)
    return built(_kernels, (variant, text), lambda: _build_cuda(variant, text),
                 lambda: _build_metal(variant))  # fmt: skip


def quantized_matmul_native(
    x, w, scales, biases, *, group_size: int, bits: int, residual: mx.array | None = None,
    norm_weight: mx.array | None = None, eps: float = 1e-6, swiglu: bool = False,
    warps: int = WARPS, min_blocks: int | None = None,
):  # fmt: skip
    """The native kernel for x [M <= 8, K]: y [M, N] in x's dtype (see ``quantized_matmul_ops``
    for the options; ``norm_weight`` and ``residual`` in x's dtype); None where there is none.
    ``warps`` and ``min_blocks`` (launch bounds, CUDA) are for benchmarks (bench_qmm.py)."""
    variant = Variant(eps if norm_weight is not None else None, swiglu, residual is not None)
    kernel = _kernel(variant, warps, min_blocks)
    if kernel is None:
        return None
    M, N = x.shape[0], w.shape[0]
    n_out, groups = launch_shape(N, swiglu)
    extra = [a for a in (norm_weight, residual) if a is not None]
    return kernel(
        inputs=[x, w, scales, biases, *extra],
        template=[
            ("XT", x.dtype),
            ("ST", scales.dtype),
            ("BITS", bits),
            ("GS", group_size),
            ("WARPS", warps),
        ],  # fmt: skip
        grid=(32 * warps * groups, 1, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(M, n_out)],
        output_dtypes=[x.dtype],
    )[0]


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


def _self_check(dtype, sdtype, group_size: int, bits: int, variant: Variant = PLAIN) -> str | None:
    """Agreement with the reference and row invariance (M = 1, 3, 8) of one variant, on 40
    weight rows of K = 1024."""
    n, k = 40, 1024  # 40 rows: a partial last tile (of 16 rows; with swiglu, of 8 pairs)
    w, scales, biases = random_quantized(n, k, group_size, bits, sdtype, seed=7)
    x = (mx.random.normal((8, k), key=mx.random.key(8)) * 3).astype(dtype)
    opts: dict = {"group_size": group_size, "bits": bits, "swiglu": variant.swiglu}
    if variant.norm_eps is not None:
        opts["eps"] = variant.norm_eps
        # small enough that float16 holds swiglu of 8-bit products (their weights are large)
        nw = mx.random.uniform(0.1, 0.3, (k,), key=mx.random.key(10))
        opts["norm_weight"] = nw.astype(dtype)
    n_out = n // 2 if variant.swiglu else n
    r = mx.random.normal((8, n_out), key=mx.random.key(9)).astype(dtype)
    rows = (lambda m: {"residual": r[:m]}) if variant.residual else (lambda m: {})
    try:
        got = {m: quantized_matmul_native(x[:m], w, scales, biases, **opts, **rows(m))
               for m in (1, 3, 8)}  # fmt: skip
        want = quantized_matmul_ops(x, w, scales, biases, **opts, **rows(8))
        mx.eval(got, want)
    except Exception as e:  # noqa: BLE001 - a kernel that fails to build is not trusted
        return f"{type(e).__name__}: {e}"
    a, b = got[8].astype(mx.float32), want.astype(mx.float32)
    err = mx.abs(a - b).max().item()
    if not err <= 2e-2 * mx.abs(b).max().item():
        return f"differs from the reference by up to {err:.3g}"
    for m in (1, 3):
        if not mx.array_equal(got[m], got[8][:m]).item():
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


def quantized_matmul(
    x, w, scales, biases, *, group_size: int, bits: int, residual: mx.array | None = None,
    norm_weight: mx.array | None = None, eps: float = 1e-6, swiglu: bool = False,
) -> mx.array:  # fmt: skip
    """``quantized_matmul_ops`` (same options) on the best trusted path: one native launch
    where the variant runs natively here, else the options as their own ops around the
    product, which may still run natively."""
    rows, n = math.prod(x.shape[:-1]), w.shape[0]
    variant = Variant(eps if norm_weight is not None else None, swiglu, residual is not None)
    n_out = n // 2 if swiglu else n
    if (
        backend() != "cpu"
        and 1 <= rows <= MAX_ROWS
        and biases is not None
        and supported(x, w, group_size, bits)
        and (not swiglu or (n % 2 == 0 and residual is None))
        and (
            residual is None
            or (residual.shape == (*x.shape[:-1], n_out) and residual.dtype == x.dtype)
        )  # fmt: skip
        and (
            norm_weight is None
            or (norm_weight.shape == (x.shape[-1],) and norm_weight.dtype == x.dtype)
        )  # fmt: skip
        and use_native(
            "quantized_matmul" + variant.suffix(),
            (backend(), str(x.dtype), str(scales.dtype), group_size, bits, variant.norm_eps),
            lambda: _self_check(x.dtype, scales.dtype, group_size, bits, variant),
        )
    ):
        extra = {"residual": residual.reshape(rows, n_out)} if residual is not None else {}
        out = quantized_matmul_native(
            x.reshape(rows, x.shape[-1]), w, scales, biases, group_size=group_size, bits=bits,
            norm_weight=norm_weight, eps=eps, swiglu=swiglu, **extra,
        )  # fmt: skip
        if out is not None:
            return out.reshape(*x.shape[:-1], n_out)
    if variant == PLAIN:
        return quantized_matmul_ops(x, w, scales, biases, group_size=group_size, bits=bits)
    if norm_weight is not None:
        x = mx.fast.rms_norm(x, norm_weight, eps)
    y = quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits)
    if swiglu:
        y = _swiglu(*mx.split(y, 2, axis=-1))
    return y if residual is None else residual + y


# Whether ``linear_add`` lets our product add the residual (benchmarks turn it off to compare).
FUSE_RESIDUAL = True


def linear_add(layer: nn.Module, x: mx.array, residual: mx.array) -> mx.array:
    """``residual + layer(x)``: one launch where ``layer`` runs through our product, which adds
    the residual in its store with MLX's rounding; otherwise the two ops."""
    if FUSE_RESIDUAL and type(layer) is KernelQuantizedLinear and "bias" not in layer:
        return quantized_matmul(
            x, layer["weight"], layer["scales"], layer.get("biases"),
            group_size=layer.group_size, bits=layer.bits, residual=residual,
        )  # fmt: skip
    return residual + layer(x)


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

    def __call__(self, x: mx.array, norm: nn.RMSNorm | None = None) -> mx.array:
        """x [..., K] (normed by ``norm`` first, if given) -> the siblings' outputs side by
        side, [..., sum(N)] (see ``split``); with ``swiglu``, swiglu(gate, up) [..., N/2]."""
        if norm is not None and not FUSE_NORM:
            x, norm = norm(x), None
        fold = self.swiglu and FUSE_SWIGLU
        y = quantized_matmul(
            x, self["weight"], self["scales"], self["biases"],
            group_size=self.group_size, bits=self.bits, swiglu=fold,
            **({} if norm is None else {"norm_weight": norm.weight, "eps": norm.eps}),
        )  # fmt: skip
        return _swiglu(*self.split(y)) if self.swiglu and not fold else y

    def split(self, y: mx.array) -> list[mx.array]:
        return mx.split(y, self._cuts, axis=-1)


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
