"""``mtp extract-drafter``: split a raw checkpoint's mtp.* tensors into a standalone drafter."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from .config import TARGET_TYPES, load_config, read_json_object
from .errors import BadCheckpointError, UsageError
from .loading import check_drafter
from .weights import MTP_PREFIX, read_inventory, sanitize_drafter, weight_files


def extract_drafter(src: Path, out: Path, block_size: int | None = None) -> Path:
    """Write ``out`` as a qwen3_5_mtp drafter made from the raw ``src`` checkpoint's MTP head."""
    config = load_config(src)
    if config.model_type not in TARGET_TYPES:
        raise UsageError(f"{src} is a {config.model_type} model; expected a raw qwen3_5 checkpoint")
    inv = read_inventory(src)
    wanted = {n for n in inv if n.startswith(MTP_PREFIX)}
    if not wanted:
        raise BadCheckpointError(f"{src} has no mtp.* tensors to extract")
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"{out} exists and is not empty")
    tensors: dict[str, mx.array] = {}
    for f in weight_files(src):
        if any(inv[n].file == f.name for n in wanted):
            tensors.update({k: v for k, v in mx.load(str(f.resolve())).items() if k in wanted})
    raw = read_json_object(src / "config.json", "config.json")
    text = raw.get("text_config", {k: v for k, v in raw.items() if k != "model_type"})
    block = block_size or max(config.text.mtp_num_hidden_layers, 1) + 2
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(out / "model.safetensors"), sanitize_drafter(tensors), {"format": "mlx"}
    )
    drafter_config = {"model_type": "qwen3_5_mtp", "block_size": block, "text_config": text}
    (out / "config.json").write_text(json.dumps(drafter_config, indent=1))
    check_drafter(out, config)
    return out
