"""The gated-delta recurrence of Qwen3.5's linear-attention layers, with per-step states.

The verify pass needs the state after every position but the last (that one is the final
state) so that the rollback can restore the state after any accepted prefix without running
the target again. One launch runs all T steps of a block for all heads. Chain parity: step t
of a T-step launch does exactly the arithmetic of a one-step launch, so T steps equal T
one-step calls bitwise, and MTP equals classic on a backend as long as both use the same path
(they do: ``gated_delta_conv`` picks per shape class, not per T).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial

import mlx.core as mx
from mlx_lm.models.gated_delta import compute_g, normalize_qk

from . import RCP1, backend, built, constant, fill, kernel_name, launch_bounds, spell, use_native
from .conv_window import conv_silu, conv_silu_ops


@mx.compile
def _step(q, k, v, g, beta, state):
    """One recurrent step.

    q, k: [B, Hv, Dk]; v: [B, Hv, Dv]; g, beta: [B, Hv]; state: [B, Hv, Dv, Dk] (float32).
    Returns y [B, Hv, Dv] (q's dtype) and the new state.
    """
    state = state * g[..., None, None]
    kv_mem = (state * k[..., None, :]).sum(axis=-1)  # [B, Hv, Dv]
    delta = (v - kv_mem) * beta[..., None]  # [B, Hv, Dv]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)  # [B, Hv, Dv]
    return y.astype(q.dtype), state


def gated_delta_ops(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    *,
    keep_states: bool = False,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """Ops reference: T sequential steps.

    Shapes: q, k [B, T, Hk, Dk] (q/k normalised, readout scale folded into q); v [B, T, Hv, Dv];
    g, beta [B, T, Hv]; state [B, Hv, Dv, Dk] float32.
    Returns y [B, T, Hv, Dv], the final state, and (with ``keep_states``) the state after each
    step but the last, [T - 1, B, Hv, Dv, Dk].
    """
    hk, hv = k.shape[2], v.shape[2]
    if hv > hk:
        q = mx.repeat(q, hv // hk, axis=2)
        k = mx.repeat(k, hv // hk, axis=2)
    T, ys, states = q.shape[1], [], []
    for t in range(T):
        y, state = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        if keep_states and t < T - 1:
            states.append(state)
    if not keep_states:
        return mx.stack(ys, axis=1), state, None
    return mx.stack(ys, axis=1), state, mx.stack(states) if states else _no_states(state)


def _no_states(state: mx.array) -> mx.array:
    return mx.zeros((0, *state.shape), mx.float32)  # [0, B, Hv, Dv, Dk]: a one-step block


# T and B are read from k's shape at run time, so one compiled variant serves every block and
# prompt length. A threadgroup is WARPS warps (CUDA) / SIMD-groups (Metal) of HPT value heads
# of one key head (WARPS / HPT warps a head; HPT is 1 but in a wide block), each warp R value
# rows. A row is held by a group of LH = LANES lanes (32 / LH groups a warp, R
# a multiple of them, RH rows a group), lane l of a group holding Dk/LH columns of each of its
# group's rows in runs of 4 (4l..4l+3, then 4 LH further on; COL). A dot product is summed
# along a lane's columns in at most 4 partial sums of at most 8 terms (a shorter dependent
# chain), then a butterfly over the group's lanes in a fixed order, so one shuffle serves a
# row of each group. A lane writes a run as one 16-byte store and reads a run of the chunk's
# q or k from shared memory as 4 adjacent words.
# The steps go in chunks of up to CH: a chunk's q/k normalisation and gates do not depend on
# the state, so the threadgroup makes them once, spread over its warps, into shared memory,
# and every warp's steps read them there (made in each warp, they were about half of a step's
# instructions). A row's arithmetic depends on neither R, T nor which warp made its inputs.
# Both backends' sources are this one text with their few differences filled in
# (``kernels.spell``), so the Metal kernel mirrors the CUDA kernel line by line by construction.
# It reads the layer's raw q/k, a and b and computes mlx-lm's normalize_qk, compute_g and
# sigmoid(b) itself (seven launches a layer a step saved); how it reads q, k and v is a part
# (``_READ``, ``_CONV_READ``).
_TEMPLATE = """
    constexpr int NPT = Dk / 32;  // a lane's columns of a q/k row (all 32 lanes make one)
    constexpr int LH = {{LANES}};  // a state row's lanes: a group
    constexpr int NG = 32 / LH;  // a warp's groups
    constexpr int SPL = Dk / LH;  // a lane's columns of a state row
    constexpr int VW = SPL % 4 == 0 ? 4 : 1;  // in runs of VW adjacent columns
    constexpr int NA = SPL >= 32 ? 4 : SPL >= 16 ? 2 : 1;  // a dot product's partial sums
    constexpr int RH = R / NG;  // a lane's state rows: its group's
    static_assert(R % NG == 0, "a warp's groups hold as many rows");
    constexpr int CH = R > 4 ? 32 / R : 8;
    constexpr int WH = WARPS / HPT;  // a head's warps (a threadgroup holds HPT of a key head's)
    static_assert(WARPS % HPT == 0 && (Hv / Hk) % HPT == 0, "whole heads of one key head");
    static_assert(CH <= 32, "a chunk's gates are made by the lanes of one warp");
    const int B = {{TIMED}}_shape[0];
    const int T = {{TIMED}}_shape[1];
    {{THREAD_INDICES}}
    const int b = n / Hv;
    const int hv = n % Hv;
    const int hk = hv / (Hv / Hk);
    {{QKV_INPUTS}}
    DEVICE InT* y_ = y + (size_t)b * T * Hv * Dv + hv * Dv + dv;
    {{GATE_INPUTS}}
    // The state is read through its strides: after a rollback it is a view into the last
    // verify's per-step states, and a fresh cache's zeros may be a broadcast.
    const int grp = lane / LH, hl = lane % LH;  // the lane's group and its lane there
    // The column of a lane's i-th: a group's lanes' runs side by side, then the next runs.
    #define COL(i) (((i) / VW) * (VW * LH) + VW * hl + (i) % VW)
    // A dot product's NA partial sums p, added in a fixed order.
    #define PSUM(p) \\
      (NA == 4 ? ((p)[0] + (p)[1]) + ((p)[2] + (p)[3]) : NA == 2 ? (p)[0] + (p)[1] : (p)[0])
    const int dh = dv + grp * RH;  // the group's first row
    float s[RH][SPL];
    // A lane's columns of a state row into an output row, a run a 16-byte store where runs
    // are 4 long (16-byte aligned: rows of Dk), evict-first on CUDA (the next reader is the
    // next step's launch, after the weights have gone through L2).
    #define STORE_ROW(dst, src) \
      if (VW == 4) { \
        for (int i = 0; i < SPL; i += 4) \
          STORE4((DEVICE float4*)((dst) + COL(i)), \
                 FLOAT4((src)[i], (src)[i + 1], (src)[i + 2], (src)[i + 3])); \
      } else { \
        for (int i = 0; i < SPL; ++i) STORE1((dst) + COL(i), (src)[i]); \
      }
    for (int r = 0; r < RH; ++r) {
      DEVICE const float* s_in = state_in + b * state_in_strides[0] + hv * state_in_strides[1]
          + (dh + r) * state_in_strides[2];
      for (int i = 0; i < SPL; ++i) s[r][i] = s_in[COL(i) * state_in_strides[3]];
    }
    ALIGN16 SHARED float qk_sh[CH][2][Dk];  // a chunk's normalised q (0) and k (1)
    SHARED float gb_sh[HPT][CH][2];  // a chunk's decay (0) and beta (1), each head's
    {{CONV_COPY}}
    static_assert(CH * R <= 32, "a chunk's value inputs are loaded by the lanes of one warp");
    {{KEEP_INIT}}
    float xin = 0.0f;  // lane l < C R: value row l % R's input at the chunk's step l / R
    for (int t0 = 0; t0 < T; t0 += CH) {
      const int C = min(CH, T - t0);
      if (lane < C * R) V_LOAD(xin, lane % R, t0 + lane / R);
      if (t0 > 0) {
        BARRIER;  // every warp is done with the last chunk
      }
      for (int u = warp; u < 2 * C; u += WARPS) {
        const int j = u >> 1;
        const bool isq = (u & 1) == 0;
        float x[NPT];
        {{QK_LOAD}}
        {{QK}}
        for (int i = 0; i < NPT; ++i) qk_sh[j][isq ? 0 : 1][lane * NPT + i] = x[i];
      }
      if (warp % WH == WH - 1 && lane < C) {
        const float gx = static_cast<float>(g_[(t0 + lane) * gs]);
        const float bx = static_cast<float>(b_[(t0 + lane) * bs]);
        {{GATES}}
        gb_sh[hg][lane][0] = gt;
        gb_sh[hg][lane][1] = bt;
      }
      BARRIER;
      for (int j = 0; j < C; ++j) {
        const int t = t0 + j;
        float qn[SPL], kn[SPL], xv[RH], vt[RH];
        for (int i = 0; i < SPL; ++i) {
          qn[i] = qk_sh[j][0][COL(i)];  // a run: one 16-byte read on CUDA
          kn[i] = qk_sh[j][1][COL(i)];
        }
        for (int r = 0; r < RH; ++r) xv[r] = LANE_SHUFFLE(xin, LANE_OFFSET(j * R + grp * RH + r));
        {{V_TAKE}}
        const float gt = gb_sh[hg][j][0], bt = gb_sh[hg][j][1];
        float kv[RH], o[RH];
        for (int r = 0; r < RH; ++r) {
          float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          for (int i = 0; i < SPL; ++i) {
            s[r][i] = s[r][i] * gt;
            p[i % NA] = p[i % NA] + s[r][i] * kn[i];
          }
          kv[r] = PSUM(p);
        }
        for (LANE_OFFSET off = LH / 2; off > 0; off >>= 1) {
          for (int r = 0; r < RH; ++r) kv[r] = kv[r] + XOR_SHUFFLE(kv[r], off);
        }
        for (int r = 0; r < RH; ++r) {
          const float delta = (vt[r] - kv[r]) * bt;
          float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          for (int i = 0; i < SPL; ++i) {
            s[r][i] = s[r][i] + kn[i] * delta;
            p[i % NA] = p[i % NA] + s[r][i] * qn[i];
          }
          o[r] = PSUM(p);
        }
        for (LANE_OFFSET off = LH / 2; off > 0; off >>= 1) {
          for (int r = 0; r < RH; ++r) o[r] = o[r] + XOR_SHUFFLE(o[r], off);
        }
        if (hl == 0) {
          for (int r = 0; r < RH; ++r) y_[grp * RH + r] = static_cast<InT>(o[r]);
        }
        {{KEEP_STATES}}
        y_ += Hv * Dv;  // pointers moved on a step, not addresses made again (a step's issue)
      }
    }
    for (int r = 0; r < RH; ++r) {
      DEVICE float* s_out = state_out + ((size_t)n * Dv + dh + r) * Dk;
      STORE_ROW(s_out, s[r]);
    }
"""

# Where a warp's / SIMD-group's threads are: the rest of the two backends' differences are
# ``kernels.spell``'s.
_THREAD_INDICES = {
    False: """const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int hg = warp / WH;  // the warp's head of the threadgroup's
    const int dv = (blockIdx.y * WH + warp % WH) * R;
    const int n = blockIdx.z * HPT + hg;""",
    True: """const int lane = thread_index_in_simdgroup;
    const int warp = simdgroup_index_in_threadgroup;
    const int hg = warp / WH;  // the warp's head of the threadgroup's
    const int dv = (threadgroup_position_in_grid.y * WH + warp % WH) * R;
    const int n = threadgroup_position_in_grid.z * HPT + hg;""",
}

# The splices. Only the keep-states variant has the ``states`` output [T - 1, B, Hv, Dv, Dk]:
# the store after each step but the last (which is state_out) is spliced in, so both variants
# run the same arithmetic. st_ is the group's first row in step t's states.
_KEEP_INIT = "DEVICE float* st_ = states + ((size_t)n * Dv + dh) * Dk;"
_KEEP = """if (t + 1 < T) {
          for (int r = 0; r < RH; ++r) {
            DEVICE float* s_t = st_ + r * Dk;
            STORE_ROW(s_t, s[r]);
          }
          st_ += (size_t)B * Hv * Dv * Dk;
        }"""
# g_/b_ and gs/bs name the two gate inputs and their time strides; GATES makes the decay gt
# and beta bt from one step's gx, bx; QK normalises one loaded q (isq) or k row x in place:
# mlx-lm's arithmetic, rounded to the input dtype where mlx-lm's ops round: rms_norm(q) then
# times Dk^-1 (q) or Dk^-1/2 (k); a + dt_bias and softplus in the input dtype, the decay in
# float32; sigmoid(b) in the input dtype.
_RAW = {
    "GATE_INPUTS": """DEVICE const InT* g_ = a + b * a_strides[0] + hv * a_strides[2];
    DEVICE const InT* b_ = bb + b * bb_strides[0] + hv * bb_strides[2];
    const int gs = a_strides[1], bs = bb_strides[1];
    const float neg_a = -expf(static_cast<float>(A_log[hv]));
    const float dtb = static_cast<float>(dt_bias[hv]);
    #define RD(x) static_cast<float>(static_cast<InT>(x))  // rounded to the input dtype
    const float qs = RD(1.0f / Dk);
    const float ks = RD(rsqrtf(static_cast<float>(Dk)));""",
    "GATES": """const float x = RD(gx + dtb);
        const float sp = RD(fmaxf(x, 0.0f) + logf(1.0f + expf(-fabsf(x))));
        const float gt = expf(neg_a * sp);
        const float bt = RD(1.0f / (1.0f + expf(-bx)));""",
    "QK": """float ss = 0.0f;
        for (int i = 0; i < NPT; ++i) ss = ss + x[i] * x[i];
        for (LANE_OFFSET off = 16; off > 0; off >>= 1) ss = ss + XOR_SHUFFLE(ss, off);
        const float inv = rsqrtf(ss / Dk + 1e-6f / Dk);
        const float sc = isq ? qs : ks;
        for (int i = 0; i < NPT; ++i) x[i] = RD(RD(x[i] * inv) * sc);""",
}
# How q, k and v are read. The raw variant reads them as given (views into the conv's
# output); TIMED names the input whose shape gives B and T.
_READ = {
    "TIMED": "k",
    "QKV_INPUTS": """DEVICE const InT* q_ = q + b * q_strides[0] + hk * q_strides[2]
        + lane * NPT * q_strides[3];
    DEVICE const InT* k_ = k + b * k_strides[0] + hk * k_strides[2]
        + lane * NPT * k_strides[3];
    DEVICE const InT* v_ = v + b * v_strides[0] + hv * v_strides[2] + dv * v_strides[3];
    #define V_LOAD(dst, r, t) \\
      dst = static_cast<float>(v_[(t) * v_strides[1] + (r) * v_strides[3]])""",
    "QK_LOAD": """DEVICE const InT* src = isq ? q_ + (t0 + j) * q_strides[1]
                                    : k_ + (t0 + j) * k_strides[1];
        const auto st = isq ? q_strides[3] : k_strides[3];
        for (int i = 0; i < NPT; ++i) x[i] = static_cast<float>(src[i * st]);""",
    "CONV_COPY": "",
    "V_TAKE": "for (int r = 0; r < RH; ++r) vt[r] = xv[r];",
}
# The "conv" variant reads the input projection's qkv [B, T, NC], the conv window
# [B, CK-1, NC] and the conv weight [NC, CK] instead, and makes each q, k and v value with the
# conv kernel's arithmetic and roundings (kernels/conv_window.py) where it needs it: a q/k
# channel's is made by every threadgroup of its key head, as the q/k normalisation is. It also
# writes the conv kernel's other outputs: the window and inputs [B, CK-1+T, NC] (what the
# rollback restores the window from) and the new window [B, CK-1, NC], each channel by one
# thread. That saves the conv's launch per layer per step.
_CONV_READ = {
    "TIMED": "qkv",
    "QKV_INPUTS": """constexpr int NC = 2 * Hk * Dk + Hv * Dv;  // qkv's channels: q, k, then v
    constexpr int TW = CK - 1;  // the conv window's length
    DEVICE const InT* x_ = qkv + b * qkv_strides[0];
    DEVICE const InT* w_ = window + b * window_strides[0];
    const int xs = qkv_strides[1], xc = qkv_strides[2];
    const int ws = window_strides[1], wc = window_strides[2];
    const int cv = 2 * Hk * Dk + hv * Dv + dv;  // the warp's first value channel
    // channel c's input at step s (the window's for s < 0)
    #define CONV_IN(c, s) ((s) < 0 ? w_[((s) + TW) * ws + (c) * wc] : x_[(s) * xs + (c) * xc])
    // the conv's sum rounded to the input dtype, then SiLU as MLX's x * sigmoid(x) rounds
    #define CONV_ACT(dst, acc) { \\
      const float h_ = RD(acc); \\
      dst = RD(h_ * RD(RCP1(1.0f + expf(-h_)))); }
    #define V_LOAD(dst, r, t) dst = static_cast<float>(x_[(t) * xs + (cv + (r)) * xc])"""
    + RCP1,
    "QK_LOAD": """const int c0 = (isq ? 0 : Hk * Dk) + hk * Dk + lane * NPT;  // the lane's first
        // Each tap's input of channel c0 (the window's or qkv's) and its channel stride, chosen
        // once a task: per (channel, tap), a branch and a 64-bit address were a third of it.
        DEVICE const InT* tap_[CK];
        int tc_[CK];
        for (int kk_ = 0; kk_ < CK; ++kk_) {
          const int s_ = t0 + j - TW + kk_;
          tap_[kk_] = s_ < 0 ? w_ + (s_ + TW) * ws + c0 * wc : x_ + s_ * xs + c0 * xc;
          tc_[kk_] = s_ < 0 ? wc : xc;
        }
        // The lane's channels' conv weights, channel-major: a float32 copy (exact), read as
        // 16-byte runs (16 2-byte loads and their conversions were a tenth of a task).
        float wq_[NPT * CK];
        if ((NPT * CK) % 4 == 0) {
          DEVICE const float4* w4_ = (DEVICE const float4*)(conv_w + c0 * CK);
          for (int m = 0; m < NPT * CK / 4; ++m) {
            const float4 v4_ = w4_[m];
            wq_[4 * m] = v4_.x, wq_[4 * m + 1] = v4_.y;
            wq_[4 * m + 2] = v4_.z, wq_[4 * m + 3] = v4_.w;
          }
        } else {
          for (int m = 0; m < NPT * CK; ++m) wq_[m] = conv_w[c0 * CK + m];
        }
        for (int i = 0; i < NPT; ++i) {  // the conv's sum in tap order, then as CONV_ACT
          float acc_ = 0.0f;
          for (int kk_ = 0; kk_ < CK; ++kk_)
            acc_ = acc_ + wq_[i * CK + kk_] * static_cast<float>(tap_[kk_][i * tc_[kk_]]);
          CONV_ACT(x[i], acc_);
        }""",
    # The conv's other outputs, one (channel, slot) a thread: the warps' value rows, then
    # key head hk's q and k channels spread over the threadgroups of its value heads. Then
    # each warp's value rows: their conv weights and window in registers.
    "CONV_COPY": """{
      #define CONV_KEEP(c, j) { \\
        const InT in_ = CONV_IN(c, (j) - TW); \\
        inputs[((size_t)b * (TW + T) + (j)) * NC + (c)] = in_; \\
        if ((j) >= T) window_out[((size_t)b * TW + (j) - T) * NC + (c)] = in_; }
      for (int u = lane; u < R * (TW + T); u += 32) CONV_KEEP(cv + u / (TW + T), u % (TW + T));
      const int per = Dv / (R * WH);  // threadgroups a value head's rows span
      const int g = (hv % (Hv / Hk)) / HPT * per + dv / (R * WH);  // of its key head's
      const int step = (Hv / Hk / HPT) * per * 32 * WARPS;
      for (int u = g * 32 * WARPS + warp * 32 + lane; u < 2 * Dk * (TW + T); u += step) {
        const int cc = u % (2 * Dk);
        const int c = (cc < Dk ? hk * Dk : (Hk - 1) * Dk + hk * Dk) + cc;
        CONV_KEEP(c, u / (2 * Dk));
      }
    }
    float vk[RH][CK], vw[RH][CK];  // the lane's rows' conv weights, inputs from step t - TW
    for (int r = 0; r < RH; ++r) {
      const int c = cv + grp * RH + r;
      for (int k = 0; k < CK; ++k) vk[r][k] = static_cast<float>(conv_w[c * CK + k]);
      for (int k = 0; k < TW; ++k) vw[r][k] = static_cast<float>(CONV_IN(c, k - TW));
    }""",
    # step t's value inputs (loaded with the chunk's, handed out by a shuffle) through the
    # conv, the window slid on
    "V_TAKE": """for (int r = 0; r < RH; ++r) {
          vw[r][TW] = xv[r];
          float acc_ = 0.0f;
          for (int k = 0; k < CK; ++k) acc_ = acc_ + vk[r][k] * vw[r][k];
          CONV_ACT(vt[r], acc_);
          for (int k = 0; k < TW; ++k) vw[r][k] = vw[r][k + 1];
        }""",
}
_INPUTS = ["q", "k", "v", "a", "bb", "A_log", "dt_bias", "state_in"]
_CONV_INPUTS = ["qkv", "window", "conv_w", "a", "bb", "A_log", "dt_bias", "state_in"]
_kernels: dict = {}


