"""Every CUDA kernel source compiles for the H200 (sm_90) with nvcc, wrapped as MLX's
``mx.fast.cuda_kernel`` wraps it, and keeps all its values in registers (no spills): checked
in CI, where there is no GPU, before any device time is spent. MLX compiles with NVRTC and its
own headers; the wrapper here mirrors its signature (pointers, ``Shape``/``Strides`` passed by
value where the source uses them, template arguments as constants)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from mtpcli.kernels import compact, launch_bounds
from mtpcli.kernels import conv_window as cw
from mtpcli.kernels import decode_attention as da
from mtpcli.kernels import gated_delta as gd
from mtpcli.kernels import gated_norm as gn
from mtpcli.kernels import moe_route as mr
from mtpcli.kernels import qmm_kernel as qm

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc")

_PRELUDE = """
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
struct Shape { int32_t v[10]; __device__ int32_t operator[](int i) const { return v[i]; } };
struct Strides { int64_t v[10]; __device__ int64_t operator[](int i) const { return v[i]; } };
"""
BF16, HALF, F32, U32 = "__nv_bfloat16", "__half", "float", "uint32_t"


def _wrap(source: str, header: str, inputs: dict, outputs: dict, constants: dict) -> str:
    source, header = compact(source), compact(header)  # the texts as MLX is given them
    params = []
    for name, ctype in inputs.items():
        params.append(f"const {ctype}* {name}")
        for kind, cls in (("shape", "Shape"), ("strides", "Strides"), ("ndim", "int")):
            if f"{name}_{kind}" in source:  # as MLX declares what the source reads
                params.append(f"const __grid_constant__ {cls} {name}_{kind}")
    params += [f"{ctype}* {name}" for name, ctype in outputs.items()]
    body = "".join(
        f"  using {k} = {v};\n" if isinstance(v, str) else f"  constexpr int {k} = {v};\n"
        for k, v in constants.items()
    )
    return (f"{_PRELUDE}{header}\n__global__ void kernel({', '.join(params)}) {{\n{body}"
            f"{source}\n}}\n")  # fmt: skip


def _compile(tmp_path, code: str) -> str:
    src = tmp_path / "k.cu"
    src.write_text(code)
    out = subprocess.run(
        [NVCC, "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"), str(src)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stderr  # ptxas's report


def _no_spills(report: str) -> bool:
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return bool(spills) and all(s == ("0", "0") for s in spills)


@pytest.mark.parametrize("keep", [False, True], ids=["", "keep"])
@pytest.mark.parametrize("dtype", [BF16, HALF, F32])
def test_gated_delta_kernel_compiles_without_spills(tmp_path, keep, dtype):
    types = dict.fromkeys(gd._INPUTS, dtype) | {"state_in": F32, "A_log": F32, "dt_bias": BF16}
    outputs = {"y": dtype, "state_out": F32} | ({"states": F32} if keep else {})
    constants = {"InT": dtype, "Dk": 128, "Dv": 128, "Hk": 16, "Hv": 48, **gd._layout(16, 48, 128)}
    constants |= {"AT": F32, "DT": BF16}
    report = _compile(tmp_path, _wrap(gd._source(False, keep), "", types, outputs, constants))
    assert _no_spills(report), report


@pytest.mark.parametrize("T", [1, 3], ids=["narrow", "wide"])
@pytest.mark.parametrize("keep", [False, True], ids=["", "keep"])
@pytest.mark.parametrize("dtype", [BF16, HALF])
def test_gated_delta_kernel_with_the_conv_folded_in_compiles_without_spills(tmp_path, keep, dtype,
                                                                            T):  # fmt: skip
    """At the 27B shape, as a one-step launch and as a block's (wide: 24 warps of 3 heads)."""
    types = dict.fromkeys(gd._CONV_INPUTS, dtype) | {"state_in": F32, "A_log": F32, "conv_w": F32}
    outputs = {"y": dtype, "state_out": F32} | ({"states": F32} if keep else {})
    outputs |= {"inputs": dtype, "window_out": dtype}
    constants = {"InT": dtype, "Dk": 128, "Dv": 128, "Hk": 16, "Hv": 48,
                 **gd._layout(16, 48, 128, T), "AT": F32, "DT": dtype, "WT": F32,
                 "CK": 4}  # fmt: skip
    warps, _, blocks = gd._placement(16, 48, 128, T)
    spec = gd._spec(False, keep, conv=True, bounds=(warps, blocks))
    report = _compile(tmp_path, _wrap(spec["source"], spec["header"], types, outputs, constants))
    assert _no_spills(report), report
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    assert regs * 32 * warps * blocks <= 65536  # its launch bounds hold


def test_convolution_kernel_compiles_without_spills(tmp_path):
    types = {"x": BF16, "window": BF16, "weight": BF16}
    outputs = {"y": BF16, "inputs": BF16, "window_out": BF16}
    report = _compile(tmp_path, _wrap(cw.source(False), "", types, outputs, {"InT": BF16, "K": 4}))
    assert _no_spills(report), report


