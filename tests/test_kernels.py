"""Gated-delta kernels: the reference's chain parity on CPU, the native kernel on CUDA, and the
run-time self-check that keeps a wrong native kernel from ever being used."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest

from mtpcli import kernels
from mtpcli.kernels import gated_delta as gd

cuda = pytest.mark.skipif(not kernels.available("cuda"), reason="needs MLX's CUDA backend")


def _inputs(T=5, B=1, hk=2, hv=4, dk=32, dv=16, dtype=mx.bfloat16, seed=0):
    ks = mx.random.split(mx.random.key(seed), 6)
    q = (mx.random.normal((B, T, hk, dk), key=ks[0]) * dk**-0.5).astype(dtype)
    k = (mx.random.normal((B, T, hk, dk), key=ks[1]) * dk**-0.5).astype(dtype)
    v = mx.random.normal((B, T, hv, dv), key=ks[2]).astype(dtype)
    g = mx.random.uniform(0.3, 1.0, (B, T, hv), key=ks[3])
    beta = mx.random.uniform(0.0, 1.0, (B, T, hv), key=ks[4]).astype(dtype)
    state = mx.random.normal((B, hv, dv, dk), key=ks[5]) * 0.1
    return q, k, v, g, beta, state


def _chain(fn, q, k, v, g, beta, state):
    ys, states = [], []
    for t in range(q.shape[1]):
        y, state, _ = fn(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1],
                         beta[:, t : t + 1], state)  # fmt: skip
        ys.append(y)
        states.append(state)
    kept = mx.stack(states[:-1]) if len(states) > 1 else mx.zeros((0, *state.shape))
    return mx.concatenate(ys, axis=1), state, kept


def _bitwise(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_reference_block_equals_chain_of_single_steps(dtype):
    args = _inputs(dtype=dtype)
    y, final, states = gd.gated_delta_ops(*args, keep_states=True)
    cy, cfinal, cstates = _chain(gd.gated_delta_ops, *args)
    assert _bitwise(y, cy) and _bitwise(final, cfinal) and _bitwise(states, cstates)
    assert states.shape == (4, 1, 4, 16, 32)  # the last step's state is ``final``, kept once


def test_one_step_block_keeps_no_states():
    args = _inputs(T=1)
    y, final, states = gd.gated_delta_ops(*args, keep_states=True)
    assert states.shape == (0, 1, 4, 16, 32) and states.dtype == mx.float32


def test_reference_matches_a_float64_recurrence():
    import numpy as np

    q, k, v, g, beta, state = _inputs(dtype=mx.float32, T=4)
    y, final, _ = gd.gated_delta_ops(q, k, v, g, beta, state)
    Q, K = (np.repeat(np.array(a, np.float64), 2, axis=2) for a in (q, k))  # Hk -> Hv heads
    V = np.array(v, np.float64)
    G, Bt, S = np.array(g, np.float64), np.array(beta, np.float64), np.array(state, np.float64)
    ys = []
    for t in range(4):
        S = S * G[:, t, :, None, None]
        kv = (S * K[:, t, :, None, :]).sum(-1)
        S = S + K[:, t, :, None, :] * ((V[:, t] - kv) * Bt[:, t, :, None])[..., None]
        ys.append((S * Q[:, t, :, None, :]).sum(-1))
    assert np.allclose(np.stack(ys, 1), np.array(y), rtol=1e-4, atol=1e-5)
    assert np.allclose(S, np.array(final), rtol=1e-4, atol=1e-5)


def _raw(T=5, hk=2, hv=4, dk=32, dv=16, dtype=mx.bfloat16, seed=0):
    """The layer's raw inputs: q, k (not normalised), v, a, b, A_log, dt_bias, the state."""
    q, k, v, g, beta, state = _inputs(T=T, hk=hk, hv=hv, dk=dk, dv=dv, dtype=dtype, seed=seed)
    a, b = (g * 4 - 3).astype(dtype), (beta * 6 - 3).astype(dtype)
    A_log, dt_bias = mx.linspace(-2, 1, hv), mx.linspace(-1, 1, hv).astype(mx.bfloat16)
    return q * 3, k * 3, v, a, b, A_log, dt_bias, state


def _raw_chain(fn, q, k, v, a, b, A_log, dt_bias, state):
    """``fn`` one step at a time over the raw inputs, each from the last one's state."""
    ys, states = [], []
    for t in range(q.shape[1]):
        y, state, _ = fn(*(x[:, t : t + 1] for x in (q, k, v, a, b)), A_log, dt_bias, state)
        ys.append(y)
        states.append(state)
    kept = mx.stack(states[:-1]) if len(states) > 1 else mx.zeros((0, *state.shape))
    return mx.concatenate(ys, axis=1), state, kept


