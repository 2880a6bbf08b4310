"""Decoding engines: classic (one token per forward) and MTP speculative decoding."""

from __future__ import annotations

import mlx.core as mx

from ..errors import (
    BatchNotSupportedError,
    ContextTooLongError,
    NonFiniteOutputError,
    UsageError,
)
from ..models import Target


def prompt_array(prompt) -> mx.array:
    """A prompt as ids [1, L]; batches are refused (the engines run one sequence)."""
    arr = prompt if isinstance(prompt, mx.array) else mx.array(list(prompt), dtype=mx.int32)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.shape[0] != 1:
        raise BatchNotSupportedError(
            f"the engine decodes one sequence at a time; got a prompt of shape {tuple(arr.shape)}"
        )
    if arr.shape[1] == 0:
        raise UsageError("the prompt is empty: give at least one token")
    return arr.astype(mx.int32)


def check_ids(target: Target, tokens: mx.array) -> None:
    """Refuse prompt ids [1, L] outside the target's vocabulary: the embedding would be read
    past its rows (whatever memory lies there, now and then NaN)."""
    vocab = target.config.text.vocab_size
    low, high = mx.min(tokens).item(), mx.max(tokens).item()
    if low < 0 or high >= vocab:
        raise UsageError(f"holds the token id {low if low < 0 else high}, outside the target's "
                         f"vocabulary of {vocab} ids (0..{vocab - 1})", param="prompt")  # fmt: skip


def check_room(target: Target, prompt_tokens: int, max_tokens: int) -> None:
    """Refuse a generation that would run past the model's positions (or forever)."""
    limit = target.config.text.max_position_embeddings
    if prompt_tokens + max_tokens > limit:
        raise ContextTooLongError(
            f"({max_tokens}) plus the prompt ({prompt_tokens} tokens) exceeds the model's "
            f"{limit} positions (max_position_embeddings); ask for at most "
            f"{max(limit - prompt_tokens, 0)} tokens or shorten the prompt",
            param="max_tokens",
        )


def first_logits(target: Target, hidden: mx.array) -> mx.array:
    """The logits [V] after the prefill's hidden states [1, L, H], checked to be numbers: NaN
    or Inf there means the weights are broken, and decoding them would print garbage with a
    clean exit."""
    logits = target.lm_head(hidden[:, -1:])[0, -1]  # [V]
    if not mx.isfinite(logits).all().item():
        raise NonFiniteOutputError(
            "the target's logits at the first step are not finite (NaN or Inf): its weights "
            "are damaged or were converted wrongly; re-download or re-convert the checkpoint"
        )
    return logits
