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

import mlx.core as mx
import mlx.nn as nn

from . import available, backend, built, changed, kernel_name, use_native

MAX_ROWS = 8  # the mma's n dimension
WARPS = 8  # split-K warps per 16-row tile, reduced in a fixed order
GROUP_SIZES = (32, 64, 128)
BITS = (4, 8)


def quantized_matmul_ops(x, w, scales, biases, *, group_size: int, bits: int) -> mx.array:
    """Ops reference: x [..., K] times the dequantized w [N, K] transposed -> [..., N]."""
    return mx.quantized_matmul(
        x, w, scales=scales, biases=biases, transpose=True, group_size=group_size, bits=bits
    )


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
_CUDA_SOURCE = """
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
    const int r_lo = blockIdx.x * 16 + g;
    const int r_hi = r_lo + 8;
    const int words = K / VPW;
    const int groups = K / GS;
    const int stretches = words / 16;
    const size_t lo = min(r_lo, N - 1), hi = min(r_hi, N - 1);  // rows past N: any row, unused
    const uint32_t* w_lo = w + lo * words;
    const uint32_t* w_hi = w + hi * words;
    const ST* s_lo = scales + lo * groups;
    const ST* b_lo = biases + lo * groups;
    const ST* s_hi = scales + hi * groups;
    const ST* b_hi = biases + hi * groups;
    const uint32_t* x_g = reinterpret_cast<const uint32_t*>(x) + (size_t)min(g, M - 1) * (K / 2);
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
    __syncthreads();
    if (warp == 0) {
      for (int i = 0; i < 4; ++i) {
        float acc = part[lane * 4 + i];
        for (int v = 1; v < WARPS; ++v) acc = acc + part[(v * 32 + lane) * 4 + i];
        const int row = i < 2 ? r_lo : r_hi;
        const int m = 2 * t + (i & 1);
        if (row < N && m < M) y[(size_t)m * N + row] = static_cast<XT>(acc);
      }
    }
"""

# Metal has no m16n8k16; the same tile, split-K and warp-order reduction, with lane (g, t)
# accumulating its rows' products for every x row itself and the 4 lanes of a row added last.
_METAL_SOURCE = """
    constexpr int VPW = 32 / BITS;
    constexpr uint MASK = (1u << BITS) - 1u;
    const int M = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int lane = thread_index_in_simdgroup;
    const int warp = simdgroup_index_in_threadgroup;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int r_lo = threadgroup_position_in_grid.x * 16 + g;
    const int r_hi = r_lo + 8;
    const int words = K / VPW;
    const int groups = K / GS;
    const int stretches = words / 16;
    const size_t lo = min(r_lo, N - 1), hi = min(r_hi, N - 1);  // rows past N: any row, unused
    device const uint32_t* w_lo = w + lo * words;
    device const uint32_t* w_hi = w + hi * words;
    float c_lo[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    float c_hi[8] = {0, 0, 0, 0, 0, 0, 0, 0};
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
              const float xm = static_cast<float>(x[(size_t)m * K + k]);
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
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (warp == 0 && lane < 16) {
      const int row = threadgroup_position_in_grid.x * 16 + lane;
      for (int m = 0; m < M; ++m) {
        float acc = part[lane * 8 + m];
        for (int v = 1; v < WARPS; ++v) acc = acc + part[(v * 16 + lane) * 8 + m];
        if (row < N) y[(size_t)m * N + row] = static_cast<XT>(acc);
      }
    }
"""

# The residual variant adds a residual [M, N] (x's dtype) to the rounded product in its store,
# as MLX's add would (float sum of two x-dtype values, rounded once): a layer's ``h + proj(x)``
# in one launch instead of two, with the same bits.
_STORE = "= static_cast<XT>(acc);"
_STORE_ADD = (
    "= static_cast<XT>(static_cast<float>(static_cast<XT>(acc))\n"
    "            + static_cast<float>(residual[(size_t)m * N + row]));"
)


def with_residual(source: str) -> str:
    """A product's source with the residual added in its store (CUDA or Metal)."""
    assert source.count(_STORE) == 1, "the product's store is not where it was"
    return source.replace(_STORE, _STORE_ADD)


_INPUTS = ["x", "w", "scales", "biases"]
_kernels: dict = {}


def _spec(source: str, header: str, residual: bool = False) -> dict:
    if residual:
        source = with_residual(source)
    return {
        "name": kernel_name("mtp_qmm_add" if residual else "mtp_qmm", source, header),
        "input_names": _INPUTS + (["residual"] if residual else []),
        "output_names": ["y"],
        "source": source,
        "header": header,
    }


def _build_cuda(header: str = _HEADER_CUDA, residual: bool = False):
    if not available("cuda"):
        return None
    return mx.fast.cuda_kernel(**_spec(_CUDA_SOURCE, header, residual))


def _build_metal(residual: bool = False):
    if not available("metal"):
        return None
    return mx.fast.metal_kernel(**_spec(_METAL_SOURCE, "", residual))


