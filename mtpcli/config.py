"""Typed, bounds-checked model configs.

Only known fields are kept. Every scalar is checked before anything is allocated, so a
mistyped or absurd config fails here with a named error instead of deep inside MLX.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import BadConfigError, ConfigOutOfBoundsError, UnsupportedModelTypeError, UsageError
from .files import read_bounded

# A round's tokens, pending token included: a drafter's ``block_size`` and every block size a
# user asks for.
BLOCK_MIN, BLOCK_MAX = 2, 16


def check_block_size(value: int, param: str = "block_size") -> int:
    """``value`` if it is a block size we run (tokens a round, the pending one included), else
    a usage error about the input ``param`` (its API name; front ends name it their way)."""
    if isinstance(value, bool) or not isinstance(value, int) or not BLOCK_MIN <= value <= BLOCK_MAX:
        raise UsageError(f"must be in [{BLOCK_MIN}, {BLOCK_MAX}], got {value!r}", param=param)
    return value


# model_type -> what it is, for targets and drafters.
TARGET_TYPES = ("qwen3_5", "qwen3_5_moe")
DRAFTER_TYPES = ("qwen3_5_mtp",)

_KNOWN_QUANT_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")


def _int(d: dict, key: str, lo: int, hi: int, default: Any = dataclasses.MISSING) -> int:
    if key not in d or d[key] is None:
        if default is dataclasses.MISSING:
            raise BadConfigError(f"config is missing '{key}'")
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigOutOfBoundsError(f"config '{key}' must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise ConfigOutOfBoundsError(f"config '{key}' = {v} is outside [{lo}, {hi}]")
    return v


def _float(d: dict, key: str, lo: float, hi: float, default: float) -> float:
    v = d.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigOutOfBoundsError(f"config '{key}' must be a finite number, got {v!r}")
    if not lo < v <= hi:
        raise ConfigOutOfBoundsError(f"config '{key}' = {v} is outside ({lo}, {hi}]")
    return float(v)


def _bool(d: dict, key: str, default: bool) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise ConfigOutOfBoundsError(f"config '{key}' must be true or false, got {v!r}")
    return v


def _rope(d: dict) -> dict:
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise ConfigOutOfBoundsError(f"config 'rope_parameters' must be an object, got {rp!r}")
    merged = {k: d[k] for k in ("rope_theta", "partial_rotary_factor") if k in d}
    merged.update(rp)
    rope_type = merged.get("type", merged.get("rope_type", "default"))
    if rope_type not in ("default", "linear", "dynamic", "yarn"):
        raise ConfigOutOfBoundsError(f"rope type {rope_type!r} is not supported")
    out = {
        "type": rope_type,
        "rope_theta": _float(merged, "rope_theta", 0.0, 1e12, 100000.0),
        "partial_rotary_factor": _float(merged, "partial_rotary_factor", 0.0, 1.0, 0.25),
    }
    section = merged.get("mrope_section", [11, 11, 10])
    if not (
        isinstance(section, list)
        and 0 < len(section) <= 4
        and all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= 4096 for s in section)
    ):
        raise ConfigOutOfBoundsError(
            f"config 'mrope_section' must be a short list of ints: {section!r}"
        )
    out["mrope_section"] = section
    if rope_type != "default":
        out["factor"] = _float(merged, "factor", 0.0, 1e4, 1.0)
        for key in ("original_max_position_embeddings", "beta_fast", "beta_slow"):
            if key in merged:
                out[key] = _float(merged, key, 0.0, 1e8, 1.0)
    if "mrope_interleaved" in merged:
        out["mrope_interleaved"] = _bool(merged, "mrope_interleaved", True)
    return out


@dataclass(frozen=True)
class TextConfig:
    """The decoder shape of a Qwen3.5-family model (target, or the drafter's mirror of it)."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    linear_num_value_heads: int
    linear_num_key_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    full_attention_interval: int
    tie_word_embeddings: bool
    attention_bias: bool
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mtp_num_hidden_layers: int
    rope_parameters: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict, model_type: str) -> TextConfig:
        if not isinstance(d, dict):
            raise BadConfigError(f"text_config must be a JSON object, got {type(d).__name__}")
        hidden = _int(d, "hidden_size", 1, 65536)
        heads = _int(d, "num_attention_heads", 1, 1024)
        kv_heads = _int(d, "num_key_value_heads", 1, 1024, heads)
        if heads % kv_heads:
            raise ConfigOutOfBoundsError(
                f"num_attention_heads ({heads}) is not a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        head_dim = _int(d, "head_dim", 2, 1024, max(hidden // heads, 2))
        layers = _int(d, "num_hidden_layers", 1, 1024)
        rope = _rope(d)
        rotary = int(head_dim * rope["partial_rotary_factor"])
        if rotary < 2 or rotary % 2:
            raise ConfigOutOfBoundsError(
                f"partial_rotary_factor {rope['partial_rotary_factor']} of head_dim {head_dim} "
                f"rotates {rotary} dimensions; RoPE needs an even number, at least 2"
            )
        lv = _int(d, "linear_num_value_heads", 1, 1024, 64)
        lk = _int(d, "linear_num_key_heads", 1, 1024, 16)
        if lv % lk:
            raise ConfigOutOfBoundsError(
                f"linear_num_value_heads ({lv}) is not a multiple of linear_num_key_heads ({lk})"
            )
        experts = _int(d, "num_experts", 0, 4096, 0)
        per_tok = _int(d, "num_experts_per_tok", 0, max(experts, 0), 0)
        if experts and not per_tok:
            raise ConfigOutOfBoundsError("num_experts_per_tok must be at least 1 for an MoE model")
        return cls(
            model_type=str(d.get("model_type", model_type)),
            hidden_size=hidden,
            num_hidden_layers=layers,
            intermediate_size=_int(d, "intermediate_size", 1, 1 << 20, 4 * hidden),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_float(d, "rms_norm_eps", 0.0, 0.1, 1e-6),
            vocab_size=_int(d, "vocab_size", 2, 1 << 22),
            max_position_embeddings=_int(d, "max_position_embeddings", 1, 1 << 24, 262144),
            linear_num_value_heads=lv,
            linear_num_key_heads=lk,
            linear_key_head_dim=_int(d, "linear_key_head_dim", 1, 1024, 128),
            linear_value_head_dim=_int(d, "linear_value_head_dim", 1, 1024, 128),
            linear_conv_kernel_dim=_int(d, "linear_conv_kernel_dim", 1, 64, 4),
            full_attention_interval=_int(d, "full_attention_interval", 1, 1024, 4),
            tie_word_embeddings=_bool(d, "tie_word_embeddings", False),
            attention_bias=_bool(d, "attention_bias", False),
            num_experts=experts,
            num_experts_per_tok=per_tok,
            moe_intermediate_size=_int(d, "moe_intermediate_size", 0, 1 << 20, 0),
            shared_expert_intermediate_size=_int(
                d, "shared_expert_intermediate_size", 0, 1 << 20, 0
            ),
            norm_topk_prob=_bool(d, "norm_topk_prob", True),
            decoder_sparse_step=_int(d, "decoder_sparse_step", 1, 1024, 1),
            mtp_num_hidden_layers=_int(d, "mtp_num_hidden_layers", 0, 16, 0),
            rope_parameters=rope,
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def to_mlx_lm(self, **overrides: Any) -> dict:
        """The dict mlx-lm's ``TextModelArgs.from_dict`` takes."""
        d = dataclasses.asdict(self)
        d["rope_parameters"] = dict(self.rope_parameters)
        d.update(overrides)
        return d


@dataclass(frozen=True)
class ModelConfig:
    """A checkpoint's config.json, reduced to what this tool uses."""

    model_type: str
    text: TextConfig
    quantization: dict | None
    eos_token_ids: tuple[int, ...]
    block_size: int | None  # drafters only: the whole round, pending token included
    nested: bool  # text_config nested (VLM-style) or flat
    # a raw block-FP8 checkpoint's scale block (rows, columns): F8_E4M3 weights, each with a
    # ``weight_scale_inv`` per block; only ``extract-drafter`` reads these
    fp8_block: tuple[int, int] | None = None


def _fp8_block(d: dict) -> tuple[int, int] | None:
    """The scale block of a Hugging Face block-FP8 config (``quant_method`` fp8, e4m3,
    ``weight_block_size`` [rows, columns]); None for any other config."""
    q = d.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        return None
    block = q.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= 4096
                       for b in block)):  # fmt: skip
        raise ConfigOutOfBoundsError(
            f"an fp8 quantization_config needs weight_block_size [rows, columns] (1-4096), got "
            f"{block!r}; per-tensor FP8 is not supported"
        )
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigOutOfBoundsError(f"fp8 format {q.get('fmt')!r} is not supported (e4m3 is)")
    return block[0], block[1]


