"""Continuous batching of MTP rounds: requests join a running batch between rounds and leave
it when they end; one round drafts, verifies, accepts and rolls back every row, each row
accepting its own count.

A greedy row's tokens are those its request decodes alone (which, at temperature 0, are its
classic tokens): the target verifies each row on its own rows of the caches, the products are
row-invariant (``models/row_policy.py``), and the rollback is per row (``rollback_rows``). The
drafts only decide how many tokens a round emits. A sampled row takes part in the rounds as a
classic step: its drafts are ignored, and its token is drawn from the block's first position
with the request's own key chain (``KeyChain``), as ``engine/batch.py`` draws it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..config import check_block_size
from ..drafters import Drafter
from ..errors import BatchNotSupportedError
from ..models import Target
from ..stats import GenerationStats, MTPStats
from .batch import Emitted, Rows, Started
from .mtp import start_mtp
from .prompt_cache import PromptCache
from .sampling import KeyChain, SamplingParams, check_finite, greedy, greedy_checked, pick_checked

# A round's drafts: (drafter, target, its caches, the rows' drafter outputs [B, 1, H], k, each
# row's owner and the output index of its pending token) -> drafts [B, k]; benchmarks swap in
# a wrapper (``bench.simulated_row_drafts``).
Propose = Callable[[Drafter, Target, list, mx.array, int, list[tuple[Any, int]]], mx.array]


def draft_rows(drafter: Drafter, target: Target, dcache: list, h: mx.array, k: int,
               rows: list[tuple[Any, int]] | None = None) -> mx.array:  # fmt: skip
    """Chain k greedy drafts for every row from the drafter's outputs h [B, 1, H]: [B, k]. The
    chain is not kept in the drafter's cache. (``rows`` is for wrappers.)"""
    drafts = []
    for i in range(k):
        d = greedy(target.lm_head(h)[:, -1])  # [B]
        drafts.append(d)
        if i < k - 1:
            h = drafter.forward(d.reshape(-1, 1), h, dcache)  # [B, 1, H]
    drafter.rewind_rows(dcache, [k - 1] * h.shape[0])
    return mx.stack(drafts, axis=1)  # [B, k]


@dataclass
class MTPRow:
    """One request in the batch."""

    owner: Any  # the caller's handle for the request
    max_tokens: int
    sampling: SamplingParams
    eos: frozenset[int]
    keys: KeyChain | None  # seeded sampling: the request's own keys
    # the prompt's token, emitted with the row's first round (which verifies it first)
    first: int | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    n: int = 0  # tokens emitted
    started: float = 0.0  # when its decoding began (perf_counter)


