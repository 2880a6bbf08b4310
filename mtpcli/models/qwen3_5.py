"""The Qwen3.5 / 3.6 / 3.8 target (dense and MoE): one forward for decode, prefill and verify.

Parameters and checkpoint names are mlx-lm's (``mlx_lm.models.qwen3_5``); the forward is ours,
so that the classic decoder and the MTP verify compute every position with the same arithmetic,
and so that a verify pass keeps what the rollback needs (per-step gated-delta states and the
conv inputs). Row invariance: a verify block runs an op batched only where this backend gives
each row bitwise the single-position result; ``RowPolicy`` finds that out per op class.
"""

from __future__ import annotations

import copy
import re
import threading
from collections.abc import Callable, Collection
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5, qwen3_5_moe
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import ArraysCache, KVCache

from .. import kernels
from ..config import ModelConfig
from ..errors import LayoutError
from ..kernels import moe_route
from ..kernels.decode_attention import (
    MAX_T,
    Rope,
    decode_attention,
    decode_attention_rows,
    native_block,
    native_rows,
)
from ..kernels.gated_delta import gated_delta_conv
from ..kernels.gated_norm import gated_norm_in_place
from ..kernels.pick_kept import pick_kept
from ..kernels.qmm_kernel import MAX_ROWS, TILE_ROWS
from ..layout import gather, stores_w_minus_1
from ..options import Options
from ..weights import load_arrays, load_module_weights, read_inventory
from . import ForwardOut, GatedDeltaTrace
from .kv_cache import BatchKV, GraphKV, RowsKVCache, held
from .pipeline import Stage, hand_on, receive
from .quantized_layers import (
    FusedExperts,
    FusedProjection,
    KernelQuantizedLinear,
    install,
    linear_add,
    rows_native,
)
from .row_policy import RowPolicy, dense

# A prompt's chunks end at multiples of this (counted from its first token), which are also
# where the prompt cache can resume a later prompt exactly: 512 is as fast as 2048 on CPU
# (docs/design.md, "Prompt cache") and leaves at most 511 tokens of a shared prefix unused.
PREFILL_CHUNK = 512


def is_cut(p: int, length: int, cuts: Collection[int] = ()) -> bool:
    """Whether processing a prompt of ``length`` tokens stops between chunks after its first
    ``p`` (``Qwen35Target.prefill``): at the multiples of the chunk, at the prompt's own
    ``cuts`` (where its messages end), and before the last."""
    return 0 < p <= length - 1 and (p % PREFILL_CHUNK == 0 or p == length - 1 or p in cuts)


def cut_at_or_before(p: int) -> int:
    """The last multiple of the chunk at or before ``p`` (a cut of every longer prompt)."""
    return p // PREFILL_CHUNK * PREFILL_CHUNK


COMPILE_MAX_T = 16  # decode steps and verify blocks; a prompt's length would trace once per use


def _gated_delta(m: qwen3_5.GatedDeltaNet, h, norm, conv_state, state, keep: bool, mode: str,
                 fused=None):  # fmt: skip
    """h [B, S, H] plus the gated-delta mixer of norm(h), pure: returns (out [B, S, H],
    conv_input [B, K-1+S, C], new conv window, state, states if ``keep``)."""
    if fused is not None:  # the norm and the four input projections in one product
        proj = fused(h, norm)  # [B, S, C + Hv * Dv + 2 Hv]
        qkv, _, b, a = fused.split(proj)
        z_source, z_at = proj, fused.start(1)
    else:
        x = norm(h)
        qkv, z = m.in_proj_qkv(x), m.in_proj_z(x)  # [B, S, C], [B, S, Hv * Dv]
        b, a = m.in_proj_b(x), m.in_proj_a(x)  # [B, S, Hv]
        z_source, z_at = z, 0
    # The conv and SiLU, the q/k normalisation, the decay and beta (mlx-lm's), then the
    # recurrence: one launch where the native kernel runs. Its T steps equal T one-step calls
    # bitwise (chain parity). y [B, S, Hv, Dv]; the window and inputs [B, K-1+S, C] and the
    # new window [B, K-1, C].
    heads = (m.num_k_heads, m.head_k_dim, m.num_v_heads, m.head_v_dim)
    y, state, states, conv_input, window = gated_delta_conv(
        qkv, conv_state, m.conv1d.weight, a, b, m.A_log, m.dt_bias, state, heads,
        keep_states=keep, mode=mode,
    )  # fmt: skip
    # mlx-lm's gated norm (m.norm) of y, reading the gate z in place; the out projection adds
    # the residual in its launch
    y = gated_norm_in_place(y, z_source, z_at, m.norm.weight, m.norm.eps, mode)  # [B, S, Hv Dv]
    out = linear_add(m.out_proj, y, h)
    return (out, conv_input, window, state) + ((states,) if keep else ())


def _attention_pre(m, h, norm, fused=None):
    """h [B, T, H] -> queries [B, T, Hq, D], keys, values [B, T, Hkv, D], gate [B, T, Hq, D] of
    norm(h): mlx-lm's attention projections, before the q/k norms (``attention_core``'s)."""
    B, L, _ = h.shape
    if fused is not None:  # the norm and the three projections in one product
        qg, k, v = fused.split(fused(h, norm))
    else:
        x = norm(h)
        qg, k, v = m.q_proj(x), m.k_proj(x), m.v_proj(x)  # [B, L, 2 Hq D], [B, L, Hkv D] x 2
    q, gate = mx.split(qg.reshape(B, L, m.num_attention_heads, -1), 2, axis=-1)
    k = k.reshape(B, L, m.num_key_value_heads, -1)
    v = v.reshape(B, L, m.num_key_value_heads, -1)
    return q, k, v, gate


