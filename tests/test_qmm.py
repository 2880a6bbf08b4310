"""The quantized-matmul kernel: its routing into every quantized layer, the self-check that keeps
a wrong or row-variant kernel from being used (on any machine, with fakes), and on CUDA the
kernel itself against MLX's reference, row by row."""

from __future__ import annotations

import io
import math
import re

import mlx.core as mx
import mlx.nn as nn
import pytest

from mtpcli import kernels
from mtpcli.kernels import qmm_kernel as qmk
from mtpcli.kernels import quantized_matmul as qm
from mtpcli.models import quantized_layers as ql
from mtpcli.options import Options

cuda = pytest.mark.skipif(not kernels.available("cuda"), reason="needs MLX's CUDA backend")


@pytest.fixture(autouse=True)
def fresh_verdicts():
    kernels.reset_verdicts()
    yield
    kernels.reset_verdicts()


def _layer_inputs(n=40, k=1024, gs=64, bits=4, dtype=mx.bfloat16, m=8, seed=0):
    w, scales, biases = qm.random_quantized(n, k, gs, bits, dtype, seed=seed)
    x = mx.random.normal((m, k), key=mx.random.key(seed + 1)).astype(dtype)
    return x, w, scales, biases


def test_install_routes_every_quantized_layer_and_stock_layers_restores(ckpts):
    from mtpcli.loading import load_pair

    path, dpath = ckpts.target(bits=4), ckpts.drafter(bits=4, predictable=None, seed=5)
    default = load_pair(str(path), str(dpath), options=Options(qmm="mlx"))  # auto off CUDA
    loaded = load_pair(str(path), str(dpath), options=Options(qmm="ours", kernels="ops"))
    stock = [type(m) for _, m in default.target.model.named_modules()]
    assert nn.QuantizedLinear in stock and ql.KernelQuantizedLinear not in stock
    target = loaded.target
    quantized = [m for _, m in target.model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    in_drafter = [m for _, m in loaded.drafter.module.named_modules()
                  if isinstance(m, nn.QuantizedLinear)]  # fmt: skip
    assert len(quantized) > 10 and in_drafter
    assert all(type(m) is ql.KernelQuantizedLinear for m in quantized + in_drafter)
    embed = target.embed_tokens
    assert type(embed) is ql.KernelQuantizedEmbedding
    with ql.stock_layers(target.model):
        assert all(type(m) is nn.QuantizedLinear for m in quantized)
        assert type(embed) is nn.QuantizedEmbedding
    assert all(type(m) is ql.KernelQuantizedLinear for m in quantized)
    assert {m.kernel_mode for m in quantized + in_drafter} == {"ops"}  # the options' mode
    assert ql.install(target.model) == 0  # idempotent: nothing left to swap


def test_qmm_auto_picks_ours_on_cuda_only(monkeypatch):
    from mtpcli import options

    for backend, want in (("cuda", True), ("metal", False), ("cpu", False)):
        monkeypatch.setattr(options, "backend", lambda b=backend: b)
        assert Options().ours is want
        assert Options(qmm="mlx").ours is False and Options(qmm="ours").ours is True


def test_options_are_validated_once_when_made():
    from mtpcli.errors import UsageError

    for bad, name in (
        ({"qmm": "fast"}, "qmm"),
        ({"kernels": "fast"}, "kernels"),
        ({"submit_every": -1}, "submit_every"),
        ({"compile": "on"}, "compile"),
        ({"graph": 1}, "graph"),
    ):
        with pytest.raises(UsageError, match=f"^{name} must"):  # the API's name (the CLI's flag)
            Options(**bad)


def _pretend_gpu(monkeypatch, native):
    monkeypatch.setattr(qm, "backend", lambda: "cuda")
    monkeypatch.setattr(kernels, "backend", lambda: "cuda")
    monkeypatch.setattr(qm, "launch", native)


def _rows(x) -> int:
    """x [..., K]'s rows, as a native product counts them: its leading axes."""
    return math.prod(x.shape[:-1])


def _reference_rows(x, w, scales, biases, **kw):
    # A correct, row-invariant stand-in for a native kernel: the reference one row at a time,
    # x [..., K] with its leading axes as rows, as the kernel takes it.
    rows = x.reshape(-1, x.shape[-1])
    y = mx.concatenate([qm.quantized_matmul_ops(rows[i : i + 1], w, scales, biases, **kw)
                        for i in range(rows.shape[0])])  # fmt: skip
    return y.reshape(*x.shape[:-1], y.shape[-1])


def test_a_kernel_whose_later_tiles_drift_is_refused(monkeypatch):
    """Rows past the first tile of 8 a hair off (within the reference's tolerance, and alike
    in every launch of more than 8 rows, so every prefix agrees): a request alone would not
    get the bits it gets in a batch, and the self-check refuses the kernel."""

    def drifting(x, w, scales, biases, **kw):
        y = _reference_rows(x, w, scales, biases, **kw)
        if _rows(x) <= qmk.TILE_ROWS:
            return y
        scale = mx.where(mx.arange(_rows(x)) >= qmk.TILE_ROWS, 1 + 2**-6, 1.0)[:, None]
        return (y.astype(mx.float32) * scale).astype(y.dtype)

    _pretend_gpu(monkeypatch, drifting)
    problem = qm._self_check(mx.bfloat16, mx.bfloat16, 64, 4)
    assert problem is not None and "alone differs" in problem
    _pretend_gpu(monkeypatch, _reference_rows)
    assert qm._self_check(mx.bfloat16, mx.bfloat16, 64, 4) is None


def test_a_correct_row_invariant_kernel_is_trusted_and_used(monkeypatch):
    calls = []

    def native(x, *a, **kw):
        calls.append(x.shape[:-1])
        return _reference_rows(x, *a, **kw)

    _pretend_gpu(monkeypatch, native)
    x, w, s, b = _layer_inputs()
    y = qm.quantized_matmul(x[:3].reshape(1, 3, -1), w, s, b, group_size=64, bits=4)
    assert y.shape == (1, 3, 40)
    assert calls[-1] == (1, 3)  # the product itself went native, after the self-check's calls
    want = _reference_rows(x[:3], w, s, b, group_size=64, bits=4)
    assert mx.array_equal(y[0], want).item()


def test_a_wrong_kernel_is_refused_with_a_warning(monkeypatch):
    def native(x, *a, **kw):
        return _reference_rows(x, *a, **kw) * 1.5

    _pretend_gpu(monkeypatch, native)
    x, w, s, b = _layer_inputs()
    with pytest.warns(RuntimeWarning, match="quantized_matmul kernel disagrees"):
        y = qm.quantized_matmul(x[:2], w, s, b, group_size=64, bits=4)
    assert mx.array_equal(y, qm.quantized_matmul_ops(x[:2], w, s, b, group_size=64, bits=4)).item()


def test_a_kernel_whose_rows_depend_on_m_is_refused(monkeypatch):
    # Close to the reference (it would pass a tolerance check) but the rows change with M:
    # exactly what would break MTP == classic.
    def native(x, *a, **kw):
        y = _reference_rows(x, *a, **kw)
        return (y.astype(mx.float32) * (1 + 1e-2 * (_rows(x) > 1))).astype(y.dtype)

    _pretend_gpu(monkeypatch, native)
    x, w, s, b = _layer_inputs()
    with pytest.warns(RuntimeWarning, match="rows of"):
        qm.quantized_matmul(x[:1], w, s, b, group_size=64, bits=4)


def _with_residual(native):
    """A stand-in native kernel that honours ``residual`` as the real one does."""

    def run(x, *a, residual=None, **kw):
        y = native(x, *a, **kw)
        return y if residual is None else residual + y

    return run


def _linear(w, s, b) -> nn.QuantizedLinear:
    layer = nn.QuantizedLinear(w.shape[1] * 8, w.shape[0], bias=False, group_size=64, bits=4)
    layer.weight, layer.scales, layer.biases = w, s, b
    ql.install(layer)
    return layer


def test_the_product_adds_no_graph_nodes_around_its_launch(monkeypatch):
    """x [1, 3, K] and its residual go to the native launch as they are: the graph is the
    launch's node and nothing else (MLX builds and encodes every node, a reshape included;
    b2c47b9 took 530 of them off a 27B decode step)."""

    def native(x, w, scales, biases, *, group_size, bits, residual=None, **_):
        y = mx.quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits)
        return y if residual is None else mx.add(residual, y)

    _pretend_gpu(monkeypatch, native)
    # The stand-in taken without its self-check: on CUDA MLX's product is not row-invariant,
    # so the check would refuse it and the count would be the reference path's.
    x, w, s, b = _layer_inputs(m=3)
    h = mx.random.normal((1, 3, 40), key=mx.random.key(5)).astype(mx.bfloat16)
    layer = _linear(w, s, b)
    layer.kernel_mode = "native"
    x3 = x.reshape(1, 3, -1)
    mx.eval(x3, h, layer.parameters())  # inputs and weights made: only the product is counted
    dot = io.StringIO()
    mx.export_to_dot(dot, ql.linear_add(layer, x3, h))
    assert sorted(re.findall(r'label ="([^"]+)"', dot.getvalue())) == ["Add", "QuantizedMatmul"]


