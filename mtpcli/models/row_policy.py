"""Which of a verify block's operations may run batched: only those whose rows are, bitwise,
what one position at a time computes (the exactness of MTP at temperature 0 rests on it)."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


class RowPolicy:
    """Run a verify block's op batched only where that is bitwise the one-position result.

    The first ``CONFIRM`` times an op class (its parameter shapes and dtypes, T, input dtype)
    meets a block, both ways are computed and the one-position result is used; the class runs
    batched only after every comparison was bitwise equal, and never after one differed.
    MLX's CPU backend turns out row-invariant throughout; on CUDA, bf16 matmuls are not, while
    the 4- and 8-bit ones are for up to 7 rows (measured, docs/design.md). A class that is not
    to be probed (``probe=False``) always runs position by position.
    """

    CONFIRM = 3

    def __init__(self) -> None:
        self.verdicts: dict[tuple, bool] = {}  # settled: True = batched is exact here
        self._seen: dict[tuple, int] = {}  # equal comparisons so far, per unsettled class
        self._sigs: dict[int, tuple] = {}  # id(module) -> (module, signature)
        self._classes: dict[tuple, int] = {}  # op class -> its signature
        self.probed = False  # whether a comparison ran since the owner last cleared this

    def signature(self, module: nn.Module) -> int:
        """The module's op class (its type, bits, parameter names, shapes and dtypes) as a small
        number: keys made of it hash at once, where the class itself (a tuple of tuples, whose
        hash Python does not keep) is hashed anew at every lookup, dozens a verify."""
        entry = self._sigs.get(id(module))
        if entry is None:
            params = tree_flatten(module.parameters())
            shapes = tuple((k, tuple(v.shape), str(v.dtype)) for k, v in params)
            op_class = (type(module).__name__, getattr(module, "bits", None), shapes)
            # The module is kept in the entry, so its id cannot be reused while cached.
            entry = (module, self._classes.setdefault(op_class, len(self._classes)))
            self._sigs[id(module)] = entry
        return entry[1]

    def op_class(self, signature: int) -> tuple:
        """What ``signature`` stands for: (type name, bits, ((name, shape, dtype), ...))."""
        return next(c for c, s in self._classes.items() if s == signature)

    def choose(self, key: tuple, batched: Callable, single: Callable, probe: bool = True):
        """``single()`` (the one-position arithmetic) until ``batched()`` settled as equal to it."""
        if not probe:
            return single()
        ok = self.verdicts.get(key)
        if ok:
            return batched()
        out = single()
        if ok is None:
            self.probed = True
            if equal(batched(), out):
                self._seen[key] = self._seen.get(key, 0) + 1
                if self._seen[key] >= self.CONFIRM:
                    self.verdicts[key] = True
            else:
                self.verdicts[key] = False
        return out

    def rows(self, fn: Callable, xs: tuple, exact: bool, sig: tuple, probe: bool = True):
        """``fn`` over inputs [B, T, ...]: batched, or position by position where rows differ.
        ``sig`` names the op class (see ``signature``); ``fn`` may return a tuple."""
        T = xs[0].shape[1]
        if not exact or T == 1:
            return fn(*xs)

        def single():
            outs = [fn(*(x[:, t : t + 1] for x in xs)) for t in range(T)]
            if isinstance(outs[0], tuple):
                return tuple(mx.concatenate(part, axis=1) for part in zip(*outs, strict=True))
            return mx.concatenate(outs, axis=1)

        return self.choose((sig, T, str(xs[0].dtype)), lambda: fn(*xs), single, probe)


def dense(module: nn.Module) -> bool:
    """Whether ``module`` runs an unquantized matmul (a Linear, or a tied Embedding as head)."""
    if isinstance(module, nn.Embedding):
        return True
    return any(isinstance(m, nn.Linear) for _, m in module.named_modules())


def equal(a, b) -> bool:
    if isinstance(a, tuple):
        return all(equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(mx.array_equal(a, b).item())
