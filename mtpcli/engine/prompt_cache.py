"""The prompt cache: the decoder's state after a prompt's first tokens, kept so that a later
prompt starting with the same tokens (a shared system prompt, the next turn of a chat, the
same request again) skips processing them, with the tokens of a cold start.

A gated-delta layer's state cannot be cut back to an earlier position as a KV cache can, so
the state is kept whole, as snapshots taken while a prompt is processed, and only at its cuts
(``Target.prefill``): the multiples of the prefill chunk, where its messages end, and its last
position but one. A snapshot serves a later prompt that starts with its tokens and has a cut
there too (a multiple of the chunk, the end of one of its messages, or its own last position
but one), so the positions after it are computed as the prompt processed whole computes them,
on every backend: exact by construction, not by a row-invariance that only some backends give.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..drafters import Drafter
from ..models import Target
from ..models.kv_cache import RowsKVCache
from ..models.qwen3_5 import cut_at_or_before, is_cut


@dataclass
class Snapshot:
    """The state after ``tokens``: the target's caches and, where an MTP run took it, the
    drafter's cache over all positions but the last and the target's hidden state at the
    last [1, 1, H] (what the drafter reads next)."""

    tokens: tuple[int, ...]
    target: list
    below: tuple[int, ...] = ()  # the message-end cuts before it: the chunks that made it
    drafter: list | None = None
    hidden: mx.array | None = None

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        arrays = [*_arrays(self.target), *_arrays(self.drafter or [])]
        return sum(a.nbytes for a in arrays) + (self.hidden.nbytes if self.hidden is not None
                                                 else 0)  # fmt: skip

    def serves(self, ids: Sequence[int], boundaries: Collection[int] = ()) -> bool:
        """Whether a prompt ``ids`` (its messages ending at ``boundaries``) may resume from
        here: it starts with these tokens and, processed whole, would cut here and at the
        same places before (so its chunks up to here are the ones that made this state)."""
        p = self.length
        return is_cut(p, len(ids), boundaries) and _below(boundaries, p) == self.below and \
            tuple(ids[:p]) == self.tokens  # fmt: skip


def _below(boundaries: Collection[int], p: int) -> tuple[int, ...]:
    return tuple(sorted({b for b in boundaries if 0 < b < p}))


def _arrays(caches: list) -> list[mx.array]:
    out: list[mx.array] = []
    for c in caches:  # an attention layer's rows, a gated-delta layer's (window, state), or
        if c is not None:  # None: another pipeline stage's layer
            out += [a for a in ((c.keys, c.values) if isinstance(c, RowsKVCache) else c)
                    if a is not None]  # fmt: skip
    return out


@dataclass
class PromptCacheStats:
    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0
    evicted: int = 0


class PromptCache:
    """Snapshots, least recently used first out, holding at most ``max_bytes`` together."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], Snapshot] = OrderedDict()
        self.bytes = 0
        self.stats = PromptCacheStats()

    def find(self, ids: Sequence[int], drafter: bool = False,
             boundaries: Collection[int] = ()) -> Snapshot | None:  # fmt: skip
        """The longest snapshot ``ids`` (its messages ending at ``boundaries``) may resume
        from (with a drafter part, if asked)."""
        self.stats.lookups += 1
        best = None
        for snap in self.entries.values():
            if (not drafter or snap.drafter is not None) and snap.serves(ids, boundaries) and \
                    (best is None or snap.length > best.length):  # fmt: skip
                best = snap
        if best is not None:
            self.entries.move_to_end(best.tokens)
            self.stats.hits += 1
            self.stats.tokens_reused += best.length
        return best

    def cuts_to_keep(self, ids: Sequence[int], boundaries: Collection[int] = (),
                     start: int = 0, drafter: bool = False) -> set[int]:  # fmt: skip
        """Where to snapshot a prompt ``ids`` resumed at ``start``: where its messages end
        (``boundaries``: a later prompt may share up to there), the last multiple of the chunk
        before its end, and its last position but one; not where a snapshot is kept already
        (with a drafter part, if ``drafter``)."""
        last = len(ids) - 1
        cuts = {b for b in boundaries if 0 < b <= last} | {cut_at_or_before(last), last}

        def kept(p: int) -> bool:
            snap = self.entries.get(tuple(ids[:p]))
            return snap is not None and (snap.drafter is not None or not drafter)

        return {p for p in cuts if p > start and not kept(p)}

    def put(self, snap: Snapshot) -> None:
        """Keep ``snap`` (in place of one of the same tokens without a drafter part), then
        drop the least recently used until the bytes fit; one larger than all is not kept."""
        old = self.entries.get(snap.tokens)
        if old is not None:
            if old.drafter is not None or snap.drafter is None:
                self.entries.move_to_end(snap.tokens)
                return
            self._drop(snap.tokens)
        size = snap.nbytes
        if size > self.max_bytes:
            return
        self.entries[snap.tokens] = snap
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))
            self.stats.evicted += 1

    def _drop(self, tokens: tuple[int, ...]) -> None:
        self.bytes -= self.entries.pop(tokens).nbytes


class PromptStart:
    """Where one prompt's processing starts (``start`` positions restored from ``snapshot``,
    the longest the cache has for it) and the snapshots it leaves there as it goes."""

    def __init__(self, cache: PromptCache | None, ids: Sequence[int],
                 boundaries: Collection[int] = (), mtp: bool = False) -> None:  # fmt: skip
        self.cache, self.ids, self.mtp = cache, tuple(ids), mtp
        self.boundaries = tuple(boundaries)
        self.snapshot = cache.find(ids, mtp, boundaries) if cache is not None else None
        self.start = self.snapshot.length if self.snapshot is not None else 0
        self.cuts = cache.cuts_to_keep(ids, boundaries, self.start, mtp) if cache else set()
        self.taken: list[Snapshot] = []  # MTP: the target's parts, until the drafter's

    def cut(self, target: Target, cache: list, p: int) -> None:
        """The prompt's processing reached cut ``p``: snapshot ``cache`` if it is kept."""
        if p not in self.cuts:
            return
        snap = Snapshot(self.ids[:p], target.snapshot(cache), _below(self.boundaries, p))
        mx.eval(*_arrays(snap.target))
        if self.mtp:
            self.taken.append(snap)
        else:
            self.cache.put(snap)

    def drafter_parts(self, drafter: Drafter, dcache: list, hidden: mx.array) -> None:
        """MTP: the drafter caught up over the prompt (``dcache`` holds all its positions but
        the last); ``hidden`` [1, *, H] from position ``start - 1`` (0 when not resumed) on.
        The snapshots taken get their drafter parts and go into the cache."""
        base = max(self.start - 1, 0)
        for snap in self.taken:
            p = snap.length
            snap.drafter = drafter.snapshot(dcache, p - 1)
            snap.hidden = mx.contiguous(hidden[:, p - 1 - base : p - base])  # [1, 1, H]
            mx.eval(*_arrays(snap.drafter), snap.hidden)
            self.cache.put(snap)
        self.taken = []
