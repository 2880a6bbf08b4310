"""MTP speculative decoding with a qwen3_5_mtp drafter (batch 1).

One round: the drafter proposes k = block_size - 1 tokens; the target verifies the pending
token and the drafts in one forward; the longest agreeing prefix is accepted; both caches roll
back to it; the accepted drafts plus one target token are emitted. At temperature 0 the output
is identical to classic decoding.

At temperature 0, once the target's verify runs as one graph reading its caches' length on the
device, a round is decided there too (``submit_round``): the accepted count, the rollback and
the next round's pending token and drafter input stay device arrays, so the host builds round
r + 1 while the device runs round r, and reads round r afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass

import mlx.core as mx

from ..config import check_block_size
from ..drafters import Drafter
from ..models import ForwardOut, Target
from ..stats import GenerationStats, MTPStats
from . import check_ids, check_room, first_logits, prompt_array
from .classic import decode_step, read_token
from .prompt_cache import PromptCache, PromptStart
from .sampling import (
    SamplingParams,
    accept,
    accept_on_device,
    greedy,
    pick_checked,
    positions,
    probs,
    read_verdict,
)

GREEDY = SamplingParams()


@dataclass
class CatchUp:
    """What the drafter sees before it drafts: tokens [L] and the target's hidden state before
    each [1, L, H]. In a round built ahead, ``last`` (int32 [1], on the device) is the index of
    the last token the previous round emitted, and the rest are dropped; None: all L count."""

    tokens: mx.array
    hidden: mx.array
    last: mx.array | None = None


def draft(
    drafter: Drafter,
    target: Target,
    catch: CatchUp,
    cache: list,
    k: int,
    s: SamplingParams,
    position: int | mx.array = 0,
) -> tuple[mx.array, mx.array | None]:
    """Catch the drafter up on ``catch``, then chain k drafts (the chain is not kept in its
    cache). ``position``, the output index of the pending token the drafts follow, is for
    wrappers (``bench.simulated_drafts``).

    Returns the drafts [k] and, when sampling, the drafter distributions they were drawn from,
    as graphs not yet submitted.
    """
    h = drafter.forward(catch.tokens[None], catch.hidden, cache)  # [1, L, H]
    if catch.last is None:
        h = h[:, -1:]
    else:
        h = mx.take(h, catch.last, axis=1)  # [1, 1, H]
        drafter.keep(cache, catch.last + 1, catch.tokens.shape[0])
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
    drafter.trim(cache, k - 1)
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

    def catch(self) -> CatchUp:
        """The tokens [L] and their hidden states [1, L, H], for ``draft``."""
        hidden = self.hidden[0] if len(self.hidden) == 1 else mx.concatenate(self.hidden, 1)
        return CatchUp(mx.array(self.tokens, mx.uint32), hidden)

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


def verify(target: Target, cache: list, pending: mx.array, drafts: mx.array
           ) -> tuple[ForwardOut, mx.array]:  # fmt: skip
    """The target over [pending, drafts] [1, k+1], each position as a decode step: its output
    and logits [k+1, V]."""
    block = mx.concatenate([pending.astype(drafts.dtype).reshape(1), drafts])[None]  # [1, k+1]
    out = target.forward(block, cache, verify=True)
    return out, positions(target.lm_head(out.hidden, exact=True))


@dataclass
class Round:
    """A temperature-0 round built and decided on the device, its verdict not read yet."""

    k: int
    position: int | mx.array  # the output index of its pending token
    verdict: mx.array  # [3k+2], for ``read_verdict``
    tokens: mx.array  # [k+1]: the target's tokens at the block's positions
    hidden: mx.array  # [1, k+1, H]: the target's hidden states there
    n_keep: mx.array  # int32 [1]: positions kept, the accepted drafts + 1

    def pending(self) -> mx.array:
        """The token that ends this round, [1]: the next round verifies it first."""
        return mx.take(self.tokens, self.n_keep - 1)

    def catch(self) -> CatchUp:
        """The drafter's input for the next round: this block, up to the token that ends it."""
        return CatchUp(self.tokens, self.hidden, self.n_keep - 1)


