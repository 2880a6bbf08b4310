"""MTP speculative decoding with a qwen3_5_mtp drafter (batch 1).

One round: the drafter proposes k = block_size - 1 tokens; the target verifies the pending
token and the drafts in one forward; the longest agreeing prefix is accepted; both caches roll
back to it; the accepted drafts plus one target token are emitted. At temperature 0 the output
is identical to classic decoding.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import mlx.core as mx

from ..config import check_block_size
from ..drafters import Drafter
from ..models import Target
from ..stats import GenerationStats, MTPStats
from . import check_room, first_logits, prompt_array
from .classic import decode_step, read_token
from .sampling import SamplingParams, accept, greedy, pick, positions, probs


def draft(
    drafter: Drafter,
    target: Target,
    tokens: mx.array,
    hidden: mx.array,
    cache: list,
    k: int,
    s: SamplingParams,
) -> tuple[mx.array, mx.array | None]:
    """Catch the drafter up on ``tokens`` [L] (with the target hidden before each, [1, L, H]),
    then chain k drafts.

    Returns the drafts [k] and, when sampling, the drafter distributions they were drawn from,
    as graphs not yet submitted.
    """
    h = drafter.forward(tokens[None], hidden, cache)[:, -1:]  # [1, 1, H]
    drafts, qs = [], []
    for i in range(k):
        logits = target.lm_head(h)[0, -1]  # [V]
        if s.greedy:
            d = greedy(logits)
        else:
            qs.append(probs(logits, s))
            d = mx.random.categorical(mx.log(qs[-1]))
        drafts.append(d)
        if i < k - 1:
            h = drafter.forward(d.reshape(1, 1), h, cache)
    return mx.stack(drafts).reshape(k), (mx.stack(qs) if qs else None)  # [k], [k, V]


class Unseen:
    """What the drafter has not seen yet: token j+1 with the target hidden at j, as the
    target made them (a prompt, a round's accepted positions, classic steps)."""

    # While the rounds are off, the drafter catches up in batches of this many tokens (its
    # cache stays current and the hidden states held stay few).
    BATCH = 256
    CHUNK = 2048  # the most tokens one catch-up forward takes (a long prompt's in parts)

    def __init__(self, tokens: list[int], hidden: mx.array) -> None:
        self.tokens, self.hidden = list(tokens), [hidden]  # [1, *, H] each

    def add(self, token: int, hidden: mx.array) -> None:
        self.tokens.append(token)
        self.hidden.append(hidden)

    def arrays(self) -> tuple[mx.array, mx.array]:
        """The tokens [L] and their hidden states [1, L, H]."""
        hidden = self.hidden[0] if len(self.hidden) == 1 else mx.concatenate(self.hidden, 1)
        return mx.array(self.tokens, mx.uint32), hidden

    def catch_up(self, drafter: Drafter, cache: list, batch: int | None = None) -> mx.array | None:
        """Past ``batch`` tokens (``BATCH``), submit the drafter's forward over all but the
        newest (the next draft starts from it); returns that forward's output."""
        if len(self.tokens) <= (self.BATCH if batch is None else batch):
            return None
        hidden = (
            self.hidden[0][:, :-1] if len(self.hidden) == 1 else mx.concatenate(self.hidden[:-1], 1)
        )
        tokens = mx.array(self.tokens[:-1], mx.uint32)[None]  # [1, L]
        for i in range(0, tokens.shape[1], self.CHUNK):  # a long prompt's attention in parts
            seen = drafter.forward(tokens[:, i : i + self.CHUNK], hidden[:, i : i + self.CHUNK],
                                   cache)  # fmt: skip
            mx.async_eval(seen)
        last = self.hidden[-1][:, -1:]
        self.tokens, self.hidden = self.tokens[-1:], [last]
        return seen


def generate_mtp(
    target: Target,
    drafter: Drafter,
    prompt,
    *,
    block_size: int,
    max_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    eos_ids: Iterable[int] = (),
    stats: GenerationStats | None = None,
    propose=draft,
    choose_block: Callable[[MTPStats, int], int] | None = None,
    on_prefill: Callable[[int, int], None] | None = None,
) -> Iterator[int]:
    """Yield generated token ids (EOS excluded) until EOS or ``max_tokens``.

    ``propose`` makes the drafts (``draft``'s signature); benchmarks swap in a wrapper.
    ``choose_block`` picks each round's block size (at most ``block_size``) from the
    statistics so far and the context reached (tokens in the target's cache), or 1 for a
    classic step where no round is expected to pay; without it every round has
    ``block_size``. ``on_prefill`` follows the prompt's processing (tokens done, total).
    """
    check_block_size(block_size)
    stats = stats if stats is not None else GenerationStats()
    stats.mtp = rs = MTPStats(block_size)
    eos = set(eos_ids)
    tokens = prompt_array(prompt)
    check_room(target, tokens.shape[1], max_tokens)
    tcache, dcache = target.make_cache(), drafter.make_cache()
    start = time.perf_counter()
    hidden = target.prefill(tokens, tcache, on_prefill)  # [1, L, H]
    pending = int(pick(first_logits(target, hidden), sampling).item())
    unseen = Unseen(tokens[0, 1:].tolist() + [pending], hidden)
    caught = unseen.catch_up(drafter, dcache, batch=1)  # the drafter's part of the prompt
    if caught is not None:
        mx.eval(caught)
    stats.prompt_tokens, stats.prompt_s = tokens.shape[1], time.perf_counter() - start
    start = time.perf_counter()
    emitted, n = [pending], 0
    queued = None  # a classic step already submitted: it feeds ``pending``
    rounds = True  # whether the last token came from a round (False: from a classic step)
    choose = choose_block or (lambda stats, context: block_size)
    try:
        while True:
            for t in emitted:
                if t in eos or n >= max_tokens:
                    return
                yield t
                n += 1
                stats.emitted(n, start, time.perf_counter())
            if n >= max_tokens:
                return
            context = tokens.shape[1] + n - 1  # all but ``pending`` are in the target's cache
            b = 1 if queued is not None else choose(rs, context)
            if b == 1:
                if rounds:
                    rounds = False
                    rs.switch(context, rounds)
                y, seen, h = queued or decode_step(target, tcache, mx.array(pending, mx.uint32),
                                                   sampling)  # fmt: skip
                # the next step goes out before this one is read, when it is classic too
                more = n + 1 < max_tokens and choose(rs, context + 1) == 1
                queued = decode_step(target, tcache, y, sampling) if more else None
                pending = read_token(seen, n)
                rs.classic_steps += 1
                unseen.add(pending, h)
                unseen.catch_up(drafter, dcache)
                emitted = [pending]
                continue
            if not rounds:
                rounds = True
                rs.switch(context, rounds)
            k = min(b, block_size) - 1
            t0 = time.perf_counter()
            drafts, q = propose(drafter, target, *unseen.arrays(), dcache, k, sampling)
            mx.async_eval(drafts)  # computed while the host builds the verify that takes them
            t1 = time.perf_counter()
            block = mx.concatenate([mx.array([pending], drafts.dtype), drafts])[None]  # [1, k+1]
            out = target.forward(block, tcache, verify=True)
            logits = positions(target.lm_head(out.hidden, exact=True))  # [k+1, V]
            t_built = time.perf_counter()  # the rest of the verify is the wait for the device
            n_acc, nxt = accept(logits, drafts, q, sampling, n)
            drafter.trim(dcache, k - 1)
            draft_ids = drafts.tolist()  # computed by now: accept read the verify
            t2 = time.perf_counter()
            target.rollback(tcache, out.traces, n_acc + 1, k + 1)
            mx.async_eval(target.cache_arrays(tcache))  # the next round's draft is built meanwhile
            rs.record(k, n_acc)
            rs.draft_s += t1 - t0
            rs.verify_s += t2 - t1
            rs.verify_build_s += t_built - t1
            rs.rollback_s += time.perf_counter() - t2
            emitted = draft_ids[:n_acc] + [nxt]
            unseen = Unseen(emitted, out.hidden[:, : n_acc + 1])
            pending = nxt
    finally:
        stats.finish(start, time.perf_counter(), mx.get_peak_memory())
