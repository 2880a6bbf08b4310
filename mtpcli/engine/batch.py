"""Continuous batching of classic decoding: requests join a running batch between steps and
leave it when they end; one forward decodes a token of every row.

Each row's tokens are those the request decodes alone (``generate_classic``): its prompt is
processed alone, its attention reads only its own rows of the cache (``BatchKV``), the other
operations are row-invariant (the products where they run batched, ``models/row_policy.py``),
and a seeded sample draws from the row's own key chain (``KeyChain``) in the order it would
alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..errors import BatchNotSupportedError
from ..models import Target
from ..stats import GenerationStats
from .classic import start_classic
from .prompt_cache import PromptCache
from .sampling import KeyChain, SamplingParams, check_finite, greedy_checked, pick_checked, readback


@dataclass
class Picks:
    """Tokens picked together: ids [n] and their ``readback`` [2n], read once for all of
    them (pick b: ids[b], read[b] and read[n + b]). A greedy step's are every row's; a
    sampled row's, and a joining row's first token, its own (n = 1)."""

    ids: mx.array  # [n]
    seen: mx.array  # [2n]
    _read: list[float] | None = None

    def token(self, b: int, position: int) -> int:
        """Pick b's token, its logits checked to be numbers (``classic.read_token``'s)."""
        if self._read is None:
            self._read = self.seen.tolist()
        rows = len(self._read) // 2
        check_finite([self._read[rows + b]], position)
        return int(self._read[b])


@dataclass
class Row:
    """One request in the batch."""

    owner: Any  # the caller's handle for the request
    max_tokens: int
    sampling: SamplingParams
    eos: frozenset[int]
    keys: KeyChain | None  # seeded sampling: the request's own keys
    # The token to feed next (the last one picked): ``picks.ids[slot]``, read by the next
    # ``step``.
    picks: Picks
    slot: int
    stats: GenerationStats = field(default_factory=GenerationStats)
    n: int = 0  # tokens emitted
    started: float = 0.0  # when its decoding began (perf_counter)


@dataclass
class Emitted:
    """What one step or round gave a row: its tokens (none at EOS, where a classic step ends
    it) and whether the row has ended."""

    row: Any  # ``Row``, or ``mtp_batch.MTPRow``
    tokens: list[int]
    ended: bool


@dataclass
class Started:
    """A request whose prompt was processed alone (``Rows.start``), waiting to ``join``: its
    row and the one-row state the batch takes in (caches; per batch kind)."""

    row: Any
    parts: tuple


class Rows:
    """What a batch of requests does whatever it decodes in (classic steps here, MTP rounds in
    ``mtp_batch.py``): rows joining, their steps collected, and rows leaving.

    A request joins in two parts: ``start`` processes its prompt alone, touches nothing of
    the batch and evaluates all it hands on, so it may run on another thread (with a stream of
    its own: MLX's streams belong to the thread that made them) while the batch steps (the
    target builds one pass at a time); ``join`` then adds it between steps. ``add`` does both,
    the batch waiting."""

    rows: list

    def add(self, prompt, **request) -> Any:
        """``start`` and ``join`` a request (``start``'s arguments); its row."""
        self.check_room()
        return self.join(self.start(prompt, **request))

    def start(self, prompt, **request) -> Started:
        raise NotImplementedError

    def join(self, started: Started) -> Any:
        raise NotImplementedError

    def check_room(self) -> None:
        """Refuse a request past the rows this batch decodes exactly together."""
        raise NotImplementedError

    def step(self) -> list[Emitted]:
        raise NotImplementedError

    def advance(self, tokens) -> list[Emitted]:
        """One ``step``, each row's tokens appended to ``tokens[row.owner]`` and the rows that
        ended dropped (for callers that only collect tokens: benches, tests)."""
        out = self.step()
        for e in out:
            tokens[e.row.owner].extend(e.tokens)
        self.drop([e.row for e in out if e.ended])
        return out

    def drain(self, tokens) -> None:
        """``advance`` until every row has ended."""
        while self.rows:
            self.advance(tokens)

    def drop(self, rows: Iterable) -> None:
        """Take ``rows`` out of the batch (ended, or their client left)."""
        gone = {id(r) for r in rows}
        if not gone:  # (a step where nothing ended: the caches stay as they are)
            return
        for r in self.rows:
            if id(r) in gone:
                r.stats.finish(r.started, time.perf_counter(), mx.get_peak_memory())
        keep = [i for i, r in enumerate(self.rows) if id(r) not in gone]
        self.rows = [self.rows[i] for i in keep]
        self._keep(keep)

    def _keep(self, keep: list[int]) -> None:
        """The batch's state with only the rows ``keep`` (indices, in order; none: empty)."""
        raise NotImplementedError


class Batch(Rows):
    """The rows decoding together and their caches (``Target.join_rows``)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.rows: list[Row] = []
        self.cache: list | None = None
        self._picks: Picks | None = None  # the last step's, while the rows are its rows

    def check_room(self) -> None:
        cap = self.target.batch_rows
        if cap is not None and len(self.rows) >= cap:
            raise BatchNotSupportedError(
                f"this target decodes at most {cap} requests together exactly on this backend "
                "(Target.batch_rows); let one leave first"
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
        """Process a request's prompt alone and pick its first token (read by the step after
        it joins); everything it hands ``join`` is evaluated."""
        keys = KeyChain(seed) if seed is not None and not sampling.greedy else None
        stats = GenerationStats()
        cache, y, seen = start_classic(self.target, prompt, max_tokens, sampling, stats,
                                       on_prefill, prompt_cache, boundaries,
                                       keys.next() if keys else None)  # fmt: skip
        row = Row(owner, max_tokens, sampling, frozenset(eos_ids), keys,
                  Picks(y.reshape(1), seen), 0, stats)  # fmt: skip
        mx.eval(row.picks.ids, *([keys.key] if keys else []))
        return Started(row, (cache,))

    def join(self, started: Started) -> Row:
        """Add a started request as the last row. A batch holds at most the target's
        ``batch_rows``."""
        self.check_room()
        row, (cache,) = started.row, started.parts
        row.started = time.perf_counter()
        self.cache = self.target.join_rows(self.cache, cache)
        self.rows.append(row)
        self._picks = None
        return row

    def pending(self) -> mx.array:
        """The token each row feeds next, [B]: the last step's picks, where the rows are its
        rows, as they are."""
        if self._picks is not None:
            return self._picks.ids
        return mx.stack([r.picks.ids[r.slot] for r in self.rows])

    def step(self) -> list[Emitted]:
        """Queue the next forward of every row, then read each row's pending token: what each
        row gave, in row order. Rows that ended stay until ``drop`` (the caller may have more
        to do with them). Where every row is greedy, the rows' picks are one argmax over the
        batch's logits [B, V] and one read (each row's the arithmetic it has alone: a verify's
        positions are picked the same way); else each row picks on its own."""
        ys = self.pending()
        logits = self.target.lm_head(self.target.forward(ys.reshape(-1, 1), self.cache).hidden)
        if all(r.sampling.greedy for r in self.rows):
            ids, lse = greedy_checked(logits[:, -1])  # [B], [B, 1]
            picks = Picks(ids, readback(ids, lse))
            nxt = [(picks, b) for b in range(len(self.rows))]
        else:
            picks, nxt = None, []
            for b, r in enumerate(self.rows):
                y, lse = pick_checked(logits[b, -1], r.sampling,
                                      r.keys.next() if r.keys else None)  # fmt: skip
                nxt.append((Picks(y.reshape(1), readback(y, lse)), 0))  # [1], [2]
        mx.async_eval([p.seen for p, _ in nxt])
        out = []
        self._picks = None  # (until every row has read its token: a read may raise)
        for r, (p, slot) in zip(self.rows, nxt, strict=True):
            token = r.picks.token(r.slot, r.n)
            if token in r.eos:
                out.append(Emitted(r, [], True))
                continue
            r.n += 1
            r.stats.emitted(r.n, r.started, time.perf_counter())
            out.append(Emitted(r, [token], r.n >= r.max_tokens))
            r.picks, r.slot = p, slot
        self._picks = picks
        return out

    def _keep(self, keep: list[int]) -> None:
        self.cache = self.target.keep_rows(self.cache, keep) if keep else None
        self._picks = None
