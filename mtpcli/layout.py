"""How a checkpoint stores its RMSNorm weights, decided from evidence in its files.

Raw Hugging Face checkpoints store the shifted norms as ``w - 1`` (the model computes with
``1 + w``); MLX conversions store ``w``. Shifting the wrong way, or twice, gives a model that
runs and writes worse text, so the decision is never a guess: each piece of evidence says
"raw", "mlx" or nothing, and ``stores_w_minus_1`` answers only when at least one speaks and
none disagrees. Callers gather the evidence; this module only weighs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .errors import LayoutError
from .weights import TensorInfo, read_format

RAW, MLX = "raw", "mlx"
# A norm weight's values centre on 0 when stored as w - 1 and on 1 when stored as w; a median
# further than this from both says nothing (trained weights may sit anywhere in between).
NORM_CENTRE_TOLERANCE = 0.25


@dataclass(frozen=True)
class Evidence:
    """One observation about a checkpoint: what it says (``RAW``, ``MLX`` or None) and why."""

    source: str  # "format tag", "tensor names", "conv1d layout", "norm values"
    says: str | None
    detail: str


def format_tag(tags: Mapping[str, str | None]) -> Evidence:
    """The safetensors ``format`` metadata of each file (file name -> tag or None): transformers
    writes ``pt``, MLX ``mlx``; files that disagree, or any other tag, say nothing."""
    known = {t for t in tags.values() if t in ("pt", MLX)}
    shown = ", ".join(f"{f}: {t!r}" for f, t in sorted(tags.items())) or "no files"
    if len(known) != 1 or any(t not in known for t in tags.values()):
        return Evidence("format tag", None, f"format tags {shown}")
    tag = known.pop()
    return Evidence("format tag", RAW if tag == "pt" else MLX, f"format tag {tag!r} ({shown})")


def tensor_names(names: Iterable[str]) -> Evidence:
    """Where the language model's tensors sit: ``model.language_model.*`` is Hugging Face's
    naming, ``language_model.model.*`` an MLX conversion's; flat ``model.*`` says nothing."""
    names = list(names)
    hf = sum(n.startswith("model.language_model.") for n in names)
    mlx = sum(n.startswith("language_model.model.") for n in names)
    if hf and not mlx:
        return Evidence("tensor names", RAW, f"{hf} tensors named model.language_model.*")
    if mlx and not hf:
        return Evidence("tensor names", MLX, f"{mlx} tensors named language_model.model.*")
    return Evidence("tensor names", None, f"{hf} model.language_model.* and {mlx} "
                    "language_model.model.* tensor names")  # fmt: skip


def conv1d_layout(shapes: Mapping[str, tuple[int, ...]]) -> Evidence:
    """The gated-delta convolution weights: PyTorch's ``[C, 1, K]`` in raw checkpoints, MLX's
    ``[C, K, 1]`` after conversion (mlx-lm's own test)."""
    convs = {n: s for n, s in shapes.items() if n.endswith("conv1d.weight") and len(s) == 3}
    raw = sum(s[1] == 1 and s[2] != 1 for s in convs.values())
    mlx = sum(s[2] == 1 and s[1] != 1 for s in convs.values())
    if raw and not mlx:
        return Evidence("conv1d layout", RAW, f"{raw} conv1d weights [C, 1, K] (PyTorch's)")
    if mlx and not raw:
        return Evidence("conv1d layout", MLX, f"{mlx} conv1d weights [C, K, 1] (MLX's)")
    return Evidence("conv1d layout", None, f"{raw} [C, 1, K] and {mlx} [C, K, 1] conv1d weights")


def norm_values(norms: Mapping[str, mx.array]) -> Evidence:
    """The median of the shifted norms' values: near 0 when stored as w - 1, near 1 as w."""
    if not norms:
        return Evidence("norm values", None, "no norm weights")
    values = mx.concatenate([v.astype(mx.float32).reshape(-1) for v in norms.values()])
    median = mx.sort(values)[values.size // 2].item()
    detail = f"the median of {len(norms)} norm weights is {median:.3g}"
    if abs(median) <= NORM_CENTRE_TOLERANCE:
        return Evidence("norm values", RAW, detail + " (centred on 0)")
    if abs(median - 1) <= NORM_CENTRE_TOLERANCE:
        return Evidence("norm values", MLX, detail + " (centred on 1)")
    return Evidence("norm values", None, detail + " (near neither 0 nor 1)")


def gather(model_dir: Path, inv: Mapping[str, TensorInfo],
           norms: Mapping[str, mx.array]) -> list[Evidence]:  # fmt: skip
    """Every piece of evidence a checkpoint holds: its files' format tags, its tensor names
    and conv1d shapes (``inv``, from headers), and the values of ``norms`` (the norm weights
    that would be shifted, loaded)."""
    files = sorted({i.file for i in inv.values()})
    return [
        format_tag({f: read_format(model_dir / f) for f in files}),
        tensor_names(inv),
        conv1d_layout({n: i.shape for n, i in inv.items()}),
        norm_values(norms),
    ]


def stores_w_minus_1(evidence: Iterable[Evidence], what: str) -> bool:
    """True when ``what``'s norms are stored as w - 1 (raw), False when as w (MLX). Refuses,
    naming every piece of evidence, when none speaks or two disagree."""
    evidence = list(evidence)
    said = {e.says for e in evidence if e.says is not None}
    listed = "; ".join(f"{e.source}: {e.detail} -> {e.says or 'says nothing'}" for e in evidence)
    if len(said) == 1:
        return said.pop() == RAW
    if not said:
        raise LayoutError(
            f"cannot tell whether {what} stores its norm weights as w - 1 (raw Hugging Face) "
            f"or as w (MLX), and shifting on a guess would corrupt it ({listed}); re-save it "
            "with its safetensors 'format' tag ('pt' for raw, 'mlx' for an MLX conversion)"
        )
    raise LayoutError(
        f"the evidence on how {what} stores its norm weights disagrees ({listed}); it was "
        "converted or edited inconsistently: re-download or re-convert it"
    )
