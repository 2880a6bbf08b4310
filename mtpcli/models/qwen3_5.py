"""The Qwen3.5 / 3.6 / 3.8 target (dense and MoE): one forward for decode, prefill and verify.

Parameters and checkpoint names are mlx-lm's (``mlx_lm.models.qwen3_5``); the forward is ours,
so that the classic decoder and the MTP verify compute every position with the same arithmetic,
and so that a verify pass keeps what the rollback needs (per-step gated-delta states and the
conv inputs). Row invariance: a verify block runs an op batched only where this backend gives
each row bitwise the single-position result; ``RowPolicy`` finds that out per op class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_5, qwen3_5_moe
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import ArraysCache, KVCache

from .. import kernels
from ..config import ModelConfig
from ..kernels import quantized_matmul
from ..kernels.gated_delta import gated_delta_raw
from ..kernels.quantized_matmul import FusedProjection
from ..weights import load_arrays, load_module_weights

PREFILL_CHUNK = 2048


@dataclass
class GatedDeltaTrace:
    """What one verify pass left behind in one gated-delta layer, for the rollback."""

    conv_input: mx.array  # [B, K-1+T, C]: the old conv window followed by the T new inputs
    states: mx.array  # [T, B, Hv, Dv, Dk]: the recurrent state after each position


@dataclass
class ForwardOut:
    hidden: mx.array  # [B, T, H], final-normed
    traces: list[GatedDeltaTrace | None] | None  # per layer (None for attention layers)


class RowPolicy:
    """Run a verify block's op batched only where that is bitwise the one-position result.

    The first ``CONFIRM`` times an op class (its parameter shapes and dtypes, T, input dtype)
    meets a block, both ways are computed and the one-position result is used; the class runs
    batched only after every comparison was bitwise equal, and never after one differed.
    MLX's CPU backend turns out row-invariant throughout; on CUDA, bf16 matmuls are not, while
    the 4- and 8-bit ones are for up to 7 rows (measured, docs/design.md).
    """

    CONFIRM = 3

    def __init__(self) -> None:
        self.verdicts: dict[tuple, bool] = {}  # settled: True = batched is exact here
        self._seen: dict[tuple, int] = {}  # equal comparisons so far, per unsettled class
        self._sigs: dict[int, tuple] = {}  # id(module) -> (module, signature)

    def signature(self, module) -> tuple:
        entry = self._sigs.get(id(module))
        if entry is None:
            params = tree_flatten(module.parameters())
            shapes = tuple((k, tuple(v.shape), str(v.dtype)) for k, v in params)
            # The module is kept in the entry, so its id cannot be reused while cached.
            entry = (module, (type(module).__name__, getattr(module, "bits", None), shapes))
            self._sigs[id(module)] = entry
        return entry[1]

    def choose(self, key: tuple, batched: Callable[[], mx.array], single: Callable[[], mx.array]):
        ok = self.verdicts.get(key)
        if ok:
            return batched()
        out = single()
        if ok is None:
            if mx.array_equal(batched(), out).item():
                self._seen[key] = self._seen.get(key, 0) + 1
                if self._seen[key] >= self.CONFIRM:
                    self.verdicts[key] = True
            else:
                self.verdicts[key] = False
        return out

    def rows(self, fn, x: mx.array, exact: bool, module=None) -> mx.array:
        """``fn`` over x [B, T, ...]: batched, or position by position where rows differ."""
        T = x.shape[1]
        if not exact or T == 1:
            return fn(x)
        key = (self.signature(module if module is not None else fn), T, str(x.dtype))
        return self.choose(
            key,
            lambda: fn(x),
            lambda: mx.concatenate([fn(x[:, t : t + 1]) for t in range(T)], axis=1),
        )


def _gated_delta_layer(
    m: qwen3_5.GatedDeltaNet, x, cache, exact: bool, policy: RowPolicy, fused=None
):
    B, S, _ = x.shape
    n_keep = m.conv_kernel_size - 1
    if fused is not None:  # the four input projections in one product
        qkv, z, b, a = fused.split(policy.rows(fused, x, exact))
    else:
        qkv = policy.rows(m.in_proj_qkv, x, exact)  # [B, S, C]
        z = policy.rows(m.in_proj_z, x, exact)  # [B, S, Hv * Dv]
        b = policy.rows(m.in_proj_b, x, exact)  # [B, S, Hv]
        a = policy.rows(m.in_proj_a, x, exact)  # [B, S, Hv]
    z = z.reshape(B, S, m.num_v_heads, m.head_v_dim)

    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, n_keep, m.conv_dim), dtype=x.dtype)  # [B, K-1, C]
    conv_input = mx.concatenate([conv_state, qkv], axis=1)  # [B, K-1+S, C]
    cache[0] = mx.contiguous(conv_input[:, conv_input.shape[1] - n_keep :])
    if exact and S > 1:
        conv_out = policy.choose(
            (policy.signature(m.conv1d), S, str(x.dtype)),
            lambda: m.conv1d(conv_input),
            lambda: mx.concatenate(
                [m.conv1d(conv_input[:, t : t + n_keep + 1]) for t in range(S)], axis=1
            ),
        )
    else:
        conv_out = m.conv1d(conv_input)
    conv_out = nn.silu(conv_out)  # [B, S, C]

    q, k, v = mx.split(conv_out, [m.key_dim, 2 * m.key_dim], axis=-1)
    q = q.reshape(B, S, m.num_k_heads, m.head_k_dim)
    k = k.reshape(B, S, m.num_k_heads, m.head_k_dim)
    v = v.reshape(B, S, m.num_v_heads, m.head_v_dim)
    state = cache[1]
    if state is None:
        state = mx.zeros((B, m.num_v_heads, m.head_v_dim, m.head_k_dim), dtype=mx.float32)
    # q/k normalisation, the decay and beta (mlx-lm's), then the recurrence: one launch where
    # a native kernel runs. Its T steps equal T one-step calls bitwise (chain parity).
    y, state, states = gated_delta_raw(q, k, v, a, b, m.A_log, m.dt_bias, state, keep_states=exact)
    cache[1] = state

    out = m.norm(y, z)  # [B, S, Hv, Dv]
    out = policy.rows(m.out_proj, out.reshape(B, S, -1), exact)
    return out, (GatedDeltaTrace(conv_input, states) if exact else None)


def _attention_layer(m, x, mask, cache: KVCache, exact: bool):
    T = x.shape[1]
    if not exact or T == 1 or mx.default_device() == mx.cpu:
        # MLX's CPU attention is row-invariant by construction (masked keys add exact zeros).
        return m(x, mask=mask, cache=cache)
    # GPU attention kernels differ between one query and a block, and only now and then in
    # the last bit (a probe can pass by luck): one position at a time, as a decode step runs.
    return mx.concatenate([m(x[:, t : t + 1], cache=cache) for t in range(T)], axis=1)


def _mlp(fused: FusedProjection, down: nn.Module) -> Callable[[mx.array], mx.array]:
    """mlx-lm's dense MLP with gate and up as one product."""
    return lambda x: down(swiglu(*fused.split(fused(x))))


