"""Run an ``mx.fast.cuda_kernel`` or ``mx.fast.metal_kernel`` source on the CPU: each row of a
threadgroup (its x threads) as threads that meet at every shuffle and barrier, exchanging within
their 32-lane warps / SIMD-groups; tensor-core mma is emulated from PTX's fragment layout, and
CUDA's bf16 / fp16 types are bit-exact in storage. For testing a kernel's logic (indexing,
strides, splices, the step loop) where no GPU is; the GPU's codegen and fast-math are not
covered (the H200 tests cover those for CUDA; nothing runs Metal here)."""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from mtpcli.kernels import compact

_PRELUDE = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>
using std::min;
struct Dim3 { int x, y, z; };
thread_local Dim3 threadIdx, blockIdx;
static Dim3 blockDim;
struct Row {  // the x threads of one (y, z) of a threadgroup
  explicit Row(int n) : sync(n) {
    for (int w = 0; w < n / 32; ++w) warps.emplace_back(32);
  }
  float buf[1024];
  uint32_t frag[1024][6];  // mma operands: a[4], b[2] of each thread
  std::barrier<> sync;  // the whole row (a 1-row threadgroup's __syncthreads)
  std::deque<std::barrier<>> warps;  // each warp's 32 threads (shuffles, mma)
};
thread_local Row* row_;
static inline void warp_wait() { row_->warps[threadIdx.x >> 5].arrive_and_wait(); }
static float __shfl_sync(unsigned, float v, int src) {  // lane src's v; every lane calls it
  row_->buf[threadIdx.x] = v;
  warp_wait();
  const float r = row_->buf[(threadIdx.x & ~31) | (src & 31)];
  warp_wait();
  return r;
}
static inline float __shfl_xor_sync(unsigned, float v, int off) {
  return __shfl_sync(0u, v, (threadIdx.x & 31) ^ off);
}
struct float2 { float x, y; };
struct float4 {
  float x, y, z, w;
  float4() = default;
  float4(float x_, float y_, float z_, float w_) : x(x_), y(y_), z(z_), w(w_) {}  // Metal's
};
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static inline void __stcs(float* p, float v) { *p = v; }
static inline void __stcs(float4* p, float4 v) { *p = v; }
static inline void __syncwarp() { warp_wait(); }
static inline void simdgroup_barrier(int) { warp_wait(); }
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// One copy for the whole launch: threadgroup rows run one at a time, so a kernel whose warps
// each keep to their own slice (indexed by threadIdx.y) sees its own shared memory.
#define __shared__ static
#define __align__(n) alignas(n)
// Metal's names for the same things (1-D threadgroups for the SIMD-group indices).
#define device
#define threadgroup static
using uint = unsigned int;
using ushort = unsigned short;
namespace mem_flags { constexpr int mem_threadgroup = 0; }
static inline void threadgroup_barrier(int) { row_->sync.arrive_and_wait(); }
static inline float simd_shuffle_xor(float v, ushort off) { return __shfl_xor_sync(0u, v, off); }
static inline float simd_shuffle(float v, ushort src) { return __shfl_sync(0u, v, src); }
#define thread_position_in_threadgroup threadIdx
#define threadgroup_position_in_grid blockIdx
#define thread_position_in_grid (Dim3{blockIdx.x * blockDim.x + threadIdx.x, \
    blockIdx.y * blockDim.y + threadIdx.y, blockIdx.z * blockDim.z + threadIdx.z})
#define thread_index_in_simdgroup (threadIdx.x & 31)
#define simdgroup_index_in_threadgroup (threadIdx.x >> 5)
static inline void __syncthreads() { row_->sync.arrive_and_wait(); }  // 1-row threadgroups