def _source(metal: bool, keep: bool, conv: bool = False) -> str:
    """The kernel body of one variant for one backend, its parts filled in (``conv``: the one
    that makes q, k and v from the conv's inputs itself)."""
    text = fill(_TEMPLATE, KEEP_STATES=_KEEP if keep else "", KEEP_INIT=_KEEP_INIT if keep else "",
                THREAD_INDICES=_THREAD_INDICES[metal], LANES=str(_LANES),
                **(_CONV_READ if conv else _READ), **_RAW)  # fmt: skip
    return spell(text, metal)


# CUDA's STORE1 and STORE4 are its __stcs; Metal has no store hints.
_METAL_HEADER = """inline void store1(device float* p, float v) { *p = v; }
inline void store4(device float4* p, float4 v) { *p = v; }
"""

# Unbounded, the conv variant's registers allow 2 threadgroups of 8 warps a multiprocessor,
# fewer than a 27B layer's 384 threadgroups (B = 1) on a big GPU; bounded to 3, ptxas fits it
# without spills (tests/test_cuda_compile.py) and a layer's threadgroups run in one wave.
CONV_MIN_BLOCKS = 3


def _spec(metal: bool, keep: bool, conv: bool = False,
          bounds: tuple[int, int] | None = None) -> dict:  # fmt: skip
    """The arguments both backends' kernel factories take, for one variant; ``bounds`` (warps,
    threadgroups a multiprocessor) the conv variant's launch bounds, by default WARPS and
    CONV_MIN_BLOCKS."""
    source = _source(metal, keep, conv)
    warps, blocks = bounds or (_WARPS, CONV_MIN_BLOCKS)
    header = _METAL_HEADER if metal else launch_bounds(warps, blocks) if conv else ""
    kind = "_conv" if conv else "_raw"
    return {
        "name": kernel_name(f"mtp_gated_delta{kind}{'_keep' if keep else ''}", source, header),
        "header": header,
        "input_names": _CONV_INPUTS if conv else _INPUTS,
        "output_names": [
            "y",
            "state_out",
            *(["states"] if keep else []),
            *(["inputs", "window_out"] if conv else []),
        ],  # fmt: skip
        "source": source,
        # q, k, v and the gate inputs are read through their strides (in a verify block they
        # are views into the projections' output: a copy each would be a launch each).
        "ensure_row_contiguous": False,
    }


