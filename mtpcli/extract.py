"""``mtp extract-drafter``: split a raw checkpoint's mtp.* tensors into a standalone drafter."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .config import TARGET_TYPES, check_block_size, load_config, read_json_object
from .drafters.qwen3_5_mtp import Qwen35MTP, check_quantize, quantize_drafter
from .errors import BadCheckpointError, MtpError, OutputError, UsageError
from .files import check_output_dir, written_dir
from .layout import gather, stores_w_minus_1
from .loading import check_drafter
from .weights import (
    MTP_PREFIX,
    dequantize_fp8_blocks,
    drafter_key,
    load_file,
    read_inventory,
    sanitize_drafter,
    weight_files,
)

SCALE_SUFFIX = "_scale_inv"


def _dequantized(tensors: dict[str, mx.array], block: tuple[int, int]) -> dict[str, mx.array]:
    """A block-FP8 head's tensors in bfloat16: each ``X.weight`` with its
    ``X.weight_scale_inv``; the tensors stored unquantized (norms) pass through."""
    out = {k: v for k, v in tensors.items() if not k.endswith(SCALE_SUFFIX)}
    for name in [k for k in tensors if k.endswith(SCALE_SUFFIX)]:
        weight = name[: -len(SCALE_SUFFIX)]
        if weight not in out:
            raise BadCheckpointError(f"{name} scales a tensor {weight} the checkpoint lacks")
        out[weight] = dequantize_fp8_blocks(out[weight], tensors[name], block, weight)
    stray = sorted(k for k, v in out.items() if v.dtype == mx.uint8 and k + SCALE_SUFFIX
                   not in tensors)  # fmt: skip
    if stray:
        raise BadCheckpointError(f"FP8 tensor {stray[0]} has no {stray[0]}{SCALE_SUFFIX}")
    return out


def extract_drafter(src: Path, out: Path, block_size: int | None = None,
                    quantize: int | None = None, group_size: int = 64) -> Path:  # fmt: skip
    """Write ``out`` as a qwen3_5_mtp drafter made from the raw ``src`` checkpoint's MTP head
    (its files found through the shard index; block-FP8 weights dequantized with their
    scales), in bf16, or quantized to ``quantize`` bits in the mlx-community layout."""
    if block_size is not None:
        check_block_size(block_size)
    config = load_config(src)
    if config.model_type not in TARGET_TYPES:
        raise UsageError(f"{src} is a {config.model_type} model; expected a raw qwen3_5 checkpoint")
    inv = read_inventory(src)
    wanted = {n for n in inv if n.startswith(MTP_PREFIX)}
    if not wanted:
        raise BadCheckpointError(f"{src} has no mtp.* tensors to extract")
    if quantize is not None:
        check_quantize(quantize, group_size, "--quantize")
    check_output_dir(out)
    tensors: dict[str, mx.array] = {}
    for f in weight_files(src):
        if any(inv[n].file == f.name for n in wanted):
            tensors.update({k: v for k, v in load_file(f).items() if k in wanted})
    if config.fp8_block:
        tensors = _dequantized(tensors, config.fp8_block)
    # The head's norms get +1.0 only if the files show they hold w - 1: an MLX conversion that
    # kept its mtp.* tensors stores them shifted already.
    norms = {k: v for k, v in tensors.items() if drafter_key(k)[1] and v.ndim == 1}
    shift = stores_w_minus_1(gather(src, inv, norms), f"the MTP head of {src}")
    tensors = sanitize_drafter(tensors, shift)
    quantization = None
    if quantize is not None:
        module = Qwen35MTP(config)
        try:
            module.load_weights(list(tensors.items()))
        except ValueError as e:  # names or shapes that are not a drafter head's
            raise BadCheckpointError(f"the MTP head of {src} cannot be quantized: {e}") from e
        quantization = quantize_drafter(module, config, quantize, group_size).quantization
        tensors = dict(tree_flatten(module.parameters()))
    raw = read_json_object(src / "config.json", "config.json")
    text = raw.get("text_config", {k: v for k, v in raw.items() if k != "model_type"})
    block = block_size or max(config.text.mtp_num_hidden_layers, 1) + 2
    tied = text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False)) is True
    drafter_config = {"block_size": block, "model_type": "qwen3_5_mtp", "text_config": text,
                      "tie_word_embeddings": tied}  # fmt: skip
    if quantization:
        drafter_config["quantization"] = drafter_config["quantization_config"] = quantization
    # Written beside OUT and renamed into place only once it passes the drafter gate: a
    # failed check or a Ctrl-C leaves no half-written drafter behind.
    with written_dir(out) as tmp:
        try:
            mx.save_safetensors(str(tmp / "model.safetensors"), tensors, {"format": "mlx"})
        except RuntimeError as e:  # MLX's write errors (a full disk) are RuntimeErrors
            raise OutputError(f"cannot write {out}: {e}") from e
        (tmp / "config.json").write_text(json.dumps(drafter_config, indent=1))
        try:
            check_drafter(tmp, config)
        except MtpError as e:
            raise BadCheckpointError(
                f"the drafter made from {src} fails the drafter check, so {out} was not "
                f"written: {e}"
            ) from e
    return out