def rows_rope(m, cache: RowsKVCache | GraphKV | BatchKV, L: int) -> Rope | None:
    """The rotary spec where L positions after the cache go through ``decode_attention`` on a
    GPU (each row exactly a decode step's), else None (MLX's ops: prefill, the CPU)."""
    if kernels.backend() == "cpu" or not cache.filled or L > MAX_T or m.q_norm.eps != m.k_norm.eps:
        return None
    return Rope.of(m.rope)


def attention_core(m, q, k, v, gate, mask, cache: RowsKVCache | GraphKV,
                   mode: str = "auto") -> mx.array:  # fmt: skip
    """The q/k norms, positions, the cache, the product and the output gate: [B, L, Hq * D].
    A decode step or a verify block on a GPU goes through ``decode_attention`` (two launches
    where its kernels run, rows exact by construction), reading the cache's whole buffers up
    to its length on the device; elsewhere MLX's ops at the host's offset."""
    B, L = q.shape[:2]
    rope = rows_rope(m, cache, L)
    if rope is not None:
        o, k = decode_attention(q, k, v, gate, m.q_norm.weight, m.k_norm.weight, m.q_norm.eps,
                                cache.keys, cache.values, rope, m.scale, mode,
                                length=cache.length())  # fmt: skip
        cache.write(k, v.transpose(0, 2, 1, 3))  # [B, Hkv, L, D] each
        return o
    q, k = m.q_norm(q), m.k_norm(k)
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # [B, heads, L, D]
    q, k = m.rope(q, offset=cache.offset), m.rope(k, offset=cache.offset)
    k, v = cache.update_and_fetch(k, v)
    out = scaled_dot_product_attention(q, k, v, cache=cache, scale=m.scale, mask=mask)
    out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)  # [B, L, Hq * D]
    return out * mx.sigmoid(gate.reshape(B, L, -1))


def batch_attention(m, q, k, v, gate, cache: BatchKV, mode: str = "auto") -> mx.array:
    """``attention_core`` for a batch of requests, each row on its own rows of the cache at its
    own length: [B, L, Hq * D]. One launch pair for every row where the decode-attention
    kernels take the rows' lengths; else row by row, each exactly as that request alone."""
    L = q.shape[1]
    got = decode_attention_rows(q, k, v, gate, m.q_norm.weight, m.k_norm.weight, m.q_norm.eps,
                                cache.keys, cache.values, cache.length(), rows_rope(m, cache, L),
                                m.scale, mode)  # fmt: skip
    if got is not None:
        o, k = got
        cache.write(k, v.transpose(0, 2, 1, 3))  # [B, Hkv, L, D] each
        return o
    if cache.lengths is None:
        raise RuntimeError("a batch's compiled step needs its attention on the native kernels")
    rows = [cache.row(b) for b in range(q.shape[0])]
    o = mx.concatenate([_row_attention(m, *(x[b : b + 1] for x in (q, k, v, gate)), r, mode)
                        for b, r in enumerate(rows)], axis=0)  # fmt: skip
    cache.put_rows(rows)
    return o


def _row_attention(m, q, k, v, gate, cache: RowsKVCache, mode: str) -> mx.array:
    """One request's L positions [1, L, ...] on its own cache, as it computes them alone: MLX's
    causal attention on the CPU (row-invariant there), else position by position."""
    L = q.shape[1]
    if L == 1 or mx.default_device() == mx.cpu or rows_rope(m, cache, L) is not None:
        return attention_core(m, q, k, v, gate, "causal" if L > 1 else None, cache, mode)
    return mx.concatenate([attention_core(m, *(x[:, t : t + 1] for x in (q, k, v, gate)), None,
                                          cache, mode) for t in range(L)], axis=1)  # fmt: skip


class LayerFunctions:
    """Pure per-layer functions, ``mx.compile``d for blocks of up to ``COMPILE_MAX_T`` tokens.

    A pass at a new block length runs op by op first (so kernels' run-time self-checks never
    run inside a trace). ``enabled`` False runs every pass op by op.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._fns: dict = {}  # (key, compiled) -> function
        self._warm: set[tuple[int, int]] = set()  # (block length, rows) that ran op by op once

    def begin(self, T: int, B: int = 1) -> bool:
        """Start a pass over T tokens of B rows; whether it runs compiled."""
        return self.enabled and T <= COMPILE_MAX_T and (T, B) in self._warm

    def end(self, T: int, B: int = 1) -> None:
        if T <= COMPILE_MAX_T:
            self._warm.add((T, B))

    def get(self, key: tuple, make: Callable[[], Callable], compiled: bool) -> Callable:
        fn = self._fns.get((key, compiled))
        if fn is None:
            fn = self._fns[(key, compiled)] = mx.compile(make()) if compiled else make()
        return fn

    def compiled_keys(self) -> list[tuple]:
        return [key for key, compiled in self._fns if compiled]


def attention_pre(layer: nn.Module, fused: FusedProjection | None = None) -> Callable:
    """h -> queries, keys, values, gate of a full-attention layer."""
    norm = layer.input_layernorm
    return lambda h: _attention_pre(layer.self_attn, h, norm, fused)


def attention_post(layer: nn.Module, mlp_add: Callable) -> Callable:
    """(h, gated attention output) -> the layer's output: o_proj, residual, MLP block
    (``mlp_add(h, norm)`` is h + the MLP of norm(h))."""
    norm = layer.post_attention_layernorm
    return lambda h, o: mlp_add(linear_add(layer.self_attn.o_proj, o, h), norm)


def residual_mlp(mlp: nn.Module) -> Callable:
    """(h, norm) -> h + mlp(norm(h)), for an MLP module as mlx-lm has it."""
    return lambda h, norm: h + mlp(norm(h))


def _mlp(fused: FusedProjection, down: nn.Module) -> Callable:
    """(h, norm) -> h + mlx-lm's dense MLP of norm(h): the norm, gate and up and their swiglu
    in one product, then the down projection's product adding the residual."""
    return lambda h, norm: linear_add(down, fused(h, norm), h)