def test_linear_add_lets_the_product_add_the_residual(monkeypatch):
    calls = []

    def native(x, *a, **kw):
        calls.append(kw.get("residual") is not None)
        return _with_residual(_reference_rows)(x, *a, **kw)

    _pretend_gpu(monkeypatch, native)
    x, w, s, b = _layer_inputs()
    layer = _linear(w, s, b)
    h = mx.random.normal((1, 3, 40), key=mx.random.key(5)).astype(mx.bfloat16)
    y = ql.linear_add(layer, x[:3].reshape(1, 3, -1), h)
    assert calls[-1] is True  # one launch, the residual passed in
    want = h + _reference_rows(x[:3], w, s, b, group_size=64, bits=4).reshape(1, 3, -1)
    assert mx.array_equal(y, want).item()
    layer.kernel_mode = "ops"  # the reference: MLX's product, then its add
    assert mx.array_equal(ql.linear_add(layer, x[:3].reshape(1, 3, -1), h), want).item()
    assert len(calls) == 9  # the residual variant's self-check (5 counts, 3 rows alone), then it


def test_a_residual_kernel_that_drops_the_residual_is_refused(monkeypatch):
    _pretend_gpu(monkeypatch, lambda x, *a, residual=None, **kw: _reference_rows(x, *a, **kw))
    x, w, s, b = _layer_inputs()
    h = mx.ones((2, 40), mx.bfloat16)
    with pytest.warns(RuntimeWarning, match="quantized_matmul_add kernel disagrees"):
        y = qm.quantized_matmul(x[:2], w, s, b, group_size=64, bits=4, residual=h)
    want = h + qm.quantized_matmul_ops(x[:2], w, s, b, group_size=64, bits=4)
    assert mx.array_equal(y, want).item()


