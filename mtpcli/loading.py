"""Resolve, validate and load a target and its drafter. Shared by every command.

The drafter gate is strict and reads headers only: a directory is a drafter when its
model_type is ``qwen3_5_mtp`` and its tensors are exactly a standalone MTP head whose shapes
fit the target. ``mtp_num_hidden_layers`` in a config is never taken as a sign of MTP weights.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .config import DRAFTER_TYPES, TARGET_TYPES, ModelConfig, load_config, read_json_object
from .drafters import DRAFTER_KINDS, Drafter
from .errors import (
    BadConfigError,
    DrafterMismatchError,
    ModelNotFoundError,
    NotStandaloneDrafterError,
    TargetNotMTPCapableError,
    UnsupportedModelTypeError,
    UsageError,
)
from .files import readable_dir
from .models import Target
from .options import Options
from .tokenizer import load_tokenizer
from .weights import (
    MTP_PREFIX,
    TensorInfo,
    check_inventory,
    quantize_like,
    read_inventory,
    sanitize_drafter,
)

MTP_TARGET_TYPES = TARGET_TYPES  # every target family we load can run MTP
DRAFT_KINDS = ("auto", "mtp", "none")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_SNAPSHOT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model"]
_MX_DTYPES = {
    "F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16, "U32": mx.uint32,
    "I32": mx.int32, "U8": mx.uint8, "I8": mx.int8, "F64": mx.float32, "I64": mx.int64,
}  # fmt: skip
SPLIT_HINT = (
    "use a standalone qwen3_5_mtp drafter (for Qwen3.8-27B: mlx-community/Qwen3.8-27B-MTP-bf16), "
    "or split one out of this checkpoint with `mtp extract-drafter DIR OUT`"
)


def resolve_path(ref: str, what: str = "model") -> Path:
    """A local directory, or a Hugging Face repo id resolved to a local snapshot."""
    path = Path(ref).expanduser()
    if path.exists() or path.is_symlink():
        return readable_dir(path, what, ModelNotFoundError)
    if not _REPO_ID.match(ref):
        raise ModelNotFoundError(f"{what} {ref} does not exist")
    from huggingface_hub import snapshot_download

    try:
        snapshot = snapshot_download(ref, local_files_only=True, allow_patterns=_SNAPSHOT_PATTERNS)
        return readable_dir(Path(snapshot), what, ModelNotFoundError)
    except ModelNotFoundError:
        raise
    except Exception:  # noqa: BLE001 - not cached: try the hub below
        pass
    try:
        snapshot = snapshot_download(ref, allow_patterns=_SNAPSHOT_PATTERNS)
    except Exception as e:  # noqa: BLE001 - any hub failure is the same user-facing problem
        raise ModelNotFoundError(
            f"{what} '{ref}' is not a local directory and the Hugging Face Hub could not "
            f"provide it ({type(e).__name__}); download it first (`hf download {ref}`) "
            "or pass a local path"
        ) from e
    return readable_dir(Path(snapshot), what, ModelNotFoundError)


def peek_model_type(model_dir: Path) -> str:
    value = read_json_object(model_dir / "config.json", "config.json").get("model_type")
    return value if isinstance(value, str) else ""


def resolve_draft_kind(requested: str, drafter_type: str | None, target_type: str) -> str:
    """auto|mtp|none + the drafter's model_type -> the drafter kind to run ("mtp" or "none")."""
    if requested not in DRAFT_KINDS:
        raise UsageError(f"--draft-kind must be one of {', '.join(DRAFT_KINDS)}, got {requested!r}")
    if requested == "none":
        return "none"
    if drafter_type is None:
        if requested == "mtp":
            raise UsageError("--draft-kind mtp needs --draft-model (a qwen3_5_mtp drafter)")
        return "none"
    if drafter_type in TARGET_TYPES:
        raise NotStandaloneDrafterError(
            f"the --draft-model is a {drafter_type} model, not a drafter; {SPLIT_HINT}"
        )
    kind = DRAFTER_KINDS.get(drafter_type)
    if kind is None:
        raise UnsupportedModelTypeError(f"Unsupported model type: {drafter_type}")
    if target_type not in MTP_TARGET_TYPES:
        raise TargetNotMTPCapableError(
            f"--draft-kind {kind} needs an MTP-capable target; the target's model_type is "
            f"'{target_type}', supported: {', '.join(MTP_TARGET_TYPES)}"
        )
    return kind


def _placeholders(inv: dict[str, TensorInfo]) -> dict[str, mx.array]:
    # Lazy arrays of the right shape and dtype: never evaluated, so nothing is allocated.
    return {n: mx.zeros(i.shape, dtype=_MX_DTYPES.get(i.dtype, mx.uint8)) for n, i in inv.items()}


_FIT_FIELDS = (
    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size",
)  # fmt: skip


