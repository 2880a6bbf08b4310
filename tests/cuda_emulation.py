"""Run an ``mx.fast.cuda_kernel`` or ``mx.fast.metal_kernel`` source on the CPU: each row of a
threadgroup (its x threads) as threads that meet at every shuffle and barrier, exchanging within
their 32-lane warps / SIMD-groups. For testing a kernel's logic (indexing, strides, splices,
the step loop) where no GPU is; float32 activations only, so input-dtype rounding and the GPU's
codegen are not covered (the H200 tests cover those for CUDA; nothing runs Metal here)."""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

_PRELUDE = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>
using std::min;
struct Dim3 { int x, y, z; };
thread_local Dim3 threadIdx, blockIdx;
static Dim3 blockDim;
struct Row {  // the x threads of one (y, z) of a threadgroup
  explicit Row(int n) : sync(n) {}
  float buf[1024];
  std::barrier<> sync;
};
thread_local Row* row_;
static float __shfl_xor_sync(unsigned, float v, int off) {  // every thread must call it
  row_->buf[threadIdx.x] = v;
  row_->sync.arrive_and_wait();
  const float r = row_->buf[(threadIdx.x & ~31) | ((threadIdx.x & 31) ^ off)];
  row_->sync.arrive_and_wait();
  return r;
}
static inline void __syncwarp() { row_->sync.arrive_and_wait(); }
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// One copy for the whole launch: threadgroup rows run one at a time, so a kernel whose warps
// each keep to their own slice (indexed by threadIdx.y) sees its own shared memory.
#define __shared__ static
// Metal's names for the same things (1-D threadgroups for the SIMD-group indices).
#define device
#define threadgroup static
using uint = unsigned int;
using ushort = unsigned short;
namespace mem_flags { constexpr int mem_threadgroup = 0; }
static inline void threadgroup_barrier(int) { row_->sync.arrive_and_wait(); }
static inline float simd_shuffle_xor(float v, ushort off) { return __shfl_xor_sync(0u, v, off); }
#define thread_position_in_threadgroup threadIdx
#define threadgroup_position_in_grid blockIdx
#define thread_position_in_grid (Dim3{blockIdx.x * blockDim.x + threadIdx.x, \
    blockIdx.y * blockDim.y + threadIdx.y, blockIdx.z * blockDim.z + threadIdx.z})
#define thread_index_in_simdgroup (threadIdx.x & 31)
#define simdgroup_index_in_threadgroup (threadIdx.x >> 5)
using std::exp;
using std::fabs;
using std::fma;
using std::fmax;
using std::log;
static inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
"""

_LAUNCH = r"""
extern "C" void launch(void** in, int64_t** strides, int32_t** shapes, void** out,
                       int gx, int gy, int gz, int tx, int ty, int tz) {
  blockDim = {tx, ty, tz};
  for (int bz = 0; bz < gz / tz; ++bz)
    for (int by = 0; by < gy / ty; ++by)
      for (int bx = 0; bx < gx / tx; ++bx)
        for (int z = 0; z < tz; ++z)
          for (int y = 0; y < ty; ++y) {
            Row row(tx);
            std::vector<std::thread> threads;
            for (int x = 0; x < tx; ++x)
              threads.emplace_back([&, x] {
                threadIdx = {x, y, z};
                blockIdx = {bx, by, bz};
                row_ = &row;
                kernel(ARGS);
              });
            for (auto& t : threads) t.join();
          }
}
"""


def available() -> bool:
    return shutil.which("g++") is not None


def _build(code: str) -> ctypes.CDLL:
    digest = hashlib.sha256(code.encode()).hexdigest()[:16]
    lib = Path(tempfile.gettempdir()) / f"mtp_cuda_emulation_{digest}.so"
    if not lib.exists():
        src = lib.with_suffix(".cpp")
        src.write_text(code)
        subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-o",
                        str(lib), str(src)], check=True, capture_output=True)  # fmt: skip
    return ctypes.CDLL(str(lib))


_C_TYPES = {np.dtype(np.float32): "float", np.dtype(np.uint32): "uint32_t"}


def run(
    source: str,
    inputs: dict[str, np.ndarray],
    outputs: dict[str, tuple[int, ...]],
    constants: dict[str, int | str],
    grid: tuple[int, int, int],
    threadgroup: tuple[int, int, int],
) -> dict[str, np.ndarray]:
    """Launch ``source`` over ``grid`` threads in ``threadgroup`` blocks (x a multiple of 32,
    at most 1024). Inputs are float32 or uint32 arrays, views allowed (read through their
    strides); outputs are float32. ``constants`` fill the template: ints, or type names (the
    type parameters InT, AT and DT are float unless given)."""
    assert threadgroup[0] % 32 == 0 and threadgroup[0] <= 1024
    assert all(g % t == 0 for g, t in zip(grid, threadgroup, strict=True))
    names = list(inputs)
    arrays = [np.asarray(inputs[n]) for n in names]
    ctypes_ = [_C_TYPES[a.dtype] for a in arrays]
    params = [f"const {c}* {n}, const int64_t* {n}_strides, const int32_t* {n}_shape"
              for n, c in zip(names, ctypes_, strict=True)]  # fmt: skip
    params += [f"float* {n}" for n in outputs]
    args = [f"(const {c}*)in[{i}], strides[{i}], shapes[{i}]" for i, c in enumerate(ctypes_)]
    args += [f"(float*)out[{i}]" for i in range(len(outputs))]
    constants = {"InT": "float", "AT": "float", "DT": "float"} | constants
    header = "".join(
        f"using {k} = {v};\n" if isinstance(v, str) else f"constexpr int {k} = {v};\n"
        for k, v in constants.items()
    )
    code = (_PRELUDE + header + f"static void kernel({', '.join(params)}) {{\n{source}\n}}\n"
            + _LAUNCH.replace("ARGS", ", ".join(args)))  # fmt: skip
    lib = _build(code)
    strides = [np.array([s // a.itemsize for s in a.strides], dtype=np.int64) for a in arrays]
    shapes = [np.array(a.shape, dtype=np.int32) for a in arrays]
    outs = {n: np.zeros(shape, np.float32) for n, shape in outputs.items()}

    def pointers(xs, ctype):
        return (ctype * len(xs))(*[ctypes.cast(x.ctypes.data, ctype) for x in xs])

    lib.launch(
        pointers(arrays, ctypes.c_void_p),
        pointers(strides, ctypes.POINTER(ctypes.c_int64)),
        pointers(shapes, ctypes.POINTER(ctypes.c_int32)),
        pointers(list(outs.values()), ctypes.c_void_p),
        *grid,
        *threadgroup,
    )
    return outs
