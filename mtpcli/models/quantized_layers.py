"""The model-side quantized layers: mlx-lm's quantized linear and embedding classes routed
through our product (``kernels/quantized_matmul.py``), sibling projections fused into one
product, and a projection that adds the residual in its launch."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from ..kernels.gathered_matmul import gathered_matmul, native_ready
from ..kernels.qmm_kernel import MAX_ROWS
from ..kernels.quantized_matmul import native_ready as product_ready
from ..kernels.quantized_matmul import quantized_matmul


class KernelQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose product runs through ``quantized_matmul`` (under the kernel
    mode ``install`` gave it)."""

    kernel_mode = "auto"

    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_matmul(
            x, self["weight"], self["scales"], self.get("biases"),
            group_size=self.group_size, bits=self.bits, mode=self.kernel_mode,
        )  # fmt: skip
        return y + self["bias"] if "bias" in self else y


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose tied-head product runs through ``quantized_matmul``."""

    kernel_mode = "auto"

    def as_linear(self, x: mx.array) -> mx.array:
        return quantized_matmul(
            x, self["weight"], self["scales"], self.get("biases"),
            group_size=self.group_size, bits=self.bits, mode=self.kernel_mode,
        )  # fmt: skip


def linear_add(layer: nn.Module, x: mx.array, residual: mx.array) -> mx.array:
    """``residual + layer(x)``: one launch where ``layer`` runs through our product, which adds
    the residual in its store with MLX's rounding; otherwise the two ops."""
    if type(layer) is not KernelQuantizedLinear or "bias" in layer:
        return residual + layer(x)
    return quantized_matmul(
        x, layer["weight"], layer["scales"], layer.get("biases"), group_size=layer.group_size,
        bits=layer.bits, residual=residual, mode=layer.kernel_mode,
    )  # fmt: skip


class FusedProjection(nn.Module):
    """Sibling quantized projections of one input as one product (one launch, one weight read).

    The siblings' weights are concatenated along the output axis once; the siblings keep views
    of their rows, so no weight is stored twice. Our kernel computes each output row the same
    way whatever the other rows are, so the fused outputs equal the separate ones bitwise.
    With ``swiglu`` the two siblings are an MLP's gate and up, and the product returns
    swiglu(gate, up). Called with the RMSNorm that precedes it, the product normalises its
    input itself (the norm's launch saved, its rounding the product's).
    """

    def __init__(self, linears: list[nn.QuantizedLinear], swiglu: bool = False,
                 mode: str = "auto"):  # fmt: skip
        super().__init__()
        first = linears[0]
        self.group_size, self.bits, self.kernel_mode = first.group_size, first.bits, mode
        self.sizes = [m.weight.shape[0] for m in linears]
        if swiglu and (len(self.sizes) != 2 or self.sizes[0] != self.sizes[1]):
            raise ValueError(f"swiglu needs a gate and an up of one size, got {self.sizes}")
        self.swiglu = swiglu
        self._cuts = [sum(self.sizes[: i + 1]) for i in range(len(self.sizes) - 1)]
        for name in ("weight", "scales", "biases"):
            fused = mx.concatenate([m[name] for m in linears])  # [sum(N), ...]
            mx.eval(fused)
            self[name] = fused
            start = 0
            for m, n in zip(linears, self.sizes, strict=True):
                m[name] = fused[start : start + n]  # a view: the sibling's own rows
                start += n
        mx.eval([m.parameters() for m in linears])

    @staticmethod
    def fusable(linears: list) -> bool:
        first = linears[0]
        return all(
            isinstance(m, nn.QuantizedLinear)
            and getattr(m, "mode", "affine") == "affine"
            and "bias" not in m
            and "biases" in m
            and (m.group_size, m.bits, m.weight.shape[1]) == (
                first.group_size, first.bits, first.weight.shape[1])
            for m in linears
        )  # fmt: skip

    def __call__(self, x: mx.array, norm: nn.RMSNorm | None = None) -> mx.array:
        """x [..., K] (normed by ``norm`` first, if given) -> the siblings' outputs side by side,
        [..., sum(N)] (see ``split``); with ``swiglu``, swiglu(gate, up) [..., N/2]."""
        opts = {} if norm is None else {"norm_weight": norm.weight, "eps": norm.eps}
        return quantized_matmul(
            x, self["weight"], self["scales"], self["biases"], group_size=self.group_size,
            bits=self.bits, swiglu=self.swiglu, mode=self.kernel_mode, **opts,
        )  # fmt: skip

    def split(self, y: mx.array) -> list[mx.array]:
        return mx.split(y, self._cuts, axis=-1)

    def start(self, i: int) -> int:
        """Where sibling i's outputs begin in the fused outputs' last axis."""
        return ([0] + self._cuts)[i]