def test_the_mode_decides_whether_the_native_kernel_runs(pretend_gpu):
    """``ops`` never runs the native kernel; ``native`` runs it without its check; ``auto``
    checks it once, then runs it."""
    kernels.reset_verdicts()
    calls = []

    def native(*a, **kw):
        calls.append(a[0].shape[1])  # T
        return gd.gated_delta_raw_ops(*a, **kw)

    pretend_gpu(gd, "gated_delta_raw_native", native)
    args = _raw()
    gd.gated_delta_raw(*args, mode="ops")
    assert calls == []
    gd.gated_delta_raw(*args, mode="native")
    assert calls == [5]
    gd.gated_delta_raw(*args, mode="auto")
    assert calls == [5, 1, 3, 5]  # the self-check, narrow and wide, then the real call
    kernels.reset_verdicts()


@pytest.mark.parametrize(
    "wrong,warning",
    [
        (lambda y: y * 1.5, "disagrees with the ops reference"),
        # outputs of the wrong shape make the comparison itself raise: a refusal too
        (lambda y: y[..., :3], "its check failed"),
    ],
    ids=["values", "shape"],
)  # fmt: skip
def test_wrong_native_kernel_is_caught_and_replaced(pretend_gpu, wrong, warning):
    """A native kernel that disagrees with the reference is never used: warn, fall back
    (never a traceback for the user)."""
    kernels.reset_verdicts()

    def broken(*args, keep_states=False):
        y, s, ss = gd.gated_delta_raw_ops(*args, keep_states=keep_states)
        return wrong(y), s, ss

    pretend_gpu(gd, "gated_delta_raw_native", broken)
    args = _raw()
    with pytest.warns(RuntimeWarning, match=warning):
        y, _, _ = gd.gated_delta_raw(*args)
    assert _bitwise(y, gd.gated_delta_raw_ops(*args)[0])
    kernels.reset_verdicts()


@cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("shape", [(2, 4, 32, 16), (16, 48, 128, 128)], ids=["tiny", "27b"])
def test_cuda_kernel_matches_reference(dtype, shape):
    hk, hv, dk, dv = shape
    args = _raw(T=4, hk=hk, hv=hv, dk=dk, dv=dv, dtype=dtype, seed=3)
    got = gd.gated_delta_raw_native(*args, keep_states=True)
    want = gd.gated_delta_raw_ops(*args, keep_states=True)
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    for a, b in zip(got, want, strict=True):
        assert mx.allclose(a.astype(mx.float32), b.astype(mx.float32), rtol=tol, atol=tol).item()


