"""Tiny checkpoints in every on-disk layout users have, written on the fly.

Used by the tests and by the built-in example. Layouts:
- ``mlx``: an mlx-community VLM-style conversion (``language_model.model.*``, nested
  ``text_config``, a ``vision_tower.*`` tensor, optional ``quantization`` block with per-module
  overrides for the MoE router);
- ``flat``: a flat config with ``model.*`` / ``lm_head`` keys;
- ``raw``: a Hugging Face checkpoint (``model.language_model.*``, conv1d ``[C, 1, K]``,
  RMSNorm stored as w-1, fused MoE experts, 15 ``mtp.*`` tensors, a ``model.visual.*`` tensor);
- a standalone ``qwen3_5_mtp`` drafter (bf16, or quantized).

``predictable`` builds a target whose next token is mostly a fixed function of the current
one, and a drafter that passes its input token through, so drafts are accepted often but
not always. The value scales how much the layers perturb that function.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .config import ModelConfig, TextConfig
from .drafters.qwen3_5_mtp import Qwen35MTP
from .models.qwen3_5 import build_model

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 258  # <|im_end|>
PRINTABLE = list(range(32, 127))
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def real_rope(head_dim: int, partial: float = 0.25) -> dict:
    """The published Qwen3.5 rope settings, the M-RoPE sections scaled to the rotary width
    (the real [11, 11, 10] for head_dim 256: they sum to the rotary pairs)."""
    pairs = int(head_dim * partial) // 2
    t, h = round(pairs * 11 / 32), round(pairs * 11 / 32)
    return {"mrope_interleaved": True, "mrope_section": [t, h, pairs - t - h],
            "rope_type": "default", "rope_theta": 10000000,
            "partial_rotary_factor": partial}  # fmt: skip


def full_text_config(text: dict) -> dict:
    """``text`` with every field a published Qwen3.5 / 3.5-MoE ``text_config`` has (the
    Qwen3.5-0.8B/27B and 35B-A3B configs, tests/reference/), those it lacks at their values."""
    moe = bool(text.get("num_experts", 0))
    n, every = text["num_hidden_layers"], text.get("full_attention_interval", 4)
    out = {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
        "dtype": "bfloat16", "full_attention_interval": every, "hidden_act": "silu",
        "initializer_range": 0.02, "max_position_embeddings": 262144,
        "layer_types": ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                        for i in range(n)],
        "mlp_only_layers": [], "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "rms_norm_eps": 1e-6, "use_cache": True, "mamba_ssm_dtype": "float32",
        "rope_parameters": real_rope(text["head_dim"]),
        "eos_token_id": text["vocab_size"] - 1,  # byte_tokenizer(vocab_size)'s <|im_end|>
    }  # fmt: skip
    if moe:
        out["router_aux_loss_coef"] = 0.001
    return out | text


def vision_config(text: dict) -> dict:
    """A one-block vision tower's config with every field a published one has."""
    moe = bool(text.get("num_experts", 0))
    return {
        "deepstack_visual_indexes": [], "depth": 1, "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 16, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 32,
        "model_type": "qwen3_5_moe" if moe else "qwen3_5", "num_heads": 2,
        "num_position_embeddings": 16, "out_hidden_size": text["hidden_size"], "patch_size": 2,
        "spatial_merge_size": 2, "temporal_patch_size": 2,
    }  # fmt: skip


def full_config(text: dict) -> dict:
    """A published Qwen3.5 ``config.json``'s top level around ``text`` (the special token ids
    placed among the model's last ids, which the byte tokenizer never produces)."""
    moe = bool(text.get("num_experts", 0))
    text = full_text_config(text)
    tied = text.pop("tie_word_embeddings", False)
    if tied:  # as Qwen3.5-0.8B states it; the untied 27B and 35B-A3B at the top level only
        text["tie_word_embeddings"] = True
    v = text["vocab_size"]
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe
                          else "Qwen3_5ForConditionalGeneration"],
        "image_token_id": v - 5, "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text, "tie_word_embeddings": tied,
        "transformers_version": "4.57.0.dev0", "video_token_id": v - 4,
        "vision_config": vision_config(text), "vision_end_token_id": v - 6,
        "vision_start_token_id": v - 7,
    }  # fmt: skip