def _kernel(keep: bool, conv: bool = False, bounds: tuple[int, int] | None = None):
    return built(_kernels, (keep, conv, bounds), lambda metal: _spec(metal, keep, conv, bounds))


# Value rows per warp (R/2 a half-warp), with the q/k and gates made once per threadgroup:
# 2 (a row a half-warp) is the fastest of 1, 2 and 4 at every T
# (docs/benchmark_results/h200_gdn_variants_7b92129.json). A chunk's value inputs are loaded
# one a lane, so above 4 rows the chunks are shorter (32 / R steps).
_ROWS = 2
# Lanes a state row: 32 / LANES rows of a warp side by side (R a multiple of them); 16 is
# faster than 8 and 4 in the real step (same file).
_LANES = 16
# A threadgroup: its warps share one chunk's q/k normalisation and gates (with the conv folded
# in, convolved too), which every threadgroup of the key head makes again: 8 warps make them
# half as often as 4, faster for a verify block and on par for a decode step (same file).
_WARPS = 8
# Value heads a threadgroup: HEADS heads of one key head share its q/k normalisation (and
# conv), made once for them, their rows WARPS / HEADS warps each. 1 where it does not divide
# a key head's value heads.
_HEADS = 1
# The conv variant's blocks of WIDE_FROM steps or more go wide where the shape allows:
# (warps, heads, launch bound) 24 warps holding 3 heads, one threadgroup a multiprocessor, so
# a key head's q/k are made a third as often: faster from T = 3 on, slower at T = 1 and 2
# (same file). A row's arithmetic is the same either way, bit for bit.
_WIDE: tuple[int, int, int] | None = (24, 3, 1)
_WIDE_FROM = 3


