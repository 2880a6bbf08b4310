"""Attention of a decode step's query, or a verify block's T queries, over the KV cache.

mlx-lm's step is, after the q/k/v projections: RMSNorm of q and of k, RoPE of each, the cache
update, the attention product (MLX's GPU kernels have no one-query path for head dim 256 and
run it as five ops), and the output gate: 14 launches a layer on CUDA, where one decode step of
the 27B shape is paced by its launches. Here the norms, the rotations, the product and the gate
are two launches (a block of keys per threadgroup, then the blocks combined), plus the cache's
own two row copies. A block of T positions is T one-query problems in the same launches:
position t attends the cache and the block's first t + 1 keys, split and summed exactly as a
decode step at that position would, so a verify's rows equal decode rows bitwise by
construction, as the quantized product's do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from . import backend, built, constant, fill, kernel_name, spell, trusted, use_native


@dataclass(frozen=True)
class Rope:
    """The rotary embedding the kernel does: MLX's non-traditional RoPE on the first ``dims``
    features, frequencies base**(-2i/dims), positions times ``scale``."""

    dims: int
    base: float
    scale: float

    @classmethod
    def of(cls, module: nn.Module) -> Rope | None:
        """The spec of an ``nn.RoPE`` the kernel can do; None for the traditional layout and
        other kinds (dynamic, llama3, yarn...)."""
        if type(module) is not nn.RoPE or module.traditional:
            return None
        return cls(int(module.dims), float(module.base), float(module.scale))


def decode_attention_ops(q, k, v, gate, q_norm, k_norm, eps: float, keys, values, rope: Rope,
                         scale: float) -> tuple[mx.array, mx.array]:  # fmt: skip
    """Ops reference (mlx-lm's arithmetic, one position at a time). q [B, T, Hq, D], k and v
    [B, T, Hkv, D], gate [B, T, Hq, D], the norms' weights [D], the cache's keys and values
    [B, Hkv, N, D] (the N positions before these). Returns the gated output [B, T, Hq * D] and
    the new keys, normed and rotated, [B, Hkv, T, D] (what the cache stores)."""
    args = (q, k, v, gate, q_norm, k_norm, eps, keys, values, rope, scale)
    return _one_query_ops(*args) if q.shape[1] == 1 else one_at_a_time(_one_query_ops, *args)


def _one_query_ops(q, k, v, gate, q_norm, k_norm, eps, keys, values, rope, scale):
    B, N = q.shape[0], keys.shape[2]
    q = mx.fast.rms_norm(q, q_norm, eps).transpose(0, 2, 1, 3)  # [B, Hq, 1, D]
    k = mx.fast.rms_norm(k, k_norm, eps).transpose(0, 2, 1, 3)  # [B, Hkv, 1, D]
    q, k = (mx.fast.rope(x, rope.dims, traditional=False, base=rope.base, scale=rope.scale,
                         offset=N) for x in (q, k))  # fmt: skip
    keys = mx.concatenate([keys, k], axis=2)  # [B, Hkv, N + 1, D]
    values = mx.concatenate([values, v.transpose(0, 2, 1, 3)], axis=2)
    o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale)  # [B, Hq, 1, D]
    o = o.transpose(0, 2, 1, 3).reshape(B, 1, -1)
    return o * mx.sigmoid(gate.reshape(B, 1, -1)), k


# Splits of a position's n keys: at least MIN_CHUNK keys a threadgroup, at most MAX_SPLITS
# threadgroups a head. The kernels and the launch compute them with the same formula.
MIN_CHUNK = 16
MAX_SPLITS = 64
MAX_T = 16  # positions a launch (a verify block's; longer blocks go through MLX's ops)
_WARPS = 8  # a threadgroup's warps / SIMD-groups; keys go to them round-robin
_SPLITS = (
    f"#define MAX_SPLITS {MAX_SPLITS}\n"
    f"#define SPLITS(n) min(((n) + {MIN_CHUNK - 1}) / {MIN_CHUNK}, MAX_SPLITS)\n"
)


def splits(n_keys: int) -> int:
    return min(-(-n_keys // MIN_CHUNK), MAX_SPLITS)


# A warp's row of D features: lane l holds features i * 32 + l (i < D / 32), so a rotary pair
# (e, e + dims/2) sits in one lane when dims/2 is a multiple of 32. The norm rounds as MLX's
# rms_norm (x * rsqrt to the input dtype, times the weight in it); the rotation's angle is
# reduced to [-pi, pi] before sin/cos (fast-math sin is accurate only there).
_HEADER = """
#define AT_RD(v) static_cast<float>(static_cast<T>(v))
template <int D, typename T, typename W>
KERNEL_FN void mtp_norm_rope(DEVICE const T* x, long stride, DEVICE const W* w, int lane,
                             float pos, THREAD float* v) {
  constexpr int NPT = D / 32;
  constexpr int HALF = {{ROPE_DIMS}} / 2;
  float ss = 0.0f;
  for (int i = 0; i < NPT; ++i) {
    v[i] = static_cast<float>(x[(i * 32 + lane) * stride]);
    ss = fmaf(v[i], v[i], ss);
  }
  for (LANE_OFFSET off = 16; off > 0; off >>= 1) ss = ss + XOR_SHUFFLE(ss, off);
  const float inv = rsqrtf(ss / D + {{NORM_EPS}});
  for (int i = 0; i < NPT; ++i) {
    v[i] = AT_RD(static_cast<float>(w[i * 32 + lane]) * AT_RD(v[i] * inv));
  }
  for (int i = 0; i < HALF / 32; ++i) {
    const float e = static_cast<float>(i * 32 + lane);
    float theta = pos * {{ROPE_SCALE}} * exp2f(-e * ({{ROPE_LOG2_BASE}} / HALF));
    const float turns = rintf(theta * 0.15915494309189535f);
    theta = fmaf(-turns, 6.28125f, theta);
    theta = fmaf(-turns, 1.9353071795864769e-3f, theta);
    const float c = cosf(theta), s = sinf(theta);
    const float x1 = v[i], x2 = v[i + HALF / 32];
    v[i] = AT_RD(x1 * c - x2 * s);
    v[i + HALF / 32] = AT_RD(x1 * s + x2 * c);
  }
}
"""

# Threadgroup (b, h, position t, split): position t's n = N + t + 1 keys in SPLITS(n) blocks
# (what a decode step at that position does: the layout depends on n alone). The grid has
# MAX_SPLITS threadgroups a position whatever N is, those past SPLITS(n) returning at once, and
# N is read from an input: a launch's shape, and so a compiled graph around it, is the same at
# every cache length. The query normed
# and rotated in every warp's registers; the split's keys j0 <= j < j1 round-robin over the
# warps, each keeping a running max, sum and weighted sum of values; then the warps' partials
# merged in warp order. Keys from N on are the block's own: the warp that takes one normalises
# and rotates it from k (the values stored in the cache are these, rounded alike), and the last
# position's first head of each KV group writes it out for the cache.
_PARTIAL = """
    constexpr int NPT = D / 32;
    {{THREAD_INDICES}}
    const int T = q_shape[1];
    const int Hq = q_shape[2];
    const int Hkv = k_shape[2];
    const int G = Hq / Hkv;
    const int total = T * MAX_SPLITS;  // a head's threadgroups: every position's most splits
    const int h = (blk / total) % Hq;
    const int b = blk / (total * Hq);
    // the cache's rows, read here so that one launch serves every N: one N for all of the
    // batch, or row b's own (a batch of requests, each at its own length)
    const int N = cached[cached_shape[0] == 1 ? 0 : b];
    const int hk = h / G;
    const int t = (blk % total) / MAX_SPLITS;
    const int split = blk % MAX_SPLITS;
    const int n = N + t + 1;
    const int S = SPLITS(n);
    if (split >= S) return;  // a split this position's n keys do not have
    const int chunk = (n + S - 1) / S;
    const int j0 = split * chunk;
    const int j1 = min(j0 + chunk, n);
    SHARED float red_m[WARPS];
    SHARED float red_l[WARPS];
    SHARED float red_acc[WARPS * D];
    float qv[NPT];
    mtp_norm_rope<D>(q + b * q_strides[0] + t * q_strides[1] + h * q_strides[2], q_strides[3],
                     q_norm, lane, static_cast<float>(N + t), qv);
    float m = -3.0e38f;
    float l = 0.0f;
    float acc[NPT];
    for (int i = 0; i < NPT; ++i) acc[i] = 0.0f;
    for (int j = j0 + warp; j < j1; j += WARPS) {
      float kr[NPT];
      float vr[NPT];
      if (j < N) {
        DEVICE const InT* kp = keys + b * keys_strides[0] + hk * keys_strides[1]
            + j * keys_strides[2];
        DEVICE const InT* vp = values + b * values_strides[0] + hk * values_strides[1]
            + j * values_strides[2];
        for (int i = 0; i < NPT; ++i) {
          kr[i] = static_cast<float>(kp[(i * 32 + lane) * keys_strides[3]]);
          vr[i] = static_cast<float>(vp[(i * 32 + lane) * values_strides[3]]);
        }
      } else {
        const int u = j - N;
        mtp_norm_rope<D>(k + b * k_strides[0] + u * k_strides[1] + hk * k_strides[2],
                         k_strides[3], k_norm, lane, static_cast<float>(j), kr);
        for (int i = 0; i < NPT; ++i) {
          vr[i] = static_cast<float>(v[b * v_strides[0] + u * v_strides[1] + hk * v_strides[2]
                                       + (i * 32 + lane) * v_strides[3]]);
          if (t == T - 1 && h % G == 0) {
            k_out[((b * Hkv + hk) * T + u) * D + i * 32 + lane] = static_cast<InT>(kr[i]);
          }
        }
      }
      float s = 0.0f;
      for (int i = 0; i < NPT; ++i) s = fmaf(qv[i], kr[i], s);
      for (LANE_OFFSET off = 16; off > 0; off >>= 1) s = s + XOR_SHUFFLE(s, off);
      s = s * {{ATTN_SCALE}};
      const float mn = fmaxf(m, s);
      const float c = expf(m - mn);
      const float p = expf(s - mn);
      l = fmaf(l, c, p);
      for (int i = 0; i < NPT; ++i) acc[i] = fmaf(p, vr[i], acc[i] * c);
      m = mn;
    }
    if (lane == 0) {
      red_m[warp] = m;
      red_l[warp] = l;
    }
    for (int i = 0; i < NPT; ++i) red_acc[warp * D + i * 32 + lane] = acc[i];
    BARRIER;
    float M = red_m[0];
    for (int w = 1; w < WARPS; ++w) M = fmaxf(M, red_m[w]);
    if (tid == 0) {
      float L = 0.0f;
      for (int w = 0; w < WARPS; ++w) L = fmaf(red_l[w], expf(red_m[w] - M), L);
      part_m[blk] = M;
      part_l[blk] = L;
    }
    for (int d = tid; d < D; d += WARPS * 32) {
      float a = 0.0f;
      for (int w = 0; w < WARPS; ++w) a = fmaf(red_acc[w * D + d], expf(red_m[w] - M), a);
      part_acc[(size_t)blk * D + d] = a;
    }
"""

# Threadgroup (b, t, h), a thread a feature: position t's splits merged in order, the output
# rounded to the input dtype as MLX's attention leaves it, times the gate's sigmoid (rounded, as
# mlx-lm's ``o * mx.sigmoid(gate)``).
_COMBINE = """
    {{THREAD_INDICES}}
    const int T = gate_shape[1];
    const int Hq = gate_shape[2];
    const int total = T * MAX_SPLITS;
    const int h = blk % Hq;
    const int t = (blk / Hq) % T;
    const int b = blk / (Hq * T);
    const int N = cached[cached_shape[0] == 1 ? 0 : b];
    const int S = SPLITS(N + t + 1);
    const size_t first = (size_t)(b * Hq + h) * total + t * MAX_SPLITS;
    DEVICE const float* pm = part_m + first;
    DEVICE const float* pl = part_l + first;
    float M = pm[0];
    for (int s = 1; s < S; ++s) M = fmaxf(M, pm[s]);
    float L = 0.0f;
    float a = 0.0f;
    for (int s = 0; s < S; ++s) {
      const float f = expf(pm[s] - M);
      L = fmaf(pl[s], f, L);
      a = fmaf(part_acc[(first + s) * D + tid], f, a);
    }
    const float o = static_cast<float>(static_cast<InT>(a / L));
    const float g = static_cast<float>(gate[b * gate_strides[0] + t * gate_strides[1]
                                            + h * gate_strides[2] + tid * gate_strides[3]]);
    const float sg = static_cast<float>(static_cast<InT>(1.0f / (1.0f + expf(-g))));
    out[(size_t)blk * D + tid] = static_cast<InT>(o * sg);
"""

_THREAD_INDICES = {
    False: """const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int blk = blockIdx.x;""",
    True: """const int tid = thread_position_in_threadgroup.x;
    const int lane = thread_index_in_simdgroup;
    const int warp = simdgroup_index_in_threadgroup;
    const int blk = threadgroup_position_in_grid.x;""",
}
_kernels: dict = {}


def _literal(x: float) -> str:
    return f"{x:.9e}f"


def sources(metal: bool, eps: float, rope: Rope, scale: float) -> tuple[str, str, str]:
    """(header, partial kernel, combine kernel) for a backend, the constants spelled in."""
    header = fill(_HEADER, NORM_EPS=_literal(eps), ROPE_DIMS=str(rope.dims),
                  ROPE_SCALE=_literal(rope.scale),
                  ROPE_LOG2_BASE=_literal(math.log2(rope.base)))  # fmt: skip
    partial = fill(_PARTIAL, THREAD_INDICES=_THREAD_INDICES[metal], ATTN_SCALE=_literal(scale))
    combine = fill(_COMBINE, THREAD_INDICES=_THREAD_INDICES[metal])
    header = _SPLITS + header
    return tuple(spell(text, metal) for text in (header, partial, combine))


_PARTIAL_INPUTS = ["q", "k", "v", "q_norm", "k_norm", "keys", "values", "cached"]
_PARTIAL_OUTPUTS = ["part_m", "part_l", "part_acc", "k_out"]
_COMBINE_INPUTS = ["part_m", "part_l", "part_acc", "gate", "cached"]


def _specs(metal: bool, eps: float, rope: Rope, scale: float) -> tuple[dict, dict]:
    header, partial, combine = sources(metal, eps, rope, scale)
    return (
        {"name": kernel_name("mtp_attn_partial", header, partial), "header": header,
         "input_names": _PARTIAL_INPUTS, "output_names": _PARTIAL_OUTPUTS, "source": partial,
         "ensure_row_contiguous": False},
        {"name": kernel_name("mtp_attn_combine", header, combine), "header": header,
         "input_names": _COMBINE_INPUTS, "output_names": ["out"], "source": combine,
         "ensure_row_contiguous": False},
    )  # fmt: skip


def _kernels_for(eps: float, rope: Rope, scale: float):
    return built(_kernels, (eps, rope, scale), lambda metal: _specs(metal, eps, rope, scale))


def launch_shapes(B: int, T: int, Hq: int, Hkv: int, D: int) -> dict:
    """Grids, threadgroups and output shapes of the two launches (for the launch and tests):
    the same at every cache length."""
    S = T * MAX_SPLITS  # every position's most splits, in order
    return {
        "partial_grid": (32 * _WARPS * B * Hq * S, 1, 1),
        "partial_threadgroup": (32 * _WARPS, 1, 1),
        "partial_outputs": [(B, Hq, S), (B, Hq, S), (B, Hq, S, D), (B, Hkv, T, D)],
        "combine_grid": (D * B * T * Hq, 1, 1),
        "combine_threadgroup": (D, 1, 1),
        "combine_outputs": [(B, T, Hq * D)],
    }


def decode_attention_native(q, k, v, gate, q_norm, k_norm, eps, keys, values, rope, scale,
                            length: mx.array | None = None):  # fmt: skip
    """The native kernels (same contract as ``decode_attention_ops``); None where there are none.
    ``length``: the cache's N as an int32 [1] array, keys and values then buffers whose first N
    rows are the cache (a graph built with it serves every N); without it N is keys' length."""
    kernels = _kernels_for(eps, rope, scale)
    if kernels is None:
        return None
    partial, combine = kernels
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    cached = mx.array([keys.shape[2]], mx.int32) if length is None else length
    if cached.shape not in ((1,), (B,)) or cached.dtype != mx.int32:
        raise ValueError(f"a cache length is int32 [1] or [{B}] (a row's each), not "
                         f"{cached.dtype} {cached.shape}")  # fmt: skip
    shapes = launch_shapes(B, T, Hq, Hkv, D)
    f32, dt = mx.float32, q.dtype
    part_m, part_l, part_acc, k_out = partial(
        inputs=[q, k, v, constant(q_norm), constant(k_norm), keys, values, cached],
        template=[("InT", dt), ("D", D), ("WARPS", _WARPS)],
        grid=shapes["partial_grid"],
        threadgroup=shapes["partial_threadgroup"],
        output_shapes=shapes["partial_outputs"],
        output_dtypes=[f32, f32, f32, dt],
    )
    out = combine(
        inputs=[part_m, part_l, part_acc, gate, cached],
        template=[("InT", dt), ("D", D)],
        grid=shapes["combine_grid"],
        threadgroup=shapes["combine_threadgroup"],
        output_shapes=shapes["combine_outputs"],
        output_dtypes=[dt],
    )[0]
    return out, k_out


def supported(q: mx.array, k: mx.array, keys: mx.array, rope: Rope | None) -> bool:
    """Whether the kernels can take these shapes (else the reference runs)."""
    B, T, Hq, D = q.shape
    return (
        rope is not None
        and T <= MAX_T
        and keys.shape[2] > 0
        and D % 32 == 0
        and D <= 1024
        and Hq % k.shape[2] == 0
        and rope.dims % 64 == 0
        and 0 < rope.dims <= D
        and keys.dtype == q.dtype
    )


def one_at_a_time(attend, q, k, v, gate, q_norm, k_norm, eps, keys, values, rope, scale):
    """``attend`` (the native kernels, say) called position by position as decode steps call
    it, each step's new key and value appended to the cache: what a block's rows must equal."""
    outs, news = [], []
    for t in range(q.shape[1]):
        rows = (x[:, t : t + 1] for x in (q, k, v, gate))
        o, new = attend(*rows, q_norm, k_norm, eps, keys, values, rope, scale)
        outs.append(o)
        news.append(new)
        keys = mx.concatenate([keys, new], axis=2)
        values = mx.concatenate([values, v[:, t : t + 1].transpose(0, 2, 1, 3)], axis=2)
    return mx.concatenate(outs, axis=1), mx.concatenate(news, axis=2)


def _self_check(dtype, wdtype, D: int, eps: float, rope: Rope, scale: float,
                block: bool = False) -> str | None:  # fmt: skip
    """Agreement with the reference at a few cache lengths (one split and several), the cache
    given as the first N rows of a longer buffer with N on the device (as the model gives it),
    for one position, or (``block``) for blocks of three, whose rows must also be the
    one-position launches' bitwise (decode steps')."""
    q, k, v, gate, qw, kw_, buffer = _check_inputs(dtype, wdtype, D)
    T = q.shape[1]
    tol = 2e-2 if dtype != mx.float32 else 1e-4
    for N, rows in ((14, T), (131, T)) if block else ((5, 1), (131, 1)):  # 14: across an edge
        keys, values = buffer[0, :, :, :N], buffer[1, :, :, :N]
        head = (q[:, :rows], k[:, :rows], v[:, :rows], gate[:, :rows], qw, kw_, eps)
        args = (*head, keys, values, rope, scale)
        try:
            got = decode_attention_native(*head, buffer[0], buffer[1], rope, scale,
                                          length=mx.array([N], mx.int32))  # fmt: skip
            want = decode_attention_ops(*args)
            steps = one_at_a_time(decode_attention_native, *args) if rows > 1 else got
            mx.eval(got, want, steps)
        except Exception as e:  # noqa: BLE001 - a kernel that fails to build is not trusted
            return f"{type(e).__name__}: {e}"
        for a, b, c in zip(got, want, steps, strict=True):
            if not mx.array_equal(a, c).item():
                return f"a block's rows differ from one-position launches at N = {N}"
            a, b = a.astype(mx.float32), b.astype(mx.float32)
            if a.shape != b.shape or not mx.allclose(a, b, rtol=tol, atol=tol).item():
                return f"differs from the reference at N = {N}, T = {rows} by up to " \
                       f"{mx.abs(a - b).max().item():.3g}"  # fmt: skip
    return None


def _check_inputs(dtype, wdtype, D: int, T: int = 3) -> tuple:
    """The self-checks' input: q, k, v, gate of B=2 rows and T positions, the norms' weights,
    and a [2, B, Hkv, 160, D] buffer of keys and values."""
    kq, kk, kv, kg, kw, kc = mx.random.split(mx.random.key(1357), 6)
    B, Hq, Hkv = 2, 6, 2
    q = (mx.random.normal((B, T, Hq, D), key=kq) * 2).astype(dtype)
    k = (mx.random.normal((B, T, Hkv, D), key=kk) * 2).astype(dtype)
    v = mx.random.normal((B, T, Hkv, D), key=kv).astype(dtype)
    gate = mx.random.normal((B, T, Hq, D), key=kg).astype(dtype)
    qw, kw = (mx.random.uniform(0.5, 1.5, (D,), key=key).astype(wdtype)
              for key in mx.random.split(kw))  # fmt: skip
    buffer = mx.random.normal((2, B, Hkv, 160, D), key=kc).astype(dtype)
    return q, k, v, gate, qw, kw, buffer


def _rows_check(dtype, wdtype, D: int, eps: float, rope: Rope, scale: float,
                T: int) -> str | None:  # fmt: skip
    """A batch of requests' rows in one buffer at lengths of their own (one split and
    several): each row bitwise the launch on that row alone."""
    q, k, v, gate, qw, kw, buffer = _check_inputs(dtype, wdtype, D, T)
    lengths = (5, 131)
    try:
        head = (q[:, :T], k[:, :T], v[:, :T], gate[:, :T], qw, kw, eps)
        got = decode_attention_native(*head, buffer[0], buffer[1], rope, scale,
                                      length=mx.array(lengths, mx.int32))  # fmt: skip
        alone = [decode_attention_native(*(x[b : b + 1] for x in head[:4]), *head[4:],
                                         buffer[0, b : b + 1], buffer[1, b : b + 1], rope, scale,
                                         length=mx.array([n], mx.int32))
                 for b, n in enumerate(lengths)]  # fmt: skip
        mx.eval(got, alone)
    except Exception as e:  # noqa: BLE001 - a kernel that fails to build is not trusted
        return f"{type(e).__name__}: {e}"
    for b, row in enumerate(alone):
        for a, want in zip(got, row, strict=True):
            if not mx.array_equal(a[b : b + 1], want).item():
                return f"a row at length {lengths[b]} differs from its launch alone"
    return None


def decode_attention_rows(q, k, v, gate, q_norm, k_norm, eps: float, keys, values,
                          lengths: mx.array, rope: Rope | None, scale: float,
                          mode: str = "auto") -> tuple[mx.array, mx.array] | None:  # fmt: skip
    """A batch of requests, row b at its own cache length ``lengths[b]`` (int32 [B]; keys and
    values the batch's buffers [B, Hkv, capacity, D]), in one launch pair where the native
    kernels are trusted for it (each row then bitwise its launch alone, checked once); None
    elsewhere: the caller goes row by row through ``decode_attention``."""
    if backend() == "cpu" or not supported(q, k, keys, rope):
        return None
    D, key = q.shape[-1], _key(q, q_norm, eps, rope, scale)
    dtypes = (q.dtype, q_norm.dtype, D, eps, rope, scale)
    T = q.shape[1]
    if not (
        use_native("decode_attention", key, lambda: _self_check(*dtypes), mode)
        and (T == 1 or use_native("decode_attention_block", key,
                                  lambda: _self_check(*dtypes, block=True), mode))
        and use_native(f"decode_attention_rows_{T}", key, lambda: _rows_check(*dtypes, T), mode)
    ):  # fmt: skip
        return None
    return decode_attention_native(q, k, v, gate, q_norm, k_norm, eps, keys, values, rope, scale,
                                   length=lengths)  # fmt: skip


def decode_attention(q, k, v, gate, q_norm, k_norm, eps: float, keys, values, rope: Rope | None,
                     scale: float, mode: str = "auto",
                     length: mx.array | None = None) -> tuple[mx.array, mx.array]:  # fmt: skip
    """Gated attention of T positions on the best trusted path under kernel ``mode``, each row
    as a decode step at its position computes it (shapes as ``decode_attention_ops``; ``rope``
    None means a rotary embedding the kernels do not do). With ``length`` (N, int32 [1]) keys
    and values are buffers whose first N rows are the cache: the native block path then builds
    a graph of the same shape at every N; the other paths read N back from the device."""
    if backend() != "cpu" and supported(q, k, keys, rope):
        D, key = q.shape[-1], _key(q, q_norm, eps, rope, scale)
        check = lambda block: _self_check(q.dtype, q_norm.dtype, D, eps, rope, scale, block)  # noqa: E731
        if use_native("decode_attention", key, lambda: check(False), mode):
            # A block in one pair of launches once its rows proved the one-position ones
            # bitwise on this device; else position by position through the same kernels.
            if q.shape[1] == 1 or use_native("decode_attention_block", key, lambda: check(True),
                                             mode):  # fmt: skip
                got = decode_attention_native(q, k, v, gate, q_norm, k_norm, eps, keys, values,
                                              rope, scale, length=length)  # fmt: skip
            else:
                keys, values = _rows(keys, values, length)
                got = one_at_a_time(decode_attention_native, q, k, v, gate, q_norm, k_norm, eps,
                                    keys, values, rope, scale)  # fmt: skip
            if got is not None:
                return got
    if rope is None:
        raise ValueError("decode_attention_ops needs a Rope; the caller keeps other kinds")
    keys, values = _rows(keys, values, length)
    return decode_attention_ops(q, k, v, gate, q_norm, k_norm, eps, keys, values, rope, scale)


def _key(q, q_norm, eps: float, rope: Rope, scale: float) -> tuple:
    """The shape class the kernels are checked for."""
    return (backend(), str(q.dtype), str(q_norm.dtype), q.shape[-1], eps, rope, scale)


def native_block(q, k, keys, q_norm, eps: float, rope: Rope | None, scale: float,
                 mode: str = "auto") -> bool:  # fmt: skip
    """Whether ``decode_attention`` runs q's T positions on the native kernels in one block
    with every check already passed: the path a compiled graph can hold (the others read the
    cache's length back, or check)."""
    if backend() == "cpu" or not supported(q, k, keys, rope):
        return False
    key = _key(q, q_norm, eps, rope, scale)
    return trusted("decode_attention", key, mode) and (
        q.shape[1] == 1 or trusted("decode_attention_block", key, mode)
    )


def native_rows(q, k, keys, q_norm, eps: float, rope: Rope | None, scale: float,
                mode: str = "auto") -> bool:  # fmt: skip
    """``native_block`` for ``decode_attention_rows``: the batch's rows run in one launch pair
    with every check already passed."""
    key = _key(q, q_norm, eps, rope, scale) if rope is not None else None
    return native_block(q, k, keys, q_norm, eps, rope, scale, mode) and trusted(
        f"decode_attention_rows_{q.shape[1]}", key, mode
    )


def _rows(keys: mx.array, values: mx.array, length: mx.array | None) -> tuple:
    """The cache's N rows of buffers ``keys``, ``values`` (all of them without ``length``)."""
    if length is None:
        return keys, values
    N = int(length.item())
    return keys[..., :N, :], values[..., :N, :]
