"""Run an ``mx.fast.cuda_kernel`` source on the CPU: each row of a threadgroup (its x threads)
as threads that meet at every shuffle, exchanging within their 32-lane warps. For testing a
kernel's logic (indexing, strides, splices, the step loop) where no GPU is; float32 only, so
input-dtype rounding and the GPU's codegen are not covered (the H200 tests cover those)."""

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


def run(
    source: str,
    inputs: dict[str, np.ndarray],
    outputs: dict[str, tuple[int, ...]],
    constants: dict[str, int],
    grid: tuple[int, int, int],
    threadgroup: tuple[int, int, int],
) -> dict[str, np.ndarray]:
    """Launch ``source`` over ``grid`` threads in ``threadgroup`` blocks (x a multiple of 32,
    at most 1024). Inputs are float32 arrays, views allowed (read through their strides);
    ``constants`` fill the template (types are float)."""
    assert threadgroup[0] % 32 == 0 and threadgroup[0] <= 1024
    assert all(g % t == 0 for g, t in zip(grid, threadgroup, strict=True))
    names = list(inputs)
    params = [f"const float* {n}, const int64_t* {n}_strides, const int32_t* {n}_shape"
              for n in names] + [f"float* {n}" for n in outputs]  # fmt: skip
    args = [f"(const float*)in[{i}], strides[{i}], shapes[{i}]" for i in range(len(names))]
    args += [f"(float*)out[{i}]" for i in range(len(outputs))]
    header = "using InT = float;\nusing AT = float;\nusing DT = float;\n" + "".join(
        f"constexpr int {k} = {v};\n" for k, v in constants.items()
    )
    code = (_PRELUDE + header + f"static void kernel({', '.join(params)}) {{\n{source}\n}}\n"
            + _LAUNCH.replace("ARGS", ", ".join(args)))  # fmt: skip
    lib = _build(code)
    arrays = [np.asarray(inputs[n]) for n in names]
    assert all(a.dtype == np.float32 for a in arrays)
    strides = [np.array([s // 4 for s in a.strides], dtype=np.int64) for a in arrays]
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
