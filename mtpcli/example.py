"""The built-in example: a small trained qwen3_5 target and its qwen3_5_mtp head, shipped in
the package (``example_model/``, made by ``scripts/train_tiny.py``).

It is loaded through exactly the same code as a real checkpoint: an mlx-community-style target
(VLM-style nesting, tokenizer, chat template) and a standalone drafter with ``block_size``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import ModelNotFoundError

EXAMPLE_DIR = Path(__file__).parent / "example_model"
NOTE = (
    "built-in example: a 1M-parameter model trained on Python's standard library "
    "(scripts/train_tiny.py), so expect code-like text"
)


def cache_dir() -> Path:
    if os.environ.get("MTP_CACHE_DIR"):
        return Path(os.environ["MTP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mtp"


def ensure_example() -> tuple[Path, Path]:
    """Paths of the example target and drafter."""
    target, drafter = EXAMPLE_DIR / "target", EXAMPLE_DIR / "drafter"
    if not (target / "config.json").is_file() or not (drafter / "config.json").is_file():
        raise ModelNotFoundError(
            f"the built-in example is missing from this installation ({EXAMPLE_DIR}); "
            "reinstall mtp, or pass -m TARGET --draft-model DRAFTER"
        )
    return target, drafter


def example_prompts() -> list[str]:
    """Held-out prompts of the example (openings of standard-library files it never saw)."""
    path = EXAMPLE_DIR / "heldout_prompts.txt"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