def submit_round(target: Target, drafter: Drafter, tcache: list, dcache: list,
                 pending: mx.array, catch: CatchUp, position: int | mx.array, k: int,
                 propose: Callable, rs: MTPStats) -> Round:  # fmt: skip
    """Draft, verify, accept and roll back without reading anything: the round is submitted
    and its outcome stays on the device."""
    t0 = time.perf_counter()
    drafts, _ = propose(drafter, target, catch, dcache, k, GREEDY, position)
    mx.async_eval(drafts)
    t1 = time.perf_counter()
    out, logits = verify(target, tcache, pending, drafts)
    verdict, tokens, n_keep = accept_on_device(logits, drafts)
    t2 = time.perf_counter()
    target.rollback(tcache, out.traces, n_keep, k + 1)
    t3 = time.perf_counter()
    mx.async_eval(verdict, *target.cache_arrays(tcache))  # waits while the device is behind
    rs.draft_s += t1 - t0
    rs.verify_build_s += t2 - t1
    rs.verify_s += t2 - t1 + time.perf_counter() - t3
    rs.rollback_s += t3 - t2
    return Round(k, position, verdict, tokens, out.hidden, n_keep)


def host_round(target: Target, drafter: Drafter, tcache: list, dcache: list, pending: int,
               catch: CatchUp, n: int, k: int, s: SamplingParams, propose: Callable,
               rs: MTPStats) -> tuple[list[int], mx.array]:  # fmt: skip
    """A round whose verdict the host reads before rolling back (sampling, or a verify not yet
    a graph): the tokens it emits and the target's hidden states before them [1, n_acc+1, H]."""
    t0 = time.perf_counter()
    drafts, q = propose(drafter, target, catch, dcache, k, s, n - 1)
    mx.async_eval(drafts)  # computed while the host builds the verify that takes them
    t1 = time.perf_counter()
    out, logits = verify(target, tcache, mx.array(pending, mx.uint32), drafts)
    t_built = time.perf_counter()  # the rest of the verify is the wait for the device
    n_acc, nxt = accept(logits, drafts, q, s, n)
    draft_ids = drafts.tolist()  # computed by now: accept read the verify
    t2 = time.perf_counter()
    target.rollback(tcache, out.traces, n_acc + 1, k + 1)
    mx.async_eval(target.cache_arrays(tcache))  # the next round's draft is built meanwhile
    rs.record(k, n_acc)
    rs.draft_s += t1 - t0
    rs.verify_s += t2 - t1
    rs.verify_build_s += t_built - t1
    rs.rollback_s += time.perf_counter() - t2
    return draft_ids[:n_acc] + [nxt], out.hidden[:, : n_acc + 1]


@dataclass
class MTPStart:
    """A prompt processed for MTP decoding (``start_mtp``)."""

    tcache: list
    dcache: list  # the drafter's: every position of the prompt but the last
    pending: int  # the first token, not yet verified or fed
    unseen: Unseen  # what the drafter reads next: the pending token after the last position
    ps: PromptStart  # its snapshots wait for their drafter parts (``drafter_parts``)
    hidden: mx.array  # [1, L - start + 1 or L - start, H]: the target's, from the snapshot on