VARIANTS = [qm.PLAIN, qm.Variant(residual=True), qm.Variant(1e-6), qm.Variant(swiglu=True),
            qm.Variant(1e-6, swiglu=True), qm.Variant(1e-6, residual=True)]  # fmt: skip
VARIANT_IDS = ["plain", "residual", "norm", "swiglu", "norm_swiglu", "norm_residual"]


def _product(variant: qm.Variant, xt: str, bits: int, group_size: int = 64,
             header: str | None = None, nt: int = 1) -> str:  # fmt: skip
    """A product variant's source wrapped as MLX wraps it, with its header (launch bounds
    included where the variant has them)."""
    header = qm.header(variant) if header is None else header
    types = ({"x": xt, "ew": U32, "escales": xt, "ebiases": xt, "idx": U32} if variant.gathered
             else {"x": xt, "w": U32, "scales": xt, "biases": xt})  # fmt: skip
    types |= {"norm_w": xt} if variant.norm_eps is not None else {}
    types |= {"residual": xt} if variant.residual else {}
    outputs = {"y": xt}
    constants = {"XT": xt, "ST": xt, "BITS": bits, "GS": group_size, "WARPS": qm.WARPS, "NT": nt}
    return _wrap(qm.source(False, variant), header, types, outputs, constants)


@pytest.mark.parametrize("xt", [BF16, HALF])
@pytest.mark.parametrize("bits", qm.BITS)
@pytest.mark.parametrize("group_size", qm.GROUP_SIZES)
def test_quantized_matmul_kernel_compiles_without_spills(tmp_path, xt, bits, group_size):
    report = _compile(tmp_path, _product(qm.PLAIN, xt, bits, group_size))
    assert _no_spills(report), report


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("xt", [BF16, HALF])
@pytest.mark.parametrize("bits", qm.BITS)
def test_quantized_matmul_variants_fit_four_blocks_per_multiprocessor(tmp_path, variant, xt,
                                                                       bits):  # fmt: skip
    """The product is latency-bound on the H200 (ncu: 43% of DRAM bandwidth, issue ~50%
    busy), so occupancy matters: at most 64 registers a thread keep 4 blocks of 256 threads
    on a multiprocessor (65536 registers). A variant that loaded a first scale before its
    loop took 68 (3 blocks). The norm, swiglu and residual variants must not cost a block
    (the norm ones need launch bounds for that: 67-68 registers without)."""
    report = _compile(tmp_path, _product(variant, xt, bits))
    assert _no_spills(report), report
    used = int(re.search(r"Used (\d+) registers", report).group(1))
    assert used * 32 * qm.WARPS * 4 <= 65536, used


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("nt", qm.TILES[1:])
def test_products_of_more_tiles_compile_without_spills(tmp_path, variant, nt):
    """A launch of 9-32 rows (2 or 4 tiles of 8 x rows) holds more accumulators: unbounded
    (``qm.header``), no variant spills; but the norm + swiglu variant of 4 tiles, bounded to 2
    blocks a multiprocessor (128 registers), which spills a few bytes (faster measured)."""
    code = _product(variant, BF16, 4, header=qm.header(variant, nt=nt), nt=nt)
    report = _compile(tmp_path, code)
    used = int(re.search(r"Used (\d+) registers", report).group(1))
    if variant.norm_eps is not None and variant.swiglu and nt == 4:
        assert "__launch_bounds__(256, 2)" in code and used <= 128, used
        assert int(re.search(r"(\d+) bytes spill stores", report).group(1)) <= 16, report
        return
    assert _no_spills(report), report
    assert "maxntid" not in code and "__launch_bounds__" not in code


@pytest.mark.parametrize("norm,swiglu", [(None, False), (None, True), (1e-6, True)],
                         ids=["plain", "swiglu", "norm_swiglu"])  # fmt: skip
@pytest.mark.parametrize("bits", qm.BITS)
def test_gathered_products_compile_without_spills(tmp_path, norm, swiglu, bits):
    """A MoE layer's expert products (bf16 activations; the gate and up with the block's norm
    folded in too): no spills, 3 blocks a multiprocessor (unbounded: see
    qmm_kernel.NORM_MIN_BLOCKS)."""
    variant = qm.Variant(norm, swiglu=swiglu, gathered=True)
    report = _compile(tmp_path, _product(variant, BF16, bits))
    assert _no_spills(report), report
    used = int(re.search(r"Used (\d+) registers", report).group(1))
    assert used * 32 * qm.WARPS * 3 <= 65536, used


