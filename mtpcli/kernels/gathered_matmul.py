"""A mixture-of-experts layer's expert products: each token's selected experts, one launch.

MLX's ``gather_qmm`` runs a token's experts as one product per (token, expert) pair, and which
pairs it batches together depends on the other tokens, so a verify's rows need not equal the
decode rows. Here each (token, slot) pair is a row of our quantized product
(``qmm_kernel.py``): the rows that chose one expert share one read of its weights, and every row
is computed by the same instructions whichever rows share its expert, so a verify batches its
positions through the routed layers and stays exact. The self-check confirms both on the
running GPU before the kernel is trusted.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.activations import swiglu as _swiglu

from . import backend, product_verdict, use_native
from .qmm_kernel import BITS, GROUP_SIZES, MAX_ROWS, launch_gathered
from .quantized_matmul import ALONE, alone_verdict, fits, random_quantized


def gathered_matmul_ops(
    x, w, scales, biases, indices, *, group_size: int, bits: int, swiglu: bool = False,
    norm_weight: mx.array | None = None, eps: float = 1e-6,
) -> mx.array:  # fmt: skip
    """Ops reference: x [..., XS, K] (XS = 1: one input per token; XS = KS: one per selected
    expert), the experts' quantized weights w [E, N, K*bits/32] (scales, biases [E, N,
    K/group]), indices [..., KS] -> y [..., KS, N], row (t, s) = x[t, s or 0] @ w[idx[t, s]].T
    as ``mx.gather_qmm`` computes it. With ``swiglu``, w [2E, N, ...] holds E experts' gate
    weights, then their up weights, and y [..., KS, N] = swiglu(gate, up) of each row (mlx-lm's
    ``SwitchGLU`` before its down projection). ``norm_weight`` [K] RMS-normalises x first
    (``mx.fast.rms_norm`` with ``eps``: the norm before a MoE block)."""
    if norm_weight is not None:
        x = mx.fast.rms_norm(x, norm_weight, eps)

    def product(rows: mx.array) -> mx.array:
        return mx.gather_qmm(
            mx.expand_dims(x, -2), w, scales, biases, rhs_indices=rows, transpose=True,
            group_size=group_size, bits=bits,
        ).squeeze(-2)  # fmt: skip

    if not swiglu:
        return product(indices)
    return _swiglu(product(indices), product(indices + w.shape[0] // 2))


def _self_check(dtype, sdtype, group_size: int, bits: int, swiglu: bool,
                norm_eps: float | None = None) -> str | None:  # fmt: skip
    """Agreement with the reference and row invariance (1, 3, 8 and ``MAX_ROWS`` tokens of 2
    experts each, of 4, so that experts are shared, by more than 8 tokens at the most; and
    tokens alone against their place among all) on 40 weight rows of K = 1024 (of one
    variant: swiglu, the norm folded in)."""
    e, n, k = 4, 40, 1024
    stacked = 2 * e if swiglu else e  # gates, then ups
    parts = [random_quantized(n, k, group_size, bits, sdtype, seed=30 + i)
             for i in range(stacked)]  # fmt: skip
    w, scales, biases = (mx.stack(a) for a in zip(*parts, strict=True))  # [E, N, ...]
    x = (mx.random.normal((MAX_ROWS, 1, k), key=mx.random.key(31)) * 3).astype(dtype)
    idx = mx.array([[t % e, (t + 1 + t // e % (e - 1)) % e] for t in range(MAX_ROWS)], mx.uint32)
    opts: dict = {"group_size": group_size, "bits": bits, "swiglu": swiglu}
    if norm_eps is not None:  # small, as the plain product's check has it (float16 swiglu)
        nw = mx.random.uniform(0.1, 0.3, (k,), key=mx.random.key(32)).astype(dtype)
        opts |= {"eps": norm_eps, "norm_weight": nw}
    try:
        got = {m: launch_gathered(x[:m], w, scales, biases, idx[:m], **opts)
               for m in (1, 3, 8, MAX_ROWS)}  # fmt: skip
        want = gathered_matmul_ops(x, w, scales, biases, idx, **opts)
        single = {i: launch_gathered(x[i : i + 1], w, scales, biases, idx[i : i + 1], **opts)
                  for i in ALONE}  # fmt: skip
        mx.eval(got, want, single)
    except Exception as err:  # noqa: BLE001 - a kernel that fails to build is not trusted
        return f"{type(err).__name__}: {err}"
    return product_verdict(got, want) or alone_verdict(single, got[MAX_ROWS])


def supported(x: mx.array, w: mx.array, indices: mx.array, group_size: int, bits: int) -> bool:
    """Whether the native kernel's layout covers this product (else the reference runs)."""
    return (
        fits(x, group_size, bits)
        and w.ndim == 3
        and indices.dtype == mx.uint32
        and x.ndim == indices.ndim + 1
        and x.shape[-2] in (1, indices.shape[-1])
        and x.shape[:-2] == indices.shape[:-1]
        and indices.size // indices.shape[-1] <= MAX_ROWS
    )