def launch_bounds(warps: int, min_blocks: int) -> str:
    """A header tail that gives the kernel CUDA launch bounds: ``min_blocks`` blocks of
    ``warps`` warps must fit a multiprocessor, so ptxas caps the registers a thread (at 5
    blocks of 8 warps, 51). MLX writes the kernel's signature after the header, so the bounds
    ride on ``__global__``."""
    return (f"#undef __global__\n#define __global__ __location__(global) "
            f"__launch_bounds__({32 * warps}, {min_blocks})\n")  # fmt: skip


def _kernel(warps: int = WARPS, min_blocks: int | None = None, residual: bool = False):
    if min_blocks is None:
        return built(_kernels, (residual,), lambda: _build_cuda(residual=residual),
                     lambda: _build_metal(residual))  # fmt: skip
    header = _HEADER_CUDA + launch_bounds(warps, min_blocks)
    return built(_kernels, ("bounds", warps, min_blocks, residual),
                 lambda: _build_cuda(header, residual), lambda: _build_metal(residual))  # fmt: skip


def quantized_matmul_native(
    x, w, scales, biases, *, group_size: int, bits: int, residual: mx.array | None = None,
    warps: int = WARPS, min_blocks: int | None = None,
):  # fmt: skip
    """The native kernel for x [M <= 8, K]: y [M, N] in x's dtype (plus ``residual`` [M, N],
    x's dtype, if given); None where there is none. ``warps`` and ``min_blocks`` (launch
    bounds, CUDA) are for benchmarks (scripts/bench_qmm.py)."""
    kernel = _kernel(warps, min_blocks, residual is not None)
    if kernel is None:
        return None
    M, N = x.shape[0], w.shape[0]
    return kernel(
        inputs=[x, w, scales, biases] + ([residual] if residual is not None else []),
        template=[
            ("XT", x.dtype),
            ("ST", scales.dtype),
            ("BITS", bits),
            ("GS", group_size),
            ("WARPS", warps),
        ],  # fmt: skip
        grid=(32 * warps * ((N + 15) // 16), 1, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(M, N)],
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


def _self_check(dtype, sdtype, group_size: int, bits: int, residual: bool = False) -> str | None:
    """Agreement with the reference and row invariance (M = 1, 3, 8), on 40 rows of K = 1024
    (``residual``: of the variant that adds one)."""
    n, k = 40, 1024  # 40 rows: a partial last tile
    w, scales, biases = random_quantized(n, k, group_size, bits, sdtype, seed=7)
    x = mx.random.normal((8, k), key=mx.random.key(8)).astype(dtype)
    r = mx.random.normal((8, n), key=mx.random.key(9)).astype(dtype) if residual else None
    kw = {"group_size": group_size, "bits": bits}
    try:
        extra = (lambda m: {}) if r is None else (lambda m: {"residual": r[:m]})
        got = {m: quantized_matmul_native(x[:m], w, scales, biases, **kw, **extra(m))
               for m in (1, 3, 8)}  # fmt: skip
        want = quantized_matmul_ops(x, w, scales, biases, **kw)
        want = want if r is None else r + want
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
    x, w, scales, biases, *, group_size: int, bits: int, residual: mx.array | None = None
) -> mx.array:
    """x [..., K] times the dequantized w [N, K] transposed (plus ``residual`` [..., N], if
    given), on the best trusted path."""
    rows, n = math.prod(x.shape[:-1]), w.shape[0]
    add = residual is not None
    if add and (residual.shape != (*x.shape[:-1], n) or residual.dtype != x.dtype):
        return residual + quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits)
    if (
        backend() != "cpu"
        and 1 <= rows <= MAX_ROWS
        and biases is not None
        and supported(x, w, group_size, bits)
        and use_native(
            "quantized_matmul_add" if add else "quantized_matmul",
            (backend(), str(x.dtype), str(scales.dtype), group_size, bits),
            lambda: _self_check(x.dtype, scales.dtype, group_size, bits, add),
        )
    ):
        extra = {"residual": residual.reshape(rows, n)} if add else {}
        out = quantized_matmul_native(
            x.reshape(rows, x.shape[-1]), w, scales, biases, group_size=group_size, bits=bits,
            **extra,
        )  # fmt: skip
        if out is not None:
            return out.reshape(*x.shape[:-1], n)
    y = quantized_matmul_ops(x, w, scales, biases, group_size=group_size, bits=bits)
    return residual + y if add else y


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


class FusedProjection(nn.Module):
    """Sibling quantized projections of one input as one product (one launch, one weight read).

    The siblings' weights are concatenated along the output axis once; the siblings keep views
    of their rows, so no weight is stored twice. Our kernel computes each output row the same
    way whatever the other rows are, so the fused outputs equal the separate ones bitwise.
    """

    def __init__(self, linears: list[nn.QuantizedLinear]):
        super().__init__()
        first = linears[0]
        self.group_size, self.bits = first.group_size, first.bits
        self.sizes = [m.weight.shape[0] for m in linears]
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

    def __call__(self, x: mx.array) -> mx.array:
        """x [..., K] -> the siblings' outputs side by side, [..., sum(N)] (see ``split``)."""
        return quantized_matmul(
            x, self["weight"], self["scales"], self["biases"],
            group_size=self.group_size, bits=self.bits,
        )  # fmt: skip

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
