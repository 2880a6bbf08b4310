"""Safetensors inventories, checked headers, and the drafter's checkpoint layout.

Headers are read through the safetensors library (no tensor data is touched), so every
file is validated before MLX maps it. ``sanitize_drafter`` is the one place where the raw
Hugging Face MTP layout is turned into the standalone MLX layout.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from safetensors import SafetensorError, safe_open

from .config import read_json_object
from .errors import BadCheckpointError, BadConfigError
from .files import regular_file, why

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip

MTP_PREFIX = "mtp."
# Raw checkpoints store these RMSNorm weights as w - 1; the standalone MLX layout already
# holds w. Exactly these seven suffixes are shifted, nothing else.
NORM_SHIFT_SUFFIXES = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "norm.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
)
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    file: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES.get(self.dtype, 1)


def _checked_file(path: Path) -> Path:
    real = regular_file(path, "weights file", BadCheckpointError).resolve()
    try:  # the cause MLX's own open would hide ("Failed to open file")
        os.close(os.open(real, os.O_RDONLY))
    except OSError as e:
        raise BadCheckpointError(f"cannot read the weights file {path}: {why(e)}") from e
    return real


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those named by the index, else ``*.safetensors``."""
    index = model_dir / INDEX_FILE
    if index.exists() or index.is_symlink():
        try:
            obj = read_json_object(index, INDEX_FILE)
        except BadConfigError as e:
            raise BadCheckpointError(str(e)) from e
        wmap = obj.get("weight_map")
        if not isinstance(wmap, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()
        ):
            raise BadCheckpointError(f"{index} has no valid 'weight_map'")
        names = sorted(set(wmap.values()))
        for n in names:
            if "/" in n or "\\" in n or n.startswith("."):
                raise BadCheckpointError(f"{index} names a file outside the checkpoint: {n!r}")
        return [model_dir / n for n in names]
    files = sorted(p for p in model_dir.glob("*.safetensors"))
    if not files:
        raise BadCheckpointError(f"no .safetensors weights in {model_dir}")
    return files


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Validated header of one safetensors file: names, dtypes and shapes, no data read."""
    real = _checked_file(path)
    try:
        with safe_open(str(real), framework="numpy") as f:
            out = {}
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = TensorInfo(sl.get_dtype(), tuple(sl.get_shape()), path.name)
            return out
    except SafetensorError as e:
        raise BadCheckpointError(f"{path} is not a valid safetensors file: {e}") from e
    except OSError as e:
        raise BadCheckpointError(f"cannot read {path}: {e}") from e


def read_format(path: Path) -> str | None:
    """A safetensors file's ``format`` metadata tag (``pt`` from transformers, ``mlx`` from
    MLX), None where it has none."""
    real = _checked_file(path)
    try:
        with safe_open(str(real), framework="numpy") as f:
            tag = (f.metadata() or {}).get("format")
    except (SafetensorError, OSError) as e:
        raise BadCheckpointError(f"{path} is not a valid safetensors file: {e}") from e
    return tag if isinstance(tag, str) else None


def read_inventory(model_dir: Path) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint, from headers alone; duplicates and index drift refused
    (tensors the index lists but no file holds, or that a file holds but the index omits,
    also in a ``*.safetensors`` file the index does not name)."""
    inv: dict[str, TensorInfo] = {}
    for f in weight_files(model_dir):
        for name, info in read_header(f).items():
            if name in inv:
                raise BadCheckpointError(
                    f"tensor {name} appears in both {inv[name].file} and {f.name}"
                )
            inv[name] = info
    index = model_dir / INDEX_FILE
    if index.exists():
        wmap = read_json_object(index, INDEX_FILE)["weight_map"]
        missing = sorted(k for k, v in wmap.items() if k not in inv or inv[k].file != v)
        if missing:
            raise BadCheckpointError(
                f"{index} lists {len(missing)} tensors its files do not hold, e.g. {missing[0]}"
            )
        unlisted = sorted(k for k in inv if k not in wmap)
        if unlisted:
            raise BadCheckpointError(
                f"{inv[unlisted[0]].file} holds {len(unlisted)} tensor(s) that {INDEX_FILE} "
                f"does not list, e.g. {unlisted[0]}: the index is out of date; add them to "
                "its weight_map"
            )
        named = {f.name for f in weight_files(model_dir)}
        for f in sorted(model_dir.glob("*.safetensors")):
            if f.name in named:
                continue
            new = sorted(k for k in read_header(f) if k not in inv)
            if new:
                raise BadCheckpointError(
                    f"{f} holds {len(new)} tensor(s), e.g. {new[0]}, but {INDEX_FILE} does not "
                    f"name that file, so they would be ignored: add them to its weight_map"
                )
    return inv


