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
        capacity = room(self.keys.shape[2], self.offset + n, self.step)
        self.keys, self.values = padded(self.keys, capacity), padded(self.values, capacity)


def room(have: int, rows: int, step: int = KVCache.step) -> int:
    """A buffer's capacity once it holds ``rows``: ``have`` grown in ``step``s (mlx-lm's)."""
    return have + -(-max(rows - have, 0) // step) * step


def padded(a: mx.array, capacity: int) -> mx.array:
    """Buffer ``a`` [B, Hkv, n, D] with zero rows up to ``capacity``."""
    more = capacity - a.shape[2]
    return a if more <= 0 else mx.pad(a, [(0, 0), (0, 0), (0, more), (0, 0)])


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


class BatchKV:
    """One attention layer's cache in a batch of requests (``engine/batch.py``): every row's
    keys and values in one pair of buffers [B, Hkv, capacity, D], row b's first ``lengths[b]``
    rows filled. Each row's attention reads its own rows alone (the decode-attention kernels
    take a length per row), so its arithmetic is the one it has decoding by itself."""

    filled = True

    def __init__(self, keys: mx.array, values: mx.array, lengths: list[int] | None,
                 device: mx.array | None = None):  # fmt: skip
        """``lengths`` on the host; inside a compiled forward None, and ``device`` (int32
        [B], an input of the graph) holds them."""
        self.keys, self.values, self.lengths = keys, values, lengths
        self._device = device

    @classmethod
    def join(cls, batch: BatchKV | None, cache: RowsKVCache) -> BatchKV:
        """``batch`` with a request's own filled cache added as its last row (the buffers
        padded to one capacity)."""
        assert cache.filled and cache.device_length is None, "a request joins with its rows"
        n = cache.offset
        parts = [(cache.keys[..., :n, :], cache.values[..., :n, :])]
        lengths = [n]
        if batch is not None:
            parts.insert(0, (batch.keys, batch.values))
            lengths = [*batch.lengths, n]
        capacity = room(0, max(a.shape[2] for a, _ in parts))
        keys = mx.concatenate([padded(k, capacity) for k, _ in parts], axis=0)  # [B, Hkv, C, D]
        values = mx.concatenate([padded(v, capacity) for _, v in parts], axis=0)
        return cls(keys, values, lengths)

    def keep(self, rows: list[int]) -> BatchKV:
        """The batch with only ``rows`` (indices, in order)."""
        idx = mx.array(rows, mx.int32)
        return BatchKV(mx.take(self.keys, idx, axis=0), mx.take(self.values, idx, axis=0),
                       [self.lengths[r] for r in rows])  # fmt: skip

    def length(self) -> mx.array:
        """Each row's filled rows as an int32 [B] array."""
        if self._device is None:
            self._device = mx.array(self.lengths, mx.int32)
        return self._device

    def reserve(self, n: int) -> None:
        """Grow the buffers so that every row takes ``n`` more rows (before a forward: a
        buffer grown inside a graph would make a new graph each step)."""
        capacity = room(self.keys.shape[2], max(self.lengths) + n)
        self.keys, self.values = padded(self.keys, capacity), padded(self.values, capacity)

    def write(self, keys: mx.array, values: mx.array) -> None:
        """Append T rows to each row at its own length: keys and values [B, Hkv, T, D] (the
        buffers hold them: ``reserve``)."""
        T = keys.shape[2]
        at = self.length().reshape(-1, 1, 1, 1) + mx.arange(T, dtype=mx.int32).reshape(1, 1, T, 1)
        self.keys = mx.put_along_axis(self.keys, at, keys, axis=2)  # at: [B, 1, T, 1]
        self.values = mx.put_along_axis(self.values, at, values, axis=2)
        self.advance(T)

    def advance(self, T: int) -> None:
        """Every row took T rows (here, or in a graph)."""
        if self.lengths is None:
            self._device = self._device + T
        else:
            self.lengths, self._device = [n + T for n in self.lengths], None

    def rewind(self, dropped: list[int]) -> None:
        """Row b's last ``dropped[b]`` rows go (a round's rollback, a drafter's chain)."""
        self.lengths = [n - d for n, d in zip(self.lengths, dropped, strict=True)]
        self._device = None

    def row(self, b: int) -> RowsKVCache:
        """Row b as a cache of its own (its rows copied out on write; ``put_rows`` puts them
        back): for the attention paths that go row by row."""
        out = RowsKVCache()
        out.keys, out.values = self.keys[b : b + 1], self.values[b : b + 1]
        out.offset = self.lengths[b]
        return out

    def put_rows(self, rows: list[RowsKVCache]) -> None:
        """The rows of ``row`` back after each took the same number of new rows."""
        self.keys = mx.concatenate([r.keys for r in rows], axis=0)
        self.values = mx.concatenate([r.values for r in rows], axis=0)
        self.lengths = [r.offset for r in rows]
        self._device = None