def _side_by_side(linears: list[nn.Module]) -> Callable:
    """x -> the outputs of ``linears`` side by side (where they cannot be one product)."""
    return lambda x: mx.concatenate([m(x) for m in linears], axis=-1)


def _shared(fused: FusedProjection, down: nn.Module) -> Callable:
    """x -> a MoE block's shared expert (mlx-lm's dense MLP) of x: its gate and up and their
    swiglu in one product, then the down projection."""
    return lambda x: down(fused(x))


def _moe(block: nn.Module, experts: FusedExperts, shared: Callable, router: Callable,
         mode: str, folded: bool) -> Callable:  # fmt: skip
    """(h, norm) -> h + mlx-lm's sparse MoE block of norm(h): ``router`` gives the router's
    logits and the shared expert's gate logit side by side [..., E + 1]; the routing (softmax,
    top-k, scores) and the combination (weighted sum, gated shared expert, residual) are a
    launch each where their kernels run (kernels/moe_route.py), the selected experts go
    through ``experts``, the shared expert through ``shared``. ``folded`` (the shared expert
    stacked with the experts, the router one product): the norm rides in the router's and
    the experts' gate and up products (each normalises h itself), and a MoE block is five
    launches, router, routing, two gathered products, combination."""
    n, k, normalize = block.num_experts, block.top_k, block.norm_topk_prob

    def run(h: mx.array, norm: nn.Module) -> mx.array:
        if folded and experts.takes(h):  # the shared expert as slot k, expert E
            logits = router(h, norm)  # [B, T, E + 1]
            fast = moe_route.native_ready(logits.dtype, n, k, normalize, mode)
            inds, scores = moe_route.route(logits, n, k, normalize, mode, shared_slot=True)
            y = experts(h, inds, norm)  # [B, T, k + 1, H]
            return moe_route.combine(y, scores, h, logits, h, fast)
        x = norm(h)  # [B, T, H]
        logits = router(x)  # [B, T, E + 1]
        fast = moe_route.native_ready(logits.dtype, n, k, normalize, mode)
        if experts.shared and experts.takes(x):  # the shared expert as slot k, expert E
            inds, scores = moe_route.route(logits, n, k, normalize, mode, shared_slot=True)
            y = experts(x, inds)  # [B, T, k + 1, H]
            return moe_route.combine(y, scores, h, logits, h, fast)
        inds, scores = moe_route.route(logits, n, k, normalize, mode)  # [B, T, k] each
        return moe_route.combine(experts(x, inds), scores, shared(x), logits, h, fast)

    return run


