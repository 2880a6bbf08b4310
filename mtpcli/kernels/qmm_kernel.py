"""The quantized matmul's kernel texts and builders: the tensor-core product for CUDA, its
mirror for Metal, and the variants that fold the work around a product into its launch.

Layout (MLX's affine quantization, as mlx-community checkpoints store it): ``w`` [N, K*bits/32]
uint32, value i of a word in bits [bits*i, bits*(i+1)); ``scales``, ``biases`` [N, K/group];
weight = scale * q + bias. The dispatch, ops reference and self-check are in
``quantized_matmul.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from . import built, fill, kernel_name, launch_bounds

TILE_ROWS = 8  # the mma's n dimension: x rows a tile of the product takes
TILES = (1, 2, 4)  # tiles a launch: one dequantized weight fragment feeds each tile's mma
MAX_ROWS = TILE_ROWS * TILES[-1]  # rows of one product
WARPS = 8  # split-K warps per 16-row tile, reduced in a fixed order
GROUP_SIZES = (32, 64, 128)
BITS = (4, 8)

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

// (w & mask) | bits as one LOP3: with both constants immediate, ptxas spends two (seen in
// the SASS: twice the LOP3s a stretch needs).
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

"""


# One m16n8k16 tensor-core product with float accumulators, per activation type (overloaded on
# an unnamed argument of that type).
_MMA = """__device__ __forceinline__ void qm_mma(
    float* c, const uint32_t* a, const uint32_t* b, {{T}}) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.{{P}}.{{P}}.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

"""
_HEADER_CUDA += "".join(
    fill(_MMA, T=t, P=p) for t, p in (("__nv_bfloat16", "bf16"), ("__half", "f16"))
)


def _prologue(lane: str, warp: str) -> str:
    """Both bodies' opening: the shapes, a thread's lane (g, t) and warp, its rows (``ROWS``)."""
    return f"""    {{{{SHAPES}}}}
    const int lane = {lane};
    const int warp = {warp};
    const int g = lane >> 2;
    const int t = lane & 3;
    {{{{ROWS}}}}
    const int words = K / VPW;
    const int groups = K / GS;
    const int stretches = words / 16;
"""


# A warp owns a 16-row tile and every WARPS-th 16-word stretch of K. Lane (g, t) = (lane / 4,
# lane % 4) dequantizes 4 words of rows g and g + 8 and loads x rows g, g + 8, ... (one a tile
# of 8 x rows, NT tiles) at the same k: exactly the A and B fragments of m16n8k16, up to a
# permutation of k inside each mma, which is the same for A and B and so leaves each product's
# terms unchanged. The dequantized A fragment feeds every tile's mma, and a column of an mma is
# computed alone, so an x row's outputs are the same bits in any tile of any NT. The warps'
# partial tiles are added in warp order. x rows >= M are zeros; nothing else depends on M.
_CUDA_TEMPLATE = (
    """
    constexpr int VPW = 32 / BITS;              // values per word
    constexpr int STEPS = VPW / 4;              // mma k-steps per word
    constexpr int XW = VPW / 2;                 // x words (2 values each) per weight word
    using XT2 = decltype(qm_ints<BITS>(0u, 0, XT{}));
"""
    + _prologue("threadIdx.x & 31", "threadIdx.x >> 5")
    + """    const uint32_t* w_lo = w + lo * words;
    const uint32_t* w_hi = w + hi * words;
    const ST* s_lo = scales + lo * groups;
    const ST* b_lo = biases + lo * groups;
    const ST* s_hi = scales + hi * groups;
    const ST* b_hi = biases + hi * groups;
    const uint32_t* x_w = reinterpret_cast<const uint32_t*>(x);
    {{NORM_INIT}}
    float c[NT][4];  // tile nt: x rows 8 nt + 2t, + 1 of rows r_lo, r_hi
    for (int nt = 0; nt < NT; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.0f;
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
        uint32_t xv[NT][XW];
        for (int nt = 0; nt < NT; ++nt) {
          if (g + 8 * nt < M) {
            qm_load<XW>(xv[nt], x_w + {{X_G}} + (word0 + j) * XW);
          } else {
            for (int i = 0; i < XW; ++i) xv[nt][i] = 0u;
          }
        }
        {{NORM_X}}
        for (int s = 0; s < STEPS; ++s) {
          uint32_t a[4];
          a[0] = qm_as_u32(__hfma2(qm_ints<BITS>(wl[j], 2 * s, XT{}), s2_lo, b2_lo));
          a[1] = qm_as_u32(__hfma2(qm_ints<BITS>(wh[j], 2 * s, XT{}), s2_hi, b2_hi));
          a[2] = qm_as_u32(__hfma2(qm_ints<BITS>(wl[j], 2 * s + 1, XT{}), s2_lo, b2_lo));
          a[3] = qm_as_u32(__hfma2(qm_ints<BITS>(wh[j], 2 * s + 1, XT{}), s2_hi, b2_hi));
          for (int nt = 0; nt < NT; ++nt) {
            uint32_t b[2];
            b[0] = __byte_perm(xv[nt][s], xv[nt][s + STEPS], 0x5410);
            b[1] = __byte_perm(xv[nt][s], xv[nt][s + STEPS], 0x7632);
            qm_mma(c[nt], a, b, XT{});
          }
        }
      }
    }
    __shared__ float part[NT * WARPS * 32 * 4];
    for (int nt = 0; nt < NT; ++nt) {
      for (int i = 0; i < 4; ++i) part[((nt * WARPS + warp) * 32 + lane) * 4 + i] = c[nt][i];
    }
    {{NORM_PART}}
    __syncthreads();
    if (warp == 0) {
      for (int nt = 0; nt < NT; ++nt) {
        float acc[4];  // rows r_lo (0, 1) and r_hi (2, 3), x rows 8 nt + 2t and 8 nt + 2t + 1
        for (int i = 0; i < 4; ++i) {
          acc[i] = part[(nt * WARPS * 32 + lane) * 4 + i];
          for (int v = 1; v < WARPS; ++v) {
            acc[i] = acc[i] + part[((nt * WARPS + v) * 32 + lane) * 4 + i];
          }
        }
        {{NORM_SCALE}}
        {{STORE}}
      }
    }
"""
)


