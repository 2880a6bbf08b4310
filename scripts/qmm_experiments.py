"""An experimental quantized product for ``bench_qmm.py --arms grp``: fewer instructions a weight.

Our product (``mtpcli/kernels/quantized_matmul.py``) dequantizes every weight pair to bf16
before its mma: a shift, a LOP3, a subtraction and an FMA with the scale and bias, four
instructions a pair. Under ``ncu`` its head and gate+up launches ran at 74-76% of the SMs'
throughput and only 57% of DRAM's (session 6), so the instructions, not the bytes, may set
their pace. This variant feeds the mma the raw integers (128 + q, exact in bf16: a shift and a
LOP3 a pair) and applies each group's scale and bias in float32 after it, from the group's
products and a second mma of x against ones (the column sums of x):

    y += s * sum_k x_k (128 + q_k) + (b - 128 s) * sum_k x_k      (over one group's k)

For an mma's 16 k-values to share one group, lane t of a quad holds C contiguous words of each
chunk of 4C words (C = 1, 2 or 4 by group size) instead of 4 contiguous words of a stretch of 16.
Rows stay M-invariant by construction (each output column is its x row's alone), but the
results are not our product's bits: this is for measuring, not for the model. Plain product
only (no norm, swiglu, residual or gate), bf16 activations and scales, 4 and 8 bits.
"""

from __future__ import annotations

import mlx.core as mx

from mtpcli.kernels import available, kernel_name, launch_bounds
from mtpcli.kernels import quantized_matmul as qm

_HEADER = """
template <int N>
__device__ __forceinline__ void qx_load(uint32_t* dst, const uint32_t* src) {
  if constexpr (N == 4) {
    const uint4 v = *reinterpret_cast<const uint4*>(src);
    dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
  } else if constexpr (N == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    dst[0] = v.x, dst[1] = v.y;
  } else {
    dst[0] = src[0];
  }
}

// Values i and i + VPW/2 of a word as a bf16 pair, undequantized: 128 + q (4 bits, exact in
// bf16), or q (8 bits, exact).
template <int BITS>
__device__ __forceinline__ uint32_t qx_raw(uint32_t w, int i) {
  if constexpr (BITS == 4) {
    return qm_and_or(w >> (BITS * i), 0x000F000Fu, 0x43004300u);
  } else {
    const uint32_t u = (w >> (BITS * i)) & 0x00FF00FFu;
    return qm_as_u32(__floats2bfloat162_rn(static_cast<float>(u & 0xFFFFu),
                                           static_cast<float>(u >> 16)));
  }
}
"""