def test_unsupported_layouts_and_row_counts_take_the_reference(monkeypatch):
    calls = []

    def native(x, *a, **kw):
        calls.append(x.shape)
        return _reference_rows(x, *a, **kw)

    _pretend_gpu(monkeypatch, native)
    x, w, s, b = _layer_inputs(k=1024)
    kw = {"group_size": 64, "bits": 4}
    qm.quantized_matmul(x[:3].astype(mx.float32), w, s, b, **kw)  # f32 activations
    qm.quantized_matmul(mx.concatenate([x] * 4 + [x[:1]]), w, s, b, **kw)  # 33 rows
    assert calls == [] and not qm.supported(x[:, :960], w, 64, 4)  # nor K % 128 != 0
    qm.quantized_matmul(x[:2], w, s, b, **kw)  # control: a supported product goes native
    assert calls[-1] == (2, 1024)


def _stub_variants(native):
    """A stand-in native kernel that honours every variant option as the real one does (the
    options applied by the reference around ``native``'s product)."""

    def run(x, w, s, b, *, group_size, bits, residual=None, norm_weight=None, eps=1e-6,
            swiglu=False):  # fmt: skip
        if norm_weight is not None:
            x = mx.fast.rms_norm(x, norm_weight, eps)
        y = native(x, w, s, b, group_size=group_size, bits=bits)
        if swiglu:
            y = qm._swiglu(*mx.split(y, 2, axis=-1))
        return y if residual is None else residual + y

    return run