class MTPBatch(Rows):
    """The rows decoding together in MTP rounds of ``block_size`` positions, their caches
    (``Target.join_rows``, ``Drafter.join_rows``), each row's pending token [B] and the
    drafter's output at it [B, 1, H] (where the row's first draft comes from)."""

    def __init__(self, target: Target, drafter: Drafter, block_size: int,
                 propose: Propose = draft_rows, round_rows: int | None = None) -> None:  # fmt: skip
        """``round_rows``: the most product rows (requests x block) a round may verify; past
        it a step decodes one token a row (a round would cost nearly what its rows do, more
        than its tokens pay for: docs/design.md). None: the target's ``tile_rows``, or no
        bound where each row costs a product its own work."""
        check_block_size(block_size)
        self.target, self.drafter, self.block = target, drafter, block_size
        self.propose = propose
        self.round_rows = round_rows if round_rows is not None else target.tile_rows
        self.rows: list[MTPRow] = []
        self.tcache: list | None = None
        self.dcache: list | None = None
        self.pending: mx.array | None = None  # [B] uint32
        self.h: mx.array | None = None  # [B, 1, H]

    @property
    def max_rows(self) -> int | None:
        """The most requests the batch holds: every position of a round's rows is a row of the
        products, whose rows are exact up to the target's ``batch_rows``; where rounds stop at
        ``round_rows`` within that, its steps of one position take up to ``batch_rows``."""
        cap = self.target.batch_rows
        if cap is None or (self.round_rows is not None and self.round_rows <= cap):
            return cap
        return max(cap // self.block, 1)  # (one request verifies as it does alone)

    def check_room(self) -> None:
        cap = self.max_rows
        if cap is not None and len(self.rows) >= cap:
            raise BatchNotSupportedError(
                f"this target decodes at most {cap} requests together exactly at block "
                f"{self.block} on this backend (MTPBatch.max_rows); let one leave first"
            )

    def start(
        self,
        prompt,
        *,
        owner: Any = None,
        max_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        seed: int | None = None,
        eos_ids: Iterable[int] = (),
        on_prefill: Callable[[int, int], None] | None = None,
        prompt_cache: PromptCache | None = None,
        boundaries: Collection[int] = (),
    ) -> Started:
        """Process a request's prompt alone and catch the drafter up on it (everything
        handed to ``join`` evaluated); its first token comes out of the step after it joins."""
        keys = KeyChain(seed) if seed is not None and not sampling.greedy else None
        stats = GenerationStats()
        stats.mtp = MTPStats(self.block)
        s = start_mtp(self.target, self.drafter, prompt, max_tokens, sampling, stats, on_prefill,
                      prompt_cache, boundaries, keys.next() if keys else None)  # fmt: skip
        catch = s.unseen.catch()  # the pending token after the prompt's last position
        h = self.drafter.forward(catch.tokens[None], catch.hidden, s.dcache)[:, -1:]  # [1, 1, H]
        if s.ps.taken:  # the prompt's snapshots get their drafter parts
            s.ps.drafter_parts(self.drafter, s.dcache, s.hidden)
        pending = mx.array([s.pending], mx.uint32)  # [1]
        mx.eval(h, pending, *self.drafter.cache_arrays(s.dcache), *([keys.key] if keys else []))
        row = MTPRow(owner, max_tokens, sampling, frozenset(eos_ids), keys, s.pending, stats)
        return Started(row, (s.tcache, s.dcache, h, pending))

    def join(self, started: Started) -> MTPRow:
        """Add a started request as the last row."""
        self.check_room()
        row, (tcache, dcache, h, pending) = started.row, started.parts
        row.started = time.perf_counter()
        self.tcache = self.target.join_rows(self.tcache, tcache)
        self.dcache = self.drafter.join_rows(self.dcache, dcache)
        self.pending = pending if self.pending is None else mx.concatenate([self.pending, pending])
        self.h = h if self.h is None else mx.concatenate([self.h, h])
        self.rows.append(row)
        return row

    def rounds(self) -> bool:
        """Whether the next step is a round (else one token a row, the drafter kept current):
        one request alone always rounds, as ``generate_mtp`` would."""
        B = len(self.rows)
        return self.round_rows is None or B == 1 or B * self.block <= self.round_rows

    def step(self) -> list[Emitted]:
        """One round of every row: draft, verify, accept, roll back, emit; then the drafter
        catches up on what each row kept. Past ``round_rows`` a round of one position (a
        classic step). What each row gave, in row order; rows that ended stay until ``drop``."""
        B, T = len(self.rows), self.block if self.rounds() else 1
        k = T - 1
        at = [(r.owner, 0 if r.first is not None else r.n - 1) for r in self.rows]  # pending
        drafts = (self.propose(self.drafter, self.target, self.dcache, self.h, k, at) if k
                  else mx.zeros((B, 0), mx.uint32))  # [B, k]  # fmt: skip
        # [B, T]: each row's pending token, then its drafts
        block = mx.concatenate([self.pending.reshape(B, 1), drafts.astype(mx.uint32)], axis=1)
        out = self.target.forward(block, self.tcache, verify=T > 1)  # [B, T, H]
        picked, n_acc, lse = self._accept(self.target.lm_head(out.hidden, exact=True), drafts)
        self.target.rollback_rows(self.tcache, out.traces, [n + 1 for n in n_acc], T)
        self._catch_up(picked, out.hidden, n_acc)
        return [self._emit(r, picked[b][: n_acc[b] + 1], lse[b][: n_acc[b] + 1], k)
                for b, r in enumerate(self.rows)]  # fmt: skip

    def _accept(self, logits: mx.array, drafts: mx.array
                ) -> tuple[list[list[int]], list[int], list[list[float]]]:  # fmt: skip
        """Each row's verdict from the verify's logits [B, T, V] and the drafts [B, k], read in
        one transfer: the target's tokens at the T positions (a sampled row's first, its own
        draw), the drafts accepted (a sampled row's none) and the positions' logsumexps."""
        B, T = logits.shape[:2]
        ids, lse = greedy_checked(logits)  # [B, T], [B, T, 1]
        agree = (ids[:, : T - 1] == drafts.astype(ids.dtype)).astype(mx.int32)  # [B, k]
        accepted = mx.cumprod(agree, axis=1).sum(axis=1)  # [B]
        read = [ids.reshape(-1), accepted, self._sampled(logits), lse.reshape(-1)]
        values = mx.concatenate([a.astype(mx.float32) for a in read]).tolist()
        picked = [[int(v) for v in values[b * T : (b + 1) * T]] for b in range(B)]
        n_acc = [0] * B
        for b, r in enumerate(self.rows):
            if r.sampling.greedy:
                n_acc[b] = int(values[B * T + b])
            else:  # a classic step: its own token ends its round
                picked[b][0] = int(values[B * T + B + b])
        lse_at = values[B * (T + 2) :]
        return picked, n_acc, [lse_at[b * T : (b + 1) * T] for b in range(B)]

    def _catch_up(self, picked: list[list[int]], hidden: mx.array, n_acc: list[int]) -> None:
        """The drafter reads each row's block [B, T] with the target's hidden states there
        [B, T, H] up to the token that ends the row's round; its output there is the next
        round's first draft's, and the token the next verify's first."""
        B, T = len(picked), len(picked[0])
        h = self.drafter.forward(mx.array(picked, mx.uint32), hidden, self.dcache)  # [B, T, H]
        kept = mx.array(n_acc, mx.int32).reshape(B, 1, 1)
        self.h = mx.take_along_axis(h, kept, axis=1)  # [B, 1, H]
        self.drafter.rewind_rows(self.dcache, [T - 1 - n for n in n_acc])
        pending = [p[n] for p, n in zip(picked, n_acc, strict=True)]
        self.pending = mx.array(pending, mx.uint32)  # [B]
        mx.async_eval(self.h, self.pending, *self.target.cache_arrays(self.tcache))

    def _sampled(self, logits: mx.array) -> mx.array:
        """Each sampled row's token at the block's first position, drawn with its own key where
        seeded (a greedy row's entry is an unused 0): [B]."""
        zero = mx.zeros((), mx.uint32)
        return mx.stack([zero if r.sampling.greedy else
                         pick_checked(logits[b, 0], r.sampling, r.keys.next() if r.keys else None
                                      )[0].astype(mx.uint32)
                         for b, r in enumerate(self.rows)])  # fmt: skip

    def _emit(self, r: MTPRow, tokens: list[int], lse: list[float], k: int) -> Emitted:
        """A row's tokens of this round, up to its EOS or its last token."""
        check_finite(lse, r.n)
        if k and r.sampling.greedy:
            r.stats.mtp.record(k, len(tokens) - 1)
        else:  # a step of one position, or a sampled row's classic step inside a round
            r.stats.mtp.classic_steps += 1
        out = []
        if r.first is not None:
            tokens, r.first = [r.first, *tokens], None
        for t in tokens:
            if t in r.eos:
                return Emitted(r, out, True)
            out.append(t)
            r.n += 1
            r.stats.emitted(r.n, r.started, time.perf_counter())
            if r.n >= r.max_tokens:
                return Emitted(r, out, True)
        return Emitted(r, out, False)

    def _keep(self, keep: list[int]) -> None:
        if not keep:
            self.tcache = self.dcache = self.pending = self.h = None
            return
        idx = mx.array(keep, mx.int32)
        self.tcache = self.target.keep_rows(self.tcache, keep)
        self.dcache = self.drafter.keep_rows(self.dcache, keep)
        self.pending, self.h = mx.take(self.pending, idx), mx.take(self.h, idx, axis=0)