# The plain product's rows and store: a tile is 16 consecutive rows.
_CUDA_ROWS = """const int r_lo = blockIdx.x * 16 + g;
    const int r_hi = r_lo + 8;
    const size_t lo = min(r_lo, N - 1), hi = min(r_hi, N - 1);  // rows past N: any row, unused"""
_CUDA_STORE = """for (int i = 0; i < 4; ++i) {
        const int row = i < 2 ? r_lo : r_hi;
        const int m = 8 * nt + 2 * t + (i & 1);
        if (row < N && m < M) y[{{Y_M}} * N + row] = {{RESULT}};
      }"""
# The swiglu variant: a tile is 8 gate rows and their 8 up rows (the weight's second half),
# so each lane holds both halves of its outputs, and the store makes swiglu(gate, up) [M, N/2]
# with mlx-lm's roundings (silu(gate) * up, each op rounded to x's dtype).
_CUDA_ROWS_SWIGLU = """const int NY = N / 2;  // outputs: gate row r, up row r + NY
    const int r_lo = blockIdx.x * 8 + g;
    const size_t lo = min(r_lo, NY - 1), hi = lo + NY;  // rows past NY: any pair, unused"""
_CUDA_STORE_SWIGLU = """for (int i = 0; i < 2; ++i) {
        const int m = 8 * nt + 2 * t + i;
        if (r_lo < NY && m < M) {
          const float gt = QM_RD(acc[i]), up = QM_RD(acc[i + 2]);
          const float sg = QM_RD(1.0f / (1.0f + expf(-gt)));
          y[{{Y_M}} * NY + r_lo] = static_cast<XT>(QM_RD(gt * sg) * up);
        }
      }"""


