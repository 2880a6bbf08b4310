"""Classic decoding: one target forward per token. The reference MTP must reproduce."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Iterator

import mlx.core as mx

from ..models import Target
from ..stats import GenerationStats
from . import check_ids, check_room, first_logits, prompt_array
from .prompt_cache import PromptCache, PromptStart
from .sampling import SamplingParams, check_finite, pick_checked, readback


def decode_step(
    target: Target, cache: list, y: mx.array, sampling: SamplingParams
) -> tuple[mx.array, mx.array, mx.array]:
    """Queue one decode step that feeds token ``y`` (an id, read or not): the token it picks,
    that token's ``readback`` [2] and the hidden state at ``y`` [1, 1, H], submitted, not
    waited for."""
    out = target.forward(y.reshape(1, 1), cache)
    y_next, lse = pick_checked(target.lm_head(out.hidden)[0, -1], sampling)
    seen = readback(y_next, lse)  # [2]: the token and its logsumexp
    mx.async_eval(y_next, seen)
    return y_next, seen, out.hidden


def read_token(seen: mx.array, position: int) -> int:
    """The token of a step's ``readback``, its logits checked to be numbers (one read, of the
    step's own outputs: ``position`` counts the tokens generated before it)."""
    token, lse = seen.tolist()
    check_finite([lse], position)
    return int(token)


def start_classic(
    target: Target,
    prompt,
    max_tokens: int,
    sampling: SamplingParams,
    stats: GenerationStats,
    on_prefill: Callable[[int, int], None] | None = None,
    prompt_cache: PromptCache | None = None,
    boundaries: Collection[int] = (),
    key: mx.array | None = None,
) -> tuple[list, mx.array, mx.array]:
    """Process the prompt (from the ``prompt_cache``'s longest snapshot it starts with, leaving
    its own there) and pick the first token (with ``key`` where sampled, see ``KeyChain``):
    the cache, that token and its ``readback``, evaluated; the prompt's figures in ``stats``."""
    tokens = prompt_array(prompt)
    check_room(target, tokens.shape[1], max_tokens)
    check_ids(target, tokens)
    start = time.perf_counter()
    ps = PromptStart(prompt_cache, tokens[0].tolist(), boundaries)
    cache = target.restore(ps.snapshot.target) if ps.snapshot else target.make_cache()
    hidden = target.prefill(
        tokens,
        cache,
        on_prefill,
        every_position=False,
        start=ps.start,
        on_cut=lambda p: ps.cut(target, cache, p),
        cuts=ps.boundaries,
    )  # [1, 1, H]
    y, lse = pick_checked(first_logits(target, hidden), sampling, key)
    seen = readback(y, lse)  # [2]: the token and its logsumexp
    mx.eval(y, seen)
    stats.prompt_tokens, stats.prompt_s = tokens.shape[1], time.perf_counter() - start
    stats.prompt_cached = ps.start
    return cache, y, seen


def generate_classic(
    target: Target,
    prompt,
    *,
    max_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    eos_ids: Iterable[int] = (),
    stats: GenerationStats | None = None,
    on_prefill: Callable[[int, int], None] | None = None,
    prompt_cache: PromptCache | None = None,
    boundaries: Collection[int] = (),
) -> Iterator[int]:
    """Yield generated token ids (EOS excluded) until EOS or ``max_tokens``; ``on_prefill``
    follows the prompt's processing (tokens done, total). With a ``prompt_cache`` the prompt
    resumes from its longest snapshot there and leaves its own (at ``boundaries`` too)."""
    stats = stats if stats is not None else GenerationStats()
    eos = set(eos_ids)
    cache, y, seen = start_classic(target, prompt, max_tokens, sampling, stats, on_prefill,
                                   prompt_cache, boundaries)  # fmt: skip
    start = time.perf_counter()
    n = 0
    try:
        while True:
            # Queue the next step before reading this token, so the device never waits on Python.
            if n + 1 < max_tokens:
                y_next, seen_next, _ = decode_step(target, cache, y, sampling)
            token = read_token(seen, n)
            if token in eos:
                return
            yield token
            n += 1
            stats.emitted(n, start, time.perf_counter())
            if n >= max_tokens:
                return
            y, seen = y_next, seen_next
    finally:
        stats.finish(start, time.perf_counter(), mx.get_peak_memory())