class Qwen35Target:
    """A loaded Qwen3.5-family target with the surface the engines need."""

    def __init__(self, model: nn.Module, config: ModelConfig, fuse: bool | None = None):
        self.model = model  # mlx-lm's Model: parameters and checkpoint names
        self.config = config
        ours = kernels.qmm() == "ours"
        if ours:  # decode and verify rows then share one product kernel
            quantized_matmul.install(model)
        self.text = model.language_model
        self.policy = RowPolicy()
        if fuse is None:  # where our kernel runs; on the CPU mlx-lm's exact products stay
            fuse = ours and kernels.backend() != "cpu" and kernels.mode() != "ops"
        self.fused_in, self.fused_mlp = self._fuse() if fuse else ({}, {})

    def _fuse(self) -> tuple[dict, dict]:
        """Per layer: the gated-delta input projections, and the dense MLP's gate and up."""
        fused_in, fused_mlp = {}, {}
        for i, layer in enumerate(self.layers):
            if layer.is_linear:
                m = layer.linear_attn
                group = [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a]
                if FusedProjection.fusable(group):
                    fused_in[i] = FusedProjection(group)
            mlp = layer.mlp
            if hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj"):
                group = [mlp.gate_proj, mlp.up_proj]
                if FusedProjection.fusable(group):
                    fused_mlp[i] = _mlp(FusedProjection(group), mlp.down_proj)
        return fused_in, fused_mlp

    @property
    def layers(self):
        return self.text.model.layers

    @property
    def embed_tokens(self) -> nn.Module:
        return self.text.model.embed_tokens

    def make_cache(self) -> list:
        return [ArraysCache(size=2) if layer.is_linear else KVCache() for layer in self.layers]

    def lm_head(self, hidden: mx.array, exact: bool = False) -> mx.array:
        """Logits [B, T, V] from final-normed hidden states [B, T, H]; ``exact`` as in a verify."""
        if self.config.text.tie_word_embeddings:
            embed = self.embed_tokens
            return self.policy.rows(embed.as_linear, hidden, exact, module=embed)
        return self.policy.rows(self.text.lm_head, hidden, exact)

    def forward(self, tokens: mx.array, cache: list, *, verify: bool = False) -> ForwardOut:
        """Run tokens [B, T] through the decoder, appending to ``cache``.

        ``verify`` keeps the per-position traces for ``rollback`` and computes every position
        exactly as a one-token decode step would (see ``RowPolicy``).
        """
        policy = self.policy
        h = self.embed_tokens(tokens)  # [B, T, H]
        kv = next((c for c, ly in zip(cache, self.layers, strict=True) if not ly.is_linear), None)
        mask = create_attention_mask(h, kv)  # unused where attention goes position by position
        traces: list[GatedDeltaTrace | None] = []
        for i, (layer, c) in enumerate(zip(self.layers, cache, strict=True)):
            x = layer.input_layernorm(h)
            if layer.is_linear:
                r, trace = _gated_delta_layer(
                    layer.linear_attn, x, c, verify, policy, self.fused_in.get(i)
                )
            else:
                r, trace = _attention_layer(layer.self_attn, x, mask, c, verify), None
            traces.append(trace)
            h = h + r
            mlp = self.fused_mlp.get(i, layer.mlp)
            h = h + policy.rows(mlp, layer.post_attention_layernorm(h), verify, module=layer.mlp)
        return ForwardOut(self.text.model.norm(h), traces if verify else None)

    def prefill(self, tokens: mx.array, cache: list) -> mx.array:
        """Process a prompt [B, L] in chunks; returns the final-normed hidden states [B, L, H]."""
        hidden = []
        for start in range(0, tokens.shape[1], PREFILL_CHUNK):
            out = self.forward(tokens[:, start : start + PREFILL_CHUNK], cache)
            mx.eval(out.hidden)
            hidden.append(out.hidden)
        return mx.concatenate(hidden, axis=1) if len(hidden) > 1 else hidden[0]