# The norm variant takes the un-normed x and an RMSNorm's weight [K] (x's dtype): it
# multiplies x by the weight as it loads it (one rounding, as the product's inputs are) and
# sums each row's squares on the way (a group's 4 lanes, then the warps, in a fixed order),
# and scales the row's outputs by rsqrt(mean + eps) at the end: the norm's launch saved.
_CUDA_NORM = {
    "NORM_INIT": """const uint32_t* nw = reinterpret_cast<const uint32_t*>(norm_w);
    float ss[NT];  // x rows g + 8 nt: their squares over this lane's words
    for (int nt = 0; nt < NT; ++nt) ss[nt] = 0.0f;""",
    "NORM_X": """{
          const uint32_t* nw_j = nw + (word0 + j) * XW;  // word by word: 3 registers fewer
          for (int i = 0; i < XW; ++i) {
            for (int nt = 0; nt < NT; ++nt) {
              const XT2 p = qm_pair(xv[nt][i], XT{});
              const float x0 = static_cast<float>(p.x), x1 = static_cast<float>(p.y);
              ss[nt] = fmaf(x0, x0, ss[nt]);
              ss[nt] = fmaf(x1, x1, ss[nt]);
              xv[nt][i] = qm_as_u32(__hmul2(p, qm_pair(nw_j[i], XT{})));
            }
          }
        }""",
    "NORM_PART": """__shared__ float ss_part[NT * WARPS * 8];
    for (int nt = 0; nt < NT; ++nt) {
      ss[nt] = ss[nt] + __shfl_xor_sync(0xffffffffu, ss[nt], 1);
      ss[nt] = ss[nt] + __shfl_xor_sync(0xffffffffu, ss[nt], 2);
      if (t == 0) ss_part[(nt * WARPS + warp) * 8 + g] = ss[nt];
    }""",
    "NORM_SCALE": """for (int i = 0; i < 2; ++i) {
        const int m = 2 * t + i;
        float sq = ss_part[nt * WARPS * 8 + m];
        for (int v = 1; v < WARPS; ++v) sq = sq + ss_part[(nt * WARPS + v) * 8 + m];
        const float inv = rsqrtf(sq / K + {{EPS}});
        acc[i] = acc[i] * inv;
        acc[i + 2] = acc[i + 2] * inv;
      }""",
}


# Metal has no m16n8k16; the same tile, split-K and warp-order reduction, with lane (g, t)
# accumulating its rows' products for every x row itself and the 4 lanes of a row added last.
# The variants' parts mirror the CUDA ones: same rows, same roundings, and the squares of each
# x row summed in the same order.
_METAL_TEMPLATE = (
    """
    constexpr int VPW = 32 / BITS;
    constexpr uint MASK = (1u << BITS) - 1u;
    constexpr int MR = 8 * NT;  // x rows a launch takes
"""
    + _prologue("thread_index_in_simdgroup", "simdgroup_index_in_threadgroup")
    + """    device const uint32_t* w_lo = w + lo * words;
    device const uint32_t* w_hi = w + hi * words;
    float c_lo[MR], c_hi[MR];
    for (int m = 0; m < MR; ++m) c_lo[m] = c_hi[m] = 0.0f;
    {{NORM_INIT}}
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
          for (int m = 0; m < MR; ++m) {
            if (m < M) {
              float xm = static_cast<float>(x[{{X_M}} + k]);
              {{NORM_X}}
              c_lo[m] = fma(xm, wl, c_lo[m]);
              c_hi[m] = fma(xm, wh, c_hi[m]);
            }
          }
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      for (ushort off = 1; off < 4; off <<= 1) {
        c_lo[m] = c_lo[m] + simd_shuffle_xor(c_lo[m], off);
        c_hi[m] = c_hi[m] + simd_shuffle_xor(c_hi[m], off);
      }
    }
    threadgroup float part[WARPS * 16 * MR];
    if (t == 0) {
      for (int m = 0; m < MR; ++m) {
        part[(warp * 16 + g) * MR + m] = c_lo[m];
        part[(warp * 16 + g + 8) * MR + m] = c_hi[m];
      }
    }
    {{NORM_PART}}
    threadgroup_barrier(mem_flags::mem_threadgroup);
    {{STORE}}
"""
)

_METAL_STORE = """if (warp == 0 && lane < 16) {
      const int row = threadgroup_position_in_grid.x * 16 + lane;
      for (int m = 0; m < M; ++m) {
        float acc = part[lane * MR + m];
        for (int v = 1; v < WARPS; ++v) acc = acc + part[(v * 16 + lane) * MR + m];
        {{NORM_SCALE}}
        if (row < N) y[{{Y_M}} * N + row] = {{RESULT}};
      }
    }"""
