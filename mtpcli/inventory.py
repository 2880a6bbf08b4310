"""``mtp inspect-weights``: what a checkpoint directory holds, from headers alone."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from .config import DRAFTER_TYPES, read_json_object
from .errors import MtpError
from .loading import check_drafter
from .weights import MTP_PREFIX, norm_shift_names, read_inventory

LAYOUTS = {
    "drafter": "standalone MLX drafter",
    "raw_mtp": "raw checkpoint with MTP tensors",
    "raw": "raw checkpoint (no MTP tensors)",
    "mlx_vlm": "MLX target (VLM layout)",
    "mlx_flat": "MLX target (flat layout)",
}

# How a layout names its MTP head's tensors (None: it holds no head).
MTP_LAYOUTS = {
    "drafter": "standalone (the whole checkpoint is the head, names without 'mtp.')",
    "raw_mtp": "raw (mtp.* names inside a full checkpoint)",
}


def _layout(model_type: str, names: list[str]) -> str:
    if model_type in DRAFTER_TYPES:
        return "drafter"
    if any(n.startswith(MTP_PREFIX) for n in names):
        return "raw_mtp"
    if any(n.startswith("model.language_model.") for n in names):
        return "raw"
    if any(n.startswith("language_model.") for n in names):
        return "mlx_vlm"
    return "mlx_flat"


def describe(model_dir: Path) -> dict:
    """A JSON-ready description of a checkpoint directory. Reads no tensor data."""
    config = read_json_object(model_dir / "config.json", "config.json")
    inv = read_inventory(model_dir)
    names = sorted(inv)
    model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else ""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    layout = _layout(model_type, names)
    # The MTP head's tensors: all of a standalone drafter's, the mtp.* ones of a raw checkpoint.
    mtp = names if layout == "drafter" else [n for n in names if n.startswith(MTP_PREFIX)]
    quant = config.get("quantization")
    try:
        check_drafter(model_dir)
        packed = sum(1 for n in names if n.endswith(".scales"))
        how = (
            f": the head's {len(names) - 2 * packed} tensors, {packed} of them quantized and "
            "stored as weight, scales and biases"
            if packed
            else ""
        )
        drafter_ok, reason = (
            True,
            f"standalone {model_type} drafter; its {len(names)} tensors match its config{how}",
        )
    except MtpError as e:
        drafter_ok, reason = False, str(e)
    claimed = text.get("mtp_num_hidden_layers", 0) if isinstance(text, dict) else 0
    claimed = claimed if isinstance(claimed, int) else 0
    return {
        "path": str(model_dir),
        "model_type": model_type,
        "layout": LAYOUTS[layout],
        "dtypes": dict(Counter(i.dtype for i in inv.values())),
        "quantization": (
            {k: quant[k] for k in ("bits", "group_size", "mode") if k in quant}
            | {"overrides": sum(1 for v in quant.values() if isinstance(v, dict))}
            if isinstance(quant, dict)
            else None
        ),
        "tensor_count": len(names),
        "total_bytes": sum(i.nbytes for i in inv.values()),
        "mtp_tensor_count": len(mtp),
        "mtp_layout": MTP_LAYOUTS.get(layout),
        "mtp_tensors": mtp,
        "norm_shift": norm_shift_names(names),
        "drafter_ok": drafter_ok,
        "reason": reason,
        "block_size": config.get("block_size") if model_type in DRAFTER_TYPES else None,
        "config_mtp_layers": claimed,
        "mtp_claim_unbacked": layout not in ("drafter", "raw_mtp") and claimed > 0,
    }