def load_file(path: Path) -> dict[str, mx.array]:
    """One safetensors file's tensors as (lazily loaded) MLX arrays."""
    try:
        return mx.load(str(path.resolve()))
    except (RuntimeError, ValueError) as e:
        raise BadCheckpointError(f"MLX cannot load {path}: {e}") from e


def load_arrays(model_dir: Path) -> dict[str, mx.array]:
    """All tensors of a checkpoint as (lazily loaded) MLX arrays, after the header checks."""
    read_inventory(model_dir)
    weights: dict[str, mx.array] = {}
    for f in weight_files(model_dir):
        weights.update(load_file(f))
    return weights


def e4m3_values() -> mx.array:
    """The value of each FP8 E4M3 (``e4m3fn``) code, [256] float32: sign, 4 exponent bits
    (bias 7; 0 is subnormal), 3 mantissa bits; S.1111.111 is NaN (the format has no inf)."""
    code = mx.arange(256, dtype=mx.uint32)
    sign = mx.where(code >= 128, -1.0, 1.0)
    exp, man = (code >> 3) & 15, (code & 7).astype(mx.float32)
    normal = mx.power(2.0, exp.astype(mx.float32) - 7) * (1 + man / 8)
    value = sign * mx.where(exp == 0, man / 8 * 2.0**-6, normal)
    return mx.where((code & 127) == 127, mx.nan, value)