@cuda
@pytest.mark.parametrize("T", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_cuda_kernel_chain_parity(T, dtype):
    """T steps in one launch == T one-step launches, bitwise (outputs and every state)."""
    args = _raw(T=T, hk=16, hv=48, dk=128, dv=128, dtype=dtype, seed=T)
    y, final, states = gd.gated_delta_raw_native(*args, keep_states=True)
    cy, cfinal, cstates = _raw_chain(gd.gated_delta_raw_native, *args)
    assert _bitwise(y, cy) and _bitwise(final, cfinal) and _bitwise(states, cstates)


@pytest.mark.parametrize("conv", [False, True], ids=["raw", "conv"])
@pytest.mark.parametrize("keep", [False, True], ids=["", "keep"])
def test_metal_source_mirrors_cuda_line_by_line(keep, conv):
    """The Metal kernel cannot run here; keep it a line-for-line mirror of the tested CUDA one."""
    metal_to_cuda = [
        ("thread_index_in_simdgroup", "threadIdx.x & 31"),
        ("simdgroup_index_in_threadgroup", "threadIdx.x >> 5"),
        ("threadgroup_position_in_grid.y", "blockIdx.y"),
        ("threadgroup_position_in_grid.z", "blockIdx.z"),
        ("threadgroup_barrier(mem_flags::mem_threadgroup)", "__syncthreads()"),
        ("threadgroup float", "__shared__ float"),
        ("device ", ""),
        ("ushort off", "int off"), ("ushort(", "int("),
        ("simd_shuffle_xor(", "__shfl_xor_sync(0xffffffffu, "),
        ("simd_shuffle(", "__shfl_sync(0xffffffffu, "),
        ("store1(", "__stcs("), ("store4(", "__stcs("), ("float4(", "make_float4("),
        ("rsqrt(", "rsqrtf("), ("exp(", "expf("), ("log(", "logf("), ("fmax(", "fmaxf("),
        ("fabs(", "fabsf("), ("fma(", "fmaf("),
    ]  # fmt: skip
    metal = gd._source(True, keep, conv)
    for a, b in metal_to_cuda:
        metal = metal.replace(a, b)
    # CUDA aligns the shared q/k so that a run reads as one 16-byte load; Metal reads words.
    cuda = gd._source(False, keep, conv).replace("__align__(16) ", "")
    assert metal.splitlines() == cuda.splitlines()
    assert ("states +" in cuda) == keep and "A_log[hv]" in cuda
    assert ("conv_w[" in cuda) == conv


def test_raw_reference_is_mlx_lm_gating_then_the_recurrence():
    """The ops path from raw inputs is exactly mlx-lm's normalize_qk, compute_g and sigmoid."""
    from mlx_lm.models.gated_delta import compute_g, normalize_qk

    q, k, v, g, beta, state = _inputs(T=4, dk=64, dv=16, dtype=mx.bfloat16, seed=3)
    a = (g * 4 - 3).astype(mx.bfloat16)
    b = (beta * 6 - 3).astype(mx.bfloat16)
    A_log, dt_bias = mx.linspace(-2, 1, 4), mx.linspace(-1, 1, 4).astype(mx.bfloat16)
    got = gd.gated_delta_raw_ops(q * 3, k * 3, v, a, b, A_log, dt_bias, state, keep_states=True)
    qn, kn = normalize_qk(q * 3, k * 3, inv_scale=64**-0.5, eps=1e-6)
    want = gd.gated_delta_ops(qn, kn, v, compute_g(A_log, a, dt_bias), mx.sigmoid(b), state,
                              keep_states=True)  # fmt: skip
    assert all(_bitwise(x, y) for x, y in zip(got, want, strict=True))


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_cuda_raw_kernel_passes_its_check_and_keeps_chain_parity(dtype):
    assert gd._self_check_raw(dtype, 16, 48, 128, 128, (mx.float32, mx.bfloat16)) is None
    q, k, v, g, beta, state = _inputs(T=5, hk=16, hv=48, dk=128, dv=128, dtype=dtype, seed=9)
    a, b = (g * 4 - 3).astype(dtype), (beta * 6 - 3).astype(dtype)
    A_log, dt_bias = mx.linspace(-2, 1, 48), mx.linspace(-1, 1, 48).astype(mx.bfloat16)

    def run(q, k, v, a, b, state):
        return gd.gated_delta_raw_native(q * 3, k * 3, v, a, b, A_log, dt_bias, state,
                                         keep_states=True)  # fmt: skip

    y, final, states = run(q, k, v, a, b, state)
    cy, cfinal, cstates = _chain(lambda *x: run(*x), q, k, v, a, b, state)
    assert _bitwise(y, cy) and _bitwise(final, cfinal) and _bitwise(states, cstates)


def test_kernel_names_change_with_their_source(monkeypatch):
    """MLX's CUDA backend caches compiled kernels on disk by name: a new source needs a new name,
    or an upgraded install would run the old machine code."""
    from mtpcli.kernels import qmm_kernel as qm

    names = {gd._spec(False, keep, conv)["name"] for keep in (False, True) for conv in (0, 1)}
    assert len(names) == 4
    before = gd._spec(False, True)["name"]
    monkeypatch.setattr(gd, "_TEMPLATE", gd._TEMPLATE.replace("hl == 0", "hl == 1"))
    assert gd._spec(False, True)["name"] != before
    names = {
        qm._spec(metal, "", v)["name"]
        for metal in (False, True)
        for v in (qm.PLAIN, qm.Variant(1e-6), qm.Variant(1e-5), qm.Variant(swiglu=True))
    }
    assert len(names) == 8  # each variant and eps its own name, on each backend
    before = qm._spec(False, "", qm.PLAIN)["name"]
    monkeypatch.setattr(qm, "_CUDA_TEMPLATE", qm._CUDA_TEMPLATE.replace("warp == 0", "warp == 1"))
    assert qm._spec(False, "", qm.PLAIN)["name"] != before


@cuda
@pytest.mark.parametrize("T", [1, 3])
def test_cuda_raw_kernel_reads_strided_views_as_their_copies(T):
    """In a verify block q, k, v, a and b are views into one projection output; the kernel reads
    them through their strides, bitwise as it reads contiguous copies."""
    q, k, v, g, beta, state = _inputs(T=T, hk=16, hv=48, dk=128, dv=128, seed=11)
    a, b = (g * 4 - 3).astype(mx.bfloat16), (beta * 6 - 3).astype(mx.bfloat16)
    views = gd._views((q * 3, k * 3, v)) + gd._views((a, b))
    copies = [q * 3, k * 3, v, a, b]  # computed arrays: row-contiguous
    mx.eval(views, copies)
    A_log, dt_bias = mx.linspace(-2, 1, 48), mx.linspace(-1, 1, 48).astype(mx.bfloat16)
    got = gd.gated_delta_raw_native(*views, A_log, dt_bias, state, keep_states=True)
    want = gd.gated_delta_raw_native(*copies, A_log, dt_bias, state, keep_states=True)
    assert all(_bitwise(x, y) for x, y in zip(got, want, strict=True))


@cuda
@pytest.mark.parametrize("rows", [4])
def test_cuda_rows_per_warp_do_not_change_a_bit(monkeypatch, rows):
    """A warp runs R value rows (R / 2 a half); each row's arithmetic is the same whatever R
    is, so the launch shape may be tuned without touching exactness (states included)."""
    q, k, v, g, beta, state = _inputs(T=3, hk=16, hv=48, dk=128, dv=128, seed=5)
    a, b = (g * 4 - 3).astype(mx.bfloat16), (beta * 6 - 3).astype(mx.bfloat16)
    A_log, dt_bias = mx.linspace(-2, 1, 48), mx.linspace(-1, 1, 48).astype(mx.bfloat16)
    args = (q * 3, k * 3, v, a, b, A_log, dt_bias, state)
    want = gd.gated_delta_raw_native(*args, keep_states=True)
    mx.eval(want)
    assert gd._ROWS != rows
    monkeypatch.setattr(gd, "_ROWS", rows)
    got = gd.gated_delta_raw_native(*args, keep_states=True)
    assert all(_bitwise(x, y) for x, y in zip(got, want, strict=True))


# The convolution folded into the kernel (``gated_delta_conv``).


def _conv_args(T=3, heads=(2, 32, 4, 16), K=4, dtype=mx.bfloat16, seed=0):
    """The layer's inputs from its conv's: qkv [1, T, NC] (a view), the window (a view),
    the conv weight [NC, K, 1], a, b, A_log, dt_bias, the state, the head sizes."""
    hk, dk, hv, dv = heads
    qkv, window, conv_w = gd._conv_inputs(dtype, heads, K, dtype, T=T)
    *_, g, beta, state = _inputs(T=T, hk=hk, hv=hv, dk=dk, dv=dv, dtype=dtype, seed=seed)
    a, b, A_log, dt_bias = gd._raw_gates(g, beta, dtype, hv, (mx.float32, mx.bfloat16))
    return qkv, window, conv_w, a, b, A_log, dt_bias, state, heads


def test_the_conv_reference_is_the_conv_then_the_raw_reference():
    from mtpcli.kernels import conv_window as cw

    qkv, window, conv_w, a, b, A_log, dt_bias, state, heads = _conv_args()
    got = gd.gated_delta_conv_ops(qkv, window, conv_w, a, b, A_log, dt_bias, state, heads,
                                  keep_states=True)  # fmt: skip
    out, inputs, new_window = cw.conv_silu_ops(qkv, window, conv_w)
    q, k, v = mx.split(out, [64, 128], axis=-1)
    want = gd.gated_delta_raw_ops(q.reshape(1, 3, 2, 32), k.reshape(1, 3, 2, 32),
                                  v.reshape(1, 3, 4, 16), a, b, A_log, dt_bias, state,
                                  keep_states=True)  # fmt: skip
    assert all(_bitwise(x, y) for x, y in zip(got, (*want, inputs, new_window), strict=True))


@pytest.mark.filterwarnings("ignore:gated_delta_raw kernel")  # no raw kernel on this CPU
def test_a_wrong_folded_kernel_is_refused_and_the_two_launches_run(monkeypatch, pretend_gpu):
    kernels.reset_verdicts()

    def wrong(*args, keep_states=False):  # right at T = 1, wrong in a block (the wide kernel)
        y, *rest = gd.gated_delta_conv_ops(*args, keep_states=keep_states)
        return (y * 1.5 if y.shape[1] > 1 else y, *rest)

    pretend_gpu(gd, "gated_delta_conv_native", wrong)
    args = _conv_args()
    with pytest.warns(RuntimeWarning, match="gated_delta_conv kernel disagrees.*T = 3: y"):
        got = gd.gated_delta_conv(*args, keep_states=True)
    # the conv's and the recurrence's own best paths (on a GPU, their native kernels)
    want = gd.conv_then_delta(gd.conv_silu, gd.gated_delta_raw, *args, True)
    assert all(_bitwise(x, y) for x, y in zip(got, want, strict=True))
    kernels.reset_verdicts()


@pytest.mark.filterwarnings("ignore:gated_delta_raw kernel")  # no raw kernel on this CPU
def test_an_agreeing_folded_kernel_is_used_unless_the_mode_is_ops(pretend_gpu):
    kernels.reset_verdicts()
    calls = []

    def native(*args, **kw):
        calls.append(args[0].shape[1])  # T
        return gd.gated_delta_conv_ops(*args, **kw)

    pretend_gpu(gd, "gated_delta_conv_native", native)
    gd.gated_delta_conv(*_conv_args(T=4))
    assert calls == [1, 3, 4]  # the self-check, narrow and wide, then the real call
    gd.gated_delta_conv(*_conv_args(), mode="ops")
    assert calls == [1, 3, 4]  # the references instead
    kernels.reset_verdicts()


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_cuda_folded_conv_kernel_passes_its_check_at_the_27b_heads(dtype):
    heads = (16, 128, 48, 128)
    assert gd._self_check_conv(dtype, heads, 4, mx.bfloat16, (mx.float32, mx.float32)) is None


@cuda
@pytest.mark.parametrize("T", [1, 3, 10])
def test_cuda_folded_conv_kernel_keeps_chain_parity(T):
    """T steps in one launch equal T one-step launches, each from the last one's window and
    state: outputs, states and windows bitwise."""
    qkv, window, conv_w, a, b, A_log, dt_bias, state, heads = _conv_args(
        T=T, heads=(16, 128, 48, 128), seed=T
    )
    y, final, states, inputs, new_window = gd.gated_delta_conv_native(
        qkv, window, conv_w, a, b, A_log, dt_bias, state, heads, keep_states=True
    )
    s, w, ys, kept = state, window, [], []
    for t in range(T):
        yt, s, _, _, w = gd.gated_delta_conv_native(
            qkv[:, t : t + 1], w, conv_w, a[:, t : t + 1], b[:, t : t + 1], A_log, dt_bias, s,
            heads)  # fmt: skip
        ys.append(yt)
        kept.append(s)
    assert _bitwise(y, mx.concatenate(ys, axis=1)) and _bitwise(final, s)
    assert _bitwise(new_window, w) and _bitwise(inputs, mx.concatenate([window, qkv], axis=1))
    if T > 1:
        assert _bitwise(states, mx.stack(kept[:-1]))


@cuda
@pytest.mark.parametrize("T", [3, 8])
def test_cuda_wide_block_is_bitwise_the_narrow_one(monkeypatch, T):
    """At the 27B heads a block goes wide (24 warps of 3 heads a threadgroup); every output
    is bitwise the narrow launch's (one head a threadgroup of 8 warps)."""
    args = _conv_args(T=T, heads=(16, 128, 48, 128), seed=50 + T)
    assert gd._layout(16, 48, 128, T)["HPT"] == 3
    wide = gd.gated_delta_conv_native(*args, keep_states=True)
    monkeypatch.setattr(gd, "_WIDE", None)
    assert gd._layout(16, 48, 128, T)["HPT"] == 1
    narrow = gd.gated_delta_conv_native(*args, keep_states=True)
    assert all(_bitwise(x, y) for x, y in zip(wide, narrow, strict=True))


def _sigmoid_denominators() -> np.ndarray:
    """1 + exp(-h) over every h a bf16 conv output reaches and beyond (to inf), powers of two
    with random mantissas up to 2^127, and the edges of RCP1's range; float32."""
    rng = np.random.default_rng(0)
    x = np.concatenate([
        1.0 + np.exp(-rng.uniform(-100.0, 30.0, 200_000)),
        2.0 ** rng.uniform(0.0, 127.0, 100_000),
        [1.0, 1.0 + 2.0**-23, 2.0**126 * (1 - 2.0**-24), 2.0**126, 3e38, np.inf],
    ])  # fmt: skip
    with np.errstate(over="ignore"):
        return x.astype(np.float32)


@cuda
def test_cuda_reciprocal_is_the_ieee_quotient_below_2_to_126():
    """RCP1, the kernels' 1 / x for a sigmoid's denominator, on the GPU: bitwise the correctly
    rounded float32 quotient for 1 <= x < 2^126 (the division it replaces), 0 from there."""
    x = _sigmoid_denominators()
    kernel = mx.fast.cuda_kernel(
        name="rcp1_probe", input_names=["x"], output_names=["y"],
        source=kernels.RCP1 + """
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < x_shape[0]) y[i] = RCP1(x[i]);""",
    )  # fmt: skip
    (y,) = kernel(inputs=[mx.array(x)], grid=(x.size, 1, 1), threadgroup=(256, 1, 1),
                  output_shapes=[x.shape], output_dtypes=[mx.float32])  # fmt: skip
    with np.errstate(divide="ignore"):
        want = np.where(x < np.float32(2.0**126), np.float32(1.0) / x, np.float32(0.0))
    got = np.array(y)
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
    assert (x >= 2.0**126).sum() > 1000 and (x < 2.0**126).sum() > 100_000


@cuda
def test_cuda_folded_conv_equals_the_conv_kernel_then_the_raw_kernel():
    """What the fold changes is the launch count: each value is the conv kernel's, bitwise
    (so a model runs the same tokens with it on or off)."""
    from mtpcli.kernels import conv_window as cw

    args = _conv_args(T=3, heads=(16, 128, 48, 128), seed=4)
    got = gd.gated_delta_conv_native(*args, keep_states=True)
    want = gd.conv_then_delta(cw.conv_silu_native, gd.gated_delta_raw_native, *args, True)
    assert all(_bitwise(x, y) for x, y in zip(got, want, strict=True))


def test_a_constant_input_is_made_once_per_weight_and_goes_with_it():
    """``kernels.constant``: made and evaluated at first use, the same array after, a new one
    for another weight or another way of making it (a contiguous copy by default); the entry
    does not keep the weight alive, and goes when the weight does."""
    calls = []

    def make(w):
        calls.append(1)
        return mx.contiguous(w.reshape(2, 3))

    w, other = mx.arange(6).astype(mx.float32), mx.arange(6).astype(mx.float32)
    a = kernels.constant(w, "rows", make)
    assert kernels.constant(w, "rows", make) is a and len(calls) == 1
    assert a.shape == (2, 3) and mx.array_equal(a.reshape(6), w).item()
    kernels.constant(other, "rows", make)
    assert len(calls) == 2
    flat = kernels.constant(w)
    assert flat is kernels.constant(w) and mx.array_equal(flat, w).item()
    key = (id(w), "rows")
    assert kernels._constants[key][0]() is w
    del w
    gc.collect()
    assert key not in kernels._constants and (id(other), "rows") in kernels._constants


def test_a_kernel_text_with_a_missing_or_stray_part_is_refused():
    """``fill`` replaces each ``{{NAME}}``; a placeholder without its part, or a part with no
    placeholder (a misspelled name), fails loudly instead of building a half-filled kernel."""
    from mtpcli.kernels import fill

    assert fill("a {{X}} b {{Y}} {{X}}", X="1", Y="2") == "a 1 b 2 1"
    with pytest.raises(ValueError, match=r"placeholders without a part \['Y'\]"):
        fill("{{X}} {{Y}}", X="1")
    with pytest.raises(ValueError, match=r"parts without a placeholder \['Z'\]"):
        fill("{{X}}", X="1", Z="2")
    for module_text in (gd._TEMPLATE,):
        with pytest.raises(ValueError, match="KEEP_STATES"):
            fill(module_text)  # every part of the real kernel is asked for


def test_compact_drops_comments_and_indentation_but_no_code():
    from mtpcli.kernels import compact

    text = """
    // a comment line
    const int a = 1;  // trailing
    asm("mov.b32 %0, %1; // not a comment" : "=r"(r) : "r"(x));

    #define TWO(x) \\
      ((x) + \\
       (x))  // the end
    int b = 2; // continued \\
    int c = 3;
    """
    assert compact(text) == (
        "const int a = 1;\n"
        'asm("mov.b32 %0, %1; // not a comment" : "=r"(r) : "r"(x));\n'
        "#define TWO(x) \\\n((x) + \\\n(x))\n"
        "int b = 2; // continued \\\nint c = 3;\n"
    )
