"""The launch budget: the graph nodes a decode step and an MTP round put on the device, and
of them the kernel launches, counted on any machine with a GPU backend's graph structure.

On a GPU the host pays for every node it builds and encodes (views included), and the device
for every launch; a round's speed on a fast GPU follows these counts (docs/design.md). On a
machine without that GPU, ``structure_of("cuda")`` builds the very graph CUDA would run: our
kernels become one node each (``kernels.graph_as``), and so do the MLX operations that are
one primitive on a GPU but a chain of operations on the CPU (the RMS norm, RoPE, attention,
dequantization). What is counted is the graph MLX is handed; on the GPU the same count runs
on the real kernels, and the two must agree (``scripts/count_launches.py``).
"""

from __future__ import annotations

import collections
import contextlib
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from . import kernels
from .drafters import Drafter
from .engine import prompt_array
from .engine.mtp import CatchUp, draft, verify
from .engine.sampling import SamplingParams, accept_on_device, greedy
from .models import Target
from .models.kv_cache import RowsKVCache
from .models.qwen3_5 import cache_state

# Primitives that launch no kernel: views and metadata. Their nodes still cost the host.
VIEWS = frozenset({
    "AsStrided", "Broadcast", "BroadcastAxes", "ExpandDims", "Flatten", "Reshape", "Slice",
    "Split", "Squeeze", "StopGradient", "Transpose", "Unflatten", "View",
})  # fmt: skip
# One launch each, whatever their name: our kernels (``Depends`` is their stand-in under
# ``structure_of``) and MLX's fused primitives.
KERNEL_NODES = frozenset({
    "CustomKernel", "Depends", "LayerNorm", "Quantize", "RMSNorm", "RoPE",
    "ScaledDotProductAttention",
})  # fmt: skip

_LABEL = re.compile(r'label ="([^"]+)", shape=rectangle')


@dataclass
class Count:
    """Nodes of one graph by kind (our and MLX's fused kernels as ``kernel``)."""

    kinds: dict[str, int] = field(default_factory=dict)

    @property
    def nodes(self) -> int:
        return sum(self.kinds.values())

    @property
    def launches(self) -> int:
        """Nodes that launch a kernel (a ``Concatenate`` counted once, though MLX's CUDA
        backend copies each of its inputs in a launch of its own)."""
        return sum(n for kind, n in self.kinds.items() if kind not in VIEWS)

    def __add__(self, other: Count) -> Count:
        return Count(dict(collections.Counter(self.kinds) + collections.Counter(other.kinds)))

    def as_dict(self) -> dict:
        kinds = dict(sorted(self.kinds.items(), key=lambda kv: (-kv[1], kv[0])))
        return {"nodes": self.nodes, "launches": self.launches, "kinds": kinds}


