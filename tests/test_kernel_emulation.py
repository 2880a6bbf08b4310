"""The CUDA gated-delta and convolution kernels' sources, run on the CPU thread by thread
(tests/cuda_emulation.py): their logic against the ops references, chain parity, rows-per-warp
invariance, in CI where there is no GPU. The H200 tests (test_kernels.py, test_conv_window.py)
cover input-dtype rounding and codegen."""

from __future__ import annotations

import dataclasses
import math

import cuda_emulation  # tests/cuda_emulation.py
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu

from mtpcli.kernels import conv_window as cw
from mtpcli.kernels import gated_delta as gd
from mtpcli.kernels import qmm_kernel as qm
from mtpcli.kernels.gathered_matmul import gathered_matmul_ops
from mtpcli.kernels.quantized_matmul import quantized_matmul_ops, random_quantized

pytestmark = pytest.mark.skipif(not cuda_emulation.available(), reason="needs g++")

HK, HV, DK, DV = 2, 4, 32, 16


def _raw_inputs(T: int, seed: int = 0, dv: int = DV) -> dict[str, np.ndarray]:
    """The layer's raw inputs, q/k/v and a/b as views into one buffer each (as the model
    passes them), float32."""
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((1, T, 2 * HK * DK + HV * dv), dtype=np.float32)
    ab = rng.standard_normal((1, T, 2 * HV), dtype=np.float32)
    q = qkv[..., : HK * DK].reshape(1, T, HK, DK)
    k = qkv[..., HK * DK : 2 * HK * DK].reshape(1, T, HK, DK)
    v = qkv[..., 2 * HK * DK :].reshape(1, T, HV, dv)
    return {
        "q": q, "k": k, "v": v, "a": ab[..., :HV], "bb": ab[..., HV:],
        "A_log": np.linspace(-2, 1, HV, dtype=np.float32),
        "dt_bias": np.linspace(-1, 1, HV, dtype=np.float32),
        "state_in": rng.standard_normal((1, HV, dv, DK), dtype=np.float32) * 0.1,
    }  # fmt: skip


def _emulate(x: dict, keep: bool, rows: int | None = None, source: str | None = None,
             metal: bool = False) -> list:  # fmt: skip
    """The kernel on x, ``rows`` value rows per warp (by default as the launch picks them);
    ``source`` a variant of the CUDA kernel, or of the Metal one."""
    T, dv = x["q"].shape[1], x["v"].shape[-1]
    layout = gd._layout(HK, HV, dv, T, rows, conv=False)
    outputs = {"y": (1, T, HV, dv), "state_out": (1, HV, dv, DK)}
    if keep:
        outputs["states"] = (T - 1, 1, HV, dv, DK)
    out = cuda_emulation.run(
        source or gd._source(False, keep),
        x,
        outputs,
        {"Dk": DK, "Dv": dv, "Hk": HK, "Hv": HV, **layout},
        *gd._geometry(1, HV, dv, layout),
        header=gd._spec(True, keep)["header"] if metal else "",  # what the Metal build gets
    )
    return list(out.values())


def _reference(x: dict, keep: bool) -> list[np.ndarray]:
    a = {n: mx.array(v) for n, v in x.items()}
    y, state, states = gd.gated_delta_raw_ops(
        a["q"], a["k"], a["v"], a["a"], a["bb"], a["A_log"], a["dt_bias"], a["state_in"],
        keep_states=keep,
    )  # fmt: skip
    return [np.array(t) for t in (y, state, states) if t is not None]


@pytest.mark.parametrize("T, keep", [(1, False), (3, True), (5, True), (3, False), (11, True)])
def test_emulated_kernel_matches_the_reference(T, keep):
    x = _raw_inputs(T, seed=T)
    got, want = _emulate(x, keep=keep), _reference(x, keep=keep)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("T", [4, 10])
def test_emulated_kernel_keeps_chain_parity(T):
    """T steps in one launch equal T one-step launches bitwise, outputs and states (10 steps
    span two of the kernel's chunks of 8)."""
    _assert_chain_parity(_raw_inputs(T, seed=7), _emulate)


def _assert_chain_parity(x: dict, emulate) -> None:
    y, final, states = emulate(x, keep=True)
    s, ys, kept = x["state_in"], [], []
    for t in range(x["q"].shape[1]):
        step = {n: (v[:, t : t + 1] if v.ndim >= 3 else v) for n, v in x.items()}
        yt, s = emulate({**step, "state_in": s}, keep=False)  # state_in: the last step's
        ys.append(yt)
        kept.append(s)
    assert np.array_equal(np.concatenate(ys, 1), y) and np.array_equal(s, final)
    assert np.array_equal(np.stack(kept[:-1]), states)


@pytest.mark.parametrize("metal", [False, True], ids=["cuda", "metal"])
@pytest.mark.parametrize("layout", ["rolled_back", "padded", "broadcast"])
def test_emulated_kernel_reads_the_state_through_its_strides(metal, layout):
    """After a rollback the state is a view into the last verify's per-step states; any view
    (rows further apart than Dk, a broadcast) reads as the dense array it stands for."""
    x = _raw_inputs(3, seed=21)
    dense = x["state_in"]
    if layout == "rolled_back":
        states = np.stack([dense * 0.5, dense, dense * 2.0])  # [T - 1 + 1, B, Hv, Dv, Dk]
        view = states[1:2].reshape(dense.shape)
    elif layout == "padded":  # a kernel that assumed dense rows would read the padding
        view = np.concatenate([dense, -dense], axis=-1)[..., :DK]
    else:
        dense = np.zeros_like(dense)
        view = np.broadcast_to(np.zeros((1, 1, 1, 1), np.float32), dense.shape)
    assert not view.flags.owndata
    source = gd._source(metal, True)
    got = _emulate({**x, "state_in": view}, keep=True, source=source, metal=metal)
    want = _emulate({**x, "state_in": np.ascontiguousarray(dense)}, keep=True, source=source,
                    metal=metal)  # fmt: skip
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("rows", [r for r in (2, 4) if r != gd._ROWS])
def test_emulated_rows_per_warp_do_not_change_a_bit(rows):
    x = _raw_inputs(3, seed=3, dv=4 * gd._WARPS)  # enough value rows for 4 a warp
    want = _emulate(x, keep=True)
    got = _emulate(x, keep=True, rows=rows)
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize(
    "old, new, T",
    [
        ("s[r][i] = s[r][i] * gt;", "s[r][i] = s[r][i];", 3),  # the decay forgotten
        ("hv * v_strides[2]", "hv * v_strides[3]", 3),  # a wrong stride
        ("st_ += (size_t)B * Hv * Dv * Dk;", "", 3),  # every kept state in the first slot
        ("(t0 + j) * q_strides[1]", "j * q_strides[1]", 11),  # every chunk reads the first's q
        ("(t0 + lane) * gs", "lane * gs", 11),  # and its gates
        ("t0 + lane / R", "lane / R", 11),  # and its values
        ("int(j * R + grp * RH + r)", "int(grp * RH + r)", 3),  # every step takes the first's v
    ],
    ids=["decay", "stride", "states", "chunk_q", "chunk_gates", "chunk_v", "step_v"],
)
def test_emulation_catches_a_broken_kernel(old, new, T):
    """The emulation is a real check: each of these mistakes makes it disagree."""
    x = _raw_inputs(T, seed=11)
    source = gd._source(False, True)
    assert old in source
    got = _emulate(x, keep=True, source=source.replace(old, new))
    want = _reference(x, keep=True)
    assert not all(np.allclose(g, w, rtol=1e-4, atol=1e-5) for g, w in zip(got, want, strict=True))


