"""Random-weight models of real shapes, built in memory, for speed measurements.

Quantized weights are drawn directly as packed integers with small scales, so a 27B-shape
4-bit model takes seconds to build and never exists in bf16.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .config import ModelConfig, TextConfig
from .drafters.qwen3_5_mtp import Qwen35MTP, Qwen35MTPDrafter
from .fixtures import full_text_config, is_norm_or_dt_bias
from .models.qwen3_5 import Qwen35Target, build_model
from .options import Options
from .weights import cpu_expert_upcast

# What every member of the family shares: the head dimensions, the gated-delta convolution, one
# full-attention layer in four and one MTP layer.
_FAMILY = {
    "head_dim": 256, "rms_norm_eps": 1e-6, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "mtp_num_hidden_layers": 1,
}  # fmt: skip
_TINY_WIDTHS = {
    "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 2,
    "num_key_value_heads": 1, "vocab_size": 1024, "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
}  # fmt: skip

SHAPES: dict[str, dict] = {
    # Qwen3.8-27B (and Qwen3.5-27B): ../shared/reference/qwen3_5_mtp.md. Every shape gets the
    # published rope settings and the other config fields from fixtures.full_text_config.
    "qwen3.8-27b": _FAMILY | {
        "hidden_size": 5120, "num_hidden_layers": 64, "intermediate_size": 17408,
        "num_attention_heads": 24, "num_key_value_heads": 4, "vocab_size": 248320,
        "linear_num_value_heads": 48, "linear_num_key_heads": 16,
    },
    # A small dense member of the family (Qwen3.5-2B-like).
    "qwen3.5-small": _FAMILY | {
        "hidden_size": 2048, "num_hidden_layers": 24, "intermediate_size": 6144,
        "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 248320,
        "linear_num_value_heads": 16, "linear_num_key_heads": 16, "tie_word_embeddings": True,
    },
    # A 35B-A3B-like MoE member (256 experts, 8 routed + 1 shared per token; ~35B weights, ~3B
    # active): the hybrid layout of the family with sparse MLPs.
    "qwen3.5-35b-a3b": _FAMILY | {
        "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
        "num_key_value_heads": 2, "vocab_size": 248320, "linear_num_value_heads": 32,
        "linear_num_key_heads": 16, "num_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    },
    # Small enough for a CPU smoke test, with the real head dimensions.
    "tiny": _FAMILY | _TINY_WIDTHS | {"intermediate_size": 512},
    "tiny-moe": _FAMILY | _TINY_WIDTHS | {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
    },
}  # fmt: skip
# The 27B shape's 64 layers (48 gated-delta, 16 attention) at "tiny"'s widths: the host's graph
# building and launch count of the real layer stack, on any machine.
SHAPES["qwen3.8-27b-layers"] = {**SHAPES["tiny"], "num_hidden_layers": 64}
# The 35B-A3B's 40 layers and routing (256 experts, 8 a token) at tiny widths: its launch count.
SHAPES["qwen3.5-35b-a3b-layers"] = {**SHAPES["tiny-moe"], "num_hidden_layers": 40,
                                    "num_experts": 256, "num_experts_per_tok": 8}  # fmt: skip


def _randomize(module: nn.Module, bits: int | None, seed: int) -> None:
    """Replace every parameter with random values of its shape, one layer at a time."""
    for i, (name, p) in enumerate(tree_flatten(module.parameters())):
        k = mx.random.key(seed * 1_000_003 + i)
        if p.dtype == mx.uint32:
            new = mx.random.randint(0, 2**31, p.shape, dtype=mx.uint32, key=k)
        elif name.endswith("scales"):
            new = mx.full(p.shape, 0.02 / 2 ** (bits or 4), dtype=mx.bfloat16)
        elif name.endswith("biases"):
            new = mx.full(p.shape, -0.01, dtype=mx.bfloat16)
        elif is_norm_or_dt_bias(name, p):  # trained away from their initial 1
            new = (p * mx.random.uniform(0.5, 1.5, p.shape, key=k)).astype(mx.bfloat16)
        elif p.ndim == 1 or name.endswith("A_log"):
            new = p.astype(mx.float32 if name.endswith("A_log") else mx.bfloat16)
        else:
            scale = p.shape[-1] ** -0.5
            new = (mx.random.normal(p.shape, key=k) * scale).astype(mx.bfloat16)
        _set(module, name, new)
        mx.eval(new)


def _set(module: nn.Module, dotted: str, value: mx.array) -> None:
    *path, leaf = dotted.split(".")
    obj = module
    for part in path:
        obj = obj[int(part)] if isinstance(obj, list) else getattr(obj, part)
    obj[leaf] = value


def _text(name: str) -> tuple[str, dict]:
    family = "qwen3_5_moe" if SHAPES[name].get("num_experts") else "qwen3_5"
    # Every field of a published config (the rope settings, the context length) around the
    # shape: loaders such as mlx-vlm's and transformers' read them.
    return family, full_text_config(SHAPES[name])


def build(name: str, bits: int | None = 4, group_size: int = 64, seed: int = 0,
          options: Options = Options()):  # fmt: skip
    """A (target, drafter) pair of shape ``name`` with random weights; bits None = bf16."""
    family, text = _text(name)
    mx.random.seed(seed)  # the parameters _randomize keeps (A_log) come from module init
    quant = {"group_size": group_size, "bits": bits, "mode": "affine"} if bits else None
    cfg = ModelConfig(family, TextConfig.from_dict(text, family), quant, (), None, True)
    model = build_model(cfg)
    if bits:
        # As mlx-lm's converter quantizes (its model's quant_predicate): a MoE block's routers
        # (mlp.gate, shared_expert_gate) at 8 bits, group 64, recorded per module in the config.
        routers = model.quant_predicate

        def predicate(path: str, m: nn.Module) -> bool | dict:
            if not hasattr(m, "to_quantized"):
                return False
            rule = routers(path, m) if routers is not None else True
            if isinstance(rule, dict):
                quant[path] = rule
            return rule

        nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)
    _randomize(model, bits, seed)
    cpu_expert_upcast(model)
    target = Qwen35Target(model, cfg, options)
    dcfg = ModelConfig("qwen3_5_mtp", cfg.text, None, (), 3, True)
    module = Qwen35MTP(dcfg)
    _randomize(module, None, seed + 1)
    cpu_expert_upcast(module)
    return target, Qwen35MTPDrafter(module, dcfg, target.embed_tokens, options)


def write(name: str, root: Path, bits: int | None = 4, group_size: int = 64, seed: int = 0,
          raw: bool = False):  # fmt: skip
    """Write ``build(name, ...)`` to disk in the layouts users download: an mlx-community
    VLM-style target (quantized unless ``bits`` is None, with a byte tokenizer that decodes
    every id) under ``root/target`` and a standalone bf16 ``qwen3_5_mtp`` drafter under
    ``root/drafter``, so that peers which load checkpoints from disk (mlx-vlm) run the very
    same weights. ``raw`` (bf16 only) writes instead one raw Hugging Face checkpoint under
    ``root/raw``, in shards, the drafter as its ``mtp.*`` tensors (for ``extract-drafter``).
    Returns the paths written."""
    from .fixtures import byte_tokenizer, write_drafter, write_target

    target, drafter = build(name, bits, group_size, seed)
    _, text = _text(name)
    quant = target.config.quantization
    root = Path(root)
    if raw:
        if bits:
            raise ValueError("raw Hugging Face checkpoints are bf16: pass bits=None")
        return (write_target(root / "raw", text, layout="raw", model=target.model,
                             drafter=drafter.module, tokenizer=byte_tokenizer(text["vocab_size"]),
                             shards=4),)  # fmt: skip
    t = write_target(root / "target", text, model=target.model, quantization=quant,
                     tokenizer=byte_tokenizer(text["vocab_size"]), shards=4)  # fmt: skip
    d = write_drafter(root / "drafter", text, module=drafter.module, block_size=3)
    return t, d