class Qwen35Target:
    """A loaded Qwen3.5-family target with the surface the engines need."""

    def __init__(self, model: nn.Module, config: ModelConfig, options: Options = Options(),
                 fuse: bool | None = None, stage: Stage | None = None):  # fmt: skip
        self.model = model  # mlx-lm's Model: parameters and checkpoint names
        self.config = config
        # In a pipeline (models/pipeline.py) this process runs ``stage.layers``; the others
        # are None here, and so are their caches.
        self.stage = stage
        self.options = options
        self.mode = options.kernels
        # A verify block is waited for as soon as it is built (the round needs its accepted
        # count), so the device idles while Python builds it. Every ``submit_every`` layers
        # the hidden state so far is submitted (mx.async_eval), the device running the first
        # layers while the rest are built; 0 submits once, at the wait. Decode steps are not
        # submitted in parts: the next step is queued before this one is read, so the device
        # is already busy while a step is built.
        self.submit_every = options.layers_a_submit
        if options.ours:  # decode and verify rows then share one product kernel
            install(model, self.mode)
        self.text = model.language_model
        self._layers = self.text.model.layers  # (asked for every layer of every step)
        self.policy = RowPolicy()
        if fuse is None:  # where our kernel runs; on the CPU mlx-lm's exact products stay
            fuse = options.ours and kernels.backend() != "cpu" and self.mode != "ops"
        self.fused_in, self.fused_mlp, self.moe_native = self._fuse() if fuse else ({}, {}, set())
        self.functions = LayerFunctions(options.compile)
        # A decode step or verify block whose layer-by-layer pass settled every choice (kernel
        # checks, row probes) and ran each attention layer on the native kernels then runs as
        # one compiled graph of the whole decoder: one call to build where the layer-by-layer
        # pass makes a hundred (docs/design.md, "One graph a step").
        self._graphs: dict[tuple[bool, bool], Callable] = {}  # (verify, rows) -> the forward
        # (T, verify, a batch of requests' rows) seen settled
        self._graph_ready: set[tuple[int, bool, bool]] = set()
        self._pass_native = True  # every attention layer of this pass took the native block
        self._building = threading.RLock()  # see ``forward``
        # Routed (MoE) layers on a GPU are never batched in a verify: which rows share an
        # expert's product changes from block to block, so a probe can pass by luck and a later
        # block differ. Nor are they compiled: on CUDA their compiled functions differ from the
        # eager ones, which the first block of each length runs (docs/supported-models.md).
        # MLX's CPU products are row-invariant regardless.
        # The exception: a routed layer that runs on our kernels alone (``moe_native``: the
        # gathered products, the routing and the combination, each row-invariant by
        # construction, and our products for the router and the shared expert) is probed and
        # compiled as any other.
        gpu = kernels.backend() != "cpu"
        moe = qwen3_5.SparseMoeBlock
        self.routed_on_gpu = [
            gpu and ly is not None and isinstance(ly.mlp, moe) and i not in self.moe_native
            for i, ly in enumerate(self.layers)
        ]
        # Nor are layers with a dense (unquantized) product probed on a GPU: MLX's bf16 matmuls
        # are not row-invariant on CUDA (docs/design.md), yet on small products three probes
        # can pass and a later block differ (docs/supported-models.md). They run position by
        # position in a verify, as decode.
        self.unprobed = [
            r or (gpu and ly is not None and dense(ly))
            for r, ly in zip(self.routed_on_gpu, self.layers, strict=True)
        ]
        self.head_unprobed = gpu and dense(self._head()[0])

    @property
    def batch_rows(self) -> int | None:
        """The most requests one step may decode together (``engine/batch.py``) with each
        row's arithmetic the one it has alone; None: any number. MLX's CPU products are
        row-invariant; on a GPU, our product kernel is for up to ``MAX_ROWS`` rows (where its
        self-checks passed for every kind of product the model has) and MLX's quantized
        products for up to 7 (docs/design.md), and a layer with a dense or routed product that
        is not row-invariant there leaves one."""
        if kernels.backend() == "cpu":
            return None
        if any(self.unprobed) or self.head_unprobed:
            return 1
        ours = self.options.ours and rows_native(self.model, self._activations_dtype())
        return MAX_ROWS if ours else 7

    @property
    def tile_rows(self) -> int | None:
        """The rows a product shares one read of its weights among (our GPU kernel's tile);
        None where each row costs a product its own work (MLX's CPU products, and its GPU ones
        for a few rows): there a batch's rows do not change what a block of positions costs
        against one position."""
        if kernels.backend() == "cpu" or not self.options.ours:
            return None
        return TILE_ROWS if rows_native(self.model, self._activations_dtype()) else None

    def _fuse(self) -> tuple[dict, dict, set[int]]:
        """Per layer: the input projections (gated-delta: qkv, z, b, a; attention: q, k, v),
        the dense MLP's gate and up, a MoE block's experts and its shared expert's gate and
        up. One product reads the weights of all of a group, and a step launches fewer
        kernels (each launch has a floor of a few us on CUDA, and costs the host more): the
        norm before each group and the MLP's swiglu ride in the same launch
        (kernels/qmm_kernel.py), 192 launches fewer a 27B step. Returns the input groups, the
        MLP functions and the MoE layers that run on our kernels alone."""
        fused_in, fused_mlp, moe_native = {}, {}, set()
        dtype = self._activations_dtype()
        for i, layer in enumerate(self.layers):
            if layer is None:
                continue
            if layer.is_linear:
                m = layer.linear_attn
                group = [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a]
            else:
                m = layer.self_attn
                group = [m.q_proj, m.k_proj, m.v_proj]
            if FusedProjection.fusable(group):
                fused_in[i] = FusedProjection(group, mode=self.mode)
            mlp = layer.mlp
            if hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj"):
                group = [mlp.gate_proj, mlp.up_proj]
                if FusedProjection.fusable(group):
                    fused = FusedProjection(group, swiglu=True, mode=self.mode)
                    fused_mlp[i] = _mlp(fused, mlp.down_proj)
            if isinstance(mlp, qwen3_5.SparseMoeBlock) and FusedExperts.fusable(mlp.switch_mlp):
                se, gates = mlp.shared_expert, [mlp.gate, mlp.shared_expert_gate]
                stack = FusedExperts.stackable(mlp.switch_mlp, se)
                experts = FusedExperts(mlp.switch_mlp, self.mode, se if stack else None)
                ours = [se.gate_proj, se.up_proj, se.down_proj, *gates]
                shared, router = se, _side_by_side(gates)
                if not stack and FusedProjection.fusable([se.gate_proj, se.up_proj]):
                    fused = FusedProjection([se.gate_proj, se.up_proj], swiglu=True,
                                            mode=self.mode)  # fmt: skip
                    shared = _shared(fused, se.down_proj)
                if FusedProjection.fusable(gates):
                    router = FusedProjection(gates, mode=self.mode)
                folded = stack and isinstance(router, FusedProjection)  # (see ``_moe``)
                fused_mlp[i] = _moe(mlp, experts, shared, router, self.mode, folded)
                eps = layer.post_attention_layernorm.eps if folded else None
                if (all(type(m) is KernelQuantizedLinear for m in ours)
                        and FusedProjection.fusable(gates) and experts.native(dtype, eps)
                        and moe_route.native_ready(dtype, mlp.num_experts, mlp.top_k,
                                                   mlp.norm_topk_prob, self.mode)):  # fmt: skip
                    moe_native.add(i)
        return fused_in, fused_mlp, moe_native

    def _activations_dtype(self) -> mx.Dtype:
        """The hidden states' dtype: the embedding's (its scales', if quantized)."""
        embed = self.embed_tokens
        return embed["scales"].dtype if "scales" in embed else embed["weight"].dtype

    @property
    def layers(self) -> list:
        return self._layers

    @property
    def embed_tokens(self) -> nn.Module:
        return self.text.model.embed_tokens

    def make_cache(self) -> list:
        return [None if layer is None else ArraysCache(size=2) if layer.is_linear else RowsKVCache()
                for layer in self.layers]  # fmt: skip

    def lm_head(self, hidden: mx.array, exact: bool = False) -> mx.array:
        """Logits [B, T, V] from final-normed hidden states [B, T, H]; ``exact`` as in a verify."""
        head, product = self._head()
        return self.policy.rows(product, (hidden,), exact, self.policy.signature(head),
                                not self.head_unprobed)  # fmt: skip

    def _head(self) -> tuple[nn.Module, Callable[[mx.array], mx.array]]:
        """The LM head's module and its product (a tied embedding's ``as_linear``)."""
        if self.config.text.tie_word_embeddings:
            return self.embed_tokens, self.embed_tokens.as_linear
        return self.text.lm_head, self.text.lm_head

    def _fn(self, kind: str, i: int, keep: bool = False, compiled: bool = False) -> Callable:
        """Layer ``i``'s ``kind`` part ("linear", "pre" or "post") as a pure function (made
        once: this runs for every layer of every step, so it does nothing else)."""

        def make() -> Callable:
            layer = self.layers[i]
            mlp_add = self.fused_mlp.get(i) or residual_mlp(layer.mlp)
            if kind == "pre":
                return attention_pre(layer, self.fused_in.get(i))
            if kind == "post":
                return attention_post(layer, mlp_add)
            fused, norm = self.fused_in.get(i), layer.input_layernorm
            mid = layer.post_attention_layernorm

            def linear(h, conv_state, state):
                h, *rest = _gated_delta(layer.linear_attn, h, norm, conv_state, state, keep,
                                        self.mode, fused)  # fmt: skip
                return (mlp_add(h, mid), *rest)

            return linear

        return self.functions.get((kind, i, keep), make, compiled and not self.routed_on_gpu[i])

    def _linear_layer(self, i: int, h: mx.array, cache, verify: bool, compiled: bool):
        """A gated-delta layer over h [B, T, H]: its output and, in a verify, its trace."""
        m, T = self.layers[i].linear_attn, h.shape[1]
        conv_state, state = cache[0], cache[1]
        if conv_state is None:
            conv_state = mx.zeros((h.shape[0], m.conv_kernel_size - 1, m.conv_dim), h.dtype)
        if state is None:  # [B, Hv, Dv, Dk]
            state = mx.zeros((h.shape[0], m.num_v_heads, m.head_v_dim, m.head_k_dim), mx.float32)
        step = self._fn("linear", i, False, compiled)  # what a decode step runs
        if not verify:
            h, _, cache[0], cache[1] = step(h, conv_state, state)
            return h, None

        def single():  # position by position, exactly as decode steps
            outs, window, s, states, rows = [], conv_state, state, [], [conv_state]
            for t in range(T):
                ht, conv_input, window, s = step(h[:, t : t + 1], window, s)
                outs.append(ht)
                rows.append(conv_input[:, -1:])
                states.append(s)
            return (mx.concatenate(outs, 1), mx.concatenate(rows, 1), window, s,
                    mx.stack(states[:-1]))  # fmt: skip

        batched = self._fn("linear", i, True, compiled)
        key = (self.policy.signature(self.layers[i]), T, str(h.dtype))
        if T == 1:
            out = batched(h, conv_state, state)
        else:
            out = self.policy.choose(key, lambda: batched(h, conv_state, state), single,
                                     probe=not self.unprobed[i])  # fmt: skip
        h, conv_input, cache[0], cache[1], states = out
        return h, GatedDeltaTrace(conv_input, states)

    def _attention_layer(self, i: int, h: mx.array, mask, cache, verify: bool, compiled: bool):
        """A full-attention layer over h [B, T, H]: its output."""
        layer = self.layers[i]
        m, policy, T = layer.self_attn, self.policy, h.shape[1]
        sig = policy.signature(layer)
        pre, post = self._fn("pre", i, compiled=compiled), self._fn("post", i, compiled=compiled)
        q, k, v, gate = policy.rows(pre, (h,), verify, (sig, "pre"), not self.unprobed[i])
        rope = rows_rope(m, cache, T)
        if isinstance(cache, BatchKV):  # a batch of requests: each row on its own rows
            o = batch_attention(m, q, k, v, gate, cache, self.mode)
            self._pass_native = self._pass_native and native_rows(
                q, k, cache.keys, m.q_norm.weight, m.q_norm.eps, rope, m.scale, self.mode
            )
            return post(h, o)
        self._pass_native = self._pass_native and native_block(
            q, k, cache.keys, m.q_norm.weight, m.q_norm.eps, rope, m.scale, self.mode
        )
        if not verify or T == 1 or mx.default_device() == mx.cpu or rope is not None:
            # MLX's CPU attention is row-invariant by construction (masked keys add exact zeros),
            # and so is decode_attention on a GPU (each row a decode step's arithmetic).
            o = attention_core(m, q, k, v, gate, mask, cache, self.mode)
        else:
            # MLX's GPU attention kernels differ between one query and a block, and only now and
            # then in the last bit (a probe can pass by luck): one position at a time, as decode.
            o = mx.concatenate(
                [attention_core(m, *(x[:, t : t + 1] for x in (q, k, v, gate)), None, cache,
                                self.mode) for t in range(T)], axis=1)  # fmt: skip
        return policy.rows(post, (h, o), verify, (sig, "post"), not self.unprobed[i])

    @property
    def graph_lengths(self) -> frozenset[tuple[int, bool]]:
        """The (positions, verify) forwards of one request that now run as one compiled
        graph."""
        return frozenset((T, verify) for T, verify, rows in self._graph_ready if not rows)

    @property
    def batch_graph_lengths(self) -> frozenset[tuple[int, bool]]:
        """The same for a batch of requests' rows (``engine/batch.py``)."""
        return frozenset((T, verify) for T, verify, rows in self._graph_ready if rows)

    def retrace(self) -> None:
        """Forget every traced function and graph: the next passes trace what the model code
        (and the functions it calls) now are. For probes that swap a part out and back."""
        self.functions = LayerFunctions(self.options.compile)
        self._graphs.clear()
        self._graph_ready.clear()

    def with_options(self, options: Options) -> Qwen35Target:
        """This target (the same weights, fused products and row policy) under ``options``'
        compile and graph settings, with its own traces."""
        out = copy.copy(self)
        out.options = options
        out._graphs, out._graph_ready = {}, set()
        out.functions = LayerFunctions(options.compile)
        return out

    def forward(self, tokens: mx.array, cache: list, *, verify: bool = False) -> ForwardOut:
        """Run tokens [B, T] through the decoder, appending to ``cache``.

        ``verify`` keeps the per-position traces for ``rollback`` and computes every position
        exactly as a one-token decode step would (see ``RowPolicy``). Decode steps and verify
        blocks run compiled layer functions, after one eager pass per block length (which
        settles the kernels' self-checks outside any trace).

        One pass is built at a time (a batch's joining prompts are built on a thread of their
        own, ``serve.py``): a pass keeps flags on the target (``_pass_native``, the policy's
        ``probed``) that decide whether its shape may run as one graph.
        """
        with self._building:
            return self._forward(tokens, cache, verify)

    def _forward(self, tokens: mx.array, cache: list, verify: bool) -> ForwardOut:
        T = tokens.shape[1]
        kv = self._kv(cache)
        rows = bool(kv) and isinstance(kv[0], BatchKV)  # a batch of requests' rows
        if (T, verify, rows) in self._graph_ready and kv[0].filled:
            return self._graph_forward(tokens, cache, verify, rows)
        if rows:
            for c in kv:
                c.reserve(T)
        B = tokens.shape[0]
        compiled = self.functions.begin(T, B)
        self.policy.probed, self._pass_native = False, True
        h = self.embed_tokens(tokens)  # [B, T, H]
        if self.stage is not None:
            h = receive(self.stage, h)
        # unused where attention goes position by position, and by a batch's rows
        mask = None if rows or not kv else create_attention_mask(h, kv[0])
        traces: list[GatedDeltaTrace | None] = []
        every = self.submit_every if verify else 0
        for i, (layer, c) in enumerate(zip(self.layers, cache, strict=True)):
            if layer is None:  # another stage's
                traces.append(None)
                continue
            if layer.is_linear:
                h, trace = self._linear_layer(i, h, c, verify, compiled)
            else:
                h, trace = self._attention_layer(i, h, mask, c, verify, compiled), None
            traces.append(trace)
            if every and (i + 1) % every == 0:
                mx.async_eval(h)
        self.functions.end(T, B)
        if self.stage is not None:
            h = hand_on(self.stage, h, cache[self.stage.layers[-1]])
        if (
            self.options.graph and compiled and self._pass_native and not self.policy.probed
            and not any(self.routed_on_gpu) and self.stage is None
        ):  # fmt: skip
            self._graph_ready.add((T, verify, rows))
        return ForwardOut(self.text.model.norm(h), traces if verify else None)

    def _graph_forward(self, tokens: mx.array, cache: list, verify: bool,
                       rows: bool = False) -> ForwardOut:  # fmt: skip
        """``forward`` as one compiled graph (see ``_graph_ready``): the caches' arrays and
        the attention caches' length (``rows``, a batch of requests: each row's) go in as
        arrays, their new arrays come out."""
        T, kv = tokens.shape[1], self._kv(cache)
        for c in kv:
            c.reserve(T)  # a buffer grown inside would make a new graph each step
        states = [(c[0], c[1]) if ly.is_linear else (c.keys, c.values)
                  for c, ly in zip(cache, self.layers, strict=True)]  # fmt: skip
        graph = self._graphs.get((verify, rows))
        if graph is None:
            graph = self._graphs[(verify, rows)] = mx.compile(
                lambda tokens, length, states: self._forward_arrays(tokens, length, states,
                                                                    verify, rows)
            )  # fmt: skip
        length = kv[0].length()
        hidden, new, kept = graph(tokens, length, states)
        # on the device while rounds are in flight (``RowsKVCache.device_length``)
        after = length + T if not rows and kv[0].device_length is not None else None
        traces, kept = [], iter(kept)
        for c, ly, (a, b) in zip(cache, self.layers, new, strict=True):
            if ly.is_linear:
                c[0], c[1] = a, b
                traces.append(GatedDeltaTrace(*next(kept)) if verify else None)
            else:
                c.keys, c.values = a, b
                c.advance(T) if rows else c.advance(T, after)
                traces.append(None)
        return ForwardOut(hidden, traces if verify else None)

    def _kv(self, cache: list) -> list[RowsKVCache]:
        """The attention layers' caches (the family has at least one), which hold one length."""
        return [c for c, ly in zip(cache, self.layers, strict=True)
                if ly is not None and not ly.is_linear]  # fmt: skip

    def _forward_arrays(self, tokens: mx.array, length: mx.array, states: list, verify: bool,
                        rows: bool = False):  # fmt: skip
        """The decoder over tokens [B, T] on the caches' arrays (traced by ``_graph_forward``):
        per layer (conv window, state) or (keys, values) buffers, and the attention caches'
        rows as an int32 [1] ``length`` (``rows``: [B], each row's). Returns the final-normed
        hidden states [B, T, H], each layer's new arrays, and (``verify``) each gated-delta
        layer's (conv inputs, states)."""
        h = self.embed_tokens(tokens)  # [B, T, H]
        new, kept = [], []
        for i, (layer, (a, b)) in enumerate(zip(self.layers, states, strict=True)):
            if layer.is_linear:
                c = [a, b]
                h, trace = self._linear_layer(i, h, c, verify, compiled=False)
                new.append((c[0], c[1]))
                if verify:
                    kept.append((trace.conv_input, trace.states))
            else:
                c = BatchKV(a, b, None, device=length) if rows else GraphKV(a, b, length)
                h = self._attention_layer(i, h, None, c, verify, compiled=False)
                new.append((c.keys, c.values))
        return self.text.model.norm(h), new, kept

    def rollback(self, cache: list, traces: list, n_keep: int | mx.array, block: int) -> None:
        rollback(cache, traces, n_keep, block, self.mode)

    def rollback_rows(self, cache: list, traces: list, n_keep: list[int], block: int) -> None:
        rollback_rows(cache, traces, n_keep, block, self.mode)

    def settle(self, cache: list, dropped: int, idle: bool) -> None:
        settle(cache, dropped, idle)

    def cache_arrays(self, cache: list) -> list[mx.array]:
        return cache_arrays(cache)

    def prefill(self, tokens: mx.array, cache: list,
                progress: Callable[[int, int], None] | None = None,
                every_position: bool = True, start: int = 0,
                on_cut: Callable[[int], None] | None = None,
                cuts: Collection[int] = ()) -> mx.array:  # fmt: skip
        """Process a prompt [B, L]: all but its last token in chunks, the last as a decode step
        (as mlx-lm does; both engines call this, so their prompts match bitwise). Returns the
        final-normed hidden states of positions ``start``..L-1 [B, L - start, H], or with
        ``every_position`` False the last position's [B, 1, H]: the chunks then evaluate the
        caches alone, and their last layer's work past its cache is never done.

        Chunks end at the multiples of ``PREFILL_CHUNK``, at the prompt's own ``cuts`` (where
        its messages end) and at L - 1 (the cuts, counted from the prompt's first token), so a
        prompt resumed at a cut (``start`` positions already in ``cache``, from a prompt-cache
        snapshot) computes every later position exactly as the prompt processed whole.
        ``on_cut(p)`` is told of each cut p once the cache holds p positions;
        ``progress(done, total)`` of each part."""
        L, hidden = tokens.shape[1], []
        assert 0 <= start < L, "a resumed prompt has a token left to process"
        pos = start
        while pos < L - 1:
            end = min(cut_at_or_before(pos) + PREFILL_CHUNK, L - 1, *(c for c in cuts if c > pos))
            out = self.forward(tokens[:, pos:end], cache)
            kept = [out.hidden] if every_position else []
            mx.eval(*kept, *cache_state(cache))
            hidden += kept
            pos = end
            if on_cut is not None:
                on_cut(pos)
            if progress is not None:
                progress(pos, L)
        out = self.forward(tokens[:, L - 1 :], cache)
        mx.eval(out.hidden, *cache_state(cache))
        if progress is not None:
            progress(L, L)
        return mx.concatenate([*hidden, out.hidden], axis=1) if hidden else out.hidden

    def snapshot(self, cache: list) -> list:
        return snapshot(cache)

    def join_rows(self, batch: list | None, cache: list) -> list:
        return join_rows(batch, cache)

    def keep_rows(self, batch: list, rows: list[int]) -> list:
        return keep_rows(batch, rows)

    def restore(self, snapshot: list) -> list:
        return restore(snapshot)