def vision_tensors(vision: dict, dtype=mx.bfloat16, seed: int = 5) -> dict[str, mx.array]:
    """The vision tower's tensors as a raw checkpoint names and shapes them (``model.visual.*``,
    the patch embedding a PyTorch Conv3d ``[out, C, T, kH, kW]``): our loaders drop them, but
    a full-model loader needs every one."""
    h, c, t, p = (vision[k] for k in ("hidden_size", "in_channels", "temporal_patch_size",
                                      "patch_size"))  # fmt: skip
    inner, merged = vision["intermediate_size"], h * vision["spatial_merge_size"] ** 2
    shapes = {
        "patch_embed.proj.weight": (h, c, t, p, p), "patch_embed.proj.bias": (h,),
        "pos_embed.weight": (vision["num_position_embeddings"], h),
        "merger.norm.weight": (h,), "merger.norm.bias": (h,),
        "merger.linear_fc1.weight": (merged, merged), "merger.linear_fc1.bias": (merged,),
        "merger.linear_fc2.weight": (vision["out_hidden_size"], merged),
        "merger.linear_fc2.bias": (vision["out_hidden_size"],),
    }  # fmt: skip
    for i in range(vision["depth"]):
        shapes |= {
            f"blocks.{i}.norm1.weight": (h,), f"blocks.{i}.norm1.bias": (h,),
            f"blocks.{i}.norm2.weight": (h,), f"blocks.{i}.norm2.bias": (h,),
            f"blocks.{i}.attn.qkv.weight": (3 * h, h), f"blocks.{i}.attn.qkv.bias": (3 * h,),
            f"blocks.{i}.attn.proj.weight": (h, h), f"blocks.{i}.attn.proj.bias": (h,),
            f"blocks.{i}.mlp.linear_fc1.weight": (inner, h),
            f"blocks.{i}.mlp.linear_fc1.bias": (inner,),
            f"blocks.{i}.mlp.linear_fc2.weight": (h, inner),
            f"blocks.{i}.mlp.linear_fc2.bias": (h,),
        }  # fmt: skip
    return {
        f"model.visual.{k}": (0.02 * mx.random.normal(shape, key=mx.random.key(seed + i))).astype(
            dtype
        )
        for i, (k, shape) in enumerate(sorted(shapes.items()))
    }


def mlx_vision_tensors(raw: dict[str, mx.array]) -> dict[str, mx.array]:
    """``vision_tensors`` as mlx-community conversions store them: ``vision_tower.*``, the
    patch embedding in MLX's Conv3d layout ``[out, T, kH, kW, C]``."""
    out = {}
    for k, v in raw.items():
        k = "vision_tower." + k[len("model.visual.") :]
        out[k] = v.transpose(0, 2, 3, 4, 1) if k.endswith("patch_embed.proj.weight") else v
    return out


def tiny_text_config(moe: bool = False, **overrides) -> dict:
    """A Qwen3.5-shaped text config small enough for a unit test."""
    cfg = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": 272,
        "max_position_embeddings": 4096,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attn_output_gate": True,
        "mtp_num_hidden_layers": 1,
        "eos_token_id": EOS_ID,
        "rope_parameters": real_rope(16),
    }
    if moe:  # a published MoE text_config has no dense intermediate_size
        del cfg["intermediate_size"]
        cfg.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
        )
    cfg.update(overrides)
    return cfg


def _model_config(model_type: str, text: dict, block_size: int | None = None) -> ModelConfig:
    return ModelConfig(
        model_type, TextConfig.from_dict(text, model_type), None, (), block_size, True
    )