def _conv(x, window, weight, source: str | None = None) -> list[np.ndarray]:
    B, T, C = x.shape
    K = weight.shape[1]
    threads = cw._THREADS
    out = cuda_emulation.run(
        source or cw.source(False),
        {"x": x, "window": window, "weight": weight},
        {"y": (B, T, C), "inputs": (B, K - 1 + T, C), "window_out": (B, K - 1, C)},
        {"K": K},
        grid=(-(-C // threads) * threads, B, 1),
        threadgroup=(threads, 1, 1),
    )
    return list(out.values())


@pytest.mark.parametrize("T", [1, 3])
def test_emulated_convolution_matches_the_reference(T):
    rng = np.random.default_rng(T)
    whole = rng.standard_normal((2, T, 300), dtype=np.float32)
    x = whole[..., 10:290]  # a strided view; 280 channels: more than one threadgroup
    window = rng.standard_normal((2, 3, 280), dtype=np.float32)
    weight = rng.standard_normal((280, 4, 1), dtype=np.float32) * 0.5
    got = _conv(x, window, weight)
    want = cw.conv_silu_ops(mx.array(x), mx.array(window), mx.array(weight))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, np.array(w), rtol=1e-5, atol=1e-6)
    broken = _conv(x, window, weight, cw.source(False).replace("last[k] = last[k + 1]", ""))
    pairs = zip(broken, want, strict=True)
    close = [np.allclose(b, np.array(w), rtol=1e-5, atol=1e-6) for b, w in pairs]
    assert not all(close)  # a window that never slides is caught


@pytest.mark.parametrize("metal", [False, True], ids=["cuda", "metal"])
def test_emulated_convolution_reads_the_window_through_its_strides(metal):
    source = cw.source(metal)
    """After a rollback the window is a view into the last verify's inputs."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 3, 280), dtype=np.float32)
    inputs = rng.standard_normal((2, 6, 280), dtype=np.float32)  # [B, K - 1 + 3, C]
    window = inputs[:, 2:5]  # rows 2-4: as restored after keeping 2 of 3 positions
    weight = rng.standard_normal((280, 4, 1), dtype=np.float32) * 0.5
    got = _conv(x, window, weight, source)
    want = _conv(x, np.ascontiguousarray(window), weight, source)
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


# The Metal sources, run the same way: nothing else here can run them.


@pytest.mark.parametrize("T, keep", [(1, False), (3, True)])
def test_emulated_metal_gated_delta_matches_the_reference(T, keep):
    x = _raw_inputs(T, seed=40 + T)
    got = _emulate(x, keep, source=gd._source(True, keep), metal=True)
    for g, w in zip(got, _reference(x, keep), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_emulated_metal_convolution_matches_the_reference():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 300), dtype=np.float32)[..., 10:290]
    window = rng.standard_normal((2, 3, 280), dtype=np.float32)
    weight = rng.standard_normal((280, 4, 1), dtype=np.float32) * 0.5
    want = cw.conv_silu_ops(mx.array(x), mx.array(window), mx.array(weight))
    for g, w in zip(_conv(x, window, weight, cw.source(True)), want, strict=True):
        np.testing.assert_allclose(g, np.array(w), rtol=1e-5, atol=1e-6)


def _outputs(variant: qm.Variant, m: int, n: int) -> dict:
    """The emulated launch's output y for m rows (x's leading axes, flattened here)."""
    n_out, _ = qm.launch_shape(n, variant.swiglu)
    return {"y": (m, n_out)}


def _constants(xt: str, bits: int, group_size: int, warps: int, x) -> dict:
    """A product's template constants for x [..., K] (its tiles of 8 rows as the launch picks)."""
    return {"XT": xt, "ST": xt, "BITS": bits, "GS": group_size, "WARPS": warps,
            "NT": qm.tiles(math.prod(x.shape[:-1]))}  # fmt: skip


def _metal_qmm(x: np.ndarray, w, scales, biases, group_size: int, bits: int,
               residual: np.ndarray | None = None, variant: qm.Variant = qm.PLAIN,
               norm_w: np.ndarray | None = None, source: str | None = None):  # fmt: skip
    """The Metal product's y."""
    n = w.shape[0]
    if residual is not None and not variant.residual:
        variant = dataclasses.replace(variant, residual=True)
    _, groups = qm.launch_shape(n, variant.swiglu)
    extra = {"norm_w": norm_w} if norm_w is not None else {}
    extra |= {"residual": residual} if residual is not None else {}
    out = cuda_emulation.run(
        source or qm.source(True, variant),
        {"x": x, "w": w, "scales": scales, "biases": biases} | extra,
        _outputs(variant, math.prod(x.shape[:-1]), n),
        _constants("float", bits, group_size, qm.WARPS, x),
        grid=(32 * qm.WARPS * groups, 1, 1),
        threadgroup=(32 * qm.WARPS, 1, 1),
    )
    return out["y"]


@pytest.mark.parametrize("bits", qm.BITS)
@pytest.mark.parametrize("group_size", qm.GROUP_SIZES)
def test_emulated_metal_quantized_matmul_matches_the_reference(bits, group_size):
    """The Metal product is its own code (no tensor-core mma on Metal), not a mirror of the
    CUDA one: its logic against mx.quantized_matmul, and rows M-invariant, bitwise."""
    n, k = 40, 512  # 40 rows: a partial last tile; 512 = 2 x 16-word stretches at 4 bits
    rng = np.random.default_rng(bits * 1000 + group_size)
    w, scales, biases = mx.quantize(
        mx.array(rng.standard_normal((n, k), dtype=np.float32)), group_size=group_size, bits=bits
    )
    x = rng.standard_normal((8, k), dtype=np.float32)
    arrays = [np.array(a) for a in (w, scales, biases)]
    got = {m: _metal_qmm(x[:m], *arrays, group_size, bits) for m in (1, 3, 8)}
    want = quantized_matmul_ops(mx.array(x), w, scales, biases, group_size=group_size,
                                   bits=bits)  # fmt: skip
    np.testing.assert_allclose(got[8], np.array(want), rtol=1e-4, atol=1e-4)
    assert np.array_equal(got[1], got[8][:1]) and np.array_equal(got[3], got[8][:3])
    # Rows in leading axes, as the model passes x [B, T, K]: the same rows' bits.
    lead = _metal_qmm(x[:6].reshape(2, 3, k), *arrays, group_size, bits)
    assert np.array_equal(lead, got[8][:6])


def _bits16(a: mx.array) -> np.ndarray:
    """A bfloat16 array's storage, as the kernel reads it."""
    return np.array(a.view(mx.uint16))


@pytest.mark.parametrize("bits", qm.BITS)
@pytest.mark.parametrize("group_size", qm.GROUP_SIZES)
def test_emulated_cuda_quantized_matmul_matches_the_reference(bits, group_size):
    """The CUDA product, its tensor-core mma emulated by the PTX fragment layout: its logic
    against x times the weights as it dequantizes them (scale * q + bias, rounded once to
    bf16) in float64, and rows M-invariant, bitwise."""
    n, k = 40, 512
    w, scales, biases = random_quantized(n, k, group_size, bits, mx.bfloat16, seed=bits)
    x = mx.random.normal((8, k), key=mx.random.key(group_size)).astype(mx.bfloat16)
    want = _as_dequantized(x, w, scales, biases, group_size, bits)
    got = {m: _cuda_qmm(x[:m], w, scales, biases, group_size, bits) for m in (1, 3, 8)}
    np.testing.assert_allclose(got[8], want, rtol=2**-7, atol=1e-3)  # bf16 outputs
    assert np.array_equal(got[1], got[8][:1]) and np.array_equal(got[3], got[8][:3])
    # Rows in leading axes, as the model passes x [B, T, K]: the same rows' bits.
    lead = _cuda_qmm(x[:6].reshape(2, 3, k), w, scales, biases, group_size, bits)
    assert np.array_equal(lead, got[8][:6])