SOURCE = """
    constexpr int VPW = 32 / BITS;
    constexpr int STEPS = VPW / 4;
    constexpr int XW = VPW / 2;
    constexpr int WG = GS / VPW;                    // words a group
    constexpr int C = WG >= 16 ? 4 : WG / 4;        // words a lane holds of a chunk
    constexpr int SEG = 4 * C;                      // a chunk: inside one group
    constexpr int CHUNKS = 16 / SEG;
    constexpr float OFF = BITS == 4 ? 128.0f : 0.0f;
    const int K = x_shape[x_ndim - 1];
    int M = 1;
    for (int d = 0; d + 1 < x_ndim; ++d) M *= x_shape[d];
    const int N = w_shape[0];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int r_lo = blockIdx.x * 16 + g;
    const int r_hi = r_lo + 8;
    const size_t lo = min(r_lo, N - 1), hi = min(r_hi, N - 1);
    const int words = K / VPW;
    const int groups = K / GS;
    const int stretches = words / 16;
    const uint32_t* w_lo = w + lo * words;
    const uint32_t* w_hi = w + hi * words;
    const uint32_t* x_g = reinterpret_cast<const uint32_t*>(x) + (size_t)min(g, M - 1) * (K / 2);
    const uint32_t ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    // A stretch's scales and biases of a row, packed: its CHUNKS groups are adjacent (bf16 each).
    constexpr int SW = CHUNKS == 4 ? 2 : 1;
    uint32_t nl[4], nh[4], nsl[SW], nbl[SW], nsh[SW], nbh[SW];
    auto packed = [&](uint32_t* dst, const ST* row, int grp) {
      if constexpr (CHUNKS == 1) {
        dst[0] = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(row + grp));
      } else {
        qx_load<SW>(dst, reinterpret_cast<const uint32_t*>(row + grp));
      }
    };
    auto fetch = [&](int st) {
      for (int ch = 0; ch < CHUNKS; ++ch) {
        qx_load<C>(nl + ch * C, w_lo + st * 16 + ch * SEG + t * C);
        qx_load<C>(nh + ch * C, w_hi + st * 16 + ch * SEG + t * C);
      }
      const int grp = (st * 16 * VPW) / GS;  // the stretch's first group
      packed(nsl, scales + lo * groups, grp);
      packed(nbl, biases + lo * groups, grp);
      packed(nsh, scales + hi * groups, grp);
      packed(nbh, biases + hi * groups, grp);
    };
    // chunk ch's value of a packed stretch, as a float (bf16's bits are a float's high half)
    auto unpack = [](const uint32_t* p, int ch) {
      const uint32_t u = p[ch >> 1];
      return __uint_as_float((ch & 1) ? (u & 0xFFFF0000u) : (u << 16));
    };
    if (warp < stretches) fetch(warp);
    for (int st = warp; st < stretches; st += WARPS) {
      uint32_t wl[4], wh[4], sl[SW], bl[SW], sh[SW], bh[SW];
      for (int i = 0; i < 4; ++i) wl[i] = nl[i], wh[i] = nh[i];
      for (int i = 0; i < SW; ++i) sl[i] = nsl[i], bl[i] = nbl[i], sh[i] = nsh[i], bh[i] = nbh[i];
      if (st + WARPS < stretches) fetch(st + WARPS);
      for (int ch = 0; ch < CHUNKS; ++ch) {
        float cq[4] = {0.0f, 0.0f, 0.0f, 0.0f}, c1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int u = 0; u < C; ++u) {
          const int word = st * 16 + ch * SEG + t * C + u;
          uint32_t xv[XW];
          if (g < M) {
            qm_load<XW>(xv, x_g + word * XW);
          } else {
            for (int i = 0; i < XW; ++i) xv[i] = 0u;
          }
          for (int s = 0; s < STEPS; ++s) {
            uint32_t a[4], b[2];
            a[0] = qx_raw<BITS>(wl[ch * C + u], 2 * s);
            a[1] = qx_raw<BITS>(wh[ch * C + u], 2 * s);
            a[2] = qx_raw<BITS>(wl[ch * C + u], 2 * s + 1);
            a[3] = qx_raw<BITS>(wh[ch * C + u], 2 * s + 1);
            b[0] = __byte_perm(xv[s], xv[s + STEPS], 0x5410);
            b[1] = __byte_perm(xv[s], xv[s + STEPS], 0x7632);
            qm_mma(cq, a, b, XT{});
            qm_mma(c1, ones, b, XT{});
          }
        }
        const float fsl = unpack(sl, ch), fsh = unpack(sh, ch);
        const float fbl = unpack(bl, ch) - OFF * fsl;
        const float fbh = unpack(bh, ch) - OFF * fsh;
        c[0] = fmaf(fsl, cq[0], fmaf(fbl, c1[0], c[0]));
        c[1] = fmaf(fsl, cq[1], fmaf(fbl, c1[1], c[1]));
        c[2] = fmaf(fsh, cq[2], fmaf(fbh, c1[2], c[2]));
        c[3] = fmaf(fsh, cq[3], fmaf(fbh, c1[3], c[3]));
      }
    }
    __shared__ float part[WARPS * 32 * 4];
    for (int i = 0; i < 4; ++i) part[(warp * 32 + lane) * 4 + i] = c[i];
    __syncthreads();
    if (warp == 0) {
      float acc[4];
      for (int i = 0; i < 4; ++i) {
        acc[i] = part[lane * 4 + i];
        for (int v = 1; v < WARPS; ++v) acc[i] = acc[i] + part[(v * 32 + lane) * 4 + i];
      }
      for (int i = 0; i < 4; ++i) {
        const int row = i < 2 ? r_lo : r_hi;
        const int m = 2 * t + (i & 1);
        if (row < N && m < M) y[(size_t)m * N + row] = static_cast<XT>(acc[i]);
      }
    }
"""
HEADER = qm._HEADER_CUDA + _HEADER
_kernels: dict = {}


def grouped_matmul(x, w, scales, biases, *, group_size: int, bits: int, warps: int = qm.WARPS,
                   min_blocks: int | None = None) -> mx.array | None:  # fmt: skip
    """x [..., K] (bf16, at most 8 rows) times the dequantized w [N, K] transposed -> [..., N]
    by the experimental kernel (``min_blocks``: launch bounds); None without CUDA."""
    if not available("cuda"):
        return None
    assert x.dtype == scales.dtype == mx.bfloat16, "bf16: the ones of the sums' mma, unpack"
    header = HEADER + (launch_bounds(warps, min_blocks) if min_blocks else "")
    kernel = _kernels.get(header)
    if kernel is None:
        kernel = _kernels[header] = mx.fast.cuda_kernel(
            name=kernel_name("mtp_qmm_grp", SOURCE, header), input_names=["x", "w", "scales",
            "biases"], output_names=["y"], source=SOURCE, header=header)  # fmt: skip
    n = w.shape[0]
    return kernel(
        inputs=[x, w, scales, biases],
        template=[
            ("XT", x.dtype),
            ("ST", scales.dtype),
            ("BITS", bits),
            ("GS", group_size),
            ("WARPS", warps),
        ],  # fmt: skip
        grid=(32 * warps * ((n + 15) // 16), 1, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(*x.shape[:-1], n)],
        output_dtypes=[x.dtype],
    )[0]