class FusedExperts:
    """A MoE block's experts (mlx-lm's quantized ``SwitchGLU``) as two gathered products for
    up to 32 tokens: every selected expert's gate and up with their swiglu in one launch, its
    down projection in another (``kernels/gathered_matmul.py``), each token's rows the same
    bits whichever tokens share its experts. More tokens (a prefill) run mlx-lm's own module.

    The gate and up weights [E, I, ...] are stacked once into one array [2E, I, ...] (the gates,
    then the ups) that the kernel reads; the module keeps contiguous views of its halves, so no
    weight is stored twice and mlx-lm's products read them as before. Given a ``shared`` expert
    of the experts' widths (mlx-lm's ``Qwen3NextMLP``), it is stacked as expert E ([2(E + 1),
    I, ...] and a down [E + 1, H, ...], its module keeping views too): a token that lists E
    last among its experts has the shared expert made in the same two launches.
    """

    def __init__(self, switch: nn.Module, mode: str = "auto", shared: nn.Module | None = None):
        gate, up, self.down = switch.gate_proj, switch.up_proj, switch.down_proj
        self.switch, self.kernel_mode, self.shared = switch, mode, shared is not None
        self.group_size, self.bits = gate.group_size, gate.bits
        e = gate.weight.shape[0]
        self.stacked, self.stacked_down = {}, {}  # stacked_down: with the shared expert
        for name in ("weight", "scales", "biases"):
            if shared is None:
                both = mx.concatenate([gate[name], up[name]])  # [2E, I, ...]
            else:
                sg, su = shared.gate_proj[name][None], shared.up_proj[name][None]
                both = mx.concatenate([gate[name], sg, up[name], su])  # [2(E + 1), I, ...]
            mx.eval(both)
            self.stacked[name] = both
            s = int(shared is not None)
            gate[name], up[name] = both[:e], both[e + s : 2 * e + s]
            if shared is not None:
                shared.gate_proj[name], shared.up_proj[name] = both[e], both[2 * e + 1]
                down = mx.concatenate([self.down[name], shared.down_proj[name][None]])
                mx.eval(down)  # [E + 1, H, ...]
                self.stacked_down[name] = down
                self.down[name], shared.down_proj[name] = down[:e], down[e]
        mx.eval(gate.parameters(), up.parameters(), self.down.parameters())
        if shared is not None:
            mx.eval(shared.parameters())

    @staticmethod
    def fusable(switch: nn.Module) -> bool:
        parts = (switch.gate_proj, switch.up_proj, switch.down_proj)
        gate, up = parts[0], parts[1]
        return (
            all(isinstance(m, QuantizedSwitchLinear) and m.mode == "affine"
                and m.get("biases") is not None and "bias" not in m and m.global_scale is None
                for m in parts)
            and (gate.weight.shape, gate.group_size, gate.bits)
            == (up.weight.shape, up.group_size, up.bits)
        )  # fmt: skip

    @staticmethod
    def stackable(switch: nn.Module, shared: nn.Module) -> bool:
        """Whether ``shared``'s three projections can be stacked with ``switch``'s experts (one
        more expert of the same widths and quantization)."""
        pairs = ((switch.gate_proj, shared.gate_proj), (switch.up_proj, shared.up_proj),
                 (switch.down_proj, shared.down_proj))  # fmt: skip
        return all(
            isinstance(one, nn.QuantizedLinear) and one.mode == "affine"
            and one.get("biases") is not None and "bias" not in one
            and (one.group_size, one.bits) == (many.group_size, many.bits)
            and all(one[n].shape == many[n].shape[1:] and one[n].dtype == many[n].dtype
                    for n in ("weight", "scales", "biases"))
            for many, one in pairs
        )  # fmt: skip

    def __call__(self, x: mx.array, indices: mx.array, norm: nn.RMSNorm | None = None
                 ) -> mx.array:  # fmt: skip
        """x [..., H] (normed by ``norm`` first, if given) and each token's experts' indices
        [..., k] (E, last, for the shared expert where it is stacked) -> [..., k, H]. With
        the norm, the gate and up product normalises its input itself (the norm's launch
        saved, its rounding the product's, as ``FusedProjection``'s)."""
        if indices.size // indices.shape[-1] > MAX_ROWS:
            return self.switch(x if norm is None else norm(x), indices)
        opts = {"group_size": self.group_size, "bits": self.bits, "mode": self.kernel_mode}
        w = self.stacked
        normed = {} if norm is None else {"norm_weight": norm.weight, "eps": norm.eps}
        h = gathered_matmul(mx.expand_dims(x, -2), w["weight"], w["scales"], w["biases"],
                            indices, swiglu=True, **normed, **opts)  # [..., k, I]  # fmt: skip
        d = self.stacked_down if self.shared else self.down
        return gathered_matmul(h, d["weight"], d["scales"], d["biases"], indices, **opts)

    def takes(self, x: mx.array) -> bool:
        """Whether a pass over x [..., H] goes through the gathered products (at most
        ``MAX_ROWS`` tokens), where the shared expert's slot is made with the others."""
        return x.size // x.shape[-1] <= MAX_ROWS

    def native(self, dtype: mx.Dtype, norm_eps: float | None = None) -> bool:
        """Whether both products run natively here for activations of ``dtype`` (the gate
        and up with a norm of ``norm_eps`` folded in, if given; checked now, once a process),
        so that every token's rows are row-invariant."""
        scales = self.stacked["scales"].dtype
        # the gate and up read the hidden state (down's outputs), down the experts' widths
        widths = {True: self.down.output_dims, False: self.down.input_dims}
        opts = {"group_size": self.group_size, "bits": self.bits, "mode": self.kernel_mode}
        ready = [
            native_ready(dtype, scales, widths[glu], swiglu=glu, norm_eps=eps, **opts)
            for glu, eps in ((True, norm_eps), (False, None))
        ]  # both checked now: any warning comes at load
        return all(ready)