_METAL_STORE_SWIGLU = """if (warp == 0 && lane < 8) {
      const int row = threadgroup_position_in_grid.x * 8 + lane;
      for (int m = 0; m < M; ++m) {
        float acc = part[lane * MR + m];  // the gate row
        float up_acc = part[(lane + 8) * MR + m];  // its up row
        for (int v = 1; v < WARPS; ++v) {
          acc = acc + part[(v * 16 + lane) * MR + m];
          up_acc = up_acc + part[(v * 16 + lane + 8) * MR + m];
        }
        {{NORM_SCALE}}
        const float gt = float(XT(acc)), up = float(XT(up_acc));
        const float sg = float(XT(1.0f / (1.0f + exp(-gt))));
        if (row < NY) y[{{Y_M}} * NY + row] = static_cast<XT>(float(XT(gt * sg)) * up);
      }
    }"""


_METAL_NORM = {
    "NORM_INIT": """float ss[MR];  // x rows' squares, this lane's k
    for (int m = 0; m < MR; ++m) ss[m] = 0.0f;""",
    "NORM_X": """ss[m] = fma(xm, xm, ss[m]);
              xm = float(XT(xm * static_cast<float>(norm_w[k])));""",
    "NORM_PART": """threadgroup float ss_part[WARPS * MR];
    for (int m = 0; m < MR; ++m) {
      for (ushort off = 1; off < 4; off <<= 1) ss[m] = ss[m] + simd_shuffle_xor(ss[m], off);
      if (lane == 0) ss_part[warp * MR + m] = ss[m];
    }""",
    "NORM_SCALE": """float sq = ss_part[m];
        for (int v = 1; v < WARPS; ++v) sq = sq + ss_part[v * MR + m];
        const float inv = rsqrt(sq / K + {{EPS}});
        acc = acc * inv;
        {{SCALE_UP}}""",
}


def _result(acc: str, residual: bool) -> str:
    """An output value from its float sum ``acc``: rounded to x's dtype; with a residual [M, N]
    (x's dtype) added to the rounded product as MLX's add would (a float sum of two x-dtype
    values, rounded once), so a layer's ``h + proj(x)`` is one launch with the same bits."""
    if not residual:
        return f"static_cast<XT>({acc})"
    return (f"static_cast<XT>(static_cast<float>(static_cast<XT>({acc}))\n"
            "            + static_cast<float>(residual[(size_t)m * N + row]))")  # fmt: skip


# The plain product's shapes: x [..., K] (its leading axes are the M rows), w [N, ...].
_SHAPES = """const int K = x_shape[x_ndim - 1];
    int M = 1;  // x [..., K]: its leading axes are rows, so no reshape is needed around a call
    for (int d = 0; d + 1 < x_ndim; ++d) M *= x_shape[d];
    const int N = w_shape[0];"""
_PLAIN_ROWS = {"X_G": "(size_t)min(g + 8 * nt, M - 1) * (K / 2)", "X_M": "(size_t)m * K",
               "Y_M": "(size_t)m"}  # fmt: skip

# The gathered (mixture-of-experts) product: ew [E, N, ...] holds every expert's weights,
# idx [..., KS] the experts each token selects (distinct within a token), x [..., XS, K] one
# input per token (XS = 1) or per selected expert (XS = KS); y [..., KS, N]. Each (token,
# slot) pair is a row: the block of pair p0 makes its expert's rows for p0 and the next pairs
# that select the same expert, up to 8 (the plain product's M rows), so an expert's weights
# are read once however many tokens chose it; a later pair of that expert leaves at once. A
# row is computed by the same instructions whichever rows share its expert. With swiglu, ew
# [2E, N/2, ...] holds the experts' gate weights, then their up weights (mlx-lm's two
# weights stacked, so each stays a contiguous view): y [..., KS, N/2].
_SHAPES_GATHERED = """const int K = x_shape[x_ndim - 1];
    {{N_E}}
    const int KS = idx_shape[idx_ndim - 1];
    int P = 1;
    for (int d = 0; d < idx_ndim; ++d) P *= idx_shape[d];
    const int XS = x_shape[x_ndim - 2];
    const int p0 = {{PAIR}};
    const uint32_t e = idx[p0];
    int before = 0;  // pairs of expert e before p0
    for (int p = 0; p < p0; ++p) before += idx[p] == e ? 1 : 0;
    if (before % 8 != 0) return;
    int M = 0;  // rows: p0 and the next pairs of e, up to 8
    for (int p = p0; p < P && M < 8; ++p) M += idx[p] == e ? 1 : 0;
    {{AS}}const uint32_t* w = ew + (size_t)e * NE * (K / VPW);
    {{AS}}const ST* scales = escales + (size_t)e * NE * (K / GS);
    {{AS}}const ST* biases = ebiases + (size_t)e * NE * (K / GS);"""