def norm_fits(norm_weight: mx.array, x: mx.array) -> bool:
    """Whether the kernel's norm takes this weight: [K], x's dtype."""
    return norm_weight.shape == x.shape[-1:] and norm_weight.dtype == x.dtype


def _trusted(dtype, sdtype, group_size: int, bits: int, swiglu: bool, mode: str,
             norm_eps: float | None = None) -> bool:  # fmt: skip
    """Whether the native kernel runs for this class of product (its self-check run once a
    process under ``auto``)."""
    return use_native(
        "gathered_matmul" + "_norm" * (norm_eps is not None) + "_swiglu" * swiglu,
        (backend(), str(dtype), str(sdtype), group_size, bits, norm_eps),
        lambda: _self_check(dtype, sdtype, group_size, bits, swiglu, norm_eps),
        mode,
    )


def native_ready(dtype, sdtype, k: int, group_size: int, bits: int, swiglu: bool,
                 mode: str, norm_eps: float | None = None) -> bool:  # fmt: skip
    """Whether every product of activations ``dtype``, inputs of width ``k`` and scales
    ``sdtype`` (of at most ``MAX_ROWS`` tokens; with a norm of ``norm_eps`` folded in) runs natively
    here: the layout is covered, the kernel exists and is trusted."""
    return (backend() != "cpu" and bits in BITS and group_size in GROUP_SIZES
            and dtype in (mx.bfloat16, mx.float16) and k % (16 * 32 // bits) == 0
            and _trusted(dtype, sdtype, group_size, bits, swiglu, mode, norm_eps))  # fmt: skip


def gathered_matmul(
    x, w, scales, biases, indices, *, group_size: int, bits: int, swiglu: bool = False,
    norm_weight: mx.array | None = None, eps: float = 1e-6, mode: str = "auto",
) -> mx.array:  # fmt: skip
    """``gathered_matmul_ops`` (same arguments) as one trusted native launch where it runs
    here (at most ``MAX_ROWS`` tokens), else the norm as its own op and the product on the best path
    left."""
    opts = {"group_size": group_size, "bits": bits, "swiglu": swiglu}
    norm = None if norm_weight is None else eps
    if (
        backend() != "cpu"
        and biases is not None
        and (not swiglu or w.shape[0] % 2 == 0)
        and supported(x, w, indices, group_size, bits)
        and (norm_weight is None or norm_fits(norm_weight, x))
        and _trusted(x.dtype, scales.dtype, group_size, bits, swiglu, mode, norm)
    ):
        return launch_gathered(x, w, scales, biases, indices, **opts, norm_weight=norm_weight,
                               eps=eps)  # fmt: skip
    if norm_weight is not None:
        x = mx.fast.rms_norm(x, norm_weight, eps)
        return gathered_matmul(x, w, scales, biases, indices, **opts, mode=mode)
    return gathered_matmul_ops(x, w, scales, biases, indices, **opts)
