"""The standalone ``qwen3_5_mtp`` drafter head (one full-attention layer on the target's shape).

``h = fc([pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden)])``, the layer, then
``norm``. It owns no embedding and no LM head: it borrows the target's. Its output is both the
draft's hidden (through the borrowed head) and the ``hidden`` of the next chained draft.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5
from mlx_lm.models.base import create_attention_mask

from ..config import ModelConfig
from ..errors import UsageError
from ..models.kv_cache import BatchKV, RowsKVCache, held
from ..models.quantized_layers import install
from ..models.qwen3_5 import (
    LayerFunctions,
    attention_core,
    attention_post,
    attention_pre,
    batch_attention,
    residual_mlp,
    rows_rope,
)
from ..options import Options
from ..weights import load_arrays, load_module_weights, sanitize_drafter


class Qwen35MTP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        text = config.text
        n_layers = max(text.mtp_num_hidden_layers, 1)
        # MTP layers are always full attention: full_attention_interval = 1.
        args = qwen3_5.TextModelArgs.from_dict(
            text.to_mlx_lm(num_hidden_layers=n_layers, full_attention_interval=1)
        )
        h, eps = text.hidden_size, text.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=eps)
        self.layers = [qwen3_5.DecoderLayer(args, layer_idx=i) for i in range(n_layers)]
        self.norm = nn.RMSNorm(h, eps=eps)


class Qwen35MTPDrafter:
    """A loaded drafter bound to a target's embedding."""

    def __init__(self, module: Qwen35MTP, config: ModelConfig, embed_tokens: nn.Module,
                 options: Options = Options()):  # fmt: skip
        self.module = module
        self.config = config
        self.mode = options.kernels
        if options.ours:
            install(module, self.mode)
        self.block_size = config.block_size or 3
        self.embed_tokens = embed_tokens
        self.functions = LayerFunctions(options.compile)  # as the target's: short blocks

    def make_cache(self) -> list:
        return [RowsKVCache() for _ in self.module.layers]

    def cache_arrays(self, cache: list) -> list[mx.array]:
        return [a for c in cache for a in (c.keys, c.values, c.device_length) if a is not None]

    def forward(self, tokens: mx.array, hidden: mx.array, cache: list) -> mx.array:
        m, fns, (B, L) = self.module, self.functions, tokens.shape
        rows = isinstance(cache[0], BatchKV)  # a batch of requests, each on its own rows
        compiled = fns.begin(L, B)
        h = fns.get(("entry",), lambda: self._entry, compiled)(tokens, hidden)  # [B, L, H]
        mask = None if rows else create_attention_mask(h, cache[0])
        for i, (layer, c) in enumerate(zip(m.layers, cache, strict=True)):
            q, k, v, gate = fns.get(("pre", i), lambda ly=layer: attention_pre(ly), compiled)(h)
            if rows:
                c.reserve(L)
                o = batch_attention(layer.self_attn, q, k, v, gate, c, self.mode)
            else:
                o = attention_core(layer.self_attn, q, k, v, gate, mask, c, self.mode)
            post = fns.get(
                ("post", i), lambda ly=layer: attention_post(ly, residual_mlp(ly.mlp)), compiled
            )
            h = post(h, o)
        fns.end(L, B)
        return m.norm(h)

    def _entry(self, tokens: mx.array, hidden: mx.array) -> mx.array:
        m = self.module
        e = m.pre_fc_norm_embedding(self.embed_tokens(tokens))  # [B, L, H]
        return m.fc(mx.concatenate([e, m.pre_fc_norm_hidden(hidden)], axis=-1))  # [B, L, H]

    def trim(self, cache: list, n: int) -> None:
        for c in cache:
            c.trim(n)

    def keep(self, cache: list, n_keep: mx.array, block: int) -> None:
        length = cache[0].length() - block + n_keep
        for c in cache:
            c.keep(length)

    def settle(self, cache: list, dropped: int, idle: bool) -> None:
        for c in cache:
            c.settle(dropped, idle)

    def join_rows(self, batch: list | None, cache: list) -> list:
        return [BatchKV.join(None if batch is None else b, c)
                for b, c in zip(batch or [None] * len(cache), cache, strict=True)]  # fmt: skip

    def keep_rows(self, batch: list, rows: list[int]) -> list:
        return [b.keep(rows) for b in batch]

    def rewind_rows(self, batch: list, dropped: list[int]) -> None:
        for b in batch:
            b.rewind(dropped)

    def reads_lengths_on_device(self, cache: list, L: int) -> bool:
        return all(rows_rope(ly.self_attn, c, L) is not None
                   for ly, c in zip(self.module.layers, cache, strict=True))  # fmt: skip

    def offset(self, cache: list) -> int:
        return cache[0].offset

    def snapshot(self, cache: list, positions: int) -> list:
        return [held(c, positions) for c in cache]

    def restore(self, snapshot: list) -> list:
        return [held(c) for c in snapshot]


DRAFT_BITS = (4, 8)


def check_quantize(bits: int, group_size: int = 64, flag: str = "--draft-quantize") -> None:
    """Refuse drafter quantization settings (given as ``flag``) before any work is done."""
    if bits not in DRAFT_BITS:
        raise UsageError(f"{flag} must be 4 or 8, got {bits}")
    if group_size not in (32, 64, 128):
        raise UsageError(f"the quantization group size must be 32, 64 or 128, got {group_size}")


def quantize_drafter(module: Qwen35MTP, config: ModelConfig, bits: int, group_size: int = 64,
                     where: str = "the drafter") -> ModelConfig:  # fmt: skip
    """Quantize a bf16 drafter's linear layers (affine) in place; its norms stay as they are.
    Returns its config with the ``quantization`` entry a quantized checkpoint's would hold
    (the gate keys costs on it)."""
    check_quantize(bits, group_size)
    if config.quantization:
        raise UsageError(f"{where} is already quantized ({config.quantization.get('bits')}-bit); "
                         "--draft-quantize applies to a bf16 drafter")  # fmt: skip
    nn.quantize(module, group_size=group_size, bits=bits,
                class_predicate=lambda _, m: isinstance(m, nn.Linear)
                and m.weight.shape[-1] % group_size == 0)  # fmt: skip
    mx.eval(module.parameters())
    return replace(config, quantization={"group_size": group_size, "bits": bits, "mode": "affine"})


def quantized_copy(drafter: Qwen35MTPDrafter, bits: int, options: Options = Options()
                   ) -> Qwen35MTPDrafter:  # fmt: skip
    """A ``bits``-bit copy of a bf16 drafter (the original is left as it is)."""
    module = Qwen35MTP(drafter.config)
    module.update(drafter.module.parameters())
    config = quantize_drafter(module, drafter.config, bits)
    return Qwen35MTPDrafter(module, config, drafter.embed_tokens, options)


def load_drafter(model_dir: Path, config: ModelConfig, embed_tokens: nn.Module,
                 options: Options = Options(), quantize: int | None = None,
                 ) -> Qwen35MTPDrafter:  # fmt: skip
    """Load a drafter; ``quantize`` (4 or 8) quantizes a bf16 one at load."""
    module = Qwen35MTP(config)
    weights = sanitize_drafter(load_arrays(model_dir), shift=False)  # standalone: holds w
    load_module_weights(module, weights, config.quantization, str(model_dir))
    if quantize is not None:
        config = quantize_drafter(module, config, quantize, where=f"the drafter {model_dir}")
    return Qwen35MTPDrafter(module, config, embed_tokens, options)
