#!/usr/bin/env bash
# Device call 2 (after call 1 copied .devA): install MLX (once a machine), then one-layer
# sweeps of HEAD and the variants, then real steps. Logs to $OUT. Settings (environment):
#   VARIANTS  the sweeps (default: head plain bulk bulkall)
#   GEOMS     the sweeps' geometries, a Python list of (W, R, MB[, L, H]) (default: the narrow
#             product's, [(8, 2, 3)])
#   STEPS     the real steps (default: head), run ROUNDS times (default 1), alternating
#   SWEEP_LIMIT  seconds a sweep may take (default 150)
#   DUMP=1    each sweep's outputs dumped and compared bitwise with HEAD's (sweep head first)
#   BUDGET    seconds since the start after which no further step run starts (default 430)
#   TAG       a suffix for the summary and CSV files (several runs in one call)
#   SOURCE    the kernel file the variants are made from (make_variants.py's SOURCE)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$OUT/summary${TAG:-}.txt
start=$(date +%s)
{ echo "load before: $(cat /proc/loadavg)"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv; git log --oneline -1; } > "$S"
[ -d /tmp/site/mlx ] || bash .devB/install.sh >> "$S" 2>&1 || exit 3
python -c "import mlx.core as mx; print(mx.__version__, mx.default_device())" >> "$S" 2>&1
python scripts/gdn_variants/make_variants.py /tmp/gdv ${SOURCE:-} >> "$S" && cp mtpcli/kernels/gated_delta.py /tmp/gdv/gd_head.py
NCU="ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum"
for v in ${VARIANTS:-head plain bulk bulkall}; do
  dump=""; [ "${DUMP:-0}" = 1 ] && dump=", '--dump', '/tmp/dump_$v.safetensors'"
  timeout ${SWEEP_LIMIT:-150} $NCU -k regex:mtp_gated_delta python -c "
import sys; sys.path.insert(0, 'scripts'); sys.argv = ['bench_gdn_geometry.py', '--module', '/tmp/gdv/gd_$v.py'$dump]
import bench_gdn_geometry as b; b.GEOMETRIES = ${GEOMS:-[(8, 2, 3)]}; b.main()" > "$OUT/sweep${TAG:-}_$v.csv" 2> /tmp/err_$v.txt
  echo "== sweep $v rc=$? at $(( $(date +%s) - start )) s" >> "$S"; tail -3 /tmp/err_$v.txt >> "$S"
  python scripts/bench_gdn_geometry.py --summary "$OUT/sweep${TAG:-}_$v.csv" >> "$S" 2>&1
done
if [ "${DUMP:-0}" = 1 ]; then
  python scripts/bench_gdn_geometry.py --compare /tmp/dump_head.safetensors /tmp/dump_*.safetensors >> "$S" 2>&1
fi
for round in $(seq "${ROUNDS:-1}"); do
  for v in ${STEPS:-head}; do
    [ $(( $(date +%s) - start )) -gt "${BUDGET:-430}" ] && { echo "== out of time before steps $v round $round" >> "$S"; continue; }
    timeout ${STEP_LIMIT:-240} $NCU -k regex:gated_delta python scripts/bench_gdn_geometry.py --step 1 3 --module /tmp/gdv/gd_$v.py > "$OUT/steps${TAG:-}_${v}_$round.csv" 2> /tmp/serr_$v.txt
    echo "== steps $v round $round rc=$? at $(( $(date +%s) - start )) s" >> "$S"; tail -3 /tmp/serr_$v.txt >> "$S"
    python scripts/bench_gdn_geometry.py --summary "$OUT/steps${TAG:-}_${v}_$round.csv" >> "$S" 2>&1
  done
done
echo "load after: $(cat /proc/loadavg)" >> "$S"
cat "$S"