def rows_native(module: nn.Module, dtype: mx.Dtype) -> bool:
    """Whether every kind of quantized product of ``module`` (its scales' dtype, group size
    and bits) runs on our kernel here for activations of ``dtype``, trusted (checked now):
    then up to ``MAX_ROWS`` rows of a product are row-invariant; where one fell back to MLX's
    product, they are not."""
    kinds = {(m["scales"].dtype, m.group_size, m.bits) for _, m in module.named_modules()
             if type(m) in (KernelQuantizedLinear, KernelQuantizedEmbedding)}  # fmt: skip
    modes = {m.kernel_mode for _, m in module.named_modules() if type(m) in _STOCK}
    return all(product_ready(dtype, *kind, mode) for kind in kinds for mode in modes)


_OURS = {nn.QuantizedLinear: KernelQuantizedLinear, nn.QuantizedEmbedding: KernelQuantizedEmbedding}
_STOCK = {v: k for k, v in _OURS.items()}


def install(module: nn.Module, mode: str = "auto", enabled: bool = True) -> int:
    """Route every affine-quantized linear layer of ``module`` through ``quantized_matmul``
    under kernel ``mode``.

    The classes are swapped in place (they add no state but the mode), so parameters, names
    and the checkpoint layout stay mlx-lm's; ``enabled=False`` swaps mlx's own classes back.
    Returns how many layers were swapped.
    """
    table = _OURS if enabled else _STOCK
    swapped = 0
    for _, m in module.named_modules():
        cls = table.get(type(m))
        if cls is not None and getattr(m, "mode", "affine") == "affine":
            m.__class__ = cls
            swapped += 1
        if enabled and type(m) in _STOCK:
            m.kernel_mode = mode
    return swapped


@contextmanager
def stock_layers(module: nn.Module) -> Iterator[None]:
    """Run a block with mlx's own quantized layers (for a peer measured on the same weights);
    the layers that were ours are ours again afterwards, and only those."""
    ours = [m for _, m in module.named_modules() if type(m) in _STOCK]
    install(module, enabled=False)
    try:
        yield
    finally:
        for m in ours:
            m.__class__ = _OURS[type(m)]