@pytest.mark.parametrize("bits", qm.BITS)
def test_launch_bounds_cap_the_products_registers(tmp_path, bits):
    """``min_blocks`` (a benchmark arm, not the default) reaches ptxas through the header: 5
    blocks of 8 warps leave at most 51 registers a thread (65536 / 1280)."""
    header = qm._HEADER_CUDA + qm.launch_bounds(qm.WARPS, 5)
    code = _product(qm.PLAIN, BF16, bits, header=header)
    used = int(re.search(r"Used (\d+) registers", _compile(tmp_path, code)).group(1))
    assert used * 32 * qm.WARPS * 5 <= 65536, used


@pytest.mark.parametrize("in_place", [False, True], ids=["view", "in_place"])
@pytest.mark.parametrize("dtype", [BF16, HALF, F32])
def test_gated_norm_kernel_compiles_without_spills(tmp_path, dtype, in_place):
    types = {"y": dtype, "z": dtype, "weight": dtype}
    constants = {"InT": dtype, "D": 128, "WARPS": gn._WARPS}
    constants |= {"Z_OFF": 10240} if in_place else {}
    code = _wrap(gn._source(False, 1e-6, in_place), "", types, {"out": dtype}, constants)
    report = _compile(tmp_path, code)
    assert _no_spills(report), report


@pytest.mark.parametrize("dtype", [BF16, HALF, F32])
def test_decode_attention_kernels_compile_without_spills(tmp_path, dtype):
    header, partial, combine = da.sources(False, 1e-6, da.Rope(64, 1e7, 1.0), 0.0625)
    names = ["q", "k", "v", "q_norm", "k_norm", "keys", "values"]
    outputs = {"part_m": F32, "part_l": F32, "part_acc": F32, "k_out": dtype}
    constants = {"InT": dtype, "D": 256, "WARPS": da._WARPS}
    inputs = dict.fromkeys(names, dtype) | {"cached": "int32_t"}
    assert list(inputs) == da._PARTIAL_INPUTS
    code = _wrap(partial, header, inputs, outputs, constants)
    assert _no_spills(_compile(tmp_path, code))
    types = {"part_m": F32, "part_l": F32, "part_acc": F32, "gate": dtype, "cached": "int32_t"}
    assert list(types) == da._COMBINE_INPUTS
    code = _wrap(combine, header, types, {"out": dtype}, {"InT": dtype, "D": 256})
    assert _no_spills(_compile(tmp_path, code))


@pytest.mark.parametrize("dtype", [BF16, HALF, F32])
def test_moe_routing_and_combination_kernels_compile_without_spills(tmp_path, dtype):
    """The 35B-A3B's routing: 256 experts, 8 a token, and the shared expert's slot (9)."""
    constants = {"InT": dtype, "E": 256, "EPL": 8, "KS": 8, "SLOTS": 9, "NORM": 1,
                 "WARPS": mr._WARPS}  # fmt: skip
    code = _wrap(mr.route_source(False), "", {"logits": dtype},
                 {"inds": U32, "scores": dtype}, constants)  # fmt: skip
    assert _no_spills(_compile(tmp_path, code))
    inputs = dict.fromkeys(["y", "scores", "shared", "logits", "h"], dtype)
    code = _wrap(mr.combine_source(False), "", inputs, {"out": dtype},
                 {"InT": dtype, "KS": 8, "SLOTS": 9})  # fmt: skip
    assert _no_spills(_compile(tmp_path, code))


def test_a_source_error_is_caught(tmp_path):
    """The check is real: a source that does not compile fails it."""
    source = gd._source(False, True)
    assert "kv[r] = PSUM(p);" in source
    source = source.replace("kv[r] = PSUM(p);", "kv[r] = undefined_name;")
    code = _wrap(source, "", dict.fromkeys(gd._INPUTS, F32), {"y": F32, "state_out": F32,
                 "states": F32}, {"InT": F32, "AT": F32, "DT": F32, "Dk": 128, "Dv": 128,
                 "Hk": 16, "Hv": 48, "R": 4, "WARPS": 4, "HPT": 1})  # fmt: skip
    with pytest.raises(AssertionError, match="undefined_name"):
        _compile(tmp_path, code)


def test_a_kernel_that_spills_is_caught(tmp_path):
    """The spill check is real: bounded to 8 threadgroups of 8 warps a multiprocessor (32
    registers a thread), the conv variant, which needs 72-78, spills."""
    types = dict.fromkeys(gd._CONV_INPUTS, BF16) | {"state_in": F32, "A_log": F32, "conv_w": F32}
    outputs = {"y": BF16, "state_out": F32, "states": F32, "inputs": BF16, "window_out": BF16}
    constants = {"InT": BF16, "Dk": 128, "Dv": 128, "Hk": 16, "Hv": 48, "R": 2, "WARPS": 8,
                 "HPT": 1, "AT": F32, "DT": BF16, "WT": F32, "CK": 4}  # fmt: skip
    source = gd._source(False, True, conv=True)
    report = _compile(tmp_path, _wrap(source, launch_bounds(8, 8), types, outputs, constants))
    assert not _no_spills(report)
