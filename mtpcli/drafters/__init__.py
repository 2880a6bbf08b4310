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
        """How many positions ``cache`` holds (at most, while ``keep`` is not settled)."""
        ...

    def keep(self, cache: list, n_keep: mx.array, block: int) -> None:
        """Of the last ``block`` positions keep the first ``n_keep`` (int32 [1]), decided on the
        device: the host has not read it."""
        ...

    def settle(self, cache: list, dropped: int, idle: bool) -> None:
        """The host read a ``keep``: ``dropped`` positions went; ``idle``: none is in flight."""
        ...

    def snapshot(self, cache: list, positions: int) -> list:
        """The first ``positions`` of ``cache`` as they are now, unchanged by later steps."""
        ...

    def restore(self, snapshot: list) -> list:
        """A cache to draft on, holding what the ``snapshot`` held."""
        ...

    def join_rows(self, batch: list | None, cache: list) -> list:
        """The caches of a batch of requests (``engine/mtp_batch.py``) with a request's own
        filled ``cache`` added as the last row (``batch`` None: a new batch)."""
        ...

    def keep_rows(self, batch: list, rows: list[int]) -> list:
        """The batch's caches with only ``rows`` (indices, in order) left."""
        ...

    def rewind_rows(self, batch: list, dropped: list[int]) -> None:
        """Drop the last ``dropped[b]`` positions of row b."""
        ...

    def cache_arrays(self, cache: list) -> list[mx.array]:
        """The arrays ``cache`` holds (to evaluate them on the thread that built them)."""
        ...

    def reads_lengths_on_device(self, cache: list, L: int) -> bool:
        """Whether a forward of L tokens reads the cache's length on the device (so ``keep``
        may leave it unread there)."""
        ...
