#!/usr/bin/env bash
# Keep a GPU machine's compiled kernels for the next machine of the same kind:
#
#   bash scripts/kernel_cache.sh save $OUT/kernels.tgz      # before the machine goes back
#   bash scripts/kernel_cache.sh restore .kernels/kernels.tgz   # before the first MLX process
#   bash scripts/kernel_cache.sh save $OUT/kernels.tgz 15M  # in parts of at most 15 MiB
#
# Saved in parts (ARCHIVE.part-aa, -ab, ...; a tool that brings back files of limited size),
# it is restored from ARCHIVE's parts when ARCHIVE itself is not there.
#
# A fresh H200 machine spends minutes compiling MLX's and our kernels before the first figure
# (once a warm-up `mtp bench` ran past 170 s, and the processes after it past 70 s
# each). MLX keeps what NVRTC made under MLX_PTX_CACHE_DIR (default $TMPDIR/mlx/<version>/ptx)
# and the CUDA driver what it made of that under CUDA_CACHE_PATH (default ~/.nv/ComputeCache);
# both are keyed by their sources, so a cache from another machine with the same GPU, driver
# and MLX is used as is, and anything else in it is simply not found.
set -euo pipefail
what=${1:-}
archive=${2:-}
part=${3:-}
if [[ -z "$archive" || ( "$what" != save && "$what" != restore ) || ( -n "$part" && "$what" != save ) ]]; then
    echo "usage: kernel_cache.sh save ARCHIVE.tgz [PART_SIZE] | restore ARCHIVE.tgz" >&2
    exit 2
fi
version=$(python -c "import mlx.core as mx; print(mx.__version__)")
ptx=${MLX_PTX_CACHE_DIR:-${TMPDIR:-/tmp}/mlx/$version/ptx}
driver=${CUDA_CACHE_PATH:-$HOME/.nv/ComputeCache}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
if [[ "$what" == save ]]; then
    mkdir -p "$stage/ptx" "$stage/driver"
    [[ -d "$ptx" ]] && cp -r "$ptx/." "$stage/ptx/"
    [[ -d "$driver" ]] && cp -r "$driver/." "$stage/driver/"
    echo "$version" > "$stage/mlx_version"
    tar -czf "$archive" -C "$stage" .
    echo "saved $(find "$stage/ptx" -type f | wc -l) MLX and $(find "$stage/driver" -type f | wc -l) driver files to $archive ($(du -h "$archive" | cut -f1))"
    if [[ -n "$part" ]]; then
        split -b "$part" "$archive" "$archive.part-"
        rm "$archive"
        echo "in $(ls "$archive".part-* | wc -l) parts: $archive.part-*"
    fi
else
    if [[ -f "$archive" ]]; then
        tar -xzf "$archive" -C "$stage"
    elif compgen -G "$archive.part-*" > /dev/null; then
        cat "$archive".part-* | tar -xzf - -C "$stage"
    else
        echo "no kernel cache at $archive (nor its parts)" >&2
        exit 1
    fi
    if [[ "$(cat "$stage/mlx_version")" != "$version" ]]; then
        echo "kernel cache is for MLX $(cat "$stage/mlx_version"), this is $version: not restored" >&2
        exit 1
    fi
    mkdir -p "$ptx" "$driver"
    cp -r "$stage/ptx/." "$ptx/"
    cp -r "$stage/driver/." "$driver/"
    echo "restored $(find "$stage/ptx" -type f | wc -l) MLX and $(find "$stage/driver" -type f | wc -l) driver files"
fi
