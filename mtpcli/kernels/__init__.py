"""Compute kernels: an ops reference, a builder per backend, one public entry each.

A native kernel is trusted only after it agrees with the ops reference on a small input in
this process (per kernel and shape class); if it disagrees, a warning is given once and the
reference is used. ``--kernels`` / ``MTP_KERNELS`` choose: ``auto`` (checked native where a
backend has one), ``native`` (skip the check), ``ops`` (reference only).
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
import weakref
from collections.abc import Callable

import mlx.core as mx

from ..errors import UsageError

MODES = ("auto", "native", "ops")
# Quantized matmuls: MLX's own product or ours (kernels/quantized_matmul.py), which reads each
# weight once for 1-8 rows. ``auto`` picks ours where it was measured faster end to end (CUDA:
# 77 vs 57 tok/s on the H200, compiled decode steps) and MLX's elsewhere (its Metal product is
# tuned; our Metal mirror is self-checked but unmeasured). Fixed when a model is loaded.
QMM_CHOICES = ("auto", "mlx", "ours")
# Decode steps and verify blocks run as mx.compile'd layer functions (a decode step's graph takes
# ~15 ms of Python to build op by op on the H200's host, as long as the GPU takes to run it).
COMPILE_CHOICES = ("on", "off")
_state: dict = {"mode": None, "qmm": None, "compile": None, "verdicts": {}, "generation": 0}


# Each switch: its flag (None: set by its environment variable alone), its environment
# variable, its values, its default.
_SWITCHES = {
    "mode": ("--kernels", "MTP_KERNELS", MODES, "auto"),
    "qmm": ("--qmm", "MTP_QMM", QMM_CHOICES, "auto"),
    "compile": (None, "MTP_COMPILE", COMPILE_CHOICES, "on"),
}


def _set(switch: str, value: str | None, initial: bool = False) -> None:
    flag, env, choices, _ = _SWITCHES[switch]
    if value is not None and value not in choices:
        raise UsageError(f"{flag or env} must be one of {', '.join(choices)}, got {value!r}")
    _state[switch] = value
    if not initial:
        changed()


def _get(switch: str) -> str:
    if _state[switch] is None:  # first use: the environment, else the default
        _, env, _, default = _SWITCHES[switch]
        _set(switch, os.environ.get(env, default), initial=True)
    return _state[switch]


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
# check passes): correctly rounded for x < 2^126, 0 beyond (where 1 / x < 2^-126). Without the
# check and its slow-path branch the gated-delta kernel's decode step took 4% less time on the
# H200 (session 30). Metal and the CPU emulation divide.
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


def built(cache: dict, key: tuple, cuda: Callable[[], object], metal: Callable[[], object]):
    """A kernel module's kernel ``key`` for the running backend, built once by that backend's
    builder; None where the backend has none (the CPU)."""
    full = (backend(), *key)
    if full not in cache:
        build = {"cuda": cuda, "metal": metal}.get(full[0])
        cache[full] = build() if build else None
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


def set_mode(mode: str | None) -> None:
    _set("mode", mode)


def mode() -> str:
    return _get("mode")


def set_qmm(choice: str | None) -> None:
    _set("qmm", choice)


def set_compile(choice: str | None) -> None:
    _set("compile", choice)


def compile_enabled() -> bool:
    return _get("compile") == "on"


def changed() -> None:
    """Note that a kernel choice changed: compiled functions traced before are stale."""
    _state["generation"] += 1


def generation() -> int:
    """Bumped by every change of a switch, a verdict reset or a layer class swap."""
    return _state["generation"]


def qmm() -> str:
    """Which quantized matmul models loaded from now on use: 'mlx' or 'ours'."""
    choice = _get("qmm")
    if choice == "auto":
        return "ours" if backend() == "cuda" else "mlx"
    return choice


def available(name: str) -> bool:
    """Whether MLX was built with backend ``name`` ("cuda" or "metal") and it has a device."""
    module = getattr(mx, name, None)  # a build need not carry every backend's module
    return bool(module is not None and module.is_available())


@functools.cache  # a process's backends do not change; backend() is asked ~80 times a verify
def _gpu_backend() -> str:
    return "metal" if available("metal") else "cuda" if available("cuda") else "cpu"


def backend() -> str:
    """'cuda', 'metal' or 'cpu': where the default device's kernels would run."""
    return "cpu" if mx.default_device() == mx.cpu else _gpu_backend()


def use_native(name: str, key: tuple, check: Callable[[], str | None]) -> bool:
    """Whether to run kernel ``name`` for shape class ``key``; runs ``check`` once in auto mode.

    ``check`` returns None when the native kernel agrees with the reference, else why not.
    """
    m = mode()
    if m == "ops":
        return False
    if m == "native":
        return True
    verdicts = _state["verdicts"]
    if (name, key) not in verdicts:
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
        verdicts[(name, key)] = problem is None
    return verdicts[(name, key)]


def reset_verdicts() -> None:
    _state["verdicts"].clear()
    changed()
