"""Experimental gated-delta kernels (CUDA only, not in the product), for A/B runs against it
(``bench_gdn_rows.py --experiments``). Each has the product's contract
(``gated_delta_raw_native``); their logic is checked on the CPU in emulation and their
compilation with nvcc (tests/test_gdn_experiments.py) before any device time is spent.

- ``one_reduction``: the product's layout (4 rows per warp, 32 lanes per row) with one
  butterfly per step instead of two: with s the decayed state row, o = (s + delta k) . q is
  computed as s . q + delta (k . q), so s . k, s . q and k . q are reduced together and the
  output no longer waits for the state update. States are the product's bitwise; outputs round
  differently.
- ``lane_group_L``: L lanes per value row (32 / L rows per warp, Dk / L state columns a lane):
  the butterflies are log2(L) levels instead of 5 and serve all of a warp's rows at once. The
  q/k normalisation is still done once per warp over 32 lanes and passed through shared memory.
  Sums run in a different order from the product (not bitwise equal to it).

Chain parity (T steps in one launch equal T one-step launches) holds for each, as for the
product: a step's arithmetic does not depend on T.
"""

from __future__ import annotations

import mlx.core as mx

from mtpcli.kernels import gated_delta as gd
from mtpcli.kernels import kernel_name

_TWO_REDUCTIONS_START = "      float kv[R], o[R];\n"
_TWO_REDUCTIONS_END = "o[r] = o[r] + __shfl_xor_sync(0xffffffffu, o[r], off);\n      }\n"
_ONE_REDUCTION = """      float kv[R], o[R], dq[R], kq = 0.0f;
      for (int i = 0; i < NPT; ++i) kq = kq + kn[i] * qn[i];
      for (int r = 0; r < R; ++r) {
        kv[r] = 0.0f;
        dq[r] = 0.0f;
        for (int i = 0; i < NPT; ++i) {
          s[r][i] = s[r][i] * gt;
          kv[r] = kv[r] + s[r][i] * kn[i];
          dq[r] = dq[r] + s[r][i] * qn[i];
        }
      }
      for (int off = 16; off > 0; off >>= 1) {
        kq = kq + __shfl_xor_sync(0xffffffffu, kq, off);
        for (int r = 0; r < R; ++r) {
          kv[r] = kv[r] + __shfl_xor_sync(0xffffffffu, kv[r], off);
          dq[r] = dq[r] + __shfl_xor_sync(0xffffffffu, dq[r], off);
        }
      }
      for (int r = 0; r < R; ++r) {
        const float delta = (vt[r] - kv[r]) * bt;
        o[r] = dq[r] + delta * kq;
        for (int i = 0; i < NPT; ++i) s[r][i] = s[r][i] + kn[i] * delta;
      }
"""


def one_reduction_source(keep: bool) -> str:
    """The product's CUDA source (raw variant) with its two reductions per step made one."""
    src = gd._source(False, keep, True)
    start = src.index(_TWO_REDUCTIONS_START)
    end = src.index(_TWO_REDUCTIONS_END) + len(_TWO_REDUCTIONS_END)
    return src[:start] + _ONE_REDUCTION + src[end:]


