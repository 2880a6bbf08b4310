"""Compute kernels: an ops reference, a builder per backend, one public entry each.

A native kernel is trusted only after it agrees with the ops reference on a small input in
this process (per kernel and shape class); if it disagrees, a warning is given once and the
reference is used. Each entry takes the mode (``Options.kernels``, ``--kernels``): ``auto``
(checked native where a backend has one), ``native`` (skip the check), ``ops`` (reference
only).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
import warnings
import weakref
from collections.abc import Callable, Iterator

import mlx.core as mx

MODES = ("auto", "native", "ops")
_verdicts: dict[tuple, bool] = {}  # (kernel, shape class) -> trusted: facts of this process


def kernel_name(base: str, *sources: str) -> str:
    """A kernel's name, unique to its source: MLX's CUDA backend caches compiled kernels on
    disk by name alone (``MLX_PTX_CACHE_DIR``, by default under the temp directory), so a
    changed source under an old name would run the old machine code."""
    digest = hashlib.sha256("\0".join(sources).encode()).hexdigest()[:12]
    return f"{base}_{digest}"


# What differs between a kernel's CUDA and Metal spellings, as tokens in one source text: a
# kernel written once with them is both backends' source, so its Metal kernel mirrors the CUDA
# kernel line by line by construction.
_SPELLINGS = {
    False: {  # CUDA
        "DEVICE ": "",
        "SHARED": "__shared__",
        "BARRIER": "__syncthreads()",
        "LANE_OFFSET": "int",
        "XOR_SHUFFLE(": "__shfl_xor_sync(0xffffffffu, ",
        "LANE_SHUFFLE(": "__shfl_sync(0xffffffffu, ",
        "STORE1(": "__stcs(",  # a float store, evict-first
        "STORE4(": "__stcs(",  # a float4 store, evict-first
        "FLOAT4(": "make_float4(",
        "WARP_SYNC": "__syncwarp()",
        "KERNEL_FN ": "__device__ __forceinline__ ",  # a header's helper function
        "THREAD ": "",  # the address space of a thread's own arrays
        "ALIGN16 ": "__align__(16) ",  # a shared array read in 16-byte runs
    },
    True: {  # Metal
        "DEVICE ": "device ",
        "SHARED": "threadgroup",
        "BARRIER": "threadgroup_barrier(mem_flags::mem_threadgroup)",
        "LANE_OFFSET": "ushort",
        "XOR_SHUFFLE(": "simd_shuffle_xor(",
        "LANE_SHUFFLE(": "simd_shuffle(",
        "STORE1(": "store1(",
        "STORE4(": "store4(",
        "FLOAT4(": "float4(",
        "WARP_SYNC": "simdgroup_barrier(mem_flags::mem_threadgroup)",
        "expf(": "exp(",
        "logf(": "log(",
        "rsqrtf(": "rsqrt(",
        "fmaxf(": "fmax(",
        "fabsf(": "fabs(",
        "fmaf(": "fma(",
        "KERNEL_FN ": "inline ",
        "THREAD ": "thread ",
        "ALIGN16 ": "",
        "exp2f(": "exp2(",
        "rintf(": "rint(",
        "cosf(": "cos(",
        "sinf(": "sin(",
    },
}


# A kernel body's RCP1(x): 1 / x for x >= 1 (a sigmoid's denominator). On CUDA the IEEE
# division's fast path alone (rcp.approx and one Newton step, what nvcc emits once its range
# check passes): correctly rounded for x < 2^126, 0 beyond (where 1 / x < 2^-126), without
# the check and slow-path branch that cost the gated-delta kernel's step time. Metal and the
# CPU emulation divide.
RCP1 = """
    #ifdef __CUDA_ARCH__
    const auto rcp1_ = [](float x) {
      float r;
      asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
      return x < 0x1p126f ? fmaf(r, -fmaf(x, r, -1.0f), r) : 0.0f;
    };
    #define RCP1(x) rcp1_(x)
    #else
    #define RCP1(x) (1.0f / (x))
    #endif"""


_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def fill(text: str, **parts: str) -> str:
    """``text`` with each ``{{NAME}}`` replaced by ``parts[NAME]``. A placeholder without its
    part, or a part without its placeholder, is an error: a kernel is never built from a text
    half filled, nor from a part that went nowhere."""
    names = set(_PLACEHOLDER.findall(text))
    if names != parts.keys():
        missing, unused = sorted(names - parts.keys()), sorted(parts.keys() - names)
        raise ValueError(f"kernel text: placeholders without a part {missing}, "
                         f"parts without a placeholder {unused}")  # fmt: skip
    return _PLACEHOLDER.sub(lambda m: parts[m.group(1)], text)


