#!/usr/bin/env bash
# The test files that exercise MLX's CUDA backend, one pytest run each with its own time
# limit, results streamed test by test (-v), so that a run cut off by the device tool's limit
# still shows what passed. Run on the GPU machine from the repository root:
#
#   bash scripts/cuda_tests.sh [SECONDS_PER_FILE] [FILE ...]     # logs under ${OUT:-/tmp}/cuda_tests
#
# A fresh machine compiles every kernel on first use: test_kernels.py alone took minutes there,
# test_exactness.py 301 s and 376 s on two machines: hence 420 s a file by default.
set -uo pipefail
limit=${1:-420}
shift || true
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/test_exactness.py tests/test_compile.py tests/test_cuda.py
                                 tests/test_qmm.py tests/test_conv_window.py tests/test_gated_norm.py
                                 tests/test_decode_attention.py tests/test_kernels.py)
logs=${OUT:-/tmp}/cuda_tests
mkdir -p "$logs"
for f in "${files[@]}"; do
    name=$(basename "$f" .py)
    timeout "$limit" python -m pytest -v -p no:cacheprovider --tb=short "$f" > "$logs/$name.log" 2>&1
    rc=$?
    count() { grep -cE "$1" "$logs/$name.log"; }
    echo "$name: rc=$rc passed $(count " PASSED") failed $(count " FAILED| ERROR") skipped $(count " SKIPPED")"
    grep -E " FAILED| ERROR" "$logs/$name.log" | head -5
done | tee "$logs/summary.txt"