_N_E = """const int N = ew_shape[1];
    const int NE = N;  // rows an expert has"""
_N_E_SWIGLU = """const int NE = ew_shape[1];  // rows an expert's gate (and its up) has
    const int N = 2 * NE;
    const size_t UP = (size_t)(ew_shape[0] / 2) * NE;  // expert e's up rows: UP after its gate"""
# The swiglu tile's gate rows and their up rows, in the stacked weights.
_CUDA_ROWS_SWIGLU_GATHERED = """const int NY = N / 2;
    const int r_lo = blockIdx.x * 8 + g;
    const size_t lo = min(r_lo, NY - 1), hi = lo + UP;"""
# Each backend's row m: on CUDA found again where it is needed (qm_nth), since arrays of them
# cost ptxas a spill; Metal keeps the rows' pairs and where their x start in arrays.
_GATHERED_ROWS = {"X_G": "x_row / 2", "X_M": "xoff[m]"}
_Y_M = {False: "(size_t)qm_nth(idx, blockIdx.y, m)", True: "(size_t)pairs[m]"}
_ROW_X = {
    False: """const int p_g = qm_nth(idx, p0, min(g, M - 1));  // lane g's row
    const size_t x_row = ((size_t)(p_g / KS) * XS + (XS == 1 ? 0 : p_g % KS)) * K;""",
    True: """int pairs[8];
    size_t xoff[8];  // where each row's x starts
    for (int p = p0, m = 0; m < M; ++p) {
      if (idx[p] == e) {
        pairs[m] = p;
        xoff[m] = ((size_t)(p / KS) * XS + (XS == 1 ? 0 : p % KS)) * K;
        m += 1;
      }
    }""",
}
# The pair of row m of the block of pair p0: the m-th pair from p0 that selects p0's expert.
_HEADER_GATHERED = """
__device__ __forceinline__ int qm_nth(const uint32_t* idx, int p0, int m) {
  const uint32_t e = idx[p0];
  int p = p0;
  for (int c = 0;; ++p) {
    if (idx[p] == e) {
      if (c == m) break;
      c += 1;
    }
  }
  return p;
}
"""


@dataclass(frozen=True)
class Variant:
    """What one launch does besides the product: RMS-normalise x first (with this eps), swiglu
    the two halves of its outputs, add a residual in its store, or gather each token's
    selected experts' weights (a mixture-of-experts layer's product)."""

    norm_eps: float | None = None
    swiglu: bool = False
    residual: bool = False
    gathered: bool = False

    def __post_init__(self) -> None:
        assert not (self.swiglu and self.residual), "a swiglu output has no residual"
        assert not (self.gathered and self.residual), "a gathered product adds no residual"

    def suffix(self) -> str:
        return ("_norm" * (self.norm_eps is not None) + "_swiglu" * self.swiglu
                + "_add" * self.residual + "_gather" * self.gathered)  # fmt: skip


PLAIN = Variant()


