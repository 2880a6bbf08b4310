"""The work around a MoE block's experts in two launches: the routing (softmax over the
router's logits, top-k, the scores normalised) and the combination (the experts' outputs
weighted by their scores and summed, the gated shared expert and the residual added).

mlx-lm's block spells these as a dozen MLX operations a layer (softmax, argpartition, a
gather, a sum and a division; a broadcast multiply, a sum, a sigmoid, a multiply and two adds),
each a launch on a GPU; 40 routed layers make them most of a 35B-A3B decode step's launches.
Here each row (one token) is computed by the same threads in the same order whatever the
number of rows, so a verify block's rows equal the decode rows bitwise.

The router and the shared expert's gate are one product (``FusedProjection``): both kernels
read their columns of its output in place, [..., E + 1], the gate logit last. Where the shared
expert is stacked with the routed ones as expert E (``FusedExperts``), the routing gives it to
every token as a last slot, and the combination reads its output there.
"""

from __future__ import annotations

import mlx.core as mx

from . import backend, built, fill, kernel_name, spell, use_native


def route_ops(logits: mx.array, experts: int, k: int, normalize: bool,
              shared_slot: bool = False) -> tuple[mx.array, ...]:  # fmt: skip
    """Ops reference (mlx-lm's ``Qwen3NextSparseMoeBlock``): logits [..., W] whose first
    ``experts`` columns are the router's -> (indices [..., k] uint32, scores [..., k] in the
    logits' dtype): the softmax (in float32) of the router's columns, its k largest gates and
    their values, normalised to sum 1 if ``normalize``. The order of the k is the reference's
    own (argpartition's); the kernel's is by gate, largest first. ``shared_slot``: indices
    [..., k + 1], the last ``experts`` (the shared expert stacked after the routed ones)."""
    gates = mx.softmax(logits[..., :experts], axis=-1, precise=True)
    inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if normalize:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    if shared_slot:
        last = mx.full((*inds.shape[:-1], 1), experts, inds.dtype)
        inds = mx.concatenate([inds, last], axis=-1)
    return inds.astype(mx.uint32), scores


def combine_ops(y: mx.array, scores: mx.array, shared: mx.array, logits: mx.array,
                h: mx.array) -> mx.array:  # fmt: skip
    """Ops reference: the block's output added to the residual, h + (sum_s y_s * score_s +
    sigmoid(gate) * shared), with y [..., k, H] the selected experts' outputs, scores [..., k],
    shared [..., H] the shared expert's output, the gate logit the last column of logits
    [..., W], h [..., H]; each op rounded to the activations' dtype as MLX's are. y [..., k + 1,
    H]: the shared expert's output is its last slot (``shared`` is not read)."""
    k = scores.shape[-1]
    if y.shape[-2] > k:
        y, shared = y[..., :k, :], y[..., k, :]
    routed = (y * scores[..., None]).sum(axis=-2)
    return h + (routed + mx.sigmoid(logits[..., -1:]) * shared)