def _norm_weight(k=1024):
    return mx.random.uniform(0.5, 1.5, (k,), key=mx.random.key(77)).astype(mx.bfloat16)


def test_norm_and_swiglu_ride_in_one_launch(monkeypatch):
    calls = []

    def native(x, *a, **kw):
        calls.append(kw)
        return _stub_variants(_reference_rows)(x, *a, **kw)

    _pretend_gpu(monkeypatch, native)
    x, w, s, b = _layer_inputs()
    nw = _norm_weight()
    y = qm.quantized_matmul(x[:3], w, s, b, group_size=64, bits=4, norm_weight=nw, swiglu=True)
    assert calls[-1]["swiglu"] is True and calls[-1]["norm_weight"] is nw  # one launch
    assert len(calls) == 9  # the variant's self-check (5 counts, 3 rows alone), then the product
    want = qm.quantized_matmul_ops(x[:3], w, s, b, group_size=64, bits=4, norm_weight=nw,
                                   swiglu=True)  # fmt: skip
    assert y.shape == (3, 20) and mx.array_equal(y, want).item()


def test_a_variant_with_outputs_of_the_wrong_shape_or_number_is_refused(monkeypatch):
    """A swiglu variant that returns both halves, or a kernel that returns a tuple: refused
    with a warning (not an exception), and the options run around the plain product."""

    def native(x, *a, swiglu=False, **kw):  # ignores swiglu
        return _stub_variants(_reference_rows)(x, *a, **kw)

    _pretend_gpu(monkeypatch, native)
    x, w, s, b = _layer_inputs()
    with pytest.warns(RuntimeWarning, match="have the shape"):
        y = qm.quantized_matmul(x[:2], w, s, b, group_size=64, bits=4, swiglu=True)
    assert y.shape == (2, 20)
    kernels.reset_verdicts()
    monkeypatch.setattr(qm, "launch", lambda x, *a, **kw: (_reference_rows(x, *a, **kw),) * 2)
    with pytest.warns(RuntimeWarning, match="gives tuple, not one array"):
        out = qm._native(x[:2], w, s, b, group_size=64, bits=4, mode="auto")
    assert out is None


def test_a_variant_that_fails_its_check_runs_as_separate_ops_around_the_product(monkeypatch):
    """A norm variant that ignores the norm is refused; the norm then runs as MLX's op before
    the plain product, which still runs natively (its own check passed)."""
    plain_calls = []

    def native(x, *a, norm_weight=None, **kw):  # forgets the norm
        if norm_weight is None:
            plain_calls.append(_rows(x))
        return _stub_variants(_reference_rows)(x, *a, **kw)

    _pretend_gpu(monkeypatch, native)
    x, w, s, b = _layer_inputs()
    nw = _norm_weight()
    with pytest.warns(RuntimeWarning, match="quantized_matmul_norm kernel disagrees"):
        y = qm.quantized_matmul(x[:2], w, s, b, group_size=64, bits=4, norm_weight=nw)
    assert plain_calls[-1] == 2  # the product after the norm: native
    want = _reference_rows(mx.fast.rms_norm(x[:2], nw, 1e-6), w, s, b, group_size=64, bits=4)
    assert mx.array_equal(y, want).item()