def dequantize_fp8_blocks(codes: mx.array, scale_inv: mx.array, block: tuple[int, int],
                          name: str = "tensor") -> mx.array:  # fmt: skip
    """Block-FP8 weights to bfloat16: ``codes`` [N, K] (E4M3 bytes, as MLX loads them: uint8)
    times ``scale_inv`` [ceil(N / rows), ceil(K / columns)], one scale per block."""
    bn, bk = block
    n, k = codes.shape if codes.ndim == 2 else (0, 0)
    want = (-(-n // bn), -(-k // bk))
    if codes.ndim != 2 or codes.dtype != mx.uint8 or tuple(scale_inv.shape) != want:
        raise BadCheckpointError(
            f"{name}: FP8 weight {codes.dtype} {tuple(codes.shape)} with scales "
            f"{tuple(scale_inv.shape)}; expected 2-D uint8 codes and scales "
            f"[ceil(rows / {bn}), ceil(columns / {bk})]"
        )
    scales = mx.repeat(mx.repeat(scale_inv.astype(mx.float32), bn, axis=0), bk, axis=1)
    return (e4m3_values()[codes] * scales[:n, :k]).astype(mx.bfloat16)  # [N, K]


def is_raw_mtp_layout(names) -> bool:
    return any(n.startswith(MTP_PREFIX) for n in names)


def drafter_key(name: str) -> tuple[str, bool]:
    """Map one drafter tensor name to the standalone layout: (new name, needs +1.0 shift)."""
    if not name.startswith(MTP_PREFIX):
        return name, False
    stripped = name[len(MTP_PREFIX) :]
    return stripped, any(stripped.endswith(s) for s in NORM_SHIFT_SUFFIXES)


def norm_shift_names(names) -> list[str]:
    """The ``mtp.*`` norms that ``sanitize_drafter`` shifts by +1.0 when the checkpoint
    stores w - 1."""
    return sorted(n for n in names if drafter_key(n)[1])


def sanitize_drafter(weights: dict[str, mx.array], shift: bool) -> dict[str, mx.array]:
    """``mtp.*`` tensors -> standalone drafter layout. Idempotent: a second pass is a no-op.

    ``shift``: the checkpoint stores its norms as w - 1 (``layout.stores_w_minus_1`` decides
    it from the files); then the ``mtp.*`` norms get +1.0. Names without ``mtp.`` are taken as
    already standalone and are never shifted. MoE experts, fused (``experts.gate_up_proj``) or
    one tensor per expert (``experts.{i}.gate_proj.weight``), become mlx-lm's ``switch_mlp``
    layout.
    """
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        key, is_norm = drafter_key(name)
        out[key] = value + 1.0 if shift and is_norm else value
    per_expert = re.compile(r"(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
    stacks: dict[tuple[str, str], dict[int, mx.array]] = {}
    for key in [k for k in out if per_expert.fullmatch(k)]:
        prefix, i, proj = per_expert.fullmatch(key).groups()
        stacks.setdefault((prefix, proj), {})[int(i)] = out.pop(key)
    for (prefix, proj), experts in sorted(stacks.items()):
        if sorted(experts) != list(range(len(experts))):
            raise BadCheckpointError(f"{prefix}.experts: {proj} of experts {sorted(experts)}; "
                                     "expected 0 to n-1 without gaps")  # fmt: skip
        stacked = mx.stack([experts[i] for i in range(len(experts))])  # [E, N, K]
        out[f"{prefix}.switch_mlp.{proj}.weight"] = stacked
    for prefix in sorted(
        {k.rsplit(".experts.", 1)[0] for k in out if ".experts.gate_up_proj" in k}
    ):
        gate_up = out.pop(f"{prefix}.experts.gate_up_proj")
        mid = gate_up.shape[-2] // 2
        out[f"{prefix}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        out[f"{prefix}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        out[f"{prefix}.switch_mlp.down_proj.weight"] = out.pop(f"{prefix}.experts.down_proj")
    return out


def quantize_like(module, quantization: dict | None, weights: dict[str, mx.array]) -> None:
    """Quantize the layers the checkpoint stores quantized (per-module overrides honoured)."""
    import mlx.nn as nn

    if not quantization:
        return

    def predicate(path: str, m) -> bool | dict:
        if path in quantization:
            return quantization[path]
        return hasattr(m, "to_quantized") and f"{path}.scales" in weights

    nn.quantize(
        module,
        group_size=quantization.get("group_size", 64),
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )


def check_inventory(expected: dict[str, tuple], weights: dict[str, mx.array], where: str) -> None:
    """Refuse missing, unknown, mis-shaped or mis-typed tensors with one clear message."""
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing:
        raise BadCheckpointError(
            f"{where} lacks {len(missing)} tensor(s) its config needs, e.g. {missing[0]}"
        )
    if extra:
        raise BadCheckpointError(
            f"{where} has {len(extra)} tensor(s) its config does not explain, e.g. {extra[0]}"
        )
    for name, (shape, dtype) in expected.items():
        w = weights[name]
        if tuple(w.shape) != tuple(shape):
            raise BadCheckpointError(
                f"{where}: tensor {name} has shape {tuple(w.shape)}, config expects {tuple(shape)}"
            )
        if (dtype == mx.uint32) != (w.dtype == mx.uint32) or not (
            w.dtype == mx.uint32 or mx.issubdtype(w.dtype, mx.floating)
        ):
            raise BadCheckpointError(
                f"{where}: tensor {name} has dtype {w.dtype}, expected {dtype}"
            )


def cpu_expert_upcast(module) -> None:
    """On the CPU, upcast unquantized MoE expert weights to float32, once, at load.

    MLX's CPU backend runs gather_mm in float32 only; quantized experts (gather_qmm) are
    unaffected, and nothing changes on a GPU.
    """
    from mlx_lm.models.switch_layers import SwitchLinear

    if mx.default_device() != mx.cpu:
        return
    for _, m in module.named_modules():
        if isinstance(m, SwitchLinear) and m.weight.dtype != mx.float32:
            m.weight = m.weight.astype(mx.float32)


def load_module_weights(
    module, weights: dict[str, mx.array], quantization: dict | None, where: str
):
    """Quantize ``module`` like the checkpoint, check the inventory, then load and evaluate."""
    from mlx.utils import tree_flatten

    quantize_like(module, quantization, weights)
    expected = {k: (v.shape, v.dtype) for k, v in tree_flatten(module.parameters())}
    check_inventory(expected, weights, where)
    module.load_weights(list(weights.items()), strict=True)
    cpu_expert_upcast(module)
    mx.eval(module.parameters())
    module.eval()
    return module