# One warp / SIMD-group a row: lane l holds gates l, l + 32, ... (EPL of them). The max and the
# sum of the exponentials go lane by lane, then over the lanes 16, 8, 4, 2, 1 apart; each gate
# is rounded to the logits' type, as the softmax's output is. The k largest are taken one at a
# time (lowest index on ties) and come largest first; the normalising sum adds them in that
# order and is rounded before the division, as a reduction's result is.
_ROUTE = """
    {{THREAD_INDICES}}
    const int W = logits_shape[logits_ndim - 1];
    int R = 1;
    for (int d = 0; d + 1 < logits_ndim; ++d) R *= logits_shape[d];
    if (row < R) {
      DEVICE const InT* x = logits + (size_t)row * W;
      float v[EPL];
      float top = -3.0e38f;
      for (int i = 0; i < EPL; ++i) {
        v[i] = lane + 32 * i < E ? static_cast<float>(x[lane + 32 * i]) : -3.0e38f;
        top = fmaxf(top, v[i]);
      }
      for (LANE_OFFSET off = 16; off > 0; off >>= 1) top = fmaxf(top, XOR_SHUFFLE(top, off));
      float sum = 0.0f;
      for (int i = 0; i < EPL; ++i) {
        v[i] = lane + 32 * i < E ? expf(v[i] - top) : 0.0f;
        sum = sum + v[i];
      }
      for (LANE_OFFSET off = 16; off > 0; off >>= 1) sum = sum + XOR_SHUFFLE(sum, off);
      for (int i = 0; i < EPL; ++i) {  // the gates; -1 marks a column that is no expert
        v[i] = lane + 32 * i < E ? static_cast<float>(static_cast<InT>(v[i] / sum)) : -1.0f;
      }
      float picked[KS];
      for (int s = 0; s < KS; ++s) {
        float best = -2.0f;
        int at = E;
        for (int i = 0; i < EPL; ++i) {
          if (v[i] > best) {
            best = v[i];
            at = lane + 32 * i;
          }
        }
        for (LANE_OFFSET off = 16; off > 0; off >>= 1) {
          const float other = XOR_SHUFFLE(best, off);
          const int other_at = XOR_SHUFFLE(at, off);
          if (other > best || (other == best && other_at < at)) {
            best = other;
            at = other_at;
          }
        }
        for (int i = 0; i < EPL; ++i) {
          if (lane + 32 * i == at) v[i] = -2.0f;  // taken
        }
        picked[s] = best;
        if (lane == 0) inds[(size_t)row * SLOTS + s] = at;
      }
      if (lane == 0 && SLOTS > KS) inds[(size_t)row * SLOTS + KS] = E;  // the shared expert
      if (lane == 0) {
        float total = 0.0f;
        for (int s = 0; s < KS; ++s) total = total + picked[s];
        const float norm = static_cast<float>(static_cast<InT>(total));
        for (int s = 0; s < KS; ++s) {
          scores[(size_t)row * KS + s] = static_cast<InT>(NORM ? picked[s] / norm : picked[s]);
        }
      }
    }
"""
_ROUTE_THREADS = {
    False: """const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * WARPS + (threadIdx.x >> 5);""",
    True: """const int lane = thread_index_in_simdgroup;
    const int row = threadgroup_position_in_grid.x * WARPS + simdgroup_index_in_threadgroup;""",
}

# One thread an output value: the experts' weighted outputs added in slot order in float, each
# product and the sum rounded as MLX's multiply and sum are, then the gated shared expert (from
# y's last slot where y has SLOTS = KS + 1 of them, else from ``shared``) and the residual, each
# op rounded.
_COMBINE = """
    {{THREAD_INDEX}}
    const int H = y_shape[y_ndim - 1];
    const int W = logits_shape[logits_ndim - 1];
    int R = 1;
    for (int d = 0; d + 2 < y_ndim; ++d) R *= y_shape[d];
    if (i < (size_t)R * H) {
      const size_t r = i / H;
      const int n = i % H;
      float acc = 0.0f;
      for (int s = 0; s < KS; ++s) {
        const float ys = static_cast<float>(y[(r * SLOTS + s) * H + n]);
        const float sc = static_cast<float>(scores[r * KS + s]);
        acc = acc + static_cast<float>(static_cast<InT>(ys * sc));
      }
      const float routed = static_cast<float>(static_cast<InT>(acc));
      const float g = static_cast<float>(logits[r * W + W - 1]);
      const float sg = static_cast<float>(static_cast<InT>(1.0f / (1.0f + expf(-g))));
      const InT se = SLOTS > KS ? y[(r * SLOTS + KS) * H + n] : shared[i];
      const float sh = static_cast<float>(static_cast<InT>(sg * static_cast<float>(se)));
      const float t = static_cast<float>(static_cast<InT>(routed + sh));
      out[i] = static_cast<InT>(static_cast<float>(h[i]) + t);
    }
"""
_COMBINE_THREAD = {
    False: "const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;",
    True: "const size_t i = thread_position_in_grid.x;",
}
_WARPS = 4  # routing rows a threadgroup
_THREADS = 256  # combination values a threadgroup
_kernels: dict = {}