def _as_dequantized(x, w, scales, biases, group_size, bits) -> np.ndarray:
    """x times the weights as the CUDA kernel dequantizes them (scale * q + bias, rounded once
    to bf16), in float64."""
    n, k = w.shape[0], x.shape[-1]
    words = np.array(w)  # [N, K * bits / 32]
    q = (words[..., None] >> (bits * np.arange(32 // bits, dtype=np.uint32))) & (2**bits - 1)
    per_group = (n, k // group_size, group_size)
    scale, bias = (np.array(a.astype(mx.float32), np.float64)[..., None] for a in (scales, biases))
    dense = (q.reshape(per_group) * scale + bias).reshape(n, k)
    dense = np.array(mx.array(dense.astype(np.float32)).astype(mx.bfloat16).astype(mx.float32))
    return np.array(x.astype(mx.float32), np.float64) @ dense.astype(np.float64).T


def _cuda_qmm(x, w, scales, biases, group_size, bits, warps=qm.WARPS, residual=None,
              variant: qm.Variant = qm.PLAIN, norm_w=None, source: str | None = None):  # fmt: skip
    """The CUDA product's y."""
    n = w.shape[0]
    if residual is not None and not variant.residual:
        variant = dataclasses.replace(variant, residual=True)
    _, groups = qm.launch_shape(n, variant.swiglu)
    extra = {"norm_w": _bits16(norm_w)} if norm_w is not None else {}
    extra |= {"residual": _bits16(residual)} if residual is not None else {}
    out = cuda_emulation.run(
        source or qm.source(False, variant),
        {"x": _bits16(x), "w": np.array(w), "scales": _bits16(scales), "biases": _bits16(biases)}
        | extra,
        _outputs(variant, math.prod(x.shape[:-1]), n),
        _constants("__nv_bfloat16", bits, group_size, warps, x),
        grid=(32 * warps * groups, 1, 1),
        threadgroup=(32 * warps, 1, 1),
        header=cuda_emulation.emulated_mma(qm._HEADER_CUDA),
        types={"x": "XT", "scales": "ST", "biases": "ST", "residual": "XT", "norm_w": "XT"},
    )  # fmt: skip
    return out["y"]


def _bf16_sum(a: np.ndarray, b: mx.array) -> np.ndarray:
    """a + b as MLX adds two bfloat16 arrays (a holds bfloat16 values as float32)."""
    return np.array((mx.array(a).astype(mx.bfloat16) + b).astype(mx.float32))


@pytest.mark.parametrize("bits", qm.BITS)
def test_emulated_cuda_product_adds_its_residual_as_mlx_adds(bits):
    """The residual variant (a layer's h + proj(x) in one launch) stores exactly what the plain
    product followed by MLX's bf16 add gives, every row of M = 1..8 in its own place."""
    n, k = 40, 512
    w, scales, biases = random_quantized(n, k, 64, bits, mx.bfloat16, seed=11 + bits)
    x = mx.random.normal((8, k), key=mx.random.key(12)).astype(mx.bfloat16)
    r = (mx.random.normal((8, n), key=mx.random.key(13)) * 4).astype(mx.bfloat16)
    plain = _cuda_qmm(x, w, scales, biases, 64, bits)
    for m in (1, 3, 8):
        got = _cuda_qmm(x[:m], w, scales, biases, 64, bits, residual=r[:m])
        assert np.array_equal(got, _bf16_sum(plain[:m], r[:m])), f"M={m}"
    assert not np.array_equal(got, plain)  # the residual is really there


def test_emulated_metal_product_adds_its_residual():
    rng = np.random.default_rng(14)
    w, scales, biases = mx.quantize(mx.array(rng.standard_normal((40, 512), dtype=np.float32)),
                                    group_size=64, bits=4)  # fmt: skip
    arrays = [np.array(a) for a in (w, scales, biases)]
    x = rng.standard_normal((3, 512), dtype=np.float32)
    r = rng.standard_normal((3, 40), dtype=np.float32)
    got = _metal_qmm(x, *arrays, 64, 4, residual=r)
    np.testing.assert_array_equal(got, _metal_qmm(x, *arrays, 64, 4) + r)  # float: one rounding


@pytest.mark.parametrize("bits", qm.BITS)
def test_emulated_cuda_quantized_matmul_prefetch_over_many_rounds(bits):
    """Each warp requests the next stretch while it multiplies the current one: 2 warps over
    32 stretches run 16 rounds each, so a stretch used before or after its own request (a
    broken prefetch) gives wrong rows."""
    n, k = 24, 4096 if bits == 4 else 2048
    w, scales, biases = random_quantized(n, k, 64, bits, mx.bfloat16, seed=3)
    x = mx.random.normal((3, k), key=mx.random.key(4)).astype(mx.bfloat16)
    got = _cuda_qmm(x, w, scales, biases, 64, bits, warps=2)
    want = _as_dequantized(x, w, scales, biases, 64, bits)
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-3)


def _bf16(a) -> np.ndarray:
    """float values rounded to bfloat16 (as float32)."""
    return np.array(mx.array(np.asarray(a, np.float32)).astype(mx.bfloat16).astype(mx.float32))


def _normed_reference(x, norm_w, w, scales, biases, bits, eps=1e-6) -> np.ndarray:
    """What the norm variant computes, in float64: x times the norm weight (rounded once to
    bf16) times the dequantized weights, scaled by rsqrt(mean(x^2) + eps), rounded to bf16."""
    xf = np.array(x.astype(mx.float32), np.float64)
    scaled = mx.array(_bf16(xf * np.array(norm_w.astype(mx.float32)))).astype(mx.bfloat16)
    inv = 1.0 / np.sqrt((xf**2).mean(axis=-1, keepdims=True) + eps)
    return _bf16(_as_dequantized(scaled, w, scales, biases, 64, bits) * inv)


def _silu_times(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """mlx-lm's swiglu(gate, up) on bf16 values, as MLX computes it on the CPU."""
    g, u = (mx.array(a).astype(mx.bfloat16) for a in (gate, up))
    return np.array(swiglu(g, u).astype(mx.float32))


def _norm_inputs(bits: int, n: int = 40, k: int = 512, m: int = 8, seed: int = 0):
    w, scales, biases = random_quantized(n, k, 64, bits, mx.bfloat16, seed=seed)
    x = (mx.random.normal((m, k), key=mx.random.key(seed + 1)) * 3).astype(mx.bfloat16)
    nw = mx.random.uniform(0.5, 1.5, (k,), key=mx.random.key(seed + 2)).astype(mx.bfloat16)
    return x, nw, w, scales, biases


@pytest.mark.parametrize("bits", qm.BITS)
def test_emulated_cuda_product_normalises_its_input(bits):
    """The norm variant (an RMSNorm folded into the product that follows it) against its
    arithmetic in float64, rows M-invariant bitwise, and near the exact norm then product."""
    x, nw, *weights = _norm_inputs(bits, seed=20 + bits)
    norm = qm.Variant(norm_eps=1e-6)
    got = {m: _cuda_qmm(x[:m], *weights, 64, bits, variant=norm, norm_w=nw) for m in (1, 3, 8)}
    np.testing.assert_allclose(got[8], _normed_reference(x, nw, *weights, bits),
                               rtol=2**-7, atol=1e-3)  # fmt: skip
    assert np.array_equal(got[1], got[8][:1]) and np.array_equal(got[3], got[8][:3])
    # and near the norm without roundings: x * rsqrt(mean(x^2) + eps) * weight, in float64
    xf = np.array(x.astype(mx.float32), np.float64)
    inv = 1.0 / np.sqrt((xf**2).mean(axis=-1, keepdims=True) + 1e-6)
    dense = np.array(mx.dequantize(*weights, group_size=64, bits=bits).astype(mx.float32))
    exact = (xf * inv * np.array(nw.astype(mx.float32))) @ dense.T.astype(np.float64)
    assert np.abs(got[8] - exact).max() <= 1e-2 * np.abs(exact).max()


@pytest.mark.parametrize("bits", qm.BITS)
def test_emulated_cuda_product_makes_swiglu_of_its_halves(bits):
    """The swiglu variant pairs gate row r with up row r + N/2 in one tile: each output is
    mlx-lm's swiglu of the plain product's two values, the last tile partial (20 outputs),
    rows M-invariant bitwise."""
    w, scales, biases = random_quantized(40, 512, 64, bits, mx.bfloat16, seed=30 + bits)
    x = mx.random.normal((8, 512), key=mx.random.key(31)).astype(mx.bfloat16)
    plain = _cuda_qmm(x, w, scales, biases, 64, bits)
    want = _silu_times(plain[:, :20], plain[:, 20:])
    sw = qm.Variant(swiglu=True)
    got = {m: _cuda_qmm(x[:m], w, scales, biases, 64, bits, variant=sw) for m in (1, 3, 8)}
    assert got[8].shape == (8, 20)
    # up to 2 bf16 ulps: MLX's CPU sigmoid is its own approximation of exp
    np.testing.assert_allclose(got[8], want, rtol=2**-6, atol=1e-5)
    assert np.array_equal(got[1], got[8][:1]) and np.array_equal(got[3], got[8][:3])


def test_emulated_cuda_norm_and_swiglu_together():
    """The MLP's gate/up launch: norm in, swiglu out; each is the separate variant's value."""
    x, nw, w, scales, biases = _norm_inputs(4, seed=40)
    normed = _cuda_qmm(x, w, scales, biases, 64, 4, variant=qm.Variant(1e-6), norm_w=nw)
    both = qm.Variant(1e-6, swiglu=True)
    got = {m: _cuda_qmm(x[:m], w, scales, biases, 64, 4, variant=both, norm_w=nw)
           for m in (1, 8)}  # fmt: skip
    np.testing.assert_allclose(got[8], _silu_times(normed[:, :20], normed[:, 20:]),
                               rtol=2**-6, atol=1e-5)  # fmt: skip
    assert np.array_equal(got[1], got[8][:1])


TILED = [qm.PLAIN, qm.Variant(residual=True), qm.Variant(1e-6, swiglu=True),
         qm.Variant(1e-6, residual=True)]  # fmt: skip


@pytest.mark.parametrize("variant", TILED, ids=["plain", "residual", "norm_swiglu", "norm_add"])
def test_emulated_cuda_product_tiles_give_each_row_its_bits_alone(variant):
    """Up to 32 rows a launch (a batch of requests, a batched verify): 2 and 4 tiles of 8 x
    rows share each dequantized weight fragment, and every row's outputs are the bits it has
    alone (one tile, M = 1) and among 8; the reference agrees on all 32."""
    x, nw, w, scales, biases = _norm_inputs(4, m=qm.MAX_ROWS, seed=70)
    nw = nw if variant.norm_eps is not None else None
    n_out = 20 if variant.swiglu else 40
    r = mx.random.normal((qm.MAX_ROWS, n_out), key=mx.random.key(71)).astype(mx.bfloat16)

    def run(rows: slice) -> np.ndarray:
        res = r[rows] if variant.residual else None
        return _cuda_qmm(x[rows], w, scales, biases, 64, 4, variant=variant, norm_w=nw,
                         residual=res)  # fmt: skip

    top = run(slice(0, qm.MAX_ROWS))
    assert np.array_equal(run(slice(0, 13)), top[:13])  # 2 tiles
    assert np.array_equal(run(slice(0, 8)), top[:8])
    for i in (0, 9, 17, 31):  # a row of each tile, alone
        assert np.array_equal(run(slice(i, i + 1))[0], top[i]), i
    if variant == qm.PLAIN:
        want = _as_dequantized(x, w, scales, biases, 64, 4)
        np.testing.assert_allclose(top, want, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("mistake", [
    ("const int m = 8 * nt + 2 * t + (i & 1);", "const int m = 2 * t + (i & 1);"),  # one tile
    ("min(g + 8 * nt, M - 1)", "min(g, M - 1)"),  # every tile reads the first tile's x
    ("c[nt][i];", "c[0][i];"),  # every tile stores the first one's sums
])  # fmt: skip
def test_emulation_catches_a_broken_tile(mistake):
    """The tiles' test can fail: each mistake changes a row of a later tile."""
    x, _, w, scales, biases = _norm_inputs(4, m=20, seed=72)
    text = qm.source(False, qm.PLAIN)
    assert text.count(mistake[0]) == 1
    good = _cuda_qmm(x, w, scales, biases, 64, 4)
    bad = _cuda_qmm(x, w, scales, biases, 64, 4, source=text.replace(*mistake))
    assert np.abs(bad[8:] - good[8:]).max() > 1e-2 * np.abs(good).max()


def test_emulated_metal_product_tiles_give_each_row_its_bits_alone():
    """The Metal product at 32 rows (with the norm and swiglu): each row the bits it has
    alone."""
    rng = np.random.default_rng(73)
    dense = mx.array(rng.standard_normal((40, 512), dtype=np.float32))
    w, scales, biases = (np.array(a) for a in mx.quantize(dense, group_size=64, bits=4))
    x = rng.standard_normal((qm.MAX_ROWS, 512), dtype=np.float32)
    nw = rng.uniform(0.5, 1.5, 512).astype(np.float32)
    variant = qm.Variant(1e-6, swiglu=True)
    top = _metal_qmm(x, w, scales, biases, 64, 4, variant=variant, norm_w=nw)
    for i in (0, 13, 31):
        alone = _metal_qmm(x[i : i + 1], w, scales, biases, 64, 4, variant=variant, norm_w=nw)
        assert np.array_equal(alone[0], top[i]), i


ONE_WARPS_SQUARES = ("sq = sq + ss_part[(nt * WARPS + v) * 8 + m]", "sq = sq + ss_part[m]")
BROKEN_VARIANTS = [  # (variant, a mistake spliced into its source)
    (qm.Variant(1e-6), ONE_WARPS_SQUARES),
    (qm.Variant(1e-6), ("ss[nt] = ss[nt] + __shfl_xor_sync(0xffffffffu, ss[nt], 2);", "")),
    (qm.Variant(swiglu=True), ("hi = lo + NY;", "hi = lo + 8;")),
]


@pytest.mark.parametrize("variant,mistake", BROKEN_VARIANTS)
def test_emulation_catches_a_broken_variant(variant, mistake):
    """The variants' tests can fail: each of these mistakes changes the outputs."""
    x, nw, w, scales, biases = _norm_inputs(4, seed=50)
    nw = nw if variant.norm_eps is not None else None
    good = _cuda_qmm(x[:3], w, scales, biases, 64, 4, variant=variant, norm_w=nw)
    text = qm.source(False, variant)
    assert text.count(mistake[0]) == 1
    bad = _cuda_qmm(x[:3], w, scales, biases, 64, 4, variant=variant, norm_w=nw,
                    source=text.replace(*mistake))  # fmt: skip
    assert np.abs(bad - good).max() > 1e-2 * np.abs(good).max()


def _metal_norm_reference(x, nw, w, scales, biases, bits, eps=1e-6) -> np.ndarray:
    xf = x.astype(np.float64)
    dense = np.array(mx.dequantize(mx.array(w), mx.array(scales), mx.array(biases), group_size=64,
                                   bits=bits), np.float64)  # fmt: skip
    inv = 1.0 / np.sqrt((xf**2).mean(axis=-1, keepdims=True) + eps)
    return (xf * nw) @ dense.T * inv


@pytest.mark.parametrize("swiglu_out", [False, True], ids=["norm", "norm_swiglu"])
def test_emulated_metal_variants_match_their_arithmetic(swiglu_out):
    """The Metal product's norm and swiglu splices (float activations): the norm against its
    float64 arithmetic, swiglu against silu(gate) * up of it, rows M-invariant bitwise."""
    rng = np.random.default_rng(60)
    w, scales, biases = (
        np.array(a)
        for a in mx.quantize(
            mx.array(rng.standard_normal((40, 512), dtype=np.float32)), group_size=64, bits=4
        )
    )
    x = rng.standard_normal((8, 512), dtype=np.float32) * 3
    nw = rng.uniform(0.5, 1.5, 512).astype(np.float32)
    variant = qm.Variant(1e-6, swiglu=swiglu_out)
    got = {m: _metal_qmm(x[:m], w, scales, biases, 64, 4, variant=variant, norm_w=nw)
           for m in (1, 3, 8)}  # fmt: skip
    want = _metal_norm_reference(x, nw, w, scales, biases, 4)
    if swiglu_out:
        gate, up = want[:, :20], want[:, 20:]
        want = gate / (1 + np.exp(-gate)) * up
    # float32 sums against float64: their error is relative to the largest terms
    np.testing.assert_allclose(got[8], want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    assert np.array_equal(got[1], got[8][:1]) and np.array_equal(got[3], got[8][:3])


def _conv_layer_inputs(T: int, seed: int = 0, heads=(HK, DK, HV, DV), K: int = 4) -> dict:
    """The folded kernel's inputs: qkv a view into a wider projection output, the window a view
    into a verify's inputs (as a rollback leaves it), float32."""
    hk, dk, hv, dv = heads
    nc = 2 * hk * dk + hv * dv
    rng = np.random.default_rng(seed)
    wide = rng.standard_normal((1, T, nc + 24), dtype=np.float32)
    kept = rng.standard_normal((1, K + 1, nc), dtype=np.float32)  # [1, K-1 + 2, NC]
    ab = rng.standard_normal((1, T, 2 * hv), dtype=np.float32)
    return {
        "qkv": wide[..., 16 : 16 + nc], "window": kept[:, 2:],
        "conv_w": rng.standard_normal((nc, K), dtype=np.float32) * 0.5,
        "a": ab[..., :hv], "bb": ab[..., hv:],
        "A_log": np.linspace(-2, 1, hv, dtype=np.float32),
        "dt_bias": np.linspace(-1, 1, hv, dtype=np.float32),
        "state_in": rng.standard_normal((1, hv, dv, dk), dtype=np.float32) * 0.1,
    }  # fmt: skip


def _emulate_conv(x: dict, keep: bool, heads=(HK, DK, HV, DV), source: str | None = None,
                  rows: int | None = None, metal: bool = False) -> list:  # fmt: skip
    """y, the final state, the states where kept, the conv's window and inputs, new window
    (``rows`` value rows a warp, by default as the launch picks them; ``source`` a variant
    of the CUDA kernel, or of the Metal one)."""
    hk, dk, hv, dv = heads
    T, K, nc = x["qkv"].shape[1], x["conv_w"].shape[1], x["qkv"].shape[2]
    layout = gd._layout(hk, hv, dv, T, rows)
    outputs = {"y": (1, T, hv, dv), "state_out": (1, hv, dv, dk)}
    outputs |= {"states": (T - 1, 1, hv, dv, dk)} if keep else {}
    outputs |= {"inputs": (1, K - 1 + T, nc), "window_out": (1, K - 1, nc)}
    out = cuda_emulation.run(
        source or gd._source(False, keep, conv=True),
        x,
        outputs,
        {"Dk": dk, "Dv": dv, "Hk": hk, "Hv": hv, **layout, "CK": K},
        *gd._geometry(1, hv, dv, layout),
        header=gd._spec(True, keep, conv=True)["header"] if metal else "",
    )
    return list(out.values())


def _conv_reference(x: dict, keep: bool, heads=(HK, DK, HV, DV)) -> list[np.ndarray]:
    a = {n: mx.array(v) for n, v in x.items()}
    w = a["conv_w"][..., None]  # [NC, K, 1]: MLX's conv weight layout
    out = gd.gated_delta_conv_ops(a["qkv"], a["window"], w, a["a"], a["bb"], a["A_log"],
                                  a["dt_bias"], a["state_in"], heads, keep_states=keep)  # fmt: skip
    return [np.array(t) for t in out if t is not None]


@pytest.mark.parametrize("metal", [False, True], ids=["cuda", "metal"])
@pytest.mark.parametrize("T, keep", [(1, False), (3, True), (3, False), (11, True)])
def test_emulated_folded_conv_kernel_matches_the_reference(metal, T, keep):
    x = _conv_layer_inputs(T, seed=60 + T)
    got = _emulate_conv(x, keep, source=gd._source(metal, keep, conv=True), metal=metal)
    want = _conv_reference(x, keep)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("metal", [False, True], ids=["cuda", "metal"])
def test_emulated_folded_conv_kernel_covers_wide_key_heads(metal):
    """Key heads wider than a threadgroup (Dk 128): their q and k channels' conv inputs are
    written by two value heads' threadgroups, each its share; a lane's 8 columns of a state
    row, two runs of 4, go out as 16-byte stores where they belong (a store that swaps the
    runs is caught)."""
    heads = (1, 128, 2, 16)
    x = _conv_layer_inputs(3, seed=5, heads=heads)
    source = gd._source(metal, True, conv=True)
    want = _conv_reference(x, True, heads=heads)
    got = _emulate_conv(x, True, heads=heads, source=source, metal=metal)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    assert "(dst) + COL(i)" in source
    broken = source.replace("(dst) + COL(i)", "(dst) + COL(i ^ 4)")
    got = _emulate_conv(x, True, heads=heads, source=broken, metal=metal)
    assert not np.allclose(got[1], want[1], rtol=1e-4, atol=1e-5)  # the final state


def test_emulated_folded_conv_equals_the_conv_kernel_then_the_raw_kernel():
    """The folded kernel makes each q, k and v value with the conv kernel's arithmetic: bitwise
    the two launches it replaces."""
    T = 3
    x = _conv_layer_inputs(T, seed=8)
    y, state, states, inputs, window = _emulate_conv(x, keep=True)
    out, conv_inputs, conv_window = _conv(x["qkv"], x["window"], x["conv_w"][..., None])
    q, k, v = np.split(out, [HK * DK, 2 * HK * DK], axis=-1)
    raw = {
        "q": q.reshape(1, T, HK, DK),
        "k": k.reshape(1, T, HK, DK),
        "v": v.reshape(1, T, HV, DV),
    } | {n: x[n] for n in ("a", "bb", "A_log", "dt_bias")}
    want = _emulate({**raw, "state_in": x["state_in"]}, keep=True)  # fmt: skip
    got = [y, state, states, inputs, window]
    for g, w in zip(got, [*want, conv_inputs, conv_window], strict=True):
        assert np.array_equal(g, w)


def test_the_wrapper_hands_the_folded_kernel_float32_conv_weights(monkeypatch):
    """A q/k task reads its conv weights as float4s, so the wrapper must pass a float32 copy
    of bf16 weights (exact), [NC, K] and contiguous. End to end on the CPU: the wrapper's own
    inputs go to the emulated CUDA kernel, whose outputs match the reference's on the same
    bf16 weights (a bf16 array handed on unconverted cannot even reach the emulator)."""
    x = _conv_layer_inputs(3, seed=12)
    w16 = mx.array(x["conv_w"]).astype(mx.bfloat16)
    seen = {}

    def emulated(keep, conv=False, bounds=None):
        spec = gd._spec(False, keep, conv, bounds)

        def kernel(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            seen.update(zip(spec["input_names"], inputs, strict=True))
            arrays = {n: np.array(a) for n, a in zip(spec["input_names"], inputs, strict=True)}
            constants = {k: v for k, v in template if isinstance(v, int)}
            outputs = dict(zip(spec["output_names"], output_shapes, strict=True))
            out = cuda_emulation.run(spec["source"], arrays, outputs, constants, grid, threadgroup)
            return [mx.array(o) for o in out.values()]

        return kernel

    monkeypatch.setattr(gd, "_kernel", emulated)
    a = {n: mx.array(v) for n, v in x.items() if n != "conv_w"}
    args = (a["qkv"], a["window"], w16[..., None], a["a"], a["bb"], a["A_log"], a["dt_bias"],
            a["state_in"], (HK, DK, HV, DV))  # fmt: skip
    got = gd.gated_delta_conv_native(*args, keep_states=True)
    w = seen["conv_w"]
    assert w.dtype == mx.float32 and w.shape == (x["conv_w"].shape[0], 4)
    assert mx.array_equal(w, w16.astype(mx.float32)).item()
    want = gd.gated_delta_conv_ops(*args, keep_states=True)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(np.array(g), np.array(r), rtol=1e-4, atol=1e-5)


def _chained_conv(x: dict, **kw) -> tuple:
    """x's T steps as T one-step launches (``_emulate_conv``'s keywords), each from the last
    one's conv window and state: y, the final state, the states but the last, the window."""
    s, w, ys, kept = x["state_in"], x["window"], [], []
    for t in range(x["qkv"].shape[1]):
        step = {**x, "qkv": x["qkv"][:, t : t + 1], "a": x["a"][:, t : t + 1],
                "bb": x["bb"][:, t : t + 1], "window": w, "state_in": s}  # fmt: skip
        yt, s, _, w = _emulate_conv(step, False, **kw)
        ys.append(yt)
        kept.append(s)
    return np.concatenate(ys, 1), s, np.stack(kept[:-1]), w


def test_emulated_folded_conv_kernel_keeps_chain_parity():
    """T steps in one launch equal T one-step launches, each from the last one's conv window
    and state: outputs, states, and the window after every step (10 steps: two chunks)."""
    T = 10
    x = _conv_layer_inputs(T, seed=9)
    y, final, states, inputs, window = _emulate_conv(x, keep=True)
    cy, cfinal, cstates, cwindow = _chained_conv(x)
    assert np.array_equal(cy, y) and np.array_equal(cfinal, final)
    assert np.array_equal(cstates, states) and np.array_equal(cwindow, window)
    assert np.array_equal(inputs, np.concatenate([x["window"], x["qkv"]], axis=1))


@pytest.mark.parametrize("metal", [False, True], ids=["cuda", "metal"])
@pytest.mark.parametrize("lanes, rows", [(8, 4), (4, 8)])
def test_emulated_folded_conv_kernel_at_fewer_lanes_a_row(monkeypatch, metal, lanes, rows):
    """8 or 4 lanes a state row (4 or 8 rows side by side in a warp; Dk 128, so a lane sums 16
    or 32 columns in 2 or 4 partial sums): the reference's outputs, and T = 3 bitwise three
    one-step launches. Dropping a partial sum is caught."""
    monkeypatch.setattr(gd, "_LANES", lanes)
    heads = (2, 128, 4, 8 * rows)  # a threadgroup's WARPS x R value rows fill Dv
    x = _conv_layer_inputs(3, seed=31, heads=heads)
    source = gd._source(metal, True, conv=True)
    got = _emulate_conv(x, True, heads=heads, source=source, rows=rows, metal=metal)
    want = _conv_reference(x, True, heads=heads)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    one = gd._source(metal, False, conv=True)
    cy, cfinal, cstates, cwindow = _chained_conv(x, heads=heads, source=one, rows=rows,
                                                 metal=metal)  # fmt: skip
    assert np.array_equal(cy, got[0]) and np.array_equal(cfinal, got[1])
    assert np.array_equal(cstates, got[2]) and np.array_equal(cwindow, got[4])
    last = "(p)[1]) + ((p)[2] + (p)[3])" if lanes == 4 else "NA == 2 ? (p)[0] + (p)[1]"
    assert last in source
    broken = source.replace(last, last.replace(" + (p)[3]", "").replace(" + (p)[1]", ""))
    got = _emulate_conv(x, True, heads=heads, source=broken, rows=rows, metal=metal)
    assert not np.allclose(got[1], want[1], rtol=1e-4, atol=1e-5)  # the final state


@pytest.mark.parametrize(
    "old, new, output",
    [
        ("kk_ < CK;", "kk_ < CK - 1;", 0),  # the conv drops its newest input
        ("hv * Dv + dv;", "hv * Dv;", 0),  # every warp convolves the head's first value rows
        ("vw[r][k] = vw[r][k + 1];", ";", 0),  # the value rows' window never slides
        ("if ((j) >= T)", "if ((j) > T)", 4),  # the new window loses its oldest row
        ("(Hk - 1) * Dk + hk * Dk)", "hk * Dk)", 3),  # k's inputs kept over q's
    ],
    ids=["conv_taps", "value_rows", "value_window", "window", "k_inputs"],
)
def test_emulation_catches_a_broken_folded_conv(old, new, output):
    """Each of these mistakes changes the output it touches."""
    x = _conv_layer_inputs(3, seed=12)
    source = gd._source(False, True, conv=True)
    assert old in source
    got = _emulate_conv(x, keep=True, source=source.replace(old, new))[output]
    assert not np.allclose(got, _conv_reference(x, keep=True)[output], rtol=1e-4, atol=1e-5)


WIDE_HEADS = (2, 32, 6, 16)  # 3 value heads a key head, as the 27B's: a block goes wide


@pytest.mark.parametrize("metal", [False, True], ids=["cuda", "metal"])
@pytest.mark.parametrize("T", [3, 11])
def test_emulated_wide_block_is_bitwise_narrow_and_chained(monkeypatch, metal, T):
    """A block goes wide (24 warps, 3 heads of a key head a threadgroup): bitwise the narrow
    launch of the same block, and the one-step launches (narrow) chained; the reference's
    outputs."""
    assert gd._layout(*WIDE_HEADS[::2], WIDE_HEADS[3], T) == {"R": 2, "WARPS": 24, "HPT": 3}
    assert gd._layout(*WIDE_HEADS[::2], WIDE_HEADS[3], 1)["HPT"] == 1
    x = _conv_layer_inputs(T, seed=40 + T, heads=WIDE_HEADS)
    kw = {"heads": WIDE_HEADS, "metal": metal}
    wide = _emulate_conv(x, True, source=gd._source(metal, True, conv=True), **kw)
    for g, w in zip(wide, _conv_reference(x, True, heads=WIDE_HEADS), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    cy, cfinal, cstates, cwindow = _chained_conv(
        x, source=gd._source(metal, False, conv=True), **kw
    )
    assert np.array_equal(cy, wide[0]) and np.array_equal(cfinal, wide[1])
    assert np.array_equal(cstates, wide[2]) and np.array_equal(cwindow, wide[4])
    monkeypatch.setattr(gd, "_WIDE", None)
    narrow = _emulate_conv(x, True, source=gd._source(metal, True, conv=True), **kw)
    assert all(np.array_equal(a, b) for a, b in zip(wide, narrow, strict=True))


@pytest.mark.parametrize(
    "old, new, output",
    [
        ("gb_sh[hg][j][0]", "gb_sh[0][j][0]", 1),  # every head decays as the first
        ("(Hv / Hk / HPT) * per", "(Hv / Hk) * per", 3),  # q/k inputs kept by too few
        ("blockIdx.z * HPT + hg;", "blockIdx.z * HPT;", 0),  # a threadgroup's heads as one
    ],
    ids=["gates", "qk_inputs", "heads"],
)
def test_emulation_catches_a_broken_wide_block(old, new, output):
    """11 steps: a key head's q/k inputs (2 x 32 channels x 14 slots) outnumber a wide
    threadgroup's 768 threads, so its copy loop turns."""
    x = _conv_layer_inputs(11, seed=44, heads=WIDE_HEADS)
    source = gd._source(False, True, conv=True)
    assert old in source
    got = _emulate_conv(x, True, heads=WIDE_HEADS, source=source.replace(old, new))[output]
    want = _conv_reference(x, True, heads=WIDE_HEADS)[output]
    assert not np.allclose(got, want, rtol=1e-4, atol=1e-5)


def _experts(e: int, n: int, k: int, group_size: int, bits: int, seed: int):
    """e experts' quantized weights stacked: w [E, N, K*bits/32], scales and biases [E, N, G]."""
    parts = [random_quantized(n, k, group_size, bits, mx.bfloat16, seed=seed + i) for i in range(e)]
    return [mx.stack(a) for a in zip(*parts, strict=True)]


def _cuda_gathered(x, w, scales, biases, idx, group_size, bits, swiglu=False, source=None,
                   norm_w=None):  # fmt: skip
    """The CUDA gathered product's y [..., KS, N] (x [..., XS, K], idx [..., KS]; x normed
    first by ``norm_w`` [K] where given)."""
    variant = qm.Variant(None if norm_w is None else 1e-6, swiglu=swiglu, gathered=True)
    n_out, groups = qm.launch_shape(w.shape[1] * (2 if swiglu else 1), swiglu)
    idx = np.asarray(idx, np.uint32)
    extra = {} if norm_w is None else {"norm_w": _bits16(norm_w)}
    out = cuda_emulation.run(
        source or qm.source(False, variant),
        {"x": _bits16(x), "ew": np.array(w), "escales": _bits16(scales),
         "ebiases": _bits16(biases), "idx": idx} | extra,
        {"y": (*idx.shape, n_out)},
        {"XT": "__nv_bfloat16", "ST": "__nv_bfloat16", "BITS": bits, "GS": group_size,
         "WARPS": qm.WARPS, "NT": 1},
        grid=(32 * qm.WARPS * groups, idx.size, 1),
        threadgroup=(32 * qm.WARPS, 1, 1),
        header=cuda_emulation.emulated_mma(qm._HEADER_CUDA + qm._HEADER_GATHERED),
        types={"x": "XT", "escales": "ST", "ebiases": "ST", "norm_w": "XT"},
    )  # fmt: skip
    return out["y"]


# Three tokens choosing two experts each of five: expert 3 by all three, 0 by two, 4 and 1 once.
_CHOICES = [[3, 0], [0, 3], [4, 3]]


@pytest.mark.parametrize("bits", qm.BITS)
def test_emulated_cuda_gathered_product_is_each_experts_own_product(bits):
    """The gathered product (a MoE layer's experts, one launch): every (token, slot) row is
    bitwise the plain product of its expert's weights, alone or beside the tokens that share
    the expert; against the dequantized weights in float64; x per token or per slot."""
    n, k, gs = 40, 512, 64
    w, scales, biases = _experts(5, n, k, gs, bits, seed=bits)
    x = mx.random.normal((3, 1, k), key=mx.random.key(1)).astype(mx.bfloat16)  # one per token
    got = _cuda_gathered(x, w, scales, biases, _CHOICES, gs, bits)
    for m, chosen in enumerate(_CHOICES):
        for s, e in enumerate(chosen):
            alone = _cuda_qmm(x[m], w[e], scales[e], biases[e], gs, bits)
            assert np.array_equal(got[m, s], alone[0]), (m, s)
            want = _as_dequantized(x[m], w[e], scales[e], biases[e], gs, bits)
            np.testing.assert_allclose(got[m, s], want[0], rtol=2**-7, atol=1e-3)
    one = _cuda_gathered(x[2:], w, scales, biases, _CHOICES[2:], gs, bits)  # token 2 alone
    assert np.array_equal(one[0], got[2])
    xs = mx.random.normal((3, 2, k), key=mx.random.key(2)).astype(mx.bfloat16)  # one per slot
    per_slot = _cuda_gathered(xs, w, scales, biases, _CHOICES, gs, bits)
    for m, chosen in enumerate(_CHOICES):
        for s, e in enumerate(chosen):
            alone = _cuda_qmm(xs[m, s], w[e], scales[e], biases[e], gs, bits)
            assert np.array_equal(per_slot[m, s], alone[0]), (m, s)


def test_emulated_cuda_gathered_swiglu_and_more_than_eight_rows_of_an_expert():
    """The swiglu variant (the experts' gates, then their ups, stacked) equals the plain swiglu
    product of each expert's gate and up as one weight, row by row; ten rows of one expert
    are made in two blocks of eight and two."""
    n, k, gs, bits = 32, 512, 64, 4
    w, scales, biases = _experts(6, n, k, gs, bits, seed=11)  # gates of experts 0-2, ups
    x = mx.random.normal((5, 2, k), key=mx.random.key(3)).astype(mx.bfloat16)
    idx = [[1, 2]] * 5  # experts 1 and 2 each chosen by all five tokens: 5 rows each
    got = _cuda_gathered(x, w, scales, biases, idx, gs, bits, swiglu=True)
    sw = qm.Variant(swiglu=True)
    for m in range(5):
        for s, e in enumerate(idx[m]):
            both = [mx.concatenate([a[e], a[e + 3]]) for a in (w, scales, biases)]
            alone = _cuda_qmm(x[m, s], *both, gs, bits, variant=sw)
            assert np.array_equal(got[m, s], alone[0]), (m, s)
    want = gathered_matmul_ops(x, w, scales, biases, mx.array(idx, mx.uint32), group_size=gs,
                               bits=bits, swiglu=True)  # fmt: skip
    # The reference dequantizes in float, the kernel to bf16 (as the plain product): close, and
    # far from what a gate and up taken from the wrong experts give.
    want = np.array(want.astype(mx.float32))
    assert np.abs(got - want).max() <= 0.1 * np.abs(want).max()
    wrong = gathered_matmul_ops(x, w, scales, biases, mx.array([[2, 1]] * 5, mx.uint32),
                                group_size=gs, bits=bits, swiglu=True)  # fmt: skip
    assert np.abs(got - np.array(wrong.astype(mx.float32))).max() > 0.3 * np.abs(want).max()
    x10 = mx.random.normal((10, 1, k), key=mx.random.key(4)).astype(mx.bfloat16)
    idx10 = [[0]] * 10
    got10 = _cuda_gathered(x10, w, scales, biases, idx10, gs, bits)
    assert not np.any(np.all(got10 == 0, axis=-1)), "a row left unmade"
    plain = _cuda_qmm(x10[:8, 0], w[0], scales[0], biases[0], gs, bits)
    assert np.array_equal(got10[:8, 0], plain)
    plain = _cuda_qmm(x10[8:, 0], w[0], scales[0], biases[0], gs, bits)
    assert np.array_equal(got10[8:, 0], plain)


@pytest.mark.parametrize("bits", qm.BITS)
def test_emulated_cuda_gathered_product_normalises_its_input(bits):
    """The norm folded into the experts' gate and up product (the norm before a MoE block):
    every (token, slot) row bitwise the plain product's norm and swiglu variant of its
    expert's gate and up, alone or beside the tokens sharing the expert, and near the norm
    then the product in float64. Mutation: the squares of a row summed over one warp only."""
    n, k, gs = 32, 512, 64
    w, scales, biases = _experts(10, n, k, gs, bits, seed=40 + bits)  # gates of 0-4, ups
    x = (mx.random.normal((3, 1, k), key=mx.random.key(41)) * 3).astype(mx.bfloat16)
    nw = mx.random.uniform(0.5, 1.5, (k,), key=mx.random.key(42)).astype(mx.bfloat16)
    got = _cuda_gathered(x, w, scales, biases, _CHOICES, gs, bits, swiglu=True, norm_w=nw)
    both = qm.Variant(1e-6, swiglu=True)
    for m, chosen in enumerate(_CHOICES):
        for s, e in enumerate(chosen):
            gate_up = [mx.concatenate([a[e], a[e + 5]]) for a in (w, scales, biases)]
            alone = _cuda_qmm(x[m], *gate_up, gs, bits, variant=both, norm_w=nw)
            assert np.array_equal(got[m, s], alone[0]), (m, s)
    one = _cuda_gathered(x[2:], w, scales, biases, _CHOICES[2:], gs, bits, swiglu=True,
                         norm_w=nw)  # fmt: skip
    assert np.array_equal(one[0], got[2])
    want = gathered_matmul_ops(x, w, scales, biases, mx.array(_CHOICES, mx.uint32), group_size=gs,
                               bits=bits, swiglu=True, norm_weight=nw)  # fmt: skip
    # the reference dequantizes in float, the kernel to bf16: close (as the swiglu test's)
    want = np.array(want.astype(mx.float32))
    assert np.abs(got - want).max() <= 0.1 * np.abs(want).max()
    text = qm.source(False, qm.Variant(1e-6, swiglu=True, gathered=True))
    mistake = ONE_WARPS_SQUARES
    assert text.count(mistake[0]) == 1
    bad = _cuda_gathered(x, w, scales, biases, _CHOICES, gs, bits, swiglu=True, norm_w=nw,
                         source=text.replace(*mistake))  # fmt: skip
    assert np.abs(bad - got).max() > 1e-2 * np.abs(got).max()


@pytest.mark.parametrize("mistake", [
    ("before % 8 != 0", "before != 0"),  # rows past an expert's first eight never made
    ("(XS == 1 ? 0 : p_g % KS)", "0"),  # every slot reads its token's first x
    ("qm_nth(idx, p0, min(g, M - 1))", "p0"),  # every row reads the first row's x
    ("qm_nth(idx, blockIdx.y, m)", "m"),  # rows stored in the wrong places
])  # fmt: skip
def test_emulation_catches_a_broken_gathered_product(mistake):
    """The gathered product's tests can fail: each mistake changes some row."""
    k, gs, bits = 512, 64, 4
    w, scales, biases = _experts(3, 16, k, gs, bits, seed=21)
    x = mx.random.normal((10, 2, k), key=mx.random.key(5)).astype(mx.bfloat16)
    idx = [[0, 1 + m % 2] for m in range(10)]
    text = qm.source(False, qm.Variant(gathered=True))
    assert text.count(mistake[0]) == 1
    good = _cuda_gathered(x, w, scales, biases, idx, gs, bits)
    bad = _cuda_gathered(x, w, scales, biases, idx, gs, bits, source=text.replace(*mistake))
    assert np.abs(bad - good).max() > 1e-2 * np.abs(good).max()


def test_emulated_metal_gathered_product_matches_the_plain_one():
    """The Metal gathered product, plain, swiglu and with the norm folded in: each (token,
    slot) row bitwise the Metal plain product of its expert, x per token and per slot."""
    n, k, gs, bits = 40, 512, 64, 4
    rng = np.random.default_rng(7)
    parts = [mx.quantize(mx.array(rng.standard_normal((n, k), dtype=np.float32)), group_size=gs,
                         bits=bits) for _ in range(6)]  # fmt: skip
    w, scales, biases = (np.stack([np.array(p[i]) for p in parts]) for i in range(3))
    idx = np.array([[c % 3 for c in row] for row in _CHOICES], np.uint32)
    idx[2, 0] = 1
    nw = rng.uniform(0.5, 1.5, k).astype(np.float32)
    for xs, glu, norm in ((1, False, False), (2, False, False), (2, True, False),
                          (1, True, True)):  # fmt: skip
        x = rng.standard_normal((3, xs, k), dtype=np.float32)
        variant = qm.Variant(1e-6 if norm else None, swiglu=glu, gathered=True)
        n_out, groups = qm.launch_shape(2 * n if glu else n, glu)
        extra = {"norm_w": nw} if norm else {}
        got = cuda_emulation.run(
            qm.source(True, variant),
            {"x": x, "ew": w, "escales": scales, "ebiases": biases, "idx": idx} | extra,
            {"y": (3, 2, n_out)},
            {"XT": "float", "ST": "float", "BITS": bits, "GS": gs, "WARPS": qm.WARPS, "NT": 1},
            grid=(32 * qm.WARPS * groups, idx.size, 1),
            threadgroup=(32 * qm.WARPS, 1, 1),
        )["y"]
        for m in range(3):
            for s, e in enumerate(idx[m]):
                xm = x[m, s if xs == 2 else 0][None]
                if glu:
                    both = [np.concatenate([a[e], a[e + 3]]) for a in (w, scales, biases)]
                    plain = qm.Variant(variant.norm_eps, swiglu=True)
                    alone = _metal_qmm(xm, *both, gs, bits, variant=plain,
                                       norm_w=nw if norm else None)  # fmt: skip
                else:
                    alone = _metal_qmm(xm, w[e], scales[e], biases[e], gs, bits)
                assert np.array_equal(got[m, s], alone[0]), (xs, glu, m, s)