def test_a_norm_weight_of_another_dtype_is_applied_before_the_product(monkeypatch):
    calls = []

    def native(x, *a, **kw):
        calls.append(kw.get("norm_weight") is not None)
        return _stub_variants(_reference_rows)(x, *a, **kw)

    _pretend_gpu(monkeypatch, native)
    x, w, s, b = _layer_inputs()
    nw = _norm_weight().astype(mx.float32)  # not x's dtype: the kernel reads x's
    y = qm.quantized_matmul(x[:2], w, s, b, group_size=64, bits=4, norm_weight=nw)
    assert not any(calls)  # (the normed x is float32 here: MLX's product takes it)
    normed = mx.fast.rms_norm(x[:2], nw, 1e-6)
    assert mx.array_equal(y, qm.quantized_matmul_ops(normed, w, s, b, group_size=64, bits=4)).item()


def test_fused_projection_takes_its_norm_and_makes_its_swiglu_in_one_launch(monkeypatch):
    calls = []

    def native(x, *a, **kw):
        calls.append((kw.get("norm_weight") is not None, kw.get("swiglu")))
        return _stub_variants(_reference_rows)(x, *a, **kw)

    _pretend_gpu(monkeypatch, native)
    x, w, s, b = _layer_inputs(n=80)
    gate, up = _linear(w[:40], s[:40], b[:40]), _linear(w[40:], s[40:], b[40:])
    norm = nn.RMSNorm(1024, eps=1e-6)
    norm.weight = _norm_weight()
    fused = ql.FusedProjection([gate, up], swiglu=True)
    h = x[:3].reshape(1, 3, -1)
    want = qm._swiglu(gate(norm(h)), up(norm(h)))
    assert mx.array_equal(fused(h, norm), want).item()
    assert calls[-1] == (True, True)  # the norm and swiglu in the product's launch
    with pytest.raises(ValueError, match="gate and an up"):
        ql.FusedProjection([gate, up, gate], swiglu=True)


LAYOUTS = [(bits, gs, mx.bfloat16) for bits in (4, 8) for gs in (32, 64, 128)]
LAYOUTS += [(4, 64, mx.float16), (8, 64, mx.float16)]


@cuda
@pytest.mark.parametrize("bits,gs,dtype", LAYOUTS)
def test_cuda_kernel_matches_reference_and_rows_are_bitwise_m_invariant(bits, gs, dtype):
    x, w, s, b = _layer_inputs(n=72, k=2048, gs=gs, bits=bits, dtype=dtype, seed=bits + gs)
    kw = {"group_size": gs, "bits": bits}
    full = qmk.launch(x, w, s, b, **kw)
    want = qm.quantized_matmul_ops(x, w, s, b, **kw)
    err = mx.abs(full.astype(mx.float32) - want.astype(mx.float32)).max().item()
    assert err <= 1e-2 * mx.abs(want.astype(mx.float32)).max().item()
    for m in range(1, 9):
        part = qmk.launch(x[:m], w, s, b, **kw)
        assert part.shape == (m, 72) and part.dtype == dtype
        assert mx.array_equal(part, full[:m]).item(), f"M={m}"