def _unflatten(flat: dict):
    from mlx.utils import tree_unflatten

    return tree_unflatten(list(flat.items()))


def _next_token_map(vocab: int, seed: int) -> list[int]:
    """Every id -> a printable byte, so the predictable model writes visible text."""
    rng = mx.random.randint(0, len(PRINTABLE), (vocab,), key=mx.random.key(seed + 7))
    return [PRINTABLE[i] for i in rng.tolist()]


def is_norm_or_dt_bias(name: str, value: mx.array) -> bool:
    """A 1-D norm weight (``*norm*.weight``: layer, q/k, final, gated, pre-fc) or ``dt_bias``."""
    parts = name.split(".")
    return value.ndim == 1 and (
        parts[-1] == "dt_bias" or (parts[-1] == "weight" and len(parts) > 1 and "norm" in parts[-2])
    )


def perturb_norms(module: nn.Module, seed: int) -> None:
    """Every norm weight and ``dt_bias`` drawn around its initial 1 (trained ones sit away
    from it), so that a norm applied twice, not at all or shifted wrongly changes the output."""
    # Factors in [0.5, 1.5): a raw file's w - 1 of such a w is exact in bf16, so raw and MLX
    # layouts of one model hold the same weights.
    flat = {
        k: v * mx.random.uniform(0.5, 1.5, v.shape, key=mx.random.key(seed * 7919 + i))
        for i, (k, v) in enumerate(tree_flatten(module.parameters()))
        if is_norm_or_dt_bias(k, v)
    }
    module.update(_unflatten(flat))


def _scale(module: nn.Module, names: tuple[str, ...], factor: float) -> None:
    flat = {k: v * factor for k, v in tree_flatten(module.parameters()) if k.endswith(names)}
    module.update(_unflatten(flat))


def build_target(
    text: dict,
    *,
    seed: int = 0,
    predictable: float | None = None,
    head_scale: float = 1.0,
    dtype=mx.bfloat16,
):
    """An mlx-lm qwen3_5 / qwen3_5_moe module with seeded random (or predictable) weights.

    ``head_scale`` < 1 softens the predictable head so that sampling has several likely tokens.
    """
    model_type = "qwen3_5_moe" if text.get("num_experts", 0) else "qwen3_5"
    mx.random.seed(seed)
    model = build_model(_model_config(model_type, text))
    perturb_norms(model, seed)
    if predictable is not None:
        lm = model.language_model
        embed = lm.model.embed_tokens.weight  # [V, H]
        nxt = _next_token_map(embed.shape[0], seed)
        head = mx.zeros_like(embed)
        head = head.at[mx.array(nxt)].add(embed)  # row y = sum of embeddings of ids mapping to y
        lm.lm_head.weight = head * head_scale
        _scale(model, ("o_proj.weight", "out_proj.weight", "down_proj.weight"), predictable)
    flat = {
        k: (v if k.endswith("A_log") else v.astype(dtype))
        for k, v in tree_flatten(model.parameters())
    }
    model.update(_unflatten(flat))
    mx.eval(model.parameters())
    return model


def build_drafter(
    text: dict, *, seed: int = 1, predictable: float | None = None, dtype=mx.bfloat16
):
    """A qwen3_5_mtp head; ``predictable`` makes it pass the input token's embedding through."""
    mx.random.seed(seed)
    module = Qwen35MTP(_model_config("qwen3_5_mtp", text, 3))
    perturb_norms(module, seed)
    if predictable is not None:
        h = text["hidden_size"]
        module.fc.weight = mx.concatenate([mx.eye(h), mx.zeros((h, h))], axis=1)  # [H, 2H]
        _scale(module, ("o_proj.weight", "down_proj.weight"), predictable)
    flat = {k: v.astype(dtype) for k, v in tree_flatten(module.parameters())}
    module.update(_unflatten(flat))
    mx.eval(module.parameters())
    return module