def _quantization(d: dict) -> dict | None:
    if _fp8_block(d):
        return None
    q = d.get("quantization", d.get("quantization_config"))
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigOutOfBoundsError(f"config 'quantization' must be an object, got {q!r}")
    if "quant_method" in q and "bits" not in q:
        raise BadConfigError(
            f"quantization method '{q['quant_method']}' is not supported; "
            "use an MLX conversion (affine, mxfp4, nvfp4 or mxfp8)"
        )

    def check(where: str, spec: dict) -> None:
        _int(spec, "group_size", 1, 1024, 64)
        if spec.get("group_size", 64) not in (16, 32, 64, 128):
            raise ConfigOutOfBoundsError(f"{where} group_size must be 16, 32, 64 or 128")
        if _int(spec, "bits", 1, 8) not in (2, 3, 4, 5, 6, 8):
            raise ConfigOutOfBoundsError(f"{where} bits must be 2, 3, 4, 5, 6 or 8")
        if spec.get("mode", "affine") not in _KNOWN_QUANT_MODES:
            raise ConfigOutOfBoundsError(f"{where} mode {spec.get('mode')!r} is unknown")

    check("quantization", q)
    for key, spec in q.items():
        if isinstance(spec, dict):
            check(f"quantization override '{key}'", spec)
    return q