def trim_kv(cache: KVCache, n: int) -> None:
    cache.trim(n)


def restore_conv(cache: ArraysCache, trace: GatedDeltaTrace, n_keep: int) -> None:
    window = cache[0].shape[1]
    cache[0] = trace.conv_input[:, n_keep : n_keep + window]


def restore_state(cache: ArraysCache, trace: GatedDeltaTrace, n_keep: int) -> None:
    cache[1] = trace.states[n_keep - 1]


def rollback(cache: list, traces: list, n_keep: int, block: int) -> None:
    """Leave ``cache`` exactly as after the first ``n_keep`` of the last ``block`` positions."""
    if n_keep == block:
        return
    for c, trace in zip(cache, traces, strict=True):
        if trace is None:
            trim_kv(c, block - n_keep)
        else:
            restore_conv(c, trace, n_keep)
            restore_state(c, trace, n_keep)


def cache_arrays(cache: list) -> list[mx.array]:
    """The arrays a rollback may have replaced (for an explicit eval)."""
    return [a for c in cache if isinstance(c, ArraysCache) for a in c.cache if a is not None]


def build_model(config: ModelConfig) -> nn.Module:
    """An mlx-lm module tree of the config's shape (lazy random parameters)."""
    family = qwen3_5_moe if config.model_type == "qwen3_5_moe" else qwen3_5
    args = family.ModelArgs(model_type=config.model_type, text_config=config.text.to_mlx_lm())
    return family.Model(args)


def load_target(model_dir: Path, config: ModelConfig) -> Qwen35Target:
    """Load a target in any supported layout (mlx-community, flat, raw Hugging Face)."""
    model = build_model(config)
    # mlx-lm's sanitize is the layout fix for targets: drops vision and mtp.* tensors, maps
    # raw names, moves conv1d axes, and undoes the raw w-1 norm storage.
    weights = model.sanitize(load_arrays(model_dir))
    load_module_weights(model, weights, config.quantization, str(model_dir))
    return Qwen35Target(model, config)