# Lane l loads and normalises q/k columns l * NPT .. (as the product); lane (row l / L, sub
# l % L) holds state columns i * L + sub of its row (interleaved: conflict-free shared reads).
# The prologue (shapes, indices, input pointers) is the product's, with the row index changed.
_PRODUCT_ROW = "    const int dv = (blockIdx.y * blockDim.y + threadIdx.y) * R;\n"
_LANE_GROUP_ROW = """    constexpr int RPW = 32 / L;
    const int sub = lane % L;
    const int dv = (blockIdx.y * blockDim.y + threadIdx.y) * RPW + lane / L;
"""
_LANE_GROUP = """
    GATE_INPUTS
    constexpr int CPL = Dk / L;
    __shared__ float qk_sh[4][2][Dk];  // per warp of the threadgroup: normalised q and k
    float* q_sh = qk_sh[threadIdx.y][0];
    float* k_sh = qk_sh[threadIdx.y][1];
    const float* s_in = state_in + ((size_t)n * Dv + dv) * Dk;
    float s[CPL];
    for (int i = 0; i < CPL; ++i) s[i] = s_in[i * L + sub];
    for (int t = 0; t < T; ++t) {
      const float gx = static_cast<float>(g_[t * gs]);
      const float bx = static_cast<float>(b_[t * bs]);
      const float vt = static_cast<float>(v_[t * v_strides[1]]);
      float qn[NPT], kn[NPT];
      for (int i = 0; i < NPT; ++i) {
        qn[i] = static_cast<float>(q_[t * q_strides[1] + i * q_strides[3]]);
        kn[i] = static_cast<float>(k_[t * k_strides[1] + i * k_strides[3]]);
      }
      GATES
      QK
      __syncwarp();
      for (int i = 0; i < NPT; ++i) {
        q_sh[lane * NPT + i] = qn[i];
        k_sh[lane * NPT + i] = kn[i];
      }
      __syncwarp();
      float qc[CPL], kc[CPL];
      for (int i = 0; i < CPL; ++i) {
        qc[i] = q_sh[i * L + sub];
        kc[i] = k_sh[i * L + sub];
      }
      float kv = 0.0f;
      for (int i = 0; i < CPL; ++i) {
        s[i] = s[i] * gt;
        kv = kv + s[i] * kc[i];
      }
      for (int off = L / 2; off > 0; off >>= 1) kv = kv + __shfl_xor_sync(0xffffffffu, kv, off);
      const float delta = (vt - kv) * bt;
      float o = 0.0f;
      for (int i = 0; i < CPL; ++i) {
        s[i] = s[i] + kc[i] * delta;
        o = o + s[i] * qc[i];
      }
      for (int off = L / 2; off > 0; off >>= 1) o = o + __shfl_xor_sync(0xffffffffu, o, off);
      if (sub == 0) y_[t * Hv * Dv] = static_cast<InT>(o);
      KEEP_STATES
    }
    float* s_out = state_out + ((size_t)n * Dv + dv) * Dk;
    for (int i = 0; i < CPL; ++i) s_out[i * L + sub] = s[i];
"""
_LANE_GROUP_KEEP = """if (t + 1 < T) {
        float* s_t = states + (((size_t)t * B * Hv + n) * Dv + dv) * Dk;
        for (int i = 0; i < CPL; ++i) s_t[i * L + sub] = s[i];
      }"""


def lane_group_source(keep: bool) -> str:
    """The lane-group kernel (raw variant), with the product's gate and q/k splices."""
    product = gd._CUDA_SOURCE[: gd._CUDA_SOURCE.index("    GATE_INPUTS\n")]
    assert _PRODUCT_ROW in product, "the product's row index changed: update _PRODUCT_ROW"
    src = product.replace(_PRODUCT_ROW, _LANE_GROUP_ROW) + _LANE_GROUP.lstrip("\n")
    for name, blocks in gd._RAW.items():
        src = src.replace(name, blocks[0])
    return src.replace("KEEP_STATES", _LANE_GROUP_KEEP if keep else "")


KINDS = ("one_reduction", "lane_group_4", "lane_group_8", "lane_group_16")
_built: dict = {}


def _kernel(kind: str, keep: bool):
    if (kind, keep) not in _built:
        spec = gd._spec(False, keep, True)
        source = one_reduction_source(keep) if kind == "one_reduction" else lane_group_source(keep)
        spec |= {"source": source, "name": kernel_name(f"mtp_gdn_{kind}", source)}
        _built[(kind, keep)] = mx.fast.cuda_kernel(**spec)
    return _built[(kind, keep)]


def run(kind: str, q, k, v, a, b, A_log, dt_bias, state, *, keep_states: bool = False):
    """Experimental kernel ``kind``, same contract as ``gd.gated_delta_raw_native``."""
    keep = gd._keeps(q, keep_states)
    inputs = [q, k, v, a.astype(q.dtype), b.astype(q.dtype), mx.contiguous(A_log),
              mx.contiguous(dt_bias), gd._dense(state)]  # fmt: skip
    types = [("AT", A_log.dtype), ("DT", dt_bias.dtype)]
    if kind == "one_reduction":
        gd._ROWS = 4
        out = gd._launch(_kernel(kind, keep), inputs, q, k, v, keep, types)
        return gd._with_states(out, keep_states)
    lanes = int(kind.rsplit("_", 1)[1])
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2], v.shape[3]
    shapes = [(B, T, Hv, Dv), (B, Hv, Dv, Dk)] + ([(T - 1, B, Hv, Dv, Dk)] if keep else [])
    out = _kernel(kind, keep)(
        inputs=inputs,
        template=[
            ("InT", q.dtype),
            ("Dk", Dk),
            ("Dv", Dv),
            ("Hk", Hk),
            ("Hv", Hv),
            ("L", lanes),
            *types,
        ],  # fmt: skip
        grid=(32, Dv // (32 // lanes), B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=shapes,
        output_dtypes=[q.dtype] + [mx.float32] * (len(shapes) - 1),
    )
    return gd._with_states((out[0], out[1], out[2] if keep else None), keep_states)
