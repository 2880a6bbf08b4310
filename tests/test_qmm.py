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
from mtpcli.kernels import gated_norm as gn
from mtpcli.kernels import quantized_matmul as qm

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
    kernels.set_qmm("mlx")  # mlx's own layers stay (what auto picks off CUDA)
    try:
        default = load_pair(str(path), str(dpath))
        kernels.set_qmm("ours")
        loaded = load_pair(str(path), str(dpath))
    finally:
        kernels.set_qmm(None)
    stock = [type(m) for _, m in default.target.model.named_modules()]
    assert nn.QuantizedLinear in stock and qm.KernelQuantizedLinear not in stock
    target = loaded.target
    quantized = [m for _, m in target.model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    in_drafter = [m for _, m in loaded.drafter.module.named_modules()
                  if isinstance(m, nn.QuantizedLinear)]  # fmt: skip
    assert len(quantized) > 10 and in_drafter
    assert all(type(m) is qm.KernelQuantizedLinear for m in quantized + in_drafter)
    embed = target.embed_tokens
    assert type(embed) is qm.KernelQuantizedEmbedding
    with qm.stock_layers(target.model):
        assert all(type(m) is nn.QuantizedLinear for m in quantized)
        assert type(embed) is nn.QuantizedEmbedding
    assert all(type(m) is qm.KernelQuantizedLinear for m in quantized)
    assert qm.install(target.model) == 0  # idempotent: nothing left to swap


def test_qmm_auto_picks_ours_on_cuda_only(monkeypatch):
    monkeypatch.setitem(kernels._state, "qmm", "auto")
    for backend, want in (("cuda", "ours"), ("metal", "mlx"), ("cpu", "mlx")):
        monkeypatch.setattr(kernels, "backend", lambda b=backend: b)
        assert kernels.qmm() == want
    monkeypatch.setitem(kernels._state, "qmm", "mlx")
    assert kernels.qmm() == "mlx"  # an explicit choice stands


def test_qmm_choice_is_validated():
    from mtpcli.errors import UsageError

    with pytest.raises(UsageError, match="--qmm"):
        kernels.set_qmm("fast")


def _pretend_gpu(monkeypatch, native):
    monkeypatch.setattr(qm, "backend", lambda: "cuda")
    monkeypatch.setattr(kernels, "backend", lambda: "cuda")
    monkeypatch.setattr(qm, "quantized_matmul_native", native)
    monkeypatch.setattr(kernels, "mode", lambda: "auto")


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
    qm.install(layer)
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
    # so the check would refuse it and the count would be the reference path's (session 23).
    monkeypatch.setattr(kernels, "mode", lambda: "native")
    x, w, s, b = _layer_inputs(m=3)
    h = mx.random.normal((1, 3, 40), key=mx.random.key(5)).astype(mx.bfloat16)
    layer = _linear(w, s, b)
    x3 = x.reshape(1, 3, -1)
    mx.eval(x3, h, layer.parameters())  # inputs and weights made: only the product is counted
    dot = io.StringIO()
    mx.export_to_dot(dot, qm.linear_add(layer, x3, h))
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
    y = qm.linear_add(layer, x[:3].reshape(1, 3, -1), h)
    assert calls[-1] is True  # one launch, the residual passed in
    want = h + _reference_rows(x[:3], w, s, b, group_size=64, bits=4).reshape(1, 3, -1)
    assert mx.array_equal(y, want).item()
    monkeypatch.setattr(qm, "FUSE_RESIDUAL", False)
    assert mx.array_equal(qm.linear_add(layer, x[:3].reshape(1, 3, -1), h), want).item()
    assert calls[-1] is False  # the switch: the product, then MLX's add


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
    qm.quantized_matmul(mx.concatenate([x, x[:1]]), w, s, b, **kw)  # 9 rows
    assert calls == [] and not qm.supported(x[:, :960], w, 64, 4)  # nor K % 128 != 0
    qm.quantized_matmul(x[:2], w, s, b, **kw)  # control: a supported product goes native
    assert calls[-1] == (2, 1024)


def _stub_variants(native):
    """A stand-in native kernel that honours every variant option as the real one does (the
    options applied by the reference around ``native``'s product)."""

    def run(x, w, s, b, *, group_size, bits, residual=None, norm_weight=None, eps=1e-6,
            swiglu=False, x_sums=None, next_norm=None, gate=None):  # fmt: skip
        if gate is not None:
            x = gate.apply_flat(x, gn.gated_norm_ops)
        if norm_weight is not None:
            x = mx.fast.rms_norm(x, norm_weight, eps)
        y = native(x, w, s, b, group_size=group_size, bits=bits)
        if x_sums is not None:
            y = qm.finish_norm(y, x_sums, x.shape[-1], eps)
        if swiglu:
            y = qm._swiglu(*mx.split(y, 2, axis=-1))
        y = y if residual is None else residual + y
        return y if next_norm is None else (y, y * next_norm, qm.tile_sums(y))

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
    assert len(calls) == 4  # the variant's self-check (M = 1, 3, 8), then the product
    want = qm.quantized_matmul_ops(x[:3], w, s, b, group_size=64, bits=4, norm_weight=nw,
                                   swiglu=True)  # fmt: skip
    assert y.shape == (3, 20) and mx.array_equal(y, want).item()


def test_a_variant_with_outputs_of_the_wrong_shape_or_number_is_refused(monkeypatch):
    """A swiglu variant that returns both halves, or an add that begins no norm: refused with a
    warning (not an exception), and the options run around the plain product."""

    def native(x, *a, swiglu=False, next_norm=None, **kw):  # ignores swiglu and next_norm
        return _stub_variants(_reference_rows)(x, *a, **kw)

    _pretend_gpu(monkeypatch, native)
    x, w, s, b = _layer_inputs()
    with pytest.warns(RuntimeWarning, match="have the shape"):
        y = qm.quantized_matmul(x[:2], w, s, b, group_size=64, bits=4, swiglu=True)
    assert y.shape == (2, 20)
    h = mx.ones((2, 40), mx.bfloat16)
    next_w = mx.ones((40,), mx.bfloat16)
    with pytest.warns(RuntimeWarning, match="gives 1 outputs, not 3"):
        out = qm._native(x[:2], w, s, b, group_size=64, bits=4, residual=h, next_norm=next_w)
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


def test_fused_projection_switches_put_norm_and_swiglu_apart(monkeypatch):
    calls = []

    def native(x, *a, **kw):
        calls.append((kw.get("norm_weight") is not None, kw.get("swiglu")))
        return _stub_variants(_reference_rows)(x, *a, **kw)

    _pretend_gpu(monkeypatch, native)
    x, w, s, b = _layer_inputs(n=80)
    gate, up = _linear(w[:40], s[:40], b[:40]), _linear(w[40:], s[40:], b[40:])
    norm = nn.RMSNorm(1024, eps=1e-6)
    norm.weight = _norm_weight()
    fused = qm.FusedProjection([gate, up], swiglu=True)
    h = x[:3].reshape(1, 3, -1)
    want = qm._swiglu(gate(norm(h)), up(norm(h)))
    assert mx.array_equal(fused(h, norm), want).item()
    assert calls[-1] == (True, True)
    monkeypatch.setattr(qm, "FUSE_NORM", False)
    monkeypatch.setattr(qm, "FUSE_SWIGLU", False)
    assert mx.array_equal(fused(h, norm), want).item()
    assert calls[-1] == (False, False)
    with pytest.raises(ValueError, match="gate and an up"):
        qm.FusedProjection([gate, up, gate], swiglu=True)


def _norm_pair(monkeypatch, native=None):
    """A residual add (40 -> 1024) and a fused projection after its norm (1024 -> 40 + 40),
    through stand-in native kernels; the calls' options, recorded."""
    calls = []

    def recorded(x, *a, **kw):
        calls.append({k for k, v in kw.items() if v is not None and v is not False})
        return (native or _stub_variants(_reference_rows))(x, *a, **kw)

    _pretend_gpu(monkeypatch, recorded)
    x, w, s, b = _layer_inputs(n=1024, k=1024)
    add = _linear(w, s, b)
    _, w2, s2, b2 = _layer_inputs(n=80, k=1024, seed=3)
    fused = qm.FusedProjection([_linear(w2[:40], s2[:40], b2[:40]),
                                _linear(w2[40:], s2[40:], b2[40:])])  # fmt: skip
    norm = nn.RMSNorm(1024, eps=1e-6)
    norm.weight = _norm_weight()
    inputs = (add, x[:3].reshape(1, 3, -1), mx.random.normal((1, 3, 1024)).astype(mx.bfloat16))
    return calls, inputs, fused, norm


def test_a_residual_add_begins_the_norm_that_the_next_projection_finishes(monkeypatch):
    calls, (add, x, h), fused, norm = _norm_pair(monkeypatch)
    assert not isinstance(qm.linear_add(add, x, h, then=norm), qm.NormBegun)  # off by default
    monkeypatch.setattr(qm, "BEGIN_NORMS", True)
    begun = qm.linear_add(add, x, h, then=norm)
    assert isinstance(begun, qm.NormBegun) and "next_norm" in calls[-1]  # one launch
    assert mx.array_equal(begun.h, qm.linear_add(add, x, h)).item()
    y = fused(begun, norm)
    assert "x_sums" in calls[-1] and "norm_weight" not in calls[-1]  # finished, not redone
    # the variant's reference (its precision against the whole norm: test_kernel_emulation.py)
    want = qm.quantized_matmul_ops(begun.scaled, fused.weight, fused.scales, fused.biases,
                                   group_size=64, bits=4, x_sums=begun.sums)  # fmt: skip
    assert y.shape == (1, 3, 80) and mx.array_equal(y, want).item()
    assert mx.array_equal(begun.scaled, begun.h * norm.weight).item()
    # another norm's projection normalises h itself; the switch turns the beginning off
    other = nn.RMSNorm(1024, eps=1e-6)
    other.weight = other.weight.astype(mx.bfloat16)
    fused(begun, other)
    assert "norm_weight" in calls[-1] and "x_sums" not in calls[-1]
    monkeypatch.setattr(qm, "BEGIN_NORMS", False)
    assert not isinstance(qm.linear_add(add, x, h, then=norm), qm.NormBegun)


def test_a_residual_add_that_begins_a_wrong_norm_is_refused(monkeypatch):
    """A kernel whose h times the weight is wrong fails its check: the add then returns the
    plain sum, and the projection normalises it in its own launch."""

    def native(x, *a, next_norm=None, **kw):
        out = _stub_variants(_reference_rows)(x, *a, next_norm=next_norm, **kw)
        return out if next_norm is None else (out[0], out[0], out[2])  # forgets the weight

    calls, (add, x, h), fused, norm = _norm_pair(monkeypatch, native)
    monkeypatch.setattr(qm, "BEGIN_NORMS", True)
    with pytest.warns(RuntimeWarning, match="quantized_matmul_add_emits kernel disagrees"):
        out = qm.linear_add(add, x, h, then=norm)
    assert not isinstance(out, qm.NormBegun)
    assert mx.array_equal(out, qm.linear_add(add, x, h)).item()
    fused(out, norm)
    assert "norm_weight" in calls[-1]


def _gate(m=3, k=1024, bits=4, offset=8, dtype=mx.bfloat16) -> qm.Gate:
    """A gated-delta layer's norm for x [m, k]: z at column ``offset`` of a wider source, the
    norm's weight over heads of 16 words' values (128 at 4 bits)."""
    source = (mx.random.normal((m, k + 24), key=mx.random.key(90)) * 2).astype(dtype)
    weight = mx.random.uniform(0.5, 1.5, (16 * 32 // bits,), key=mx.random.key(91))
    return qm.Gate(source, offset, weight.astype(dtype), 1e-6)


def test_the_gated_norm_rides_in_the_out_projections_launch(monkeypatch):
    """``linear_add`` with a gate (FUSE_GATE on): one launch takes y, z's source and the norm's
    weight, and gives the residual plus the product of mlx-lm's gated norm. With FUSE_GATE off
    (the default) the norm runs in its own launch (``gated_norm_in_place``) first, the same
    values."""
    calls = []
    monkeypatch.setattr(qm, "FUSE_GATE", True)

    def native(x, *a, **kw):
        calls.append(kw.get("gate"))
        return _stub_variants(_reference_rows)(x, *a, **kw)

    _pretend_gpu(monkeypatch, native)
    x, w, s, b = _layer_inputs(m=3)
    layer, gate = _linear(w, s, b), _gate()
    h = mx.random.normal((3, 40), key=mx.random.key(5)).astype(mx.bfloat16)
    y = qm.linear_add(layer, x.reshape(3, 8, 128), h, gate=gate)  # y: 8 heads of 128
    assert calls[-1] is not None and calls[-1].weight is gate.weight and calls[-1].offset == 8
    normed = gate.apply_flat(x, gn.gated_norm_ops)
    want = h + _reference_rows(normed, w, s, b, group_size=64, bits=4)
    assert mx.array_equal(y, want).item()
    applied = []
    monkeypatch.setattr(qm, "gated_norm_in_place",
                        lambda *a: applied.append(1) or gn.gated_norm_in_place(*a))  # fmt: skip
    monkeypatch.setattr(qm, "FUSE_GATE", False)
    assert mx.array_equal(qm.linear_add(layer, x.reshape(3, 8, 128), h, gate=gate), want).item()
    assert calls[-1] is None and applied == [1]


def test_a_gated_kernel_that_ignores_the_gate_is_refused(monkeypatch):
    """A gated variant that forgets the norm fails its check; the norm then runs in its own
    launch and the product (with the residual) natively, so the values are still right."""
    plain = []
    monkeypatch.setattr(qm, "FUSE_GATE", True)

    def native(x, *a, gate=None, **kw):  # forgets the gate
        if gate is None:
            plain.append(_rows(x))
        return _stub_variants(_reference_rows)(x, *a, **kw)

    _pretend_gpu(monkeypatch, native)
    x, w, s, b = _layer_inputs(m=3)
    layer, gate = _linear(w, s, b), _gate()
    h = mx.random.normal((3, 40), key=mx.random.key(5)).astype(mx.bfloat16)
    with pytest.warns(RuntimeWarning, match="quantized_matmul_gated_add kernel disagrees"):
        y = qm.linear_add(layer, x.reshape(3, 8, 128), h, gate=gate)
    assert plain[-1] == 3
    normed = gate.apply_flat(x, gn.gated_norm_ops)
    want = h + _reference_rows(normed, w, s, b, group_size=64, bits=4)
    assert mx.array_equal(y, want).item()


def test_a_gate_whose_heads_are_not_a_stretch_runs_in_its_own_launch(monkeypatch):
    """The fold needs heads of 16 words' values (128 at 4 bits); heads of 64 take the norm's
    own launch, then the product."""
    calls = []

    def native(x, *a, **kw):
        calls.append(kw.get("gate"))
        return _stub_variants(_reference_rows)(x, *a, **kw)

    _pretend_gpu(monkeypatch, native)
    x, w, s, b = _layer_inputs(m=3)
    g = _gate(bits=8)  # heads of 64
    y = qm.quantized_matmul(x, w, s, b, group_size=64, bits=4, gate=g)
    assert calls and all(c is None for c in calls)
    want = _reference_rows(g.apply_flat(x, gn.gated_norm_ops), w, s, b, group_size=64, bits=4)
    assert mx.array_equal(y, want).item()


def test_every_gated_delta_out_projection_takes_its_norm_in_its_launch(monkeypatch):
    """The "tiny" synthetic model (value heads of 128 at 4 bits, as the 27B's), our product
    native (a row-by-row stand-in), FUSE_GATE on: each gated-delta layer's out projection
    takes its gated norm in its launch, in decode steps and verify blocks, and MTP equals
    classic; with FUSE_GATE off no launch takes a gate and the tokens are the same."""
    from mtpcli import synthetic
    from mtpcli.engine.classic import generate_classic
    from mtpcli.engine.mtp import generate_mtp

    calls = []

    def native(x, *a, **kw):
        calls.append((_rows(x), kw.get("gate") is not None))
        return _stub_variants(_reference_rows)(x, *a, **kw)

    _pretend_gpu(monkeypatch, native)
    monkeypatch.setattr(qm, "FUSE_GATE", True)
    target, drafter = synthetic.build("tiny", bits=4)
    prompt = [(i * 37) % 1000 for i in range(24)]
    want = list(generate_classic(target, prompt, max_tokens=10))
    gated_layers = sum(ly.is_linear for ly in target.layers)
    assert gated_layers == 3 and calls.count((1, True)) >= gated_layers
    calls.clear()
    assert list(generate_mtp(target, drafter, prompt, block_size=3, max_tokens=10)) == want
    assert any(rows > 1 and gated for rows, gated in calls)  # a verify block's
    calls.clear()
    monkeypatch.setattr(qm, "FUSE_GATE", False)
    kernels.changed()
    assert list(generate_classic(target, prompt, max_tokens=10)) == want
    assert calls and not any(gated for _, gated in calls)


LAYOUTS = [(bits, gs, mx.bfloat16) for bits in (4, 8) for gs in (32, 64, 128)]
LAYOUTS += [(4, 64, mx.float16), (8, 64, mx.float16)]


@cuda
@pytest.mark.parametrize("bits,gs,dtype", LAYOUTS)
def test_cuda_kernel_matches_reference_and_rows_are_bitwise_m_invariant(bits, gs, dtype):
    x, w, s, b = _layer_inputs(n=72, k=2048, gs=gs, bits=bits, dtype=dtype, seed=bits + gs)
    kw = {"group_size": gs, "bits": bits}
    full = qm.quantized_matmul_native(x, w, s, b, **kw)
    want = qm.quantized_matmul_ops(x, w, s, b, **kw)
    err = mx.abs(full.astype(mx.float32) - want.astype(mx.float32)).max().item()
    assert err <= 1e-2 * mx.abs(want.astype(mx.float32)).max().item()
    for m in range(1, 9):
        part = qm.quantized_matmul_native(x[:m], w, s, b, **kw)
        assert part.shape == (m, 72) and part.dtype == dtype
        assert mx.array_equal(part, full[:m]).item(), f"M={m}"


@cuda
@pytest.mark.parametrize("bits", qm.BITS)
def test_cuda_kernel_takes_its_rows_in_any_leading_axes_bitwise(bits):
    """x [B, T, K] (as the model passes it, without a reshape) and the options with
    the same leading axes give the bits of the same rows as [B * T, K], for every variant the
    model launches (plain, residual, norm, norm + swiglu, a norm begun or finished, gated),
    in the outputs' [B, T, ...] shape."""
    dtype, kw = mx.bfloat16, {"group_size": 64, "bits": bits}
    x, w, s, b = _layer_inputs(n=144, k=2048, bits=bits, dtype=dtype, seed=61)
    r = (mx.random.normal((8, 144), key=mx.random.key(62)) * 2).astype(dtype)
    src = (mx.random.normal((8, 2048 + 24), key=mx.random.key(63)) * 2).astype(dtype)
    gw = mx.random.uniform(0.5, 1.5, (16 * 32 // bits,), key=mx.random.key(64)).astype(dtype)
    nw, sums = _norm_weight(2048), qm.tile_sums(x)
    variants = {
        "plain": lambda rows: {},
        "residual": lambda rows: {"residual": rows(r)},
        "norm": lambda rows: {"norm_weight": nw},
        "norm swiglu": lambda rows: {"norm_weight": nw, "swiglu": True},
        "sums": lambda rows: {"x_sums": rows(sums)},
        "emits": lambda rows: {"residual": rows(r), "next_norm": nw[:144]},
        "gated": lambda rows: {"residual": rows(r), "gate": qm.Gate(rows(src), 8, gw, 1e-6)},
    }
    for name, opts in variants.items():
        for lead in ((1, 3), (3, 1), (2, 4), (1, 1, 8)):
            m = math.prod(lead)
            flat = qm.quantized_matmul_native(x[:m], w, s, b, **kw, **opts(lambda a, m=m: a[:m]))
            got = qm.quantized_matmul_native(
                x[:m].reshape(*lead, -1), w, s, b, **kw,
                **opts(lambda a, m=m, lead=lead: a[:m].reshape(*lead, -1)),
            )  # fmt: skip
            flat, got = (flat, got) if isinstance(got, tuple) else ((flat,), (got,))
            for f, g in zip(flat, got, strict=True):
                assert g.shape == (*lead, f.shape[-1]), (name, lead)
                assert mx.array_equal(g.reshape(f.shape), f).item(), (name, lead)


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_cuda_residual_variant_is_the_product_plus_mlx_add_bitwise(dtype):
    """h + proj(x) in one launch gives the bits of our product followed by MLX's add, so
    fusing the residual changes no token."""
    x, w, s, b = _layer_inputs(n=72, k=2048, dtype=dtype, seed=21)
    r = (mx.random.normal((8, 72), key=mx.random.key(22)) * 4).astype(dtype)
    kw = {"group_size": 64, "bits": 4}
    assert qm._self_check(dtype, dtype, 64, 4, qm.Variant(residual=True)) is None
    for m in range(1, 9):
        fused = qm.quantized_matmul_native(x[:m], w, s, b, residual=r[:m], **kw)
        plain = qm.quantized_matmul_native(x[:m], w, s, b, **kw)
        assert mx.array_equal(fused, r[:m] + plain).item(), f"M={m}"


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("bits", qm.BITS)
def test_cuda_norm_and_swiglu_variants_pass_their_checks_and_are_row_invariant(dtype, bits):
    """The MLP's launch (norm in, swiglu out) and the input projections' (norm in): near the
    separate ops, and every row of M = 1..8 bitwise the same."""
    x, w, s, b = _layer_inputs(n=144, k=2048, bits=bits, dtype=dtype, seed=31)
    x = x * 3
    nw = (_norm_weight(2048) * 0.2).astype(dtype)  # float16 must hold swiglu of the products
    for swiglu in (False, True):
        assert qm._self_check(dtype, dtype, 64, bits, qm.Variant(1e-6, swiglu)) is None
        kw = {"group_size": 64, "bits": bits, "norm_weight": nw, "swiglu": swiglu}
        full = qm.quantized_matmul_native(x, w, s, b, **kw)
        want = qm.quantized_matmul_ops(x, w, s, b, **kw).astype(mx.float32)
        err = mx.abs(full.astype(mx.float32) - want).max().item()
        assert err <= 2e-2 * mx.abs(want).max().item()
        for m in range(1, 9):
            part = qm.quantized_matmul_native(x[:m], w, s, b, **kw)
            assert part.shape == (m, 72 if swiglu else 144)
            assert mx.array_equal(part, full[:m]).item(), f"M={m} swiglu={swiglu}"


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("bits", qm.BITS)
def test_cuda_norm_split_over_two_launches_is_row_invariant(dtype, bits):
    """The residual add that begins the next norm (h is the residual variant's, bitwise) and
    the products that finish it (plain and swiglu, near the whole norm's ops): every row of
    M = 1..8 bitwise the same, for every output."""
    for variant in (qm.Variant(residual=True, emits=True), qm.Variant(sums_eps=1e-6),
                    qm.Variant(swiglu=True, sums_eps=1e-6)):  # fmt: skip
        assert qm._self_check(dtype, dtype, 64, bits, variant) is None, variant
    x, w, s, b = _layer_inputs(n=2048, k=1024, bits=bits, dtype=dtype, seed=41)
    r = (mx.random.normal((8, 2048), key=mx.random.key(42)) * 2).astype(dtype)
    # 8-bit weights are 16x the 4-bit ones here: a smaller norm weight keeps swiglu's
    # products inside float16 (its reference overflowed to inf on the H200, session 23)
    nw = (_norm_weight(2048) * 0.2 / 2 ** (bits - 4)).astype(dtype)
    kw = {"group_size": 64, "bits": bits, "residual": r}
    h, scaled, sums = qm.quantized_matmul_native(x, w, s, b, next_norm=nw, **kw)
    assert mx.array_equal(h, qm.quantized_matmul_native(x, w, s, b, **kw)).item()
    assert mx.array_equal(scaled, h * nw).item() and sums.shape == (8, 128)
    want_sums = qm.tile_sums(h)
    assert mx.allclose(sums, want_sums, rtol=1e-5).item()
    _, w2, s2, b2 = _layer_inputs(n=144, k=2048, bits=bits, dtype=dtype, seed=43)
    for swiglu in (False, True):
        fin = {"group_size": 64, "bits": bits, "swiglu": swiglu, "eps": 1e-6}
        full = qm.quantized_matmul_native(scaled, w2, s2, b2, x_sums=sums, **fin)
        whole = qm.quantized_matmul_ops(h, w2, s2, b2, group_size=64, bits=bits, norm_weight=nw,
                                        swiglu=swiglu).astype(mx.float32)  # fmt: skip
        err = mx.abs(full.astype(mx.float32) - whole).max().item()
        assert err <= 2e-2 * mx.abs(whole).max().item()
        for m in range(1, 9):
            b_m = qm.quantized_matmul_native(x[:m], w, s, b, next_norm=nw, group_size=64,
                                             bits=bits, residual=r[:m])  # fmt: skip
            for a, c in zip(b_m, (h, scaled, sums), strict=True):
                assert mx.array_equal(a, c[:m]).item(), f"M={m}"
            part = qm.quantized_matmul_native(scaled[:m], w2, s2, b2, x_sums=sums[:m], **fin)
            assert mx.array_equal(part, full[:m]).item(), f"M={m} swiglu={swiglu}"


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("bits", qm.BITS)
def test_cuda_gated_variant_is_the_gated_norm_kernel_then_the_product_bitwise(dtype, bits):
    """The out projection's launch with the gated norm folded in, at the 27B's sizes (y of 48
    heads of 128, z at column 10240 of the fused input projection's 16480 outputs; 96 heads of
    64 at 8 bits): the bits of the gated-norm kernel, then the product and the add, for every
    M = 1..8, and each M's rows those of M = 8."""
    variant = qm.Variant(gate_eps=1e-6, residual=True)
    assert qm._self_check(dtype, dtype, 64, bits, variant, dtype) is None
    x, w, s, b = _layer_inputs(n=5120, k=6144, bits=bits, dtype=dtype, seed=51)
    x = x * 2
    source = (mx.random.normal((8, 16480), key=mx.random.key(52)) * 2).astype(dtype)
    weight = mx.random.uniform(0.5, 1.5, (16 * 32 // bits,), key=mx.random.key(53)).astype(dtype)
    r = (mx.random.normal((8, 5120), key=mx.random.key(54)) * 2).astype(dtype)
    kw = {"group_size": 64, "bits": bits}
    full = None
    for m in (8, *range(1, 8)):
        gate = qm.Gate(source[:m], 10240, weight, 1e-6)
        fused = qm.quantized_matmul_native(x[:m], w, s, b, residual=r[:m], gate=gate, **kw)
        y = x[:m].reshape(1, m, -1)  # the layer's [B, S, Hv * Dv]
        src = qm.Gate(source[:m].reshape(1, m, -1), 10240, weight, 1e-6)
        normed = src.apply_flat(y, gn.gated_norm_native).reshape(m, -1)  # the norm's launch
        apart = qm.quantized_matmul_native(normed, w, s, b, residual=r[:m], **kw)
        assert mx.array_equal(fused, apart).item(), f"M={m}"
        full = fused if m == 8 else full
        assert mx.array_equal(fused, full[:m]).item(), f"M={m}"


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


def test_the_model_begins_each_norm_in_the_add_before_it_and_stays_exact(monkeypatch):
    """With our product native (a row-by-row stand-in here), each layer's out-projection add
    begins the MLP's norm and the MLP's gate/up product finishes it, and each MLP's down add
    begins the next layer's input norm, which that layer's input projections finish: in
    decode steps and in MTP's verify blocks alike, and MTP equals classic. A finish that
    forgets the scaling is refused by its self-check, and the norm runs in the product's loop
    instead."""
    from mtpcli.engine.classic import generate_classic
    from mtpcli.engine.mtp import generate_mtp
    from mtpcli.example import ensure_example
    from mtpcli.loading import load_pair
    from mtpcli.models.qwen3_5 import Qwen35Target

    calls = []

    def native(x, *a, **kw):
        calls.append({k for k in ("next_norm", "x_sums", "norm_weight", "swiglu") if kw.get(k)
                      is not None and kw.get(k) is not False})  # fmt: skip
        return _stub_variants(_reference_rows)(x, *a, **kw)

    _pretend_gpu(monkeypatch, native)
    monkeypatch.setattr(qm, "BEGIN_NORMS", True)  # off by default (see its comment)
    # the built-in example: 4-bit, its widths (128, 384) multiples of our product's K step
    loaded = load_pair(*(str(p) for p in ensure_example()))
    target = Qwen35Target(loaded.target.model, loaded.target.config, fuse=True)
    n = len(target.layers)
    prompt = [(i * 37) % 250 for i in range(40)]
    want = list(generate_classic(target, prompt, max_tokens=16))
    # every layer's two adds but the last layer's down, in its eager pass and its trace
    # (compiled steps call no Python); the inputs of every layer but the first finished
    assert calls.count({"next_norm"}) >= 2 * (2 * n - 1)
    assert calls.count({"x_sums", "swiglu"}) >= 2 * n and calls.count({"x_sums"}) >= 2 * (n - 1)
    assert calls.count({"norm_weight"}) >= 2  # the first layer's input norm, in the loop
    calls.clear()
    assert list(generate_mtp(target, loaded.drafter, prompt, block_size=3, max_tokens=16)) == want
    assert calls.count({"next_norm"}) > 0 and calls.count({"x_sums"}) > 0

    def unscaled(x, *a, x_sums=None, **kw):  # the norm begun, never finished
        return _stub_variants(_reference_rows)(x, *a, **kw)

    kernels.reset_verdicts()
    monkeypatch.setattr(qm, "quantized_matmul_native", unscaled)
    with pytest.warns(RuntimeWarning, match=r"quantized_matmul_sums\w* kernel disagrees"):
        list(generate_classic(target, prompt, max_tokens=4))
