"""Drafters: the ``Drafter`` protocol and the model_type -> kind table."""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx

# One mapping table: drafter model_type -> drafter kind.
DRAFTER_KINDS: dict[str, str] = {"qwen3_5_mtp": "mtp"}


class Drafter(Protocol):
    """What the MTP engine needs from a drafter head."""

    block_size: int

    def make_cache(self) -> list: ...

    def forward(self, tokens: mx.array, hidden: mx.array, cache: list) -> mx.array:
        """Tokens [B, L] with the hidden state before each [B, L, H] -> next hidden [B, L, H]."""
        ...

    def trim(self, cache: list, n: int) -> None:
        """Drop the last n positions of ``cache``."""
        ...

    def offset(self, cache: list) -> int:
        """How many positions ``cache`` holds."""
        ...