// CUDA's 16-bit float types and the intrinsics our kernels use, bit-exact in storage.
struct __nv_bfloat16 {
  uint16_t bits = 0;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) {  // round to nearest even
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
struct __half {
  _Float16 v = 0;
  __half() = default;
  __half(float f) : v(static_cast<_Float16>(f)) {}
  operator float() const { return static_cast<float>(v); }
};
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
struct __half2 { __half x, y; };
struct uint2 { uint32_t x, y; };
struct uint4 { uint32_t x, y, z, w; };
#define __device__
#define __forceinline__ inline
static inline __nv_bfloat162 __hsub2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return {float(a.x) - float(b.x), float(a.y) - float(b.y)};
}
static inline __half2 __hsub2(__half2 a, __half2 b) {
  return {float(a.x) - float(b.x), float(a.y) - float(b.y)};
}
static inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
  return {std::fma(float(a.x), float(b.x), float(c.x)),
          std::fma(float(a.y), float(b.y), float(c.y))};
}
static inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  return {std::fma(float(a.x), float(b.x), float(c.x)),
          std::fma(float(a.y), float(b.y), float(c.y))};
}
static inline __nv_bfloat162 __hmul2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return {float(a.x) * float(b.x), float(a.y) * float(b.y)};  // exact in float, rounded once
}
static inline __half2 __hmul2(__half2 a, __half2 b) {
  return {float(a.x) * float(b.x), float(a.y) * float(b.y)};
}
static inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {a, b}; }
static inline uint32_t __byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
  const uint64_t v = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    r |= static_cast<uint32_t>((v >> (8 * ((sel >> (4 * i)) & 7))) & 0xFFu) << (8 * i);
  }
  return r;
}
// mma.sync.m16n8k16.row.col with fp32 accumulation, across the warp: A 16x16 and B 16x8 in
// PTX's fragment layout (lane = 4 * group + thread in group), C/D 16x8.
template <typename T>
static void emulated_mma(float* c, const uint32_t* a, const uint32_t* b) {
  const int base = threadIdx.x & ~31, lane = threadIdx.x & 31;
  for (int i = 0; i < 4; ++i) row_->frag[threadIdx.x][i] = a[i];
  for (int i = 0; i < 2; ++i) row_->frag[threadIdx.x][4 + i] = b[i];
  warp_wait();
  auto half_of = [](uint32_t w, int k) {
    T h;
    const uint16_t bits = static_cast<uint16_t>(w >> (16 * (k & 1)));
    std::memcpy(&h, &bits, 2);
    return static_cast<float>(h);
  };
  float d[4];
  for (int i = 0; i < 4; ++i) {
    const int row = (lane >> 2) + (i >= 2 ? 8 : 0), col = 2 * (lane & 3) + (i & 1);
    float acc = c[i];
    for (int k = 0; k < 16; ++k) {
      const int from = (k % 8) / 2;
      const int ra = (row >= 8) + 2 * (k >= 8);  // which of a[4]
      const float x = half_of(row_->frag[base + (row % 8) * 4 + from][ra], k);
      const float y = half_of(row_->frag[base + col * 4 + from][4 + (k >= 8)], k);
      acc = std::fma(x, y, acc);
    }
    d[i] = acc;
  }
  warp_wait();
  for (int i = 0; i < 4; ++i) c[i] = d[i];
}
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


_C_TYPES = {
    np.dtype(np.float32): "float",
    np.dtype(np.uint32): "uint32_t",
    np.dtype(np.int32): "int32_t",
}
_MMA = re.compile(
    r'asm volatile\(\s*"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(\w+)\.'
    r'.*?"r"\(b\[1\]\)\);',
    re.DOTALL,
)


def emulated_mma(header: str) -> str:
    """``header`` with each inline-PTX m16n8k16 mma replaced by the emulated one."""
    kinds = {"bf16": "__nv_bfloat16", "f16": "__half"}
    return _MMA.sub(lambda m: f"emulated_mma<{kinds[m.group(1)]}>(c, a, b);", header)


def run(
    source: str,
    inputs: dict[str, np.ndarray],
    outputs: dict[str, tuple[int, ...]],
    constants: dict[str, int | str],
    grid: tuple[int, int, int],
    threadgroup: tuple[int, int, int],
    header: str = "",
    types: dict[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """Launch ``source`` over ``grid`` threads in ``threadgroup`` blocks (x a multiple of 32,
    at most 1024). Inputs are float32 or uint32 arrays, views allowed (read through their
    strides); outputs are float32. ``constants`` fill the template: ints, or type names (the
    type parameters InT, AT and DT are float unless given). ``types`` names an input's C type
    where its bits are not a float32 or uint32 array's (bf16 inputs as uint16 arrays, say);
    ``header`` goes before the kernel, as ``mx.fast.cuda_kernel``'s does."""
    assert threadgroup[0] % 32 == 0 and threadgroup[0] <= 1024
    source, header = compact(source), compact(header)  # the texts as MLX is given them
    assert all(g % t == 0 for g, t in zip(grid, threadgroup, strict=True))
    names = list(inputs)
    arrays = [np.asarray(inputs[n]) for n in names]
    types = types or {}
    ctypes_ = [types.get(n) or _C_TYPES[a.dtype] for n, a in zip(names, arrays, strict=True)]
    params = [f"const {c}* {n}, const int64_t* {n}_strides, const int32_t* {n}_shape"
              for n, c in zip(names, ctypes_, strict=True)]  # fmt: skip
    params += [f"float* {n}" for n in outputs]
    args = [f"(const {c}*)in[{i}], strides[{i}], shapes[{i}]" for i, c in enumerate(ctypes_)]
    args += [f"(float*)out[{i}]" for i in range(len(outputs))]
    constants = {"InT": "float", "AT": "float", "DT": "float"} | constants
    header = (
        "".join(
            f"using {k} = {v};\n" if isinstance(v, str) else f"constexpr int {k} = {v};\n"
            for k, v in constants.items()
        )
        + header
    )
    # Metal's address space of a thread's own arrays, for the header's and kernel's text only
    # (std::thread follows).
    # Each input's ndim, as MLX passes ``{name}_ndim`` where the source reads it.
    ndims = "".join(f"const int {n}_ndim = {a.ndim};\n" for n, a in zip(names, arrays, strict=True))
    code = (_PRELUDE + "#define thread\n" + header
            + f"static void kernel({', '.join(params)}) {{\n{ndims}{source}\n}}\n#undef thread\n"
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