def _hpt(Hk: int, Hv: int) -> int:
    """Value heads a threadgroup (HPT) for Hk key and Hv value heads, narrow."""
    return _HEADS if Hv % Hk == 0 and (Hv // Hk) % _HEADS == 0 else 1


def _fits(Hk: int, Hv: int, Dv: int, warps: int, heads: int) -> bool:
    """Whether threadgroups of ``warps`` warps holding ``heads`` value heads of one key head
    (R rows a warp) tile Hv heads of Dv rows."""
    return (Hv % Hk == 0 and (Hv // Hk) % heads == 0 and warps % heads == 0
            and Dv % (warps // heads * _ROWS) == 0)  # fmt: skip


def _placement(Hk: int, Hv: int, Dv: int, T: int = 1, conv: bool = True) -> tuple[int, int, int]:
    """(warps, heads, launch bound) of a T-step launch: wide where it fits, else narrow (the
    variants without the conv have no launch bounds: always narrow)."""
    if conv and _WIDE is not None and T >= _WIDE_FROM and _fits(Hk, Hv, Dv, *_WIDE[:2]):
        return _WIDE
    return _WARPS, _hpt(Hk, Hv), CONV_MIN_BLOCKS


def _layout(Hk: int, Hv: int, Dv: int, T: int = 1, R: int | None = None,
            conv: bool = True) -> dict:  # fmt: skip
    """The template constants that place a T-step launch's rows: R rows a warp, WARPS warps
    and HPT heads a threadgroup."""
    warps, heads, _ = _placement(Hk, Hv, Dv, T, conv)
    return {"R": R or _ROWS, "WARPS": warps, "HPT": heads}


def _geometry(B: int, Hv: int, Dv: int, layout: dict) -> tuple[tuple, tuple]:
    """The launch's grid and threadgroup (in threads): WARPS warps a threadgroup, of R rows
    each, WARPS / HPT warps a head."""
    R, warps, heads = layout["R"], layout["WARPS"], layout["HPT"]
    return (32 * warps, Dv * heads // (R * warps), B * Hv // heads), (32 * warps, 1, 1)


def _launch(inputs: list, dims: tuple, dtype, keep_states: bool, extra_types=(),
            conv_width: int = 0) -> list[mx.array] | None:  # fmt: skip
    """One launch for dims (B, T, Hk, Dk, Hv, Dv): y, the final state, the per-step states
    where kept, and with ``conv_width`` (the conv variant) the conv's window and inputs and new
    window; None where there is no kernel."""
    B, T, Hk, Dk, Hv, Dv = dims
    conv = conv_width > 0
    warps, _, blocks = _placement(Hk, Hv, Dv, T, conv)
    kernel = _kernel(keep_states, conv, bounds=(warps, blocks))
    if kernel is None:
        return None
    layout = _layout(Hk, Hv, Dv, T, conv=conv)
    grid, threadgroup = _geometry(B, Hv, Dv, layout)
    shapes = [(B, T, Hv, Dv), (B, Hv, Dv, Dk)] + ([(T - 1, B, Hv, Dv, Dk)] if keep_states else [])
    dtypes = [dtype] + [mx.float32] * (len(shapes) - 1)
    if conv_width:
        NC = 2 * Hk * Dk + Hv * Dv
        shapes += [(B, conv_width - 1 + T, NC), (B, conv_width - 1, NC)]
        dtypes += [dtype, dtype]
        extra_types = (*extra_types, ("CK", conv_width))
    return kernel(
        inputs=inputs,
        template=[
            ("InT", dtype),
            ("Dk", Dk),
            ("Dv", Dv),
            ("Hk", Hk),
            ("Hv", Hv),
            *layout.items(),
            *extra_types,
        ],  # fmt: skip
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=shapes,
        output_dtypes=dtypes,
    )


def _dims(q, v) -> tuple:
    """(B, T, Hk, Dk, Hv, Dv) of q [B, T, Hk, Dk] and v [B, T, Hv, Dv]."""
    return (*q.shape, *v.shape[2:])


def _keeps(x, keep_states: bool) -> bool:
    """Whether the launch writes per-step states (a one-step block has none to write); x is
    any input [B, T, ...]."""
    return keep_states and x.shape[1] > 1


def _with_states(out: list, keep_states: bool):
    """y, the final state and the states (empty for a one-step block) where asked for."""
    y, state = out[0], out[1]
    if not keep_states:
        return y, state, None
    return y, state, out[2] if y.shape[1] > 1 else _no_states(state)


def gated_delta_raw_ops(q, k, v, a, b, A_log, dt_bias, state, *, keep_states: bool = False):
    """Ops reference from the layer's raw inputs, as mlx-lm computes them.

    q, k [B, T, Hk, Dk] (conv outputs, not normalised); v [B, T, Hv, Dv]; a, b [B, T, Hv];
    A_log, dt_bias [Hv]; state [B, Hv, Dv, Dk] float32. Returns as ``gated_delta_ops``.
    """
    q, k = normalize_qk(q, k, inv_scale=k.shape[-1] ** -0.5, eps=1e-6)
    g = compute_g(A_log, a, dt_bias)  # [B, T, Hv]
    beta = mx.sigmoid(b)  # [B, T, Hv]
    return gated_delta_ops(q, k, v, g, beta, state, keep_states=keep_states)


def gated_delta_raw_native(q, k, v, a, b, A_log, dt_bias, state, *, keep_states=False):
    """The native kernel with the gating folded in; None where there is none."""
    inputs = [q, k, v, a.astype(q.dtype), b.astype(q.dtype), constant(A_log), constant(dt_bias),
              state.astype(mx.float32)]  # fmt: skip
    types = [("AT", A_log.dtype), ("DT", dt_bias.dtype)]  # in the name: they type the signature
    out = _launch(inputs, _dims(q, v), q.dtype, _keeps(q, keep_states), types)
    return None if out is None else _with_states(out, keep_states)


def _heads(conv_out: mx.array, heads: tuple) -> tuple[mx.array, mx.array, mx.array]:
    """q, k [B, T, Hk, Dk] and v [B, T, Hv, Dv]: views of conv_out [B, T, 2 Hk Dk + Hv Dv]."""
    Hk, Dk, Hv, Dv = heads
    B, T, _ = conv_out.shape
    q, k, v = mx.split(conv_out, [Hk * Dk, 2 * Hk * Dk], axis=-1)
    return q.reshape(B, T, Hk, Dk), k.reshape(B, T, Hk, Dk), v.reshape(B, T, Hv, Dv)


def conv_then_delta(conv, delta, qkv, window, conv_w, a, b, A_log, dt_bias, state, heads,
                    keep_states: bool):  # fmt: skip
    """The layer as two launches: ``conv`` (the window convolution and SiLU of ``qkv``) then
    ``delta`` (the recurrence) on its q, k, v heads; the folded kernel's outputs, in order."""
    out, inputs, new_window = conv(qkv, window, conv_w)
    q, k, v = _heads(out, heads)
    y, state, states = delta(q, k, v, a, b, A_log, dt_bias, state, keep_states=keep_states)
    return y, state, states, inputs, new_window


def gated_delta_conv_ops(qkv, window, conv_w, a, b, A_log, dt_bias, state, heads, *,
                         keep_states: bool = False):  # fmt: skip
    """Ops reference of the layer from its conv inputs: ``conv_silu_ops``, then
    ``gated_delta_raw_ops``.

    qkv [B, T, NC] (the input projection's q, k and v channels, NC = 2 Hk Dk + Hv Dv); window
    [B, K-1, NC]; conv_w [NC, K, 1]; a, b [B, T, Hv]; A_log, dt_bias [Hv]; state [B, Hv, Dv, Dk]
    float32; heads (Hk, Dk, Hv, Dv). Returns y [B, T, Hv, Dv], the final state, the states as
    ``gated_delta_ops`` does, the window and inputs [B, K-1+T, NC] and the new window
    [B, K-1, NC].
    """
    return conv_then_delta(conv_silu_ops, gated_delta_raw_ops, qkv, window, conv_w, a, b,
                            A_log, dt_bias, state, heads, keep_states)  # fmt: skip


def gated_delta_conv_native(qkv, window, conv_w, a, b, A_log, dt_bias, state, heads, *,
                            keep_states: bool = False):  # fmt: skip
    """The native kernel with the convolution and the gating folded in (same contract as
    ``gated_delta_conv_ops``); None where there is none."""
    B, T, NC = qkv.shape
    keep = _keeps(qkv, keep_states)
    K = conv_w.shape[1]
    # The weights as float32 (bf16 and f16 convert exactly), so a q/k task reads them as float4s.
    w32 = constant(conv_w, f"rows {NC}x{K} float32", lambda w: w.reshape(NC, K).astype(mx.float32))
    inputs = [qkv, window, w32,
              a.astype(qkv.dtype), b.astype(qkv.dtype), constant(A_log), constant(dt_bias),
              state.astype(mx.float32)]  # fmt: skip
    # in the name: they type the signature
    types = [("AT", A_log.dtype), ("DT", dt_bias.dtype), ("WT", mx.float32)]
    out = _launch(inputs, (B, T, *heads), qkv.dtype, keep, types, conv_width=K)
    return None if out is None else (*_with_states(out, keep_states), out[-2], out[-1])


def _random_inputs(dtype, hk: int, hv: int, dk: int, dv: int, T: int = 3):
    kq, kk, kv, kg, kb, ks = mx.random.split(mx.random.key(1234), 6)
    q = (mx.random.normal((1, T, hk, dk), key=kq) * dk**-0.5).astype(dtype)
    k = (mx.random.normal((1, T, hk, dk), key=kk) * dk**-0.5).astype(dtype)
    v = mx.random.normal((1, T, hv, dv), key=kv).astype(dtype)
    g = mx.random.uniform(0.5, 1.0, (1, T, hv), key=kg)
    beta = mx.random.uniform(0.0, 1.0, (1, T, hv), key=kb)
    states = mx.random.normal((2, 1, hv, dv, dk), key=ks) * 0.1
    state = states[1:2].reshape(states.shape[1:])  # a view, as a rollback leaves it
    # As the model passes them: views into one projection output, so strides are checked too.
    q, k, v = _views((q, k, v))
    g, beta = _views((g, beta))
    return q, k, v, g, beta, state


def _views(xs: tuple) -> list[mx.array]:
    """The arrays xs [B, T, ...] as slices of their concatenation along the last axis."""
    B, T = xs[0].shape[:2]
    whole = mx.concatenate([x.reshape(B, T, -1) for x in xs], axis=-1)  # [B, T, sum]
    ends = list(itertools.accumulate(x[0, 0].size for x in xs))
    parts = mx.split(whole, ends[:-1], axis=-1)
    return [p.reshape(x.shape) for p, x in zip(parts, xs, strict=True)]


def _compare(got, want, dtype) -> str | None:
    tol = 1e-2 if dtype != mx.float32 else 1e-4
    names = ("y", "state", "states", "conv inputs", "conv window")[: len(want)]
    for name, a, b in zip(names, got, want, strict=True):
        a, b = a.astype(mx.float32), b.astype(mx.float32)
        if not mx.allclose(a, b, rtol=tol, atol=tol).item():
            return f"{name} differs by up to {mx.abs(a - b).max().item():.3g}"
    return None


def _at_each_placement(check: Callable[[int], str | None]) -> str | None:
    """``check(T)`` at T = 1 and at a block that goes wide: each kernel a path compiles."""
    for T in sorted({1, max(3, _WIDE_FROM)}):
        if (problem := check(T)) is not None:
            return f"T = {T}: {problem}"
    return None


def _raw_gates(g, beta, dtype, hv: int, gate_dtypes) -> tuple:
    """A layer's raw a, b [B, T, Hv] (views into one buffer) and A_log, dt_bias [Hv] from
    test gates g, beta: a spread that exercises softplus and sigmoid."""
    b, a = _views(((beta * 6.0 - 3.0).astype(dtype), (g * 4.0 - 3.0).astype(dtype)))
    A_log = mx.linspace(-2.0, 1.0, hv).astype(gate_dtypes[0])
    dt_bias = mx.linspace(-1.0, 1.0, hv).astype(gate_dtypes[1])
    return a, b, A_log, dt_bias


def _self_check_raw(dtype, hk: int, hv: int, dk: int, dv: int, gate_dtypes,
                    T: int = 3) -> str | None:  # fmt: skip
    q, k, v, g, beta, state = _random_inputs(dtype, hk, hv, dk, dv, T)
    q, k = q * 3.0, k * 3.0  # not normalised: the kernel must normalise them
    a, b, A_log, dt_bias = _raw_gates(g, beta, dtype, hv, gate_dtypes)
    try:
        got = gated_delta_raw_native(q, k, v, a, b, A_log, dt_bias, state, keep_states=True)
        q2, k2 = normalize_qk(q, k, inv_scale=dk**-0.5, eps=1e-6)
        want = gated_delta_ops(q2, k2, v, compute_g(A_log, a, dt_bias), mx.sigmoid(b), state,
                               keep_states=True)  # fmt: skip
        mx.eval(got, want)
    except Exception as e:  # noqa: BLE001 - a kernel that fails to build is not trusted
        return f"{type(e).__name__}: {e}"
    return _compare(got, want, dtype)


def _conv_inputs(dtype, heads: tuple, K: int, w_dtype, T: int = 3) -> tuple:
    """qkv [1, T, NC] as a view into a wider projection output, a conv window [1, K-1, NC] as
    a view into a verify's inputs (as a rollback leaves it), and a conv weight [NC, K, 1]."""
    Hk, Dk, Hv, Dv = heads
    NC = 2 * Hk * Dk + Hv * Dv
    kx, kc, kw = mx.random.split(mx.random.key(2468), 3)
    whole = mx.random.normal((1, T, NC + 64), key=kx).astype(dtype)  # [1, T, NC + 64]
    inputs = mx.random.normal((1, K + 1, NC), key=kc).astype(dtype)  # [1, K-1 + 2, NC]
    conv_w = (mx.random.normal((NC, K, 1), key=kw) * 0.5).astype(w_dtype)
    return whole[..., 32 : 32 + NC], inputs[:, 2:], conv_w


def _self_check_conv(dtype, heads: tuple, K: int, w_dtype, gate_dtypes,
                     T: int = 3) -> str | None:  # fmt: skip
    Hk, Dk, Hv, Dv = heads
    qkv, window, conv_w = _conv_inputs(dtype, heads, K, w_dtype, T)
    *_, g, beta, state = _random_inputs(dtype, Hk, Hv, Dk, Dv, T)
    args = (qkv, window, conv_w, *_raw_gates(g, beta, dtype, Hv, gate_dtypes), state, heads)
    try:
        got = gated_delta_conv_native(*args, keep_states=True)
        want = gated_delta_conv_ops(*args, keep_states=True)
        mx.eval(got, want)
    except Exception as e:  # noqa: BLE001 - a kernel that fails to build is not trusted
        return f"{type(e).__name__}: {e}"
    return _compare(got, want, dtype)


def _native_dims(Hk: int, Dk: int, Hv: int, Dv: int) -> bool:
    return backend() != "cpu" and Dk % 32 == 0 and _fits(Hk, Hv, Dv, _WARPS, _hpt(Hk, Hv))


def _native_shape(k, v) -> bool:
    return _native_dims(k.shape[2], k.shape[3], v.shape[2], v.shape[3])


def gated_delta_raw(q, k, v, a, b, A_log, dt_bias, state, *, keep_states: bool = False,
                    mode: str = "auto"):  # fmt: skip
    """The layer's recurrence from its raw inputs (see ``gated_delta_raw_ops``) on the best
    trusted path under kernel ``mode``."""
    Hk, Dk, Hv, Dv = k.shape[2], k.shape[3], v.shape[2], v.shape[3]
    gate_dtypes = (A_log.dtype, dt_bias.dtype)
    if _native_shape(k, v) and use_native(
        "gated_delta_raw",
        (backend(), str(q.dtype), Hk, Hv, Dk, Dv, *map(str, gate_dtypes)),
        lambda: _at_each_placement(
            lambda T: _self_check_raw(q.dtype, Hk, Hv, Dk, Dv, gate_dtypes, T)
        ),
        mode,
    ):
        out = gated_delta_raw_native(q, k, v, a, b, A_log, dt_bias, state,
                                     keep_states=keep_states)  # fmt: skip
        if out is not None:
            return out
    return gated_delta_raw_ops(q, k, v, a, b, A_log, dt_bias, state, keep_states=keep_states)


def gated_delta_conv(qkv, window, conv_w, a, b, A_log, dt_bias, state, heads, *,
                     keep_states: bool = False, mode: str = "auto"):  # fmt: skip
    """The layer's convolution and recurrence (see ``gated_delta_conv_ops``) on the best
    trusted path under kernel ``mode``: one launch where the folded kernel is trusted, else the
    convolution's and the recurrence's own best paths."""
    K = conv_w.shape[1]
    NC = 2 * heads[0] * heads[1] + heads[2] * heads[3]
    dtypes = (qkv.dtype, conv_w.dtype, A_log.dtype, dt_bias.dtype)
    if (
        _native_dims(*heads)
        and conv_w.shape == (NC, K, 1)
        and use_native(
            "gated_delta_conv",
            (backend(), *map(str, dtypes), *heads, K),
            lambda: _at_each_placement(
                lambda T: _self_check_conv(qkv.dtype, heads, K, conv_w.dtype, dtypes[2:], T)
            ),
            mode,
        )
    ):
        out = gated_delta_conv_native(qkv, window, conv_w, a, b, A_log, dt_bias, state, heads,
                                      keep_states=keep_states)  # fmt: skip
        if out is not None:
            return out
    return conv_then_delta(partial(conv_silu, mode=mode), partial(gated_delta_raw, mode=mode),
                            qkv, window, conv_w, a, b, A_log, dt_bias, state, heads,
                            keep_states)  # fmt: skip