def spell(source: str, metal: bool) -> str:
    """A kernel source written with the backend tokens, spelled for CUDA or Metal."""
    for token, text in _SPELLINGS[metal].items():
        source = source.replace(token, text)
    return source


def launch_bounds(warps: int, min_blocks: int) -> str:
    """A header tail that gives the kernel CUDA launch bounds: ``min_blocks`` blocks of
    ``warps`` warps must fit a multiprocessor, so ptxas caps the registers a thread (at 5
    blocks of 8 warps, 51). MLX writes the kernel's signature after the header, so the bounds
    ride on ``__global__``."""
    return (f"#undef __global__\n#define __global__ __location__(global) "
            f"__launch_bounds__({32 * warps}, {min_blocks})\n")  # fmt: skip


def built(cache: dict, key: tuple, spec: Callable[[bool], dict | tuple[dict, ...]]):
    """A kernel module's kernel ``key`` for the running backend, built once from
    ``spec(metal)`` (the keyword arguments of ``mx.fast.cuda_kernel`` / ``metal_kernel``, or a
    tuple of them for a module of several launches); None where the backend has none (the CPU).
    """
    full = (backend(), _graph_as is not None, *key)
    if full not in cache:
        make = {"cuda": cuda_kernel, "metal": metal_kernel}.get(full[0])
        if make is None or not available(full[0]):
            cache[full] = None
        else:
            specs = spec(full[0] == "metal")
            cache[full] = (tuple(make(**one) for one in specs) if isinstance(specs, tuple)
                           else make(**specs))  # fmt: skip
    return cache[full]


_constants: dict[tuple[int, str], tuple[weakref.ref, mx.array]] = {}


def constant(a: mx.array, how: str = "contiguous", make: Callable = mx.contiguous) -> mx.array:
    """``make(a)`` for a weight ``a`` (by default its contiguous copy, a view where it already
    is), made and evaluated the first time and kept while ``a`` lives: inside a compiled layer
    function it is then a constant, not nodes that every call replays and MLX encodes (272 of
    a 27B decode step's 1,553, counted). Must first meet ``a`` outside a trace: the first pass
    at each block length runs op by op."""
    key = (id(a), how)
    entry = _constants.get(key)
    if entry is None or entry[0]() is not a:
        out = make(a)
        mx.eval(out)
        # The entry goes with the weight (a model dropped takes its constants with it).
        ref = weakref.ref(a, lambda _, key=key: _constants.pop(key, None))
        entry = _constants[key] = (ref, out)
    return entry[1]


_graph_as: str | None = None  # set by ``graph_as``


@contextlib.contextmanager
def graph_as(name: str) -> Iterator[None]:
    """Build graphs as backend ``name`` ("cuda" or "metal") would, on any machine, for counting
    their nodes (``mtpcli.launches``): its kernels become graph nodes, trusted unchecked, since
    a check would run them. What is built inside can never be evaluated here."""
    global _graph_as
    if name not in ("cuda", "metal"):
        raise ValueError(f"graph_as takes 'cuda' or 'metal', got {name!r}")
    before, _graph_as = _graph_as, name
    try:
        yield
    finally:
        _graph_as = before


def _stand_in(*, inputs, output_shapes, output_dtypes, **_launch) -> list[mx.array]:
    """A kernel launch as ``graph_as`` builds it: one node (MLX's ``Depends``) that takes the
    kernel's inputs and gives outputs of its shapes and dtypes (zeros, if ever evaluated)."""
    outs = [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]
    mx.eval(outs)  # data, not nodes: the launch is the one node
    return mx.depends(outs, list(inputs))


def compact(text: str) -> str:
    """A kernel text without its ``//`` comments, indentation and blank lines. MLX builds a
    kernel's whole text on every call and hashes it on every evaluation, so a shorter text
    costs less each launch (docs/design.md, "The launch budget"). A comment on a
    line continued by a backslash is kept (the backslash would continue the comment)."""
    lines = []
    for line in text.splitlines():
        code = line
        if not line.rstrip().endswith("\\"):
            at = _comment_at(line)
            code = line if at is None else line[:at]
        code = code.strip()
        if code:
            lines.append(code)
    return "\n".join(lines) + "\n"


