"""A MoE target's experts through our gathered product (kernels/gathered_matmul.py): the fused
layers equal mlx-lm's, and where the product runs natively (a row-by-row stand-in here) a
verify batches its positions through the routed layers and MTP stays exact. The kernel's own
arithmetic is tested in test_kernel_emulation.py and, on CUDA, in test_cuda.py."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtpcli import kernels, synthetic
from mtpcli.engine.classic import generate_classic
from mtpcli.engine.mtp import generate_mtp
from mtpcli.kernels import gathered_matmul as gm
from mtpcli.kernels import moe_route as mr
from mtpcli.kernels import quantized_matmul as qm
from mtpcli.models.qwen3_5 import Qwen35Target
from mtpcli.options import Options

PROMPT = [(7 * i) % 200 for i in range(40)]
OURS = Options(qmm="ours")  # our products, as on CUDA


def _gathered_rows(x, w, scales, biases, indices, *, group_size, bits, swiglu=False,
                   norm_weight=None, eps=1e-6):  # fmt: skip
    """A correct, row-invariant stand-in for the native gathered kernel: the reference one
    (token, slot) row at a time, x [..., XS, K] and indices [..., KS] as the kernel takes them."""
    ks, xs = indices.shape[-1], x.shape[-2]
    idx, xr = indices.reshape(-1, ks), x.reshape(-1, xs, x.shape[-1])
    rows = [gm.gathered_matmul_ops(xr[t, s if xs > 1 else 0][None, None], w, scales, biases,
                                   idx[t, s][None, None], group_size=group_size, bits=bits,
                                   swiglu=swiglu, norm_weight=norm_weight, eps=eps)[0, 0]
            for t in range(idx.shape[0]) for s in range(ks)]  # fmt: skip
    return mx.stack(rows).reshape(*indices.shape, rows[0].shape[-1])


def _dense_rows(x, w, scales, biases, *, group_size, bits, residual=None, norm_weight=None,
                eps=1e-6, swiglu=False):  # fmt: skip
    """The same for our plain product (routers, shared expert, attention, gated-delta)."""
    if norm_weight is not None:
        x = mx.fast.rms_norm(x, norm_weight, eps)
    rows = x.reshape(-1, x.shape[-1])
    y = mx.concatenate([qm.quantized_matmul_ops(rows[i : i + 1], w, scales, biases,
                                                group_size=group_size, bits=bits, swiglu=swiglu)
                        for i in range(rows.shape[0])])  # fmt: skip
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y if residual is None else residual + y


def _route_rows(logits, experts, k, normalize, shared_slot=False):
    """The same for the routing: the reference a token at a time."""
    rows = logits.reshape(-1, logits.shape[-1])
    out = [mr.route_ops(rows[i : i + 1], experts, k, normalize, shared_slot)
           for i in range(rows.shape[0])]  # fmt: skip
    return [mx.concatenate(part).reshape(*logits.shape[:-1], -1)
            for part in zip(*out, strict=True)]  # fmt: skip


def _combine_rows(y, scores, shared, logits, h):
    """And for the combination."""
    lead = h.shape[:-1]
    parts = [a.reshape(-1, *a.shape[len(lead) :]) for a in (y, scores, shared, logits, h)]
    rows = [mr.combine_ops(*(a[i : i + 1] for a in parts)) for i in range(parts[-1].shape[0])]
    return mx.concatenate(rows).reshape(h.shape)


def _pretend_gpu(monkeypatch, gathered=_gathered_rows):
    for module in (kernels, qm, gm, mr):
        monkeypatch.setattr(module, "backend", lambda: "cuda")
    monkeypatch.setattr(qm, "launch", _dense_rows)
    monkeypatch.setattr(gm, "launch_gathered", gathered)
    monkeypatch.setattr(mr, "route_native", _route_rows)
    monkeypatch.setattr(mr, "combine_native", _combine_rows)
    kernels.reset_verdicts()


def _routed(target: Qwen35Target) -> list[int]:
    return [i for i, ly in enumerate(target.layers) if hasattr(ly.mlp, "switch_mlp")]


def test_fused_experts_equal_mlx_lms_and_keep_its_weights_as_views():
    """On the CPU (mlx-lm's products): the fused MoE layers (experts' gate and up stacked with
    the shared expert's, their down with its down) give the unfused model's hidden states
    bitwise and its tokens; mlx-lm's modules, whose weights are now parts of the stacks, hold
    the weights they held."""
    plain, _ = synthetic.build("tiny-moe", bits=4)
    target, _ = synthetic.build("tiny-moe", bits=4)
    fused = Qwen35Target(target.model, target.config, target.options, fuse=True)
    routed = _routed(fused)
    assert routed and set(routed) <= set(fused.fused_mlp)
    for i in routed:
        got, want = fused.layers[i].mlp, plain.layers[i].mlp
        for module in ("switch_mlp", "shared_expert"):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                a, b = getattr(getattr(got, module), proj), getattr(getattr(want, module), proj)
                for name in ("weight", "scales", "biases"):
                    assert mx.array_equal(a[name], b[name]).item(), (i, module, proj, name)
    ha = plain.prefill(mx.array([PROMPT]), plain.make_cache())
    hb = fused.prefill(mx.array([PROMPT]), fused.make_cache())
    assert mx.array_equal(ha, hb).item()
    want = list(generate_classic(plain, PROMPT, max_tokens=12))
    assert list(generate_classic(fused, PROMPT, max_tokens=12)) == want


def test_the_shared_expert_is_made_in_the_experts_launches(monkeypatch):
    """The shared expert (of the experts' widths) stacked as expert E: a decode step's
    gathered products take k + 1 slots a token from weights of E + 1 experts, the block's norm
    rides in the router's and the gate and up products (no norm of its own), and the tokens
    are the unfused model's. Mutations: the shared slot pointing at expert 0, or the gate and
    up product leaving out the norm, change the block's output."""
    plain, _ = synthetic.build("tiny-moe", bits=4)
    want = list(generate_classic(plain, PROMPT, max_tokens=12))
    seen, normed = [], []

    def gathered(x, w, scales, biases, indices, **kw):
        seen.append((indices.shape[-1], w.shape[0] // (2 if kw.get("swiglu") else 1)))
        if kw.get("swiglu"):
            normed.append(kw.get("norm_weight") is not None)
        return _gathered_rows(x, w, scales, biases, indices, **kw)

    _pretend_gpu(monkeypatch, gathered)
    target, _ = synthetic.build("tiny-moe", bits=4, options=OURS)
    mlp = target.layers[_routed(target)[0]].mlp
    assert list(generate_classic(target, PROMPT, max_tokens=12)) == want
    assert (mlp.top_k + 1, mlp.num_experts + 1) in seen
    assert normed and all(normed)
    i = _routed(target)[0]
    # the block's output on a small residual (the random experts' outputs are ~1e-4)
    h = mx.random.normal((1, 1, target.config.text.hidden_size), key=mx.random.key(3)) * 1e-3
    h = h.astype(mx.bfloat16)
    norm = target.layers[i].post_attention_layernorm
    good = target.fused_mlp[i](h, norm)

    def shared_as_expert_0(logits, experts, k, normalize, shared_slot=False):
        inds, scores = _route_rows(logits, experts, k, normalize, shared_slot)
        return (inds * (mx.arange(inds.shape[-1]) < k) if shared_slot else inds), scores

    monkeypatch.setattr(mr, "route_native", shared_as_expert_0)  # (its check passed above)
    target, _ = synthetic.build("tiny-moe", bits=4, options=OURS)
    bad = target.fused_mlp[i](h, norm)
    assert not mx.array_equal(bad, good).item()

    def norm_left_out(x, w, scales, biases, indices, **kw):
        return _gathered_rows(x, w, scales, biases, indices, **(kw | {"norm_weight": None}))

    monkeypatch.setattr(mr, "route_native", _route_rows)
    monkeypatch.setattr(gm, "launch_gathered", norm_left_out)  # (its check passed above)
    target, _ = synthetic.build("tiny-moe", bits=4, options=OURS)
    assert not mx.array_equal(target.fused_mlp[i](h, norm), good).item()


def test_a_batch_of_requests_through_the_stacked_shared_expert_decodes_each_alone(monkeypatch):
    """Requests decoded together (``engine/batch.py``) through the routed layers on the
    gathered products with the shared expert's slot: each row's tokens are its request's
    alone, with more rows than one tile of the product takes (12: the gathered products see
    12 tokens)."""
    from mtpcli.engine.batch import Batch

    seen = []

    def gathered(x, w, scales, biases, indices, **kw):
        seen.append(indices.size // indices.shape[-1])
        return _gathered_rows(x, w, scales, biases, indices, **kw)

    _pretend_gpu(monkeypatch, gathered)
    target, _ = synthetic.build("tiny-moe", bits=4, options=OURS)
    seen.clear()  # (the self-checks' calls)
    prompts = [PROMPT, [5, 9, 2, 200, 17], [3] * 12] + [[7 + i, 40 + 3 * i] for i in range(9)]
    want = [list(generate_classic(target, p, max_tokens=6)) for p in prompts]
    batch, got = Batch(target), [[] for _ in prompts]
    for i, p in enumerate(prompts):
        batch.add(p, owner=i, max_tokens=6)
    batch.drain(got)
    assert got == want
    assert max(seen) == len(prompts)


def test_routed_layers_batch_a_verify_through_a_row_invariant_gathered_product(monkeypatch):
    """With the gathered product, the routing and the combination native (row-by-row stand-ins),
    their self-checks pass, the routed layers are probed, batched and compiled like any (no
    longer position by position), a verify block's tokens go through them together, and MTP
    equals classic."""
    calls = []

    def gathered(x, w, scales, biases, indices, **kw):
        calls.append(indices.size // indices.shape[-1])
        return _gathered_rows(x, w, scales, biases, indices, **kw)

    _pretend_gpu(monkeypatch, gathered)
    target, drafter = synthetic.build("tiny-moe", bits=4, options=OURS)
    routed = _routed(target)
    assert target.moe_native == set(routed)
    assert not any(target.unprobed[i] for i in routed)
    want = list(generate_classic(target, PROMPT, max_tokens=16))
    calls.clear()
    got = list(generate_mtp(target, drafter, PROMPT, block_size=3, max_tokens=16))
    assert got == want
    assert max(calls) == 3  # a block-3 verify's tokens in one product
    assert {key[1] for key in target.functions.compiled_keys()} >= set(routed)


def test_a_gathered_product_that_is_not_row_invariant_is_refused(monkeypatch):
    """A stand-in whose rows depend on the other tokens fails the self-check (a warning): the
    routed layers then run a verify position by position, and MTP still equals classic."""

    def shifty(x, w, scales, biases, indices, **kw):
        y = _gathered_rows(x, w, scales, biases, indices, **kw)
        tokens = indices.size // indices.shape[-1]
        return y + (tokens > 1) * 0.5  # batched rows differ from the rows alone

    _pretend_gpu(monkeypatch, shifty)
    with pytest.warns(RuntimeWarning, match="gathered_matmul"):
        target, drafter = synthetic.build("tiny-moe", bits=4, options=OURS)
    routed = _routed(target)
    assert target.moe_native == set() and all(target.unprobed[i] for i in routed)
    want = list(generate_classic(target, PROMPT, max_tokens=12))
    assert list(generate_mtp(target, drafter, PROMPT, block_size=3, max_tokens=12)) == want


def test_experts_of_widths_the_kernel_does_not_cover_stay_position_by_position(ckpts, monkeypatch):
    """The test fixture's MoE widths (64) are not a multiple of the kernel's K step (128 at 4
    bits): its products would fall back to MLX's per call, so even with a trusted kernel its
    routed layers are not batched."""
    from pathlib import Path

    from mtpcli.config import load_config
    from mtpcli.models.qwen3_5 import load_target

    _pretend_gpu(monkeypatch)
    path = Path(ckpts.target(moe=True, bits=4))
    config = load_config(path)
    target = Qwen35Target(load_target(path, config).model, config, OURS, fuse=True)
    routed = _routed(target)
    assert routed and target.moe_native == set() and all(target.unprobed[i] for i in routed)


@pytest.mark.skipif(not kernels.available("cuda"), reason="needs MLX's CUDA backend")
def test_cuda_gathered_kernel_passes_its_self_check_and_runs_the_35b_expert_shapes():
    """On CUDA: the variants (plain, swiglu, swiglu with the norm folded in) pass their
    self-check at 4 and 8 bits, and the 35B-A3B's expert products (2048 -> 2 x 512 with
    swiglu, 512 -> 2048) of a block-4 verify agree with the reference, each token's rows
    bitwise its rows alone."""
    for glu, norm in ((False, None), (True, None), (True, 1e-6)):
        for bits in (4, 8):
            verdict = gm._self_check(mx.bfloat16, mx.bfloat16, 64, bits, glu, norm)
            assert verdict is None, (glu, norm, bits, verdict)
    e, h, inter = 256, 2048, 512
    parts = [qm.random_quantized(inter, h, 64, 4, mx.bfloat16, seed=i) for i in range(2 * 16)]
    w, s, b = (mx.concatenate([mx.stack(a)] * (2 * e // 32)) for a in zip(*parts, strict=True))
    x = mx.random.normal((4, 1, h), key=mx.random.key(1)).astype(mx.bfloat16)
    idx = mx.random.permutation(e, key=mx.random.key(2))[:32].reshape(4, 8).astype(mx.uint32)
    idx = mx.concatenate([idx[:, :4], mx.broadcast_to(idx[:1, :4], (4, 4))], axis=1)  # shared
    opts = {"group_size": 64, "bits": 4, "swiglu": True}
    y = gm.gathered_matmul(x, w, s, b, idx, **opts)
    want = gm.gathered_matmul_ops(x, w, s, b, idx, **opts)
    assert mx.allclose(y.astype(mx.float32), want.astype(mx.float32), atol=0.5, rtol=5e-2).item()
    for t in range(4):
        alone = gm.gathered_matmul(x[t : t + 1], w, s, b, idx[t : t + 1], **opts)
        assert mx.array_equal(alone[0], y[t]).item(), t


@pytest.mark.skipif(not kernels.available("cuda"), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("bits", [4, 8])
def test_mtp_equals_classic_on_cuda_with_routed_layers_batched(bits):
    """On CUDA: a MoE target of widths the kernel covers runs its routed layers through the
    gathered product, batched in a verify, and MTP's tokens equal classic's."""
    target, drafter = synthetic.build("tiny-moe", bits=bits)
    routed = _routed(target)
    assert target.moe_native == set(routed)
    for prompt in (PROMPT, [5, 9, 2, 200, 17]):
        want = list(generate_classic(target, prompt, max_tokens=24))
        for block in (2, 3, 4):
            got = list(generate_mtp(target, drafter, prompt, block_size=block, max_tokens=24))
            assert got == want, (bits, block)
