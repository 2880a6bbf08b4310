"""An experimental split of K across blocks for ``bench_qmm.py --arms kKS[wW]``: more warps in
flight for products of few rows.

A product of 5120 rows (the MLP's down and the out projections, 128 launches a 27B step) is
320 tiles of 16 rows: under ``ncu`` that is 0.61 of a wave on the H200, 30% occupancy, and no
warp ready to issue in 52% of the cycles (session 22). Here each tile's K is split across KS
blocks of W warps; each block reduces its warps' partial tiles in warp order, as our product
does, and writes its partial tile; the last block of a tile to finish (a counter per tile,
which that block sets back to zero) adds the KS partials in block order and stores the outputs.
So the sum's order is fixed whatever order the blocks run in, and rows stay M-invariant; the
results are not our product's bits (the additions are grouped differently). The counters are a
buffer kept across launches: launches that may run at the same time must not share one (a
ring of them here). Plain product only, CUDA only: for measuring, not for the model.
"""

from __future__ import annotations

import itertools

import mlx.core as mx

from mtpcli.kernels import available, kernel_name, launch_bounds
from mtpcli.kernels import quantized_matmul as qm


def _split(text: str) -> str:
    """Our plain product's CUDA source with K split across KS blocks (see the module)."""
    edits = [
        ("const int r_lo = blockIdx.x * 16 + g;",
         "const int tiles = (N + 15) / 16;\n"
         "    const int tile = blockIdx.x % tiles, ks = blockIdx.x / tiles;  // K part ks of tile\n"
         "    const int r_lo = tile * 16 + g;"),
        ("const int stretches = words / 16;",
         "const int all = words / 16;  // the row's stretches; this block's are [s0, stretches)\n"
         "    const int s0 = ks * ((all + KS - 1) / KS);\n"
         "    const int stretches = min(all, s0 + (all + KS - 1) / KS);"),
        ("if (warp < stretches) fetch(warp);", "if (s0 + warp < stretches) fetch(s0 + warp);"),
        ("for (int st = warp; st < stretches; st += WARPS) {",
         "for (int st = s0 + warp; st < stretches; st += WARPS) {"),
        ("""      for (int i = 0; i < 4; ++i) {
        const int row = i < 2 ? r_lo : r_hi;""",
         """      if constexpr (KS > 1) {  // the partials, added in block order by the last block
        float* mine = partials + ((size_t)tile * KS + ks) * 128 + lane * 4;
        for (int i = 0; i < 4; ++i) mine[i] = acc[i];
        __threadfence();
        unsigned int* count = const_cast<unsigned int*>(counter) + tile;
        unsigned int before = 0u;
        if (lane == 0) before = atomicAdd(count, 1u);
        before = __shfl_sync(0xFFFFFFFFu, before, 0);
        if (before != KS - 1) return;
        __threadfence();
        const float* all_ks = partials + (size_t)tile * KS * 128 + lane * 4;
        for (int i = 0; i < 4; ++i) {
          acc[i] = __ldcg(all_ks + i);
          for (int k = 1; k < KS; ++k) acc[i] = acc[i] + __ldcg(all_ks + k * 128 + i);
        }
        if (lane == 0) *count = 0u;  // ready for the next launch
      }
      for (int i = 0; i < 4; ++i) {
        const int row = i < 2 ? r_lo : r_hi;"""),
    ]  # fmt: skip
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


SOURCE = _split(qm.source(False))
RING = 64  # counter buffers, one a launch in turn: more than the launches that run at once
_kernels: dict = {}
_counters: dict = {}  # tiles -> RING counter buffers
_turn = itertools.count()


def splitk_matmul(x, w, scales, biases, *, group_size: int, bits: int, ks: int = 2,
                  warps: int = qm.WARPS, min_blocks: int | None = None):  # fmt: skip
    """x [..., K] (at most 8 rows) times the dequantized w [N, K] transposed -> [..., N], K
    split across ``ks`` blocks of ``warps`` warps (``min_blocks``: launch bounds); None without
    CUDA."""
    if not available("cuda"):
        return None
    header = qm._HEADER_CUDA + (launch_bounds(warps, min_blocks) if min_blocks else "")
    kernel = _kernels.get(header)
    if kernel is None:
        kernel = _kernels[header] = mx.fast.cuda_kernel(
            name=kernel_name("mtp_qmm_splitk", SOURCE, header),
            input_names=["x", "w", "scales", "biases", "counter"],
            output_names=["y", "partials"], source=SOURCE, header=header)  # fmt: skip
    n = w.shape[0]
    tiles = (n + 15) // 16
    if tiles not in _counters:
        _counters[tiles] = [mx.zeros((tiles,), mx.uint32) for _ in range(RING)]
        mx.eval(_counters[tiles])
    counter = _counters[tiles][next(_turn) % RING]
    return kernel(
        inputs=[x, w, scales, biases, counter],
        template=[*qm.template(x, scales, bits, group_size, warps), ("KS", ks)],
        grid=(32 * warps * tiles * ks, 1, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(*x.shape[:-1], n), (tiles * ks * 128,)],
        output_dtypes=[x.dtype, mx.float32],
    )[0]
