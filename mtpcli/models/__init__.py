"""Targets: the ``Target`` protocol the engines decode with, and its Qwen3.5-family model."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..options import Options
    from .pipeline import Stage


@dataclass
class GatedDeltaTrace:
    """What one verify pass left behind in one gated-delta layer, for the rollback."""

    conv_input: mx.array  # [B, K-1+T, C]: the old conv window followed by the T new inputs
    states: mx.array  # [T - 1, B, Hv, Dv, Dk]: the state after each position but the last


@dataclass
class ForwardOut:
    hidden: mx.array  # [B, T, H], final-normed
    traces: list[GatedDeltaTrace | None] | None  # per layer (None for attention layers)


class Target(Protocol):
    """What the engines and the gate need from a target model."""

    config: ModelConfig
    options: Options
    stage: Stage | None  # this process's part of a pipeline (models/pipeline.py), or None

    @property
    def embed_tokens(self) -> nn.Module: ...

    def make_cache(self) -> list: ...

    def forward(self, tokens: mx.array, cache: list, *, verify: bool = False) -> ForwardOut:
        """Tokens [B, T] through the decoder, appended to ``cache``; ``verify`` computes each
        position exactly as a decode step and keeps what ``rollback`` needs."""
        ...

    def prefill(self, tokens: mx.array, cache: list,
                progress: Callable[[int, int], None] | None = None,
                every_position: bool = True, start: int = 0,
                on_cut: Callable[[int], None] | None = None,
                cuts: Collection[int] = ()) -> mx.array:  # fmt: skip
        """A prompt [B, L] into ``cache``, which holds its first ``start`` positions already
        (0, or a cut); the final-normed hidden states of the rest [B, L - start, H] (with
        ``every_position`` False the last position's, [B, 1, H]); ``on_cut(p)`` at each cut
        (the positions where any prompt's processing stops between chunks: the cache there
        is the same whatever follows), among them ``cuts`` (where its messages end);
        ``progress(done, total)`` after each part of it."""
        ...

    def snapshot(self, cache: list) -> list:
        """The state of ``cache`` now, unchanged by later steps (for ``restore``)."""
        ...

    def restore(self, snapshot: list) -> list:
        """A cache to decode on, holding what the ``snapshot`` held."""
        ...

    def join_rows(self, batch: list | None, cache: list) -> list:
        """The caches of a batch of requests (``forward`` decodes one token of each row) with a
        request's own one-row ``cache`` added as the last row (``batch`` None: a new batch)."""
        ...

    @property
    def batch_rows(self) -> int | None:
        """The most requests a step may decode together, each row exact as alone (None: any)."""
        ...

    @property
    def tile_rows(self) -> int | None:
        """The rows a product shares one read of its weights among; None where each row costs
        its own work."""
        ...

    def keep_rows(self, batch: list, rows: list[int]) -> list:
        """The batch's caches with only ``rows`` (indices, in order) left."""
        ...

    def lm_head(self, hidden: mx.array, exact: bool = False) -> mx.array:
        """Logits [B, T, V] of hidden states [B, T, H]; ``exact`` rows as in a verify."""
        ...

    def rollback(self, cache: list, traces: list, n_keep: int | mx.array, block: int) -> None:
        """Leave ``cache`` as after the first ``n_keep`` of the last verify's ``block``; an
        int32 [1] ``n_keep`` decides on the device (then ``settle`` once it is read)."""
        ...

    def rollback_rows(self, cache: list, traces: list, n_keep: list[int], block: int) -> None:
        """``rollback`` of a batch of requests' caches (``join_rows``): row b keeps the first
        ``n_keep[b]`` of the block."""
        ...

    def settle(self, cache: list, dropped: int, idle: bool) -> None:
        """The host read a rollback decided on the device: ``dropped`` positions went;
        ``idle``: no forward is in flight."""
        ...

    @property
    def graph_lengths(self) -> frozenset[tuple[int, bool]]:
        """The (positions, verify) forwards that run as one graph reading the caches' length
        on the device (so a rollback may leave it unread there)."""
        ...

    def cache_arrays(self, cache: list) -> list[mx.array]:
        """The arrays a rollback may have replaced (to evaluate them ahead)."""
        ...
