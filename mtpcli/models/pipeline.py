"""The target's decoder layers split over the processes of an ``mx.distributed`` group (started
by ``mlx.launch``), as mlx-lm's pipeline splits them: rank r runs the layers after those of
ranks r+1 .. size-1, so the last rank embeds the tokens, each rank hands its hidden state to
the rank below, and rank 0 ends with the final hidden state, which every rank then receives
(one ``all_gather``). Every rank holds the embedding, the final norm, the head and the drafter
and runs them on that same state, so all pick the same tokens (the same arithmetic on the same
inputs) and roll their own layers back with no further messages; only the decoder layers,
nearly all of a model's weights, are split.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..errors import PipelineError
from .kv_cache import RowsKVCache


@dataclass(frozen=True)
class Stage:
    """One rank's part: its group and the decoder layers it runs."""

    group: mx.distributed.Group
    layers: range

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def first(self) -> bool:
        """Runs the first layers: takes the embedded tokens."""
        return self.rank == self.size - 1

    @property
    def last(self) -> bool:
        """Runs the last layers: its output is the final hidden state."""
        return self.rank == 0


def split(n_layers: int, size: int) -> list[range]:
    """Each rank's layers (by rank): contiguous, as even as the count allows, the lower ranks
    taking one more; rank 0 the last layers."""
    if size > n_layers:
        raise PipelineError(f"{size} processes cannot split the target's {n_layers} decoder "
                            f"layers: start at most {n_layers} with mlx.launch -n")  # fmt: skip
    base, extra = divmod(n_layers, size)
    counts = [base + (r < extra) for r in range(size)]
    return [range(sum(counts[r + 1 :]), sum(counts[r:])) for r in range(size)]


def launched() -> bool:
    """Whether this process is one of several (``mlx.launch``)."""
    return mx.distributed.init().size() > 1


def rank() -> int:
    """This process's rank among those ``mlx.launch`` started (0 alone)."""
    return mx.distributed.init().rank()


def stage(n_layers: int, group: mx.distributed.Group | None = None) -> Stage | None:
    """This process's stage when it runs in a group of several (``mlx.launch``); None alone."""
    group = group if group is not None else mx.distributed.init()
    if group.size() == 1:
        return None
    return Stage(group, split(n_layers, group.size())[group.rank()])


def hand_on(stage: Stage, h: mx.array, last_cache: RowsKVCache | ArraysCache) -> mx.array:
    """After a stage's layers: its hidden state [B, T, H] to the rank below, then the final
    hidden state from rank 0 to every rank. ``last_cache`` (the stage's last layer's cache)
    is made to depend on the send, so evaluating the caches alone (a prompt's chunks) sends."""
    if not stage.last:
        h = mx.distributed.send(h, stage.rank - 1, group=stage.group)
        if isinstance(last_cache, RowsKVCache):
            last_cache.keys = mx.depends(last_cache.keys, h)
        else:  # a gated-delta layer's (window, state)
            last_cache[0] = mx.depends(last_cache[0], h)
    return mx.distributed.all_gather(h, group=stage.group)[: h.shape[0]]


def receive(stage: Stage, like: mx.array) -> mx.array:
    """Before a stage's layers: the hidden state [B, T, H] from the rank above (the first
    stage keeps ``like``, the embedded tokens)."""
    if stage.first:
        return like
    return mx.distributed.recv_like(like, stage.rank + 1, group=stage.group)


def shared_seed(stage: Stage) -> int:
    """A random seed drawn by rank 0 and known to every rank (sampling stays in step)."""
    mine = mx.random.randint(0, 2**31 - 1, (1,)) if stage.last else mx.zeros((1,), mx.int32)
    return int(mx.distributed.all_sum(mine.astype(mx.int32), group=stage.group).item())


def share(stage: Stage, data: bytes | None = None) -> bytes | None:
    """Rank 0's ``data`` on every rank (the others pass nothing; rank 0's None arrives as None,
    the end of an exchange): two ``all_sum``s, the length, then the bytes."""
    n = (-1 if data is None else len(data)) if stage.last else 0
    n = int(mx.distributed.all_sum(mx.array([n], mx.int32), group=stage.group).item())
    if n <= 0:
        return None if n < 0 else b""
    mine = mx.array(list(data), mx.int32) if stage.last else mx.zeros((n,), mx.int32)  # [n]
    return bytes(mx.distributed.all_sum(mine, group=stage.group).astype(mx.uint8).tolist())


def share_flag(stage: Stage, flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (the others' is ignored)."""
    mine = mx.array([int(flag and stage.last)], mx.int32)
    return bool(mx.distributed.all_sum(mine, group=stage.group).item())