@cuda
@pytest.mark.parametrize("bits", qmk.BITS)
def test_cuda_kernel_takes_its_rows_in_any_leading_axes_bitwise(bits):
    """x [B, T, K] (as the model passes it, without a reshape) and the options with
    the same leading axes give the bits of the same rows as [B * T, K], for every variant the
    model launches (plain, residual, norm, norm + swiglu), in the outputs' [B, T, ...] shape."""
    dtype, kw = mx.bfloat16, {"group_size": 64, "bits": bits}
    x, w, s, b = _layer_inputs(n=144, k=2048, bits=bits, dtype=dtype, seed=61)
    r = (mx.random.normal((8, 144), key=mx.random.key(62)) * 2).astype(dtype)
    nw = _norm_weight(2048)
    variants = {
        "plain": lambda rows: {},
        "residual": lambda rows: {"residual": rows(r)},
        "norm": lambda rows: {"norm_weight": nw},
        "norm swiglu": lambda rows: {"norm_weight": nw, "swiglu": True},
    }
    for name, opts in variants.items():
        for lead in ((1, 3), (3, 1), (2, 4), (1, 1, 8)):
            m = math.prod(lead)
            flat = qmk.launch(x[:m], w, s, b, **kw, **opts(lambda a, m=m: a[:m]))
            got = qmk.launch(
                x[:m].reshape(*lead, -1), w, s, b, **kw,
                **opts(lambda a, m=m, lead=lead: a[:m].reshape(*lead, -1)),
            )  # fmt: skip
            assert got.shape == (*lead, flat.shape[-1]), (name, lead)
            assert mx.array_equal(got.reshape(flat.shape), flat).item(), (name, lead)


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_cuda_residual_variant_is_the_product_plus_mlx_add_bitwise(dtype):
    """h + proj(x) in one launch gives the bits of our product followed by MLX's add, so
    fusing the residual changes no token."""
    x, w, s, b = _layer_inputs(n=72, k=2048, dtype=dtype, seed=21)
    r = (mx.random.normal((8, 72), key=mx.random.key(22)) * 4).astype(dtype)
    kw = {"group_size": 64, "bits": 4}
    assert qm._self_check(dtype, dtype, 64, 4, qmk.Variant(residual=True)) is None
    for m in range(1, 9):
        fused = qmk.launch(x[:m], w, s, b, residual=r[:m], **kw)
        plain = qmk.launch(x[:m], w, s, b, **kw)
        assert mx.array_equal(fused, r[:m] + plain).item(), f"M={m}"


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("bits", qmk.BITS)
def test_cuda_norm_and_swiglu_variants_pass_their_checks_and_are_row_invariant(dtype, bits):
    """The MLP's launch (norm in, swiglu out) and the input projections' (norm in): near the
    separate ops, and every row of M = 1..8 bitwise the same."""
    x, w, s, b = _layer_inputs(n=144, k=2048, bits=bits, dtype=dtype, seed=31)
    x = x * 3
    nw = (_norm_weight(2048) * 0.2).astype(dtype)  # float16 must hold swiglu of the products
    for swiglu in (False, True):
        assert qm._self_check(dtype, dtype, 64, bits, qmk.Variant(1e-6, swiglu)) is None
        kw = {"group_size": 64, "bits": bits, "norm_weight": nw, "swiglu": swiglu}
        full = qmk.launch(x, w, s, b, **kw)
        want = qm.quantized_matmul_ops(x, w, s, b, **kw).astype(mx.float32)
        err = mx.abs(full.astype(mx.float32) - want).max().item()
        assert err <= 2e-2 * mx.abs(want).max().item()
        for m in range(1, 9):
            part = qmk.launch(x[:m], w, s, b, **kw)
            assert part.shape == (m, 72 if swiglu else 144)
            assert mx.array_equal(part, full[:m]).item(), f"M={m} swiglu={swiglu}"