def _eos(*dicts: dict) -> tuple[int, ...]:
    ids: list[int] = []
    for d in dicts:
        v = d.get("eos_token_id")
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, int) and not isinstance(x, bool) and x >= 0 and x not in ids:
                ids.append(x)
    return tuple(ids)


def read_json_object(path: Path, what: str) -> dict:
    """Read a JSON object from ``path``, or raise a named error saying what is wrong."""
    raw = read_bounded(path, what)
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BadConfigError(f"{path} is not UTF-8 text") from e
    except json.JSONDecodeError as e:
        raise BadConfigError(f"{path} is not valid JSON: {e.msg} (line {e.lineno})") from e
    except RecursionError as e:
        raise BadConfigError(f"{path} is nested too deeply to be a {what}") from e
    if not isinstance(obj, dict):
        raise BadConfigError(f"{path} must hold a JSON object, found {type(obj).__name__}")
    return obj


def load_config(model_dir: Path) -> ModelConfig:
    """Read and bound-check ``model_dir/config.json``."""
    d = read_json_object(model_dir / "config.json", "config.json")
    model_type = d.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise BadConfigError(f"{model_dir / 'config.json'} has no 'model_type'")
    nested = "text_config" in d
    if model_type in DRAFTER_TYPES and not nested:
        raise BadConfigError(
            f"drafter config {model_dir / 'config.json'} is missing 'text_config' "
            "(a qwen3_5_mtp drafter carries the full text config of its target)"
        )
    if model_type not in TARGET_TYPES + DRAFTER_TYPES:
        raise UnsupportedModelTypeError(
            f"Unsupported model type: {model_type} (targets: {', '.join(TARGET_TYPES)}; "
            f"drafters: {', '.join(DRAFTER_TYPES)})"
        )
    text_d = d["text_config"] if nested else d
    if nested and isinstance(text_d, dict) and "tie_word_embeddings" not in text_d:
        # Published configs of untied models state it at the top level only.
        text_d = text_d | {k: d[k] for k in ("tie_word_embeddings",) if k in d}
    text = TextConfig.from_dict(text_d, model_type)
    block_size = None
    if model_type in DRAFTER_TYPES:
        default = max(text.mtp_num_hidden_layers, 1) + 2
        block_size = _int(d, "block_size", BLOCK_MIN, BLOCK_MAX, default)
    quant = _quantization(d)
    return ModelConfig(
        model_type=model_type,
        text=text,
        quantization=quant,
        eos_token_ids=_eos(d, text_d if isinstance(text_d, dict) else {}),
        block_size=block_size,
        nested=nested,
        fp8_block=_fp8_block(d),
    )
