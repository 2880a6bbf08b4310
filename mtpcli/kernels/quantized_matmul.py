"""Affine-quantized matmul for 1-32 rows that reads each weight once, row-invariant by construction.

MLX's quantized matrix-vector kernel re-reads the weights for every row of a 2-8 row input, so
a verify block of T positions costs about T decode steps in the matmuls. Here one launch serves
M = 1..32 rows: the weights are dequantized once (to the activations' dtype, one rounding) and
multiplied with tensor-core ``mma.m16n8k16``s whose 8 columns are 8 rows of x (a tile; 1, 2 or
4 tiles a launch, unused columns zeros). Every output row is computed by the same instructions
in the same order whatever M is, so a verify row equals the decode row bitwise, and a batch's
rows their requests' alone; the self-check confirms that on
the running GPU before the kernel is trusted. The kernel texts are in ``qmm_kernel.py``, the
model's layers that call this in ``models/quantized_layers.py``.
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx_lm.models.activations import swiglu as _swiglu

from . import backend, product_verdict, use_native
from .qmm_kernel import BITS, GROUP_SIZES, MAX_ROWS, PLAIN, Variant, launch


def quantized_matmul_ops(
    x, w, scales, biases, *, group_size: int, bits: int, residual: mx.array | None = None,
    norm_weight: mx.array | None = None, eps: float = 1e-6, swiglu: bool = False,
) -> mx.array:  # fmt: skip
    """Ops reference: x [..., K] times the dequantized w [N, K] transposed -> [..., N].

    Options, as MLX and mlx-lm compute them: ``norm_weight`` [K] RMS-normalises x first
    (``mx.fast.rms_norm`` with ``eps``); ``swiglu`` gives swiglu(first half, second half) of
    the outputs, [..., N/2] (gate and up projections as one weight); ``residual`` is added.
    """
    if norm_weight is not None:
        x = mx.fast.rms_norm(x, norm_weight, eps)
    y = mx.quantized_matmul(
        x, w, scales=scales, biases=biases, transpose=True, group_size=group_size, bits=bits
    )
    if swiglu:
        y = _swiglu(*mx.split(y, 2, axis=-1))
    return y if residual is None else residual + y


def random_quantized(n: int, k: int, group_size: int, bits: int, dtype, seed: int):
    """Random affine-quantized weights [N, K] (packed words, scales, biases) for checks."""
    kh, kl, ks, kb = mx.random.split(mx.random.key(seed), 4)
    shape = (n, k * bits // 32)
    w = (mx.random.randint(0, 2**16, shape, dtype=mx.uint32, key=kh) << 16) | mx.random.randint(
        0, 2**16, shape, dtype=mx.uint32, key=kl
    )  # all 32 bits random
    scales = (mx.random.uniform(0.5, 1.5, (n, k // group_size), key=ks) * 0.02).astype(dtype)
    biases = (mx.random.normal((n, k // group_size), key=kb) * 0.1).astype(dtype)
    return w, scales, biases


def _self_check(dtype, sdtype, group_size: int, bits: int, variant: Variant = PLAIN) -> str | None:
    """Agreement with the reference and row invariance (M = 1, 3, 8, 13 and ``MAX_ROWS``: one
    tile, two and all) of one variant, on 40 weight rows of K = 1024."""
    n, k = 40, 1024  # 40 rows: a partial last tile (of 16 rows; with swiglu, of 8 pairs)
    w, scales, biases = random_quantized(n, k, group_size, bits, sdtype, seed=7)
    x = (mx.random.normal((MAX_ROWS, k), key=mx.random.key(8)) * 3).astype(dtype)
    opts: dict = {"group_size": group_size, "bits": bits, "swiglu": variant.swiglu}
    if variant.norm_eps is not None:
        # small enough that float16 holds swiglu of 8-bit products (their weights are large)
        nw = mx.random.uniform(0.1, 0.3, (k,), key=mx.random.key(10)).astype(dtype)
        opts |= {"eps": variant.norm_eps, "norm_weight": nw}
    n_out = n // 2 if variant.swiglu else n
    r = mx.random.normal((MAX_ROWS, n_out), key=mx.random.key(9)).astype(dtype)

    def rows(m: int) -> dict:
        return {"residual": r[:m]} if variant.residual else {}

    def alone(i: int) -> mx.array:  # row i as a launch's only row (tile 0, column 0)
        return launch(x[i : i + 1], w, scales, biases, **opts,
                      **({"residual": r[i : i + 1]} if variant.residual else {}))  # fmt: skip

    try:
        got = {m: launch(x[:m], w, scales, biases, **opts, **rows(m))
               for m in (1, 3, 8, 13, MAX_ROWS)}  # fmt: skip
        want = quantized_matmul_ops(x, w, scales, biases, **opts, **rows(MAX_ROWS))
        single = {i: alone(i) for i in ALONE}
        mx.eval(got, want, single)
    except Exception as e:  # noqa: BLE001 - a kernel that fails to build is not trusted
        return f"{type(e).__name__}: {e}"
    return product_verdict(got, want) or alone_verdict(single, got[MAX_ROWS])


# Rows checked alone against their place among MAX_ROWS: a column of each tile but the first.
ALONE = (5, 13, 31)


def alone_verdict(single: dict[int, mx.array], top: mx.array) -> str | None:
    """None where each row i of ``single`` (a launch of that row alone) equals row i of the
    launch of all rows ``top`` bitwise (a request alone against its place in a batch)."""
    for i, a in single.items():
        if not mx.array_equal(a[0], top[i]).item():
            return f"row {i} alone differs from row {i} among {top.shape[0]}"
    return None


def native_ready(dtype, sdtype, group_size: int, bits: int, mode: str) -> bool:
    """Whether the plain product of activations ``dtype`` and scales ``sdtype`` runs natively
    here for up to ``MAX_ROWS`` rows (its self-check run now, once a process): the products
    of a batch of that many rows are then row-invariant (the variants fall back to it)."""
    return (backend() != "cpu" and bits in BITS and group_size in GROUP_SIZES
            and dtype in (mx.bfloat16, mx.float16)
            and use_native("quantized_matmul", _key(dtype, sdtype, group_size, bits, None),
                           lambda: _self_check(dtype, sdtype, group_size, bits), mode))  # fmt: skip


def _key(dtype, sdtype, group_size: int, bits: int, norm_eps: float | None) -> tuple:
    return (backend(), str(dtype), str(sdtype), group_size, bits, norm_eps)


def fits(x: mx.array, group_size: int, bits: int) -> bool:
    """Whether the native kernels' layout takes activations ``x`` [..., K] and weights of these
    bits and groups (dense and gathered alike)."""
    return (
        x.dtype in (mx.bfloat16, mx.float16)
        and bits in BITS
        and group_size in GROUP_SIZES
        and x.shape[-1] % (16 * 32 // bits) == 0
    )


def supported(x: mx.array, w: mx.array, group_size: int, bits: int) -> bool:
    """Whether the native kernel's layout covers this product (else the reference runs)."""
    return fits(x, group_size, bits) and w.ndim == 2