def trim_kv(cache: RowsKVCache, n: int) -> None:
    cache.trim(n)


def restore_conv(cache: ArraysCache, trace: GatedDeltaTrace, n_keep: int) -> None:
    window = cache[0].shape[1]
    cache[0] = trace.conv_input[:, n_keep : n_keep + window]


def restore_state(cache: ArraysCache, trace: GatedDeltaTrace, n_keep: int) -> None:
    # A view of the kept state: indexing with an integer would copy it through a gather
    # kernel, a layer's whole state each rollback.
    cache[1] = trace.states[n_keep - 1 : n_keep].reshape(trace.states.shape[1:])


def rollback(cache: list, traces: list, n_keep: int | mx.array, block: int,
             mode: str = "auto") -> None:  # fmt: skip
    """Leave ``cache`` exactly as after the first ``n_keep`` of the last ``block`` positions;
    ``n_keep`` an int32 [1] array decides on the device (the host need not have read it)."""
    if isinstance(n_keep, mx.array):
        rollback_on_device(cache, traces, n_keep, block, mode)
        return
    if n_keep == block:
        return
    for c, trace in zip(cache, traces, strict=True):
        if c is None:  # another pipeline stage's layer
            continue
        if trace is None:
            trim_kv(c, block - n_keep)
        else:
            restore_conv(c, trace, n_keep)
            restore_state(c, trace, n_keep)


