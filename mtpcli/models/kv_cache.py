"""The attention layers' KV cache, as the decode-attention kernels read and write it.

``RowsKVCache`` is mlx-lm's ``KVCache`` (its buffers, growth, trim and mask) with the cache's
length also given as a device array: the kernels read the first N rows of the whole buffers,
so a step's graph has the same shape at every N. Inside a compiled forward the same cache is
a ``GraphKV``, whose buffers and length are the graph's inputs and whose writes are slice
updates at the device length.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class RowsKVCache(KVCache):
    """mlx-lm's KV cache (buffers [B, Hkv, capacity, D], ``offset`` rows filled)."""

    @property
    def filled(self) -> bool:
        return self.offset > 0

    def length(self) -> mx.array:
        """The filled rows N as an int32 [1] array."""
        return mx.array([self.offset], mx.int32)

    def write(self, keys: mx.array, values: mx.array) -> None:
        """Append T rows: keys and values [B, Hkv, T, D]."""
        self.update_and_fetch(keys, values)

    def reserve(self, n: int) -> None:
        """Grow the buffers (in mlx-lm's steps) so that ``n`` more rows fit without growing
        inside a graph. The cache must hold a row already (its shapes come from it)."""
        have = self.keys.shape[2]
        if self.offset + n <= have:
            return
        more = -(-(self.offset + n - have) // self.step) * self.step
        self.keys, self.values = (
            mx.concatenate([a, mx.zeros((*a.shape[:2], more, a.shape[3]), a.dtype)], axis=2)
            for a in (self.keys, self.values)
        )


class GraphKV:
    """A filled ``RowsKVCache`` as a compiled forward sees it: its buffers and length are
    arrays of the graph, so one trace serves every length."""

    filled = True

    def __init__(self, keys: mx.array, values: mx.array, length: mx.array):
        self.keys, self.values, self._length = keys, values, length

    def length(self) -> mx.array:
        return self._length

    def write(self, keys: mx.array, values: mx.array) -> None:
        """Write T rows at the device length (the buffers fit them: ``RowsKVCache.reserve``)."""
        self.keys = mx.slice_update(self.keys, keys, self._length, axes=(2,))
        self.values = mx.slice_update(self.values, values, self._length, axes=(2,))
