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
    """mlx-lm's KV cache (buffers [B, Hkv, capacity, D], ``offset`` rows filled).

    While rounds the host has not read yet are in flight, the filled length is only known on
    the device (``device_length``, an int32 [1] array): rows are written there, and ``offset``
    is an upper bound (it counts every row written) until ``settle`` subtracts what the host
    learns was dropped.
    """

    device_length: mx.array | None = None

    @property
    def filled(self) -> bool:
        return self.offset > 0

    def length(self) -> mx.array:
        """The filled rows N as an int32 [1] array."""
        if self.device_length is not None:
            return self.device_length
        return mx.array([self.offset], mx.int32)

    def write(self, keys: mx.array, values: mx.array) -> None:
        """Append T rows: keys and values [B, Hkv, T, D]."""
        if self.device_length is None:
            self.update_and_fetch(keys, values)
            return
        T = keys.shape[2]
        self.reserve(T)
        self.keys = mx.slice_update(self.keys, keys, self.device_length, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.device_length, axes=(2,))
        self.advance(T, self.device_length + T)

    def advance(self, T: int, length: mx.array | None = None) -> None:
        """T rows were written (by a graph, at ``length() - T``); ``length``, the new length on
        the device, is kept while the cache is on the device."""
        self.offset += T
        if self.device_length is not None:
            self.device_length = length

    def trim(self, n: int) -> int:
        n = super().trim(n)
        if self.device_length is not None:
            self.device_length = self.device_length - n
        return n

    def keep(self, length: mx.array) -> None:
        """Set the filled length on the device (a rollback the host has not read)."""
        self.device_length = length

    def settle(self, dropped: int, idle: bool) -> None:
        """The host learnt that ``dropped`` rows counted in ``offset`` were rolled back on the
        device; ``idle``: nothing is in flight, ``offset`` is exact again and the device
        length is no longer needed."""
        self.offset -= dropped
        if idle:
            self.device_length = None

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


def held(cache: RowsKVCache, rows: int | None = None) -> RowsKVCache:
    """A cache holding the first ``rows`` (default: all) filled rows of ``cache``, whatever is
    written to either later: the rows copied to buffers of their own (a prompt-cache
    snapshot, and the cache a restored one starts from). The length must be known on the
    host."""
    assert cache.device_length is None, "a cache with rounds in flight has no host length"
    n = cache.offset if rows is None else rows
    assert 0 <= n <= cache.offset, f"the cache holds {cache.offset} rows, not {n}"
    out = RowsKVCache()
    if n > 0:
        out.keys = mx.contiguous(cache.keys[..., :n, :])  # [B, Hkv, n, D]
        out.values = mx.contiguous(cache.values[..., :n, :])
        out.offset = n
    return out


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


class RowCaches(list):
    """One attention layer's caches in a batch of requests (``engine/batch.py``): each row's
    own ``RowsKVCache``. Rows hold different lengths; each row's attention reads its own
    cache alone, so its arithmetic is the one it has decoding by itself."""