def graph(outputs: list[mx.array]) -> Count:
    """The primitives in the unevaluated graph behind ``outputs`` (shared nodes once)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.dot"
        mx.export_to_dot(str(path), *outputs)
        labels = _LABEL.findall(path.read_text())
    kinds = collections.Counter("kernel" if x in KERNEL_NODES else x for x in labels)
    return Count(dict(kinds))


def _stand_in(shape_of: Callable) -> Callable:
    """An MLX operation as one node giving outputs of ``shape_of(*args, **kw)`` [(shape,
    dtype)], for ``structure_of``."""

    def op(*args, **kw):
        arrays = [a for a in (*args, *kw.values()) if isinstance(a, mx.array)]
        shape, dtype = shape_of(*args, **kw)
        out = mx.zeros(shape, dtype)
        mx.eval(out)
        return mx.depends([out], arrays)[0]

    return op


def _dequantized(w, scales, biases=None, group_size=64, bits=4, mode="affine", dtype=None, **_):
    return (*w.shape[:-1], w.shape[-1] * 32 // bits), dtype or scales.dtype


# The MLX operations whose graph depends on the device: one fused primitive on a GPU, their
# fallback's chain of operations on the CPU.
_FUSED_ON_GPU = {
    (mx.fast, "rms_norm"): lambda x, *a, **k: (x.shape, x.dtype),
    (mx.fast, "layer_norm"): lambda x, *a, **k: (x.shape, x.dtype),
    (mx.fast, "rope"): lambda x, *a, **k: (x.shape, x.dtype),
    (mx.fast, "scaled_dot_product_attention"): lambda q, k, v, **kw: (
        (*q.shape[:-1], v.shape[-1]), q.dtype),
    (mx, "dequantize"): _dequantized,
}  # fmt: skip


@contextlib.contextmanager
def structure_of(backend: str) -> Iterator[None]:
    """Build graphs inside as ``backend`` ("cuda" or "metal") builds them, on this machine.
    On that backend itself this changes nothing. Graphs built inside evaluate here to
    placeholder values: they are for counting, never for their results."""
    if kernels.backend() == backend:
        yield
        return
    saved = {key: getattr(*key) for key in _FUSED_ON_GPU}
    try:
        for (module, name), shape_of in _FUSED_ON_GPU.items():
            setattr(module, name, _stand_in(shape_of))
        with kernels.graph_as(backend):
            yield
    finally:
        for (module, name), op in saved.items():
            setattr(module, name, op)


def all_cache_arrays(cache: list) -> list[mx.array]:
    """Every array a cache holds (a KV cache's whole buffers) and the attention caches' lengths
    where they are on the device."""
    lengths = [c.device_length for c in cache
               if isinstance(c, RowsKVCache) and c.device_length is not None]  # fmt: skip
    return cache_state(cache) + lengths


PROMPT = 16
WARM = 5  # passes before counting: each block length's first runs op by op, probes settle


def count_step(target: Target) -> Count:
    """One classic decode step (forward, head, greedy pick) after a short prompt."""
    cache = target.make_cache()
    target.prefill(prompt_array(list(range(1, PROMPT + 1))), cache)
    token = mx.array([[1]])
    for i in range(WARM + 1):
        y = greedy(target.lm_head(target.forward(token, cache).hidden)[0, -1])
        outs = [y, *all_cache_arrays(cache)]
        if i == WARM:
            return graph(outs)
        mx.eval(outs)
    raise AssertionError("unreachable")


def count_round(target: Target, drafter: Drafter, block_size: int = 3,
                accepted: int = 1) -> dict[str, Count]:  # fmt: skip
    """One greedy MTP round of ``block_size`` that accepts ``accepted`` drafts, as the engine
    runs it once the verify is a graph (``engine.mtp.submit_round``): the drafts after the
    drafter's catch-up on the last block, the verify with its verdict decided on the device,
    the rollback of both caches at a device count. Each part counted apart, after the one
    before it was evaluated; and the whole."""
    k, greedy_params = block_size - 1, SamplingParams()
    if target.options.submit_every != 0:
        raise ValueError("count a target loaded with Options(submit_every=0): a verify "
                         "submitted in parts is counted in part")  # fmt: skip
    if not 0 <= accepted <= k:
        raise ValueError(f"a round of block {block_size} accepts 0..{k} drafts, not {accepted}")
    tcache, dcache = target.make_cache(), drafter.make_cache()
    prompt = prompt_array(list(range(1, PROMPT + 1)))
    hidden = target.prefill(prompt, tcache)
    catch = CatchUp(mx.array(list(range(2, PROMPT + 2)), mx.uint32), hidden)
    pending = mx.array([PROMPT + 1], mx.uint32)
    keep = mx.array([accepted + 1], mx.int32)  # the device's count, as a round decides it
    for i in range(WARM + 1):
        parts = {}
        drafts, _ = draft(drafter, target, catch, dcache, k, greedy_params)
        parts["drafts"] = [drafts, *all_cache_arrays(dcache)]
        counted = {"drafts": graph(parts["drafts"])} if i == WARM else {}
        mx.eval(parts["drafts"])
        if catch.last is not None:
            drafter.settle(dcache, k - accepted, idle=False)
        out, logits = verify(target, tcache, pending, drafts)
        verdict, tokens, _ = accept_on_device(logits, drafts)
        traced = [a for t in out.traces if t is not None for a in (t.conv_input, t.states)]
        parts["verify"] = [verdict, tokens, out.hidden, *traced, *all_cache_arrays(tcache)]
        if i == WARM:
            counted["verify"] = graph(parts["verify"])
        mx.eval(parts["verify"])
        target.rollback(tcache, out.traces, keep, k + 1)
        catch = CatchUp(tokens, out.hidden, keep - 1)
        pending = mx.take(tokens, keep - 1)
        parts["rollback"] = [*all_cache_arrays(tcache), pending, catch.last]
        if i == WARM:
            counted["rollback"] = graph(parts["rollback"])
            counted["round"] = sum(counted.values(), Count())
            return counted
        mx.eval(parts["rollback"])
        target.settle(tcache, k - accepted, idle=False)
    raise AssertionError("unreachable")


def budget(target: Target, drafter: Drafter, block_size: int = 3, accepted: int = 1) -> dict:
    """The step's and the round's counts as one record (see ``count_step``, ``count_round``)."""
    step = count_step(target)
    parts = count_round(target, drafter, block_size, accepted)
    return {
        "decode_step": step.as_dict(),
        "round": {"block_size": block_size, "accepted": accepted}
        | {name: c.as_dict() for name, c in parts.items()},
    }