def check_drafter(drafter_dir: Path, target: ModelConfig | None = None) -> ModelConfig:
    """The strict drafter gate, from headers alone. Returns the drafter's config."""
    from .drafters.qwen3_5_mtp import Qwen35MTP

    model_type = peek_model_type(drafter_dir)
    inv = read_inventory(drafter_dir) if model_type in TARGET_TYPES else None
    if model_type in TARGET_TYPES:
        n_mtp = sum(1 for n in inv if n.startswith(MTP_PREFIX))
        what = (
            f"a full {model_type} checkpoint carrying {n_mtp} mtp.* tensors"
            if n_mtp
            else f"a {model_type} target with no MTP tensors"
        )
        raise NotStandaloneDrafterError(f"{drafter_dir} is {what}, not a drafter; {SPLIT_HINT}")
    if model_type not in DRAFTER_TYPES:
        raise UnsupportedModelTypeError(f"Unsupported model type: {model_type or '(none)'}")
    config = load_config(drafter_dir)
    inv = read_inventory(drafter_dir)
    if any(n.startswith(MTP_PREFIX) for n in inv):
        raise NotStandaloneDrafterError(
            f"{drafter_dir} stores raw mtp.* tensor names; {SPLIT_HINT}"
        )
    module = Qwen35MTP(config)
    weights = sanitize_drafter(_placeholders(inv), shift=False)  # no mtp.* names here
    quantize_like(module, config.quantization, weights)
    expected = {k: (v.shape, v.dtype) for k, v in tree_flatten(module.parameters())}
    check_inventory(expected, weights, f"drafter {drafter_dir}")
    if target is not None:
        for name in _FIT_FIELDS:
            d, t = getattr(config.text, name), getattr(target.text, name)
            if d != t:
                raise DrafterMismatchError(
                    f"drafter {drafter_dir} does not fit the target: {name} is {d} in the "
                    f"drafter and {t} in the target; use the drafter made for this model"
                )
    return config


@dataclass
class Loaded:
    """A target, its drafter (None without one, or with ``--draft-kind none``) and tokenizer,
    loaded under ``options``."""

    target: Target
    drafter: Drafter | None
    tokenizer: TokenizerWrapper
    draft_kind: str  # "mtp" or "none"
    target_dir: Path
    drafter_dir: Path | None
    options: Options = Options()
    draft_quantize: int | None = None  # bits the drafter was quantized to at load

    @property
    def eos(self) -> frozenset[int]:
        """The token ids that end a generation: the tokenizer's and the target config's."""
        return frozenset(self.tokenizer.eos_token_ids) | frozenset(self.target.config.eos_token_ids)

    @property
    def pair_key(self) -> str:
        """Names this target and drafter wherever they are reached from (links, relative
        paths, repo ids): the gate keeps the pair's acceptance under it."""
        drafter = self.drafter_dir.resolve() if self.drafter_dir else None
        bits = f"|q{self.draft_quantize}" if self.draft_quantize else ""
        return f"{self.target_dir.resolve()}|{drafter}{bits}"


def load_pair(model: str, draft_model: str | None = None, draft_kind: str = "auto",
              options: Options = Options(), draft_quantize: int | None = None,
              progress: Callable[[str], None] = lambda msg: None) -> Loaded:  # fmt: skip
    """Resolve, gate and load a target (+ drafter): local directories or Hugging Face repo ids;
    ``draft_kind`` auto, mtp or none; ``draft_quantize`` (4 or 8) quantizes a bf16 drafter at
    load; ``progress`` is told what is being loaded. Nothing is allocated before the checks
    pass."""
    from .drafters.qwen3_5_mtp import load_drafter
    from .models.pipeline import stage
    from .models.qwen3_5 import load_target

    target_dir = resolve_path(model, "model")
    target_type = peek_model_type(target_dir)
    use_drafter = draft_model is not None and draft_kind != "none"  # none ignores the drafter
    drafter_dir = resolve_path(draft_model, "draft model") if use_drafter else None
    if draft_kind == "mtp" and target_type not in MTP_TARGET_TYPES:
        raise TargetNotMTPCapableError(
            f"--draft-kind mtp needs an MTP-capable target; the target's model_type is "
            f"'{target_type}', supported: {', '.join(MTP_TARGET_TYPES)}"
        )
    if target_type in DRAFTER_TYPES:
        raise UsageError(f"{target_dir} is a {target_type} drafter; pass it as --draft-model")
    tcfg = load_config(target_dir)
    if tcfg.fp8_block:
        raise BadConfigError(
            f"{target_dir} is a block-FP8 checkpoint, which this tool does not run; use an MLX "
            "conversion of it (mlx-community), or take its drafter with mtp extract-drafter"
        )
    drafter_type = peek_model_type(drafter_dir) if drafter_dir else None
    if drafter_type in TARGET_TYPES:
        check_drafter(drafter_dir)  # refuses with what the directory is and how to get a drafter
    kind = resolve_draft_kind(draft_kind, drafter_type, tcfg.model_type)
    dcfg = check_drafter(drafter_dir, tcfg) if kind == "mtp" else None
    progress("loading the tokenizer")
    tokenizer = load_tokenizer(target_dir, tcfg.eos_token_ids, tcfg.text.vocab_size)
    size = sum(t.nbytes for t in read_inventory(target_dir).values()) / 1e9
    progress(f"loading the target ({size:.1f} GB)")
    # Under mlx.launch (several processes), this one loads and runs its part of the layers.
    target = load_target(target_dir, tcfg, options, stage(tcfg.text.num_hidden_layers))
    if dcfg:
        progress("loading the drafter" + (f", quantizing it to {draft_quantize} bits"
                                          if draft_quantize else ""))  # fmt: skip
    drafter = (load_drafter(drafter_dir, dcfg, target.embed_tokens, options, draft_quantize)
               if dcfg else None)  # fmt: skip
    return Loaded(target, drafter, tokenizer, kind, target_dir, drafter_dir, options,
                  draft_quantize if dcfg else None)  # fmt: skip