def _quantize(module: nn.Module, bits: int, group_size: int, moe: bool) -> dict:
    """Quantize like mlx-lm's converter; returns the config's ``quantization`` block."""
    block: dict = {"group_size": group_size, "bits": bits, "mode": "affine"}

    def predicate(path, m):
        if not hasattr(m, "to_quantized") or m.weight.shape[-1] % group_size:
            return False
        if moe and (path.endswith("mlp.gate") or path.endswith("shared_expert_gate")):
            block[path] = {"group_size": group_size, "bits": 8}  # per-module override
            return block[path]
        return True

    nn.quantize(module, group_size=group_size, bits=bits, class_predicate=predicate)
    return block


def _save(out: Path, tensors: dict[str, mx.array], shards: int, tag: str = "mlx") -> None:
    """Safetensors files with the ``format`` tag their writer puts there: ``mlx`` for MLX
    conversions, ``pt`` for transformers' raw checkpoints."""
    names = sorted(tensors)
    if shards <= 1:
        mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": tag})
        return
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * per : (i + 1) * per]}
        mx.save_safetensors(str(out / fname), part, metadata={"format": tag})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(v.nbytes for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def byte_tokenizer(vocab_size: int | None = None):
    """A byte-level BPE of 256 bytes + 3 specials (ids 256-258); with ``vocab_size``,
    unreachable filler tokens come between them, so that every id of a model decodes and the
    specials are its last three ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(_bytes_to_unicode())}  # id == byte value
    for i in range(len(vocab), (vocab_size or 0) - len(SPECIAL_TOKENS)):
        vocab[f"<{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def write_tokenizer(out: Path, tok=None) -> None:
    """A tokenizer with a ChatML template: ``tok`` (a ``tokenizers.Tokenizer`` holding the
    special tokens), else ``byte_tokenizer()``."""
    tok = byte_tokenizer() if tok is None else tok
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
        )
    )


def _bytes_to_unicode() -> list[str]:
    # GPT-2's byte -> printable character table, indexed by byte value.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    mapping = dict(zip(bs, cs, strict=True))
    return [chr(mapping[b]) for b in range(256)]


def _raw_target_names(flat: dict[str, mx.array], moe: bool) -> dict[str, mx.array]:
    shifted = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
               ".k_norm.weight", "model.norm.weight")  # fmt: skip
    out = {}
    for k, v in flat.items():
        if k.startswith("language_model.model."):
            k = "model.language_model." + k[len("language_model.model.") :]
        elif k.startswith("language_model."):
            k = k[len("language_model.") :]
        if "conv1d.weight" in k:
            v = v.transpose(0, 2, 1)  # MLX [C, K, 1] -> torch [C, 1, K]
        if k.endswith(shifted):
            v = v - 1.0
        out[k] = v
    if moe:
        _fuse_experts(out)
    return out


def _fuse_experts(out: dict[str, mx.array]) -> None:
    for key in [k for k in out if k.endswith("switch_mlp.gate_proj.weight")]:
        prefix = key[: -len(".switch_mlp.gate_proj.weight")]
        gate = out.pop(f"{prefix}.switch_mlp.gate_proj.weight")
        up = out.pop(f"{prefix}.switch_mlp.up_proj.weight")
        out[f"{prefix}.experts.gate_up_proj"] = mx.concatenate([gate, up], axis=-2)
        out[f"{prefix}.experts.down_proj"] = out.pop(f"{prefix}.switch_mlp.down_proj.weight")


def raw_mtp_tensors(drafter: nn.Module, moe: bool) -> dict[str, mx.array]:
    """A drafter's tensors as a raw Hugging Face checkpoint stores them (``mtp.*``, w-1 norms)."""
    from .weights import NORM_SHIFT_SUFFIXES

    out = {}
    for k, v in tree_flatten(drafter.parameters()):
        out["mtp." + k] = v - 1.0 if k.endswith(NORM_SHIFT_SUFFIXES) else v
    if moe:
        _fuse_experts(out)
    return out


# The tensors a raw checkpoint stores in float32 whatever its dtype (Qwen3.5-0.8B's index).
RAW_FLOAT32 = (".linear_attn.A_log", ".linear_attn.norm.weight")


def write_target(
    out: Path,
    text: dict,
    *,
    layout: str = "mlx",
    bits: int | None = None,
    group_size: int = 32,
    dtype=mx.bfloat16,
    seed: int = 0,
    predictable: float | None = None,
    shards: int = 1,
    model: nn.Module | None = None,
    drafter: nn.Module | None = None,
    tokenizer=None,
    quantization: dict | None = None,
) -> Path:
    """Write a target checkpoint (with tokenizer) in ``layout``: mlx, flat or raw.

    ``drafter``: the head a raw checkpoint stores as ``mtp.*`` (w - 1 norms; a random one if
    None), or that an mlx conversion keeps as ``mtp.*`` (w norms; none if None).
    ``quantization``: the config block of a ``model`` that is already quantized."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    moe = bool(text.get("num_experts", 0))
    model = model or build_target(text, seed=seed, predictable=predictable, dtype=dtype)
    config = full_config(dict(text, eos_token_id=text.get("eos_token_id", EOS_ID)))
    vision = vision_tensors(config["vision_config"], dtype)
    if layout == "raw":
        if bits:
            raise ValueError("raw Hugging Face checkpoints are not quantized")
        flat = _raw_target_names(dict(tree_flatten(model.parameters())), moe)
        flat.update(raw_mtp_tensors(drafter or build_drafter(text, dtype=dtype), moe))
        flat.update(vision)
        # As published: the recurrence's A_log and gated norm in float32, the rest in the
        # checkpoint's dtype (MoE experts too, whatever the machine ran them in).
        flat = {k: v.astype(mx.float32 if k.endswith(RAW_FLOAT32) else dtype)
                for k, v in flat.items()}  # fmt: skip
        tag = "pt"
    else:
        if bits:
            quantization = _quantize(model, bits, group_size, moe)
        if quantization:
            config["quantization"] = config["quantization_config"] = quantization
        flat = dict(tree_flatten(model.parameters()))
        tag = "mlx"
        if layout == "mlx":
            flat.update(mlx_vision_tensors(vision))
            if drafter is not None:  # a conversion that kept the head (mlx-vlm --mtp): w stored
                flat.update({"mtp." + k: v for k, v in tree_flatten(drafter.parameters())})
        elif layout == "flat":
            flat = {k[len("language_model.") :]: v for k, v in flat.items()}
            config = {"model_type": config["model_type"]} | {
                k: v for k, v in config["text_config"].items() if k != "model_type"
            } | ({"quantization": quantization, "quantization_config": quantization}
                 if quantization else {})  # fmt: skip
        else:
            raise ValueError(f"unknown layout {layout!r}")
    _save(out, flat, shards, tag)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(out, tokenizer)
    return out


def write_drafter(
    out: Path,
    text: dict,
    *,
    bits: int | None = None,
    group_size: int = 32,
    dtype=mx.bfloat16,
    seed: int = 1,
    predictable: float | None = None,
    block_size: int = 3,
    module: nn.Module | None = None,
) -> Path:
    """Write a standalone ``qwen3_5_mtp`` drafter (the mlx-community MTP layout)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    module = module or build_drafter(text, seed=seed, predictable=predictable, dtype=dtype)
    text = full_text_config(text)
    tied = text.pop("tie_word_embeddings", False)
    if tied:
        text["tie_word_embeddings"] = True
    # As mlx-vlm's split writes one: the target's whole text_config (as its config states it).
    config: dict = {"block_size": block_size, "model_type": "qwen3_5_mtp", "text_config": text,
                    "tie_word_embeddings": tied}  # fmt: skip
    if bits:
        q = _quantize(module, bits, group_size, bool(text.get("num_experts")))
        config["quantization"] = config["quantization_config"] = q
    _save(out, dict(tree_flatten(module.parameters())), 1)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out