def launch_shape(n: int, swiglu: bool) -> tuple[int, int]:
    """(outputs, threadgroups) of a product over n weight rows: a threadgroup makes 16 rows'
    outputs, or with swiglu 8 (a tile holds 8 gate rows and their 8 up rows)."""
    n_out, tile = (n // 2, 8) if swiglu else (n, 16)
    return n_out, (n_out + tile - 1) // tile


def source(metal: bool, variant: Variant = PLAIN) -> str:
    """One variant's kernel body for one backend, its placeholders filled."""
    norm = variant.norm_eps is not None
    eps = f"{variant.norm_eps:.9e}f" if norm else ""
    if variant.gathered:
        pair = "threadgroup_position_in_grid.y" if metal else "blockIdx.y"
        shapes = fill(_SHAPES_GATHERED, PAIR=pair, AS="device " if metal else "",
                      N_E=_N_E_SWIGLU if variant.swiglu else _N_E)  # fmt: skip
        rows_of = _GATHERED_ROWS
    else:
        shapes, rows_of = _SHAPES, _PLAIN_ROWS
    swiglu_rows = _CUDA_ROWS_SWIGLU_GATHERED if variant.gathered else _CUDA_ROWS_SWIGLU
    row_x = _ROW_X[metal] + "\n    " if variant.gathered else ""
    y_m = _Y_M[metal] if variant.gathered else rows_of["Y_M"]
    if metal:
        norm_parts = {k: v for k, v in _METAL_NORM.items() if k != "NORM_SCALE"}
        scale = fill(_METAL_NORM["NORM_SCALE"], EPS=eps,
                     SCALE_UP="up_acc = up_acc * inv;" if variant.swiglu else "")  # fmt: skip
        if variant.swiglu:
            store = fill(_METAL_STORE_SWIGLU, NORM_SCALE=scale if norm else "", Y_M=y_m)
        else:
            store = fill(_METAL_STORE, NORM_SCALE=scale if norm else "",
                         RESULT=_result("acc", variant.residual), Y_M=y_m)  # fmt: skip
        rows = row_x + (swiglu_rows if variant.swiglu else _CUDA_ROWS).replace(
            "blockIdx.x", "threadgroup_position_in_grid.x"
        )
        text, parts = _METAL_TEMPLATE, {"ROWS": rows, "STORE": store, "X_M": rows_of["X_M"]}
    else:
        norm_parts = {k: fill(v, EPS=eps) if "{{EPS}}" in v else v for k, v in _CUDA_NORM.items()}
        if variant.swiglu:
            rows, store = row_x + swiglu_rows, fill(_CUDA_STORE_SWIGLU, Y_M=y_m)
        else:
            rows = row_x + _CUDA_ROWS
            store = fill(_CUDA_STORE, RESULT=_result("acc[i]", variant.residual), Y_M=y_m)
        text, parts = _CUDA_TEMPLATE, {"ROWS": rows, "STORE": store, "X_G": rows_of["X_G"]}
    return fill(text, **parts, SHAPES=shapes,
                **{k: v if norm else "" for k, v in norm_parts.items()})  # fmt: skip


_kernels: dict = {}


def _spec(metal: bool, header: str, variant: Variant = PLAIN) -> dict:
    text = source(metal, variant)
    return {
        "name": kernel_name("mtp_qmm" + variant.suffix(), text, header),
        "input_names": (
            ["x", "ew", "escales", "ebiases", "idx"]
            if variant.gathered
            else ["x", "w", "scales", "biases"]
        )  # fmt: skip
        + ["norm_w"] * (variant.norm_eps is not None)
        + ["residual"] * variant.residual,
        "output_names": ["y"],
        "source": text,
        "header": header,
    }


# The norm and swiglu variants take 66-68 registers unbounded (3 blocks of 8 warps a
# multiprocessor); bounded to 4 blocks, ptxas fits them in 64 without spills
# (tests/test_cuda_compile.py). The gathered ones spill at 64 and stay unbounded: a MoE
# layer's expert products are a few hundred blocks, 2-4 a multiprocessor anyway.
NORM_MIN_BLOCKS = 4
# Of 4 tiles, the norm + swiglu variant (an MLP's gate and up) takes 139 registers unbounded:
# one block of 8 warps a multiprocessor. Bounded to 2 blocks it fits 128 with 12 bytes
# spilled, and the 27B's gate and up at 32 rows took 178 us against 233 on an H100
# (h100_qmm_tiles_bounds_576274c.json); the other variants hold 2 blocks unbounded.
WIDE_NORM_SWIGLU_MIN_BLOCKS = {4: 2}


def header(variant: Variant, warps: int = WARPS, min_blocks: int | None = None,
           nt: int = 1) -> str:  # fmt: skip
    """The CUDA header a variant's kernel of ``nt`` tiles is built with (``min_blocks``: launch
    bounds; more tiles hold more accumulators, and are left unbounded but for the norm +
    swiglu variant of 4 tiles)."""
    bounded = (variant.norm_eps is not None or variant.swiglu) and not variant.gathered
    if min_blocks is None and bounded and warps == WARPS and nt == 1:
        min_blocks = NORM_MIN_BLOCKS
    norm_swiglu = variant.norm_eps is not None and variant.swiglu and not variant.gathered
    if min_blocks is None and norm_swiglu and warps == WARPS:
        min_blocks = WIDE_NORM_SWIGLU_MIN_BLOCKS.get(nt)
    gathered = _HEADER_GATHERED if variant.gathered else ""
    return _HEADER_CUDA + gathered + (launch_bounds(warps, min_blocks) if min_blocks else "")


def kernel(variant: Variant, warps: int = WARPS, min_blocks: int | None = None, nt: int = 1):
    """The variant's kernel of ``nt`` tiles for the running backend; None where there is none
    (the CPU)."""
    text = header(variant, warps, min_blocks, nt)
    return built(_kernels, (variant, text),
                 lambda metal: _spec(metal, "" if metal else text, variant))  # fmt: skip


def launch(
    x, w, scales, biases, *, group_size: int, bits: int, residual: mx.array | None = None,
    norm_weight: mx.array | None = None, eps: float = 1e-6, swiglu: bool = False,
    warps: int = WARPS, min_blocks: int | None = None,
) -> mx.array | None:  # fmt: skip
    """The native kernel for x [..., K] of M <= ``MAX_ROWS`` rows (the leading axes): y [...,
    N] in x's dtype (see ``quantized_matmul_ops`` for the options; ``norm_weight`` and
    ``residual`` in x's dtype, the residual with x's rows); None where there is no kernel.
    ``warps`` and ``min_blocks`` (launch bounds, CUDA) are for benchmarks."""
    variant = Variant(eps if norm_weight is not None else None, swiglu, residual is not None)
    lead, N = x.shape[:-1], w.shape[0]
    nt = tiles(math.prod(lead))
    k = kernel(variant, warps, min_blocks, nt)
    if k is None:
        return None
    n_out, groups = launch_shape(N, swiglu)
    extra = [a for a in (norm_weight, residual) if a is not None]
    return k(
        inputs=[x, w, scales, biases, *extra],
        template=_template(x, scales, bits, group_size, warps, nt),
        grid=(32 * warps * groups, 1, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(*lead, n_out)],
        output_dtypes=[x.dtype],
    )[0]


def tiles(rows: int) -> int:
    """The tiles of 8 x rows a launch of ``rows`` rows takes (the fewest of ``TILES``): a row's
    bits are the same in each, so fewer rows pay for fewer tiles' registers and mma."""
    return next(n for n in TILES if rows <= n * TILE_ROWS)


def _template(x: mx.array, scales: mx.array, bits: int, group_size: int, warps: int,
              nt: int = 1) -> list:  # fmt: skip
    """The template arguments every variant takes (``nt``: tiles of x rows)."""
    return [("XT", x.dtype), ("ST", scales.dtype), ("BITS", bits), ("GS", group_size),
            ("WARPS", warps), ("NT", nt)]  # fmt: skip


def launch_gathered(
    x, w, scales, biases, indices, *, group_size: int, bits: int, swiglu: bool = False,
    norm_weight: mx.array | None = None, eps: float = 1e-6, warps: int = WARPS,
) -> mx.array | None:  # fmt: skip
    """The native gathered kernel: x [..., XS, K] (XS 1 or KS), experts' weights w [E, N, ...]
    (with ``swiglu``, [2E, N, ...]: the gates, then the ups), indices [..., KS] -> y [..., KS,
    N] in x's dtype (x RMS-normalised first by ``norm_weight`` [K], as the plain product's norm
    variant does); None where there is no kernel."""
    norm = eps if norm_weight is not None else None
    k = kernel(Variant(norm, swiglu=swiglu, gathered=True), warps)
    if k is None:
        return None
    n_out, groups = launch_shape(w.shape[1] * (2 if swiglu else 1), swiglu)
    extra = [] if norm_weight is None else [norm_weight]
    return k(
        inputs=[x, w, scales, biases, indices, *extra],
        template=_template(x, scales, bits, group_size, warps),
        grid=(32 * warps * groups, indices.size, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(*indices.shape, n_out)],
        output_dtypes=[x.dtype],
    )[0]