def _comment_at(line: str) -> int | None:
    """Where a ``//`` comment starts on ``line``, outside string literals; None if none."""
    quoted = False
    for i, ch in enumerate(line):
        if ch == '"' and (i == 0 or line[i - 1] != "\\"):
            quoted = not quoted
        elif not quoted and line.startswith("//", i):
            return i
    return None


def _compacted(spec: dict) -> dict:
    return spec | {key: compact(spec[key]) for key in ("source", "header") if spec.get(key)}


def cuda_kernel(**spec) -> Callable:
    """``mx.fast.cuda_kernel(**spec)`` with its texts compacted (``compact``); under
    ``graph_as`` a stand-in launch of one node."""
    return _stand_in if _graph_as is not None else mx.fast.cuda_kernel(**_compacted(spec))


def metal_kernel(**spec) -> Callable:
    """``mx.fast.metal_kernel(**spec)`` with its texts compacted (``compact``); under
    ``graph_as`` a stand-in launch of one node."""
    return _stand_in if _graph_as is not None else mx.fast.metal_kernel(**_compacted(spec))


def available(name: str) -> bool:
    """Whether MLX was built with backend ``name`` ("cuda" or "metal") and it has a device."""
    if _graph_as is not None:
        return name == _graph_as
    module = getattr(mx, name, None)  # a build need not carry every backend's module
    return bool(module is not None and module.is_available())


@functools.cache  # a process's backends do not change; backend() is asked ~80 times a verify
def _gpu_backend() -> str:
    return "metal" if available("metal") else "cuda" if available("cuda") else "cpu"


def backend() -> str:
    """'cuda', 'metal' or 'cpu': where the default device's kernels would run."""
    if _graph_as is not None:
        return _graph_as
    return "cpu" if mx.default_device() == mx.cpu else _gpu_backend()


def use_native(name: str, key: tuple, check: Callable[[], str | None], mode: str) -> bool:
    """Whether to run kernel ``name`` for shape class ``key`` under ``mode`` (see ``MODES``);
    in ``auto`` runs ``check`` once a process per (name, key).

    ``check`` returns None when the native kernel agrees with the reference, else why not.
    """
    if mode == "ops":
        return False
    if mode == "native" or _graph_as is not None:
        return True
    if (name, key) not in _verdicts:
        try:
            problem = check()
        except Exception as e:  # noqa: BLE001 - e.g. outputs of the wrong shape: not trusted
            problem = f"its check failed: {type(e).__name__}: {e}"
        if problem:
            warnings.warn(
                f"{name} kernel disagrees with the ops reference for {key} ({problem}); "
                "using the reference",
                RuntimeWarning,
                stacklevel=3,
            )
        _verdicts[(name, key)] = problem is None
    return _verdicts[(name, key)]


def product_verdict(got: dict[int, mx.array], want: mx.array) -> str | None:
    """A row-invariant product's self-check: ``got`` maps row counts (the largest last) to the
    kernel's outputs for the first rows of one input, ``want`` is the reference's for all of
    them. None when the largest is within 2% of the reference's scale and each smaller one
    equals its rows bitwise, else why not."""
    for a in got.values():
        if not isinstance(a, mx.array):
            return f"gives {type(a).__name__}, not one array"
    rows = sorted(got)
    top = got[rows[-1]]
    if top.shape != want.shape:
        return f"outputs have the shape {top.shape}, not {want.shape}"
    a, b = top.astype(mx.float32), want.astype(mx.float32)
    err = mx.abs(a - b).max().item()
    if not err <= 2e-2 * mx.abs(b).max().item():
        return f"outputs differ from the reference by up to {err:.3g}"
    for m in rows[:-1]:
        if not mx.array_equal(got[m], top[:m]).item():
            return f"rows of {m} differ from the same rows among {rows[-1]}"
    return None


def trusted(name: str, key: tuple, mode: str) -> bool:
    """Whether kernel ``name`` runs for ``key`` under ``mode`` with no check still to come:
    ``native``, or ``auto`` once its check passed in this process (a graph compiled around it
    must not run a check, nor take a fallback that reads values back)."""
    if mode == "ops":
        return False
    if mode == "native" or _graph_as is not None:
        return True
    return _verdicts.get((name, key), False)


def reset_verdicts() -> None:
    """Forget every kernel's self-check (tests)."""
    _verdicts.clear()