def route_source(metal: bool) -> str:
    return spell(fill(_ROUTE, THREAD_INDICES=_ROUTE_THREADS[metal]), metal)


def combine_source(metal: bool) -> str:
    return spell(fill(_COMBINE, THREAD_INDEX=_COMBINE_THREAD[metal]), metal)


def _specs(metal: bool) -> tuple[dict, dict]:
    route, combine = route_source(metal), combine_source(metal)
    return (
        {"name": kernel_name("mtp_moe_route", route), "input_names": ["logits"],
         "output_names": ["inds", "scores"], "source": route},
        {"name": kernel_name("mtp_moe_combine", combine),
         "input_names": ["y", "scores", "shared", "logits", "h"], "output_names": ["out"],
         "source": combine},
    )  # fmt: skip


def _pair():
    return built(_kernels, ("moe",), _specs)


def route_native(logits: mx.array, experts: int, k: int, normalize: bool,
                 shared_slot: bool = False):  # fmt: skip
    """The native routing (``route_ops``'s contract, indices largest gate first); None where
    there is no kernel."""
    pair = _pair()
    if pair is None:
        return None
    rows = logits.size // logits.shape[-1]
    lead = logits.shape[:-1]
    return pair[0](
        inputs=[logits],
        template=[
            ("InT", logits.dtype),
            ("E", experts),
            ("EPL", -(-experts // 32)),
            ("KS", k),
            ("SLOTS", k + shared_slot),
            ("NORM", int(normalize)),
            ("WARPS", _WARPS),
        ],  # fmt: skip
        grid=(32 * _WARPS * -(-rows // _WARPS), 1, 1),
        threadgroup=(32 * _WARPS, 1, 1),
        output_shapes=[(*lead, k + shared_slot), (*lead, k)],
        output_dtypes=[mx.uint32, logits.dtype],
    )


def combine_native(y, scores, shared, logits, h):
    """The native combination (``combine_ops``'s contract); None where there is no kernel."""
    pair = _pair()
    if pair is None:
        return None
    n = h.size
    return pair[1](
        inputs=[y, scores, shared, logits, h],
        template=[("InT", h.dtype), ("KS", scores.shape[-1]), ("SLOTS", y.shape[-2])],
        grid=(_THREADS * -(-n // _THREADS), 1, 1),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[h.shape],
        output_dtypes=[h.dtype],
    )[0]


def _self_check(dtype, experts: int, k: int, normalize: bool) -> str | None:
    """Agreement with the references (the same k gates chosen, scores and combination close)
    and row invariance (a row alone as among 5), on random logits and outputs of width 256."""
    keys = mx.random.split(mx.random.key(4242), 5)
    hid = 256
    logits = (mx.random.normal((1, 5, experts + 1), key=keys[0]) * 2).astype(dtype)
    y = mx.random.normal((1, 5, k, hid), key=keys[1]).astype(dtype)
    shared = mx.random.normal((1, 5, hid), key=keys[2]).astype(dtype)
    h = mx.random.normal((1, 5, hid), key=keys[3]).astype(dtype)
    try:
        inds, scores = route_native(logits, experts, k, normalize)
        inds1, scores1 = route_native(logits[:, 2:3], experts, k, normalize)
        _, want_scores = route_ops(logits, experts, k, normalize)
        out = combine_native(y, scores, shared, logits, h)
        out1 = combine_native(y[:, 2:3], scores[:, 2:3], shared[:, 2:3], logits[:, 2:3],
                              h[:, 2:3])  # fmt: skip
        want = combine_ops(y, scores, shared, logits, h)
        # the shared expert stacked as expert E: its slot last in the indices and in y
        inds_s, scores_s = route_native(logits, experts, k, normalize, shared_slot=True)
        stacked = mx.concatenate([y, shared[..., None, :]], axis=-2)  # [1, 5, k + 1, hid]
        out_s = combine_native(stacked, scores, h, logits, h)  # ``shared`` unread: h there
        mx.eval(inds, scores, inds1, scores1, want_scores, out, out1, want, inds_s, scores_s)
        mx.eval(out_s)
    except Exception as e:  # noqa: BLE001 - a kernel that fails to build is not trusted
        return f"{type(e).__name__}: {e}"
    if inds.shape != (1, 5, k) or out.shape != h.shape:
        return f"outputs have the shapes {inds.shape} and {out.shape}"
    gates = mx.softmax(logits[..., :experts].astype(mx.float32), axis=-1)
    chosen = mx.sort(mx.take_along_axis(gates, inds.astype(mx.int32), axis=-1), axis=-1)
    best = mx.sort(gates, axis=-1)[..., -k:]
    if not mx.allclose(chosen, best, rtol=2e-2, atol=1e-6).item():
        return "its indices are not the k largest gates"
    if not mx.allclose(mx.sort(scores.astype(mx.float32), axis=-1),
                       mx.sort(want_scores.astype(mx.float32), axis=-1),
                       rtol=2e-2, atol=1e-3).item():  # fmt: skip
        return "its scores differ from the reference"
    a, b = out.astype(mx.float32), want.astype(mx.float32)
    if not mx.allclose(a, b, rtol=2e-2, atol=2e-2).item():
        return f"its combination differs from the reference by up to {mx.abs(a - b).max():.3g}"
    same = [mx.array_equal(inds_s[..., :k], inds), (inds_s[..., k] == experts).all(),
            mx.array_equal(scores_s, scores), mx.array_equal(out_s, out)]  # fmt: skip
    if not all(a.item() for a in same):
        return "with the shared expert's slot it differs from without"
    if not (mx.array_equal(inds1, inds[:, 2:3]).item()
            and mx.array_equal(scores1, scores[:, 2:3]).item()
            and mx.array_equal(out1, out[:, 2:3]).item()):  # fmt: skip
        return "a row differs alone and among others"
    return None


def native_ready(dtype, experts: int, k: int, normalize: bool, mode: str) -> bool:
    """Whether routing ``experts`` (k a token, at most 32 and 1024) of activations ``dtype`` and
    combining runs natively here: the kernels exist and are trusted."""
    return (
        backend() != "cpu"
        and dtype in (mx.bfloat16, mx.float16, mx.float32)
        and 1 <= k <= min(32, experts)
        and experts <= 1024
        and use_native(
            "moe_route",
            (backend(), str(dtype), experts, k, normalize),
            lambda: _self_check(dtype, experts, k, normalize),
            mode,
        )
    )


def route(logits: mx.array, experts: int, k: int, normalize: bool, mode: str = "auto",
          shared_slot: bool = False) -> tuple[mx.array, mx.array]:  # fmt: skip
    """``route_ops`` (same contract) on the best trusted path under kernel ``mode``: one
    launch where the kernels run here."""
    if native_ready(logits.dtype, experts, k, normalize, mode):
        out = route_native(logits, experts, k, normalize, shared_slot)
        if out is not None:
            return out[0], out[1]
    return route_ops(logits, experts, k, normalize, shared_slot)


def combine(y: mx.array, scores: mx.array, shared: mx.array, logits: mx.array, h: mx.array,
            trusted: bool) -> mx.array:  # fmt: skip
    """``combine_ops`` (same contract): one launch where ``trusted`` (``native_ready`` said so
    for this block's routing, which checked both kernels) and the kernel runs here. ``shared``
    may be any array of h's shape and dtype where y holds the shared expert's slot."""
    if trusted and y.dtype == scores.dtype == shared.dtype == logits.dtype == h.dtype:
        out = combine_native(y, scores, shared, logits, h)
        if out is not None:
            return out
    return combine_ops(y, scores, shared, logits, h)