def start_mtp(target: Target, drafter: Drafter, prompt, max_tokens: int,
              sampling: SamplingParams, stats: GenerationStats,
              on_prefill: Callable[[int, int], None] | None = None,
              prompt_cache: PromptCache | None = None, boundaries: Collection[int] = (),
              key: mx.array | None = None) -> MTPStart:  # fmt: skip
    """Process the prompt for the target (from the ``prompt_cache``'s longest snapshot with a
    drafter part, at temperature 0), pick the first token (with ``key`` where sampled), and
    submit the drafter's part of all positions but the last; the prompt's figures in
    ``stats``."""
    tokens = prompt_array(prompt)
    check_room(target, tokens.shape[1], max_tokens)
    check_ids(target, tokens)
    start = time.perf_counter()
    ids = tokens[0].tolist()
    # Sampled drafts depend on the drafter's rows, which a resumed catch-up computes in other
    # chunks than a cold one (bitwise alike on the CPU, not promised on a GPU): greedy only.
    ps = PromptStart(prompt_cache if sampling.greedy else None, ids, boundaries, mtp=True)
    if ps.snapshot is None:
        tcache, dcache = target.make_cache(), drafter.make_cache()
    else:
        tcache, dcache = target.restore(ps.snapshot.target), drafter.restore(ps.snapshot.drafter)
    hidden = target.prefill(tokens, tcache, on_prefill, start=ps.start,
                            on_cut=lambda p: ps.cut(target, tcache, p),
                            cuts=ps.boundaries)  # fmt: skip
    # [1, L - start, H]
    if ps.snapshot is not None:  # the drafter reads on from the snapshot's last position
        hidden = mx.concatenate([ps.snapshot.hidden, hidden], axis=1)
    y, _ = pick_checked(first_logits(target, hidden), sampling, key)
    pending = int(y.item())
    unseen = Unseen(ids[max(ps.start, 1) :] + [pending], hidden)
    # The drafter's part of the prompt, submitted: the first token need not wait for it.
    unseen.catch_up(drafter, dcache, batch=1)
    stats.prompt_tokens, stats.prompt_s = tokens.shape[1], time.perf_counter() - start
    stats.prompt_cached = ps.start
    return MTPStart(tcache, dcache, pending, unseen, ps, hidden)


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
    build_ahead: bool = True,
    prompt_cache: PromptCache | None = None,
    boundaries: Collection[int] = (),
) -> Iterator[int]:
    """Yield generated token ids (EOS excluded) until EOS or ``max_tokens``.

    ``propose`` makes the drafts (``draft``'s signature); benchmarks swap in a wrapper.
    ``choose_block`` picks each round's block size (at most ``block_size``) from the
    statistics so far and the context reached (tokens in the target's cache), or 1 for a
    classic step where no round is expected to pay; without it every round has
    ``block_size``. ``on_prefill`` follows the prompt's processing (tokens done, total).
    ``build_ahead`` False reads every round before the next is built (to measure what building
    ahead gains). With a ``prompt_cache`` the prompt resumes from its longest snapshot there
    (one an MTP run left: it holds the drafter's part) and leaves its own (at ``boundaries``
    too); at temperature 0 only.
    """
    check_block_size(block_size)
    stats = stats if stats is not None else GenerationStats()
    stats.mtp = rs = MTPStats(block_size)
    eos = set(eos_ids)
    p = start_mtp(target, drafter, prompt, max_tokens, sampling, stats, on_prefill, prompt_cache,
                  boundaries)  # fmt: skip
    tcache, dcache, pending, unseen, ps, hidden = p.tcache, p.dcache, p.pending, p.unseen, p.ps, \
        p.hidden  # fmt: skip
    tokens = prompt_array(prompt)
    start = time.perf_counter()
    emitted, n = [pending], 0
    queued = None  # a classic step already submitted: it feeds ``pending``
    ahead: Round | None = None  # a round submitted before the last one was read
    rounds = True  # whether the last token came from a round (False: from a classic step)
    choose = choose_block or (lambda stats, context: block_size)

    def on_device(k: int) -> bool:  # a round of k drafts can be decided on the device
        return build_ahead and sampling.greedy and (k + 1, True) in target.graph_lengths

    try:
        while True:
            for t in emitted:
                if t in eos or n >= max_tokens:
                    return
                yield t
                n += 1
                stats.emitted(n, start, time.perf_counter())
            if ps.taken:  # the first token is out: the snapshots get the drafter's parts
                ps.drafter_parts(drafter, dcache, hidden)
            if n >= max_tokens:
                return
            context = tokens.shape[1] + n - 1  # all but ``pending`` are in the target's cache
            b = 0 if ahead is not None else 1 if queued is not None else choose(rs, context)
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
            if ahead is None and not on_device(b - 1):
                emitted, h = host_round(target, drafter, tcache, dcache, pending, unseen.catch(),
                                        n, b - 1, sampling, propose, rs)  # fmt: skip
                pending, unseen = emitted[-1], Unseen(emitted, h)
                continue
            r = ahead or submit_round(target, drafter, tcache, dcache, mx.array(pending, mx.uint32),
                                      unseen.catch(), n - 1, b - 1, propose, rs)  # fmt: skip
            # round r + 1 goes out before round r is read, when it is a device round too
            b = choose(rs, context + r.k + 1)
            ahead = None
            if n + 1 < max_tokens and b > 1 and on_device(b - 1) and \
                    drafter.reads_lengths_on_device(dcache, r.k + 1):  # fmt: skip
                ahead = submit_round(target, drafter, tcache, dcache, r.pending(), r.catch(),
                                     r.position + r.n_keep, b - 1, propose, rs)  # fmt: skip
                rs.ahead += 1
            t0 = time.perf_counter()
            n_acc, ids = read_verdict(r.verdict, r.k, n)
            rs.verify_s += time.perf_counter() - t0
            rs.record(r.k, n_acc)
            target.settle(tcache, r.k - n_acc, idle=ahead is None)
            drafter.settle(dcache, r.k - n_acc if ahead else 0, idle=ahead is None)
            emitted = ids[: n_acc + 1]
            pending = emitted[-1]
            if ahead is None:
                unseen = Unseen(emitted, r.hidden[:, : n_acc + 1])
    finally:
        if ps.taken:  # decoding ended at the first token
            ps.drafter_parts(drafter, dcache, hidden)
        stats.finish(start, time.perf_counter(), mx.get_peak_memory())