def rollback_rows(cache: list, traces: list, n_keep: list[int], block: int,
                  mode: str = "auto") -> None:  # fmt: skip
    """``rollback`` of a batch of requests (``join_rows``): row b keeps the first ``n_keep[b]``
    of the block: its attention rows cut back on the host, its window and state picked from
    its own trace (``kernels.pick_kept`` with a count a row: one launch per kind for all
    layers where the kernels run)."""
    if all(n == block for n in n_keep):
        return
    for c, trace in zip(cache, traces, strict=True):
        if c is not None and trace is None:  # (None: another pipeline stage's layer)
            c.rewind([block - n for n in n_keep])
    keep_linear(cache, traces, mx.array(n_keep, mx.int32), block, mode)


def rollback_on_device(cache: list, traces: list, n_keep: mx.array, block: int,
                       mode: str = "auto") -> None:  # fmt: skip
    """``rollback`` decided on the device: the attention caches' length becomes the length
    before the block plus ``n_keep``; every gated-delta layer's window and state are picked by
    it (``kernels.pick_kept``: one launch per kind for all layers where the kernels run)."""
    kv = [c for c, trace in zip(cache, traces, strict=True) if trace is None and c is not None]
    length = kv[0].length() - block + n_keep
    for c in kv:
        c.keep(length)
    keep_linear(cache, traces, n_keep, block, mode)


