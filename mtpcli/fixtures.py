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
        "rope_parameters": {
            "rope_type": "default",
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    }
    if moe:
        cfg.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            norm_topk_prob=True,
            decoder_sparse_step=1,
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


def _save(out: Path, tensors: dict[str, mx.array], shards: int) -> None:
    names = sorted(tensors)
    if shards <= 1:
        mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
        return
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * per : (i + 1) * per]}
        mx.save_safetensors(str(out / fname), part, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {}, "weight_map": weight_map}
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

    ``quantization``: the config block of a ``model`` that is already quantized."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    moe = bool(text.get("num_experts", 0))
    model_type = "qwen3_5_moe" if moe else "qwen3_5"
    model = model or build_target(text, seed=seed, predictable=predictable, dtype=dtype)
    config: dict = {"model_type": model_type, "eos_token_id": text.get("eos_token_id", EOS_ID)}
    if layout == "raw":
        if bits:
            raise ValueError("raw Hugging Face checkpoints are not quantized")
        flat = _raw_target_names(dict(tree_flatten(model.parameters())), moe)
        flat.update(raw_mtp_tensors(drafter or build_drafter(text, dtype=dtype), moe))
        flat["model.visual.patch_embed.proj.weight"] = mx.zeros((8, 3, 2, 2), dtype=dtype)
        config.update(text_config=text, architectures=["Qwen3_5ForConditionalGeneration"])
    else:
        if bits:
            quantization = _quantize(model, bits, group_size, moe)
        if quantization:
            config["quantization"] = config["quantization_config"] = quantization
        flat = dict(tree_flatten(model.parameters()))
        if layout == "mlx":
            # A stand-in for the vision tower, in MLX's conv3d layout [out, T, kH, kW, C] as
            # mlx-community conversions store it (the loaders drop it; mlx-vlm checks its rank).
            flat["vision_tower.patch_embed.proj.weight"] = mx.zeros((8, 2, 2, 2, 3), dtype=dtype)
            config.update(text_config=text, vision_config={"depth": 1})
        elif layout == "flat":
            flat = {k[len("language_model.") :]: v for k, v in flat.items()}
            config.update({k: v for k, v in text.items() if k != "model_type"})
        else:
            raise ValueError(f"unknown layout {layout!r}")
    _save(out, flat, shards)
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
    config: dict = {"model_type": "qwen3_5_mtp", "block_size": block_size, "text_config": text}
    if bits:
        config["quantization"] = _quantize(module, bits, group_size, bool(text.get("num_experts")))
    _save(out, dict(tree_flatten(module.parameters())), 1)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out
