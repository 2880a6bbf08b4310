"""``mtp extract-drafter``: split a raw checkpoint's mtp.* tensors into a standalone drafter."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from .config import TARGET_TYPES, load_config, read_json_object
from .errors import BadCheckpointError, MtpError, OutputError, UsageError
from .files import check_output_dir, written_dir
from .loading import check_drafter
from .weights import MTP_PREFIX, load_file, read_inventory, sanitize_drafter, weight_files


def extract_drafter(src: Path, out: Path, block_size: int | None = None) -> Path:
    """Write ``out`` as a qwen3_5_mtp drafter made from the raw ``src`` checkpoint's MTP head."""
    config = load_config(src)
    if config.model_type not in TARGET_TYPES:
        raise UsageError(f"{src} is a {config.model_type} model; expected a raw qwen3_5 checkpoint")
    inv = read_inventory(src)
    wanted = {n for n in inv if n.startswith(MTP_PREFIX)}
    if not wanted:
        raise BadCheckpointError(f"{src} has no mtp.* tensors to extract")
    check_output_dir(out)
    tensors: dict[str, mx.array] = {}
    for f in weight_files(src):
        if any(inv[n].file == f.name for n in wanted):
            tensors.update({k: v for k, v in load_file(f).items() if k in wanted})
    raw = read_json_object(src / "config.json", "config.json")
    text = raw.get("text_config", {k: v for k, v in raw.items() if k != "model_type"})
    block = block_size or max(config.text.mtp_num_hidden_layers, 1) + 2
    drafter_config = {"model_type": "qwen3_5_mtp", "block_size": block, "text_config": text}
    # Written beside OUT and renamed into place only once it passes the drafter gate: a
    # failed check or a Ctrl-C leaves no half-written drafter behind.
    with written_dir(out) as tmp:
        try:
            mx.save_safetensors(
                str(tmp / "model.safetensors"), sanitize_drafter(tensors), {"format": "mlx"}
            )
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