def _native(
    x, w, scales, biases, *, group_size: int, bits: int, mode: str,
    residual: mx.array | None = None, norm_weight: mx.array | None = None, eps: float = 1e-6,
    swiglu: bool = False,
) -> mx.array | None:  # fmt: skip
    """The product as one trusted native launch (x [..., K], the residual with x's rows), or
    None where the variant does not run natively here."""
    rows, n, k = math.prod(x.shape[:-1]), w.shape[0], x.shape[-1]
    variant = Variant(eps if norm_weight is not None else None, swiglu, residual is not None)
    n_out = n // 2 if swiglu else n

    def fits(a, shape, dtype) -> bool:
        return a is None or (a.shape == shape and a.dtype == dtype)

    if not (
        backend() != "cpu"
        and 1 <= rows <= MAX_ROWS
        and biases is not None
        and supported(x, w, group_size, bits)
        and (not swiglu or (n % 2 == 0 and residual is None))
        and fits(residual, (*x.shape[:-1], n_out), x.dtype)
        and fits(norm_weight, (k,), x.dtype)
        and use_native(
            "quantized_matmul" + variant.suffix(),
            _key(x.dtype, scales.dtype, group_size, bits, variant.norm_eps),
            lambda: _self_check(x.dtype, scales.dtype, group_size, bits, variant),
            mode,
        )
    ):
        return None
    # The kernel takes x [..., K] and the residual with x's leading axes as they are: a reshape
    # is a graph node that MLX builds and encodes (530 of a 27B decode step's 1,281, counted).
    return launch(x, w, scales, biases, group_size=group_size, bits=bits,
                  norm_weight=norm_weight, eps=eps, swiglu=swiglu, residual=residual)  # fmt: skip


def quantized_matmul(
    x, w, scales, biases, *, group_size: int, bits: int, residual: mx.array | None = None,
    norm_weight: mx.array | None = None, eps: float = 1e-6, swiglu: bool = False,
    mode: str = "auto",
) -> mx.array:  # fmt: skip
    """``quantized_matmul_ops`` (same options) on the best trusted path under kernel ``mode``:
    one native launch where the variant runs natively here, else the options as their own ops
    around the product, which may still run natively."""
    opts = {"group_size": group_size, "bits": bits}
    out = _native(x, w, scales, biases, **opts, mode=mode, residual=residual,
                  norm_weight=norm_weight, eps=eps, swiglu=swiglu)  # fmt: skip
    if out is not None:
        return out
    if norm_weight is None and not swiglu and residual is None:
        return quantized_matmul_ops(x, w, scales, biases, **opts)
    if norm_weight is not None:
        x = mx.fast.rms_norm(x, norm_weight, eps)
    y = quantized_matmul(x, w, scales, biases, **opts, mode=mode)
    if swiglu:
        y = _swiglu(*mx.split(y, 2, axis=-1))
    return y if residual is None else residual + y