def keep_linear(cache: list, traces: list, n_keep: mx.array, block: int, mode: str) -> None:
    """Every gated-delta layer's window and state after the first ``n_keep`` (int32 [1], or
    [B]: each row's) of the block, picked from its trace (``kernels.pick_kept``)."""
    linear = [(c, t) for c, t in zip(cache, traces, strict=True) if t is not None]
    windows, states = pick_kept(
        [t.conv_input for _, t in linear], [t.states for _, t in linear],
        [c[1] for c, _ in linear], n_keep, block, mode,
    )  # fmt: skip
    for (c, _), window, state in zip(linear, windows, states, strict=True):
        c[0], c[1] = window, state


def settle(cache: list, dropped: int, idle: bool) -> None:
    """The host read a rollback decided on the device: ``dropped`` positions went (see
    ``RowsKVCache.settle``)."""
    for c in cache:
        if isinstance(c, RowsKVCache):
            c.settle(dropped, idle)


def cache_state(cache: list) -> list[mx.array]:
    """Every array the caches hold: the attention buffers and the gated-delta windows and
    states."""
    out = []
    for c in cache:
        if c is not None:
            out += [c.keys, c.values] if isinstance(c, KVCache) else list(c.cache)
    return [a for a in out if a is not None]


def snapshot(cache: list) -> list:
    """The caches' state now, which later steps leave as it is: each attention layer's rows
    copied (``held``), each gated-delta layer's window and state as they are (a step
    replaces those arrays, never writes into them)."""
    return [held(c) if isinstance(c, RowsKVCache) else None if c is None else (c[0], c[1])
            for c in cache]  # fmt: skip