@cuda
def test_cuda_kernel_passes_its_self_check_and_the_head_shape_runs():
    for bits in (4, 8):
        assert qm._self_check(mx.bfloat16, mx.bfloat16, 64, bits) is None
    x, w, s, b = _layer_inputs(n=248320 // 64, k=5120, m=3)
    y = qm.quantized_matmul(x, w, s, b, group_size=64, bits=4)
    want = qm.quantized_matmul_ops(x, w, s, b, group_size=64, bits=4)
    assert mx.allclose(y.astype(mx.float32), want.astype(mx.float32), atol=0.5, rtol=2e-2).item()


def test_fused_projections_equal_the_separate_ones_and_share_their_weights(ckpts):
    from pathlib import Path

    from mtpcli.config import load_config
    from mtpcli.engine.classic import generate_classic
    from mtpcli.models.qwen3_5 import Qwen35Target, load_target

    path = Path(ckpts.target(bits=4))
    config = load_config(path)
    plain = Qwen35Target(load_target(path, config).model, config, fuse=False)
    assert not plain.fused_in
    fused = Qwen35Target(load_target(path, config).model, config, fuse=True)
    # every layer's input projections (gated-delta and attention) and every MLP
    assert len(fused.fused_in) == len(fused.fused_mlp) == len(fused.layers)
    assert {ly.is_linear for ly in fused.layers} == {True, False}
    for i, layer in enumerate(fused.layers):  # a sibling's rows of the fused weight are its own
        proj = fused.fused_in[i]
        first, second = (
            (layer.linear_attn.in_proj_qkv, layer.linear_attn.in_proj_z)
            if layer.is_linear
            else (layer.self_attn.q_proj, layer.self_attn.k_proj)
        )
        rows = proj["weight"][first.weight.shape[0] :][: second.weight.shape[0]]
        assert mx.array_equal(rows, second.weight).item()
    for prompt in ([3, 1, 4, 1, 5], [(7 * i) % 200 for i in range(40)]):
        ca, cb = plain.make_cache(), fused.make_cache()
        ha, hb = plain.prefill(mx.array([prompt]), ca), fused.prefill(mx.array([prompt]), cb)
        assert mx.array_equal(ha, hb).item()
        want = list(generate_classic(plain, prompt, max_tokens=12))
        assert list(generate_classic(fused, prompt, max_tokens=12)) == want


@pytest.mark.skipif(kernels.available("cuda"), reason="a stand-in for the GPU product; on CUDA "
                    "the real one runs through the model in test_cuda.py")  # fmt: skip
def test_the_model_runs_its_products_fused_in_decode_and_verify_and_stays_exact(monkeypatch):
    """With our product native (a row-by-row stand-in here), the model's input norms ride in
    the fused input projections, each MLP's norm and swiglu in its gate/up product, and each
    out and down projection adds its residual in its launch: in decode steps and in MTP's
    verify blocks alike, and MTP equals classic. A residual variant that drops the residual is
    refused by its self-check, and the add runs as MLX's op, still exact."""
    from mtpcli.engine.classic import generate_classic
    from mtpcli.engine.mtp import generate_mtp
    from mtpcli.example import ensure_example
    from mtpcli.loading import load_pair
    from mtpcli.models.qwen3_5 import Qwen35Target

    calls = []

    def native(x, *a, **kw):
        calls.append(({k for k in ("residual", "norm_weight", "swiglu") if kw.get(k) is not None
                       and kw.get(k) is not False}, math.prod(x.shape[:-1])))  # fmt: skip
        return _stub_variants(_reference_rows)(x, *a, **kw)

    _pretend_gpu(monkeypatch, native)
    # the built-in example: 4-bit, its widths (128, 384) multiples of our product's K step
    loaded = load_pair(*(str(p) for p in ensure_example()), options=Options(qmm="ours"))
    target = Qwen35Target(loaded.target.model, loaded.target.config, loaded.options, fuse=True)
    n = len(target.layers)
    prompt = [(i * 37) % 250 for i in range(40)]
    want = list(generate_classic(target, prompt, max_tokens=16))
    kinds = [k for k, _ in calls]
    # every layer's input projections and MLP gate/up, out/o and down projections, in the
    # eager pass and the trace (compiled steps call no Python)
    assert kinds.count({"norm_weight"}) >= 2 * n
    assert kinds.count({"norm_weight", "swiglu"}) >= 2 * n
    assert kinds.count({"residual"}) >= 2 * 2 * n
    calls.clear()
    assert list(generate_mtp(target, loaded.drafter, prompt, block_size=3, max_tokens=16)) == want
    assert any(kind == {"residual"} and rows == 3 for kind, rows in calls)  # a verify block's

    def dropped(x, *a, residual=None, **kw):  # the residual never added
        return _stub_variants(_reference_rows)(x, *a, **kw)

    kernels.reset_verdicts()
    monkeypatch.setattr(qm, "launch", dropped)
    fresh = Qwen35Target(loaded.target.model, loaded.target.config, loaded.options, fuse=True)
    with pytest.warns(RuntimeWarning, match=r"quantized_matmul\w*_add kernel disagrees"):
        got = list(generate_classic(fresh, prompt, max_tokens=16))
    assert got == want