def restore(snapshot: list) -> list:
    """A cache to decode on from a ``snapshot`` (which stays as it is)."""
    out: list = []
    for s in snapshot:
        if isinstance(s, RowsKVCache):
            out.append(held(s))
        elif s is None:
            out.append(None)
        else:
            c = ArraysCache(size=2)
            c[0], c[1] = s
            out.append(c)
    return out


def join_rows(batch: list | None, cache: list) -> list:
    """A batch's caches (``engine/batch.py``) with the one-row ``cache`` of a request added as
    its last row: gated-delta windows and states stacked on the batch axis, attention caches
    rows in one buffer at lengths of their own (``BatchKV``). ``batch`` None: the request alone
    as a batch."""
    out: list = []
    for i, c in enumerate(cache):
        b = None if batch is None else batch[i]
        if c is None:
            out.append(None)
        elif isinstance(c, RowsKVCache):
            out.append(BatchKV.join(b, c))
        else:
            joined = ArraysCache(size=2)
            joined[0], joined[1] = (a if b is None else mx.concatenate([b[j], a], axis=0)
                                    for j, a in enumerate((c[0], c[1])))  # fmt: skip
            out.append(joined)
    return out


def keep_rows(batch: list, rows: list[int]) -> list:
    """A batch's caches with only ``rows`` (their indices, in order) left."""
    idx = mx.array(rows, mx.int32)
    out: list = []
    for b in batch:
        if b is None:
            out.append(None)
        elif isinstance(b, BatchKV):
            out.append(b.keep(rows))
        else:
            kept = ArraysCache(size=2)
            kept[0], kept[1] = (mx.take(b[j], idx, axis=0) for j in (0, 1))
            out.append(kept)
    return out


def cache_arrays(cache: list) -> list[mx.array]:
    """The arrays a rollback may have replaced (for an explicit eval)."""
    return [a for c in cache if isinstance(c, ArraysCache) for a in c.cache if a is not None]


def build_model(config: ModelConfig) -> nn.Module:
    """An mlx-lm module tree of the config's shape (lazy random parameters)."""
    family = qwen3_5_moe if config.model_type == "qwen3_5_moe" else qwen3_5
    args = family.ModelArgs(model_type=config.model_type, text_config=config.text.to_mlx_lm())
    return family.Model(args)


# The norms mlx-lm's sanitize shifts in a raw target (stored there as w - 1).
TARGET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                "model.norm.weight", ".q_norm.weight", ".k_norm.weight")  # fmt: skip


def load_target(model_dir: Path, config: ModelConfig, options: Options = Options(),
                stage: Stage | None = None) -> Qwen35Target:  # fmt: skip
    """Load a target in any supported layout (mlx-community, flat, raw Hugging Face); in a
    pipeline, only the ``stage``'s decoder layers (the others are never read)."""
    model = build_model(config)
    arrays = load_arrays(model_dir)
    norms = {k: v for k, v in arrays.items() if k.endswith(TARGET_NORMS) and v.ndim == 1
             and not k.startswith("mtp.")}  # fmt: skip
    raw = stores_w_minus_1(gather(model_dir, read_inventory(model_dir), norms),
                           f"the target {model_dir}")  # fmt: skip
    # mlx-lm's sanitize is the layout fix for targets: drops vision and mtp.* tensors, maps
    # raw names, moves conv1d axes, and undoes the raw w-1 norm storage when a conv1d weight
    # is PyTorch's [C, 1, K]; the evidence above must agree with that rule.
    if raw != any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in arrays.items()):
        raise LayoutError(f"the target {model_dir} mixes conv1d layouts; re-convert it")
    weights = model.sanitize(arrays)
    if stage is not None:
        layers = model.language_model.model.layers
        for i in range(len(layers)):
            if i not in stage.layers:
                layers[i] = None
        weights = {k: v for k, v in weights.items() if _layer(k) in (None, *stage.layers)}
    load_module_weights(model, weights, config.quantization, str(model_dir))
    # The module holds the weights now: without these references the arrays that fused
    # products stack at load are freed as each layer is stacked, not at the end.
    del arrays, weights
    return Qwen35Target(model, config, options, stage=stage)


def _layer(key: str) -> int | None:
    """The decoder layer a (sanitized) weight name belongs to, if any."""
    m = re.match(r"language_model\.model\.layers\.(\d+)\.", key)
    return int(m.group(1)) if m else None
