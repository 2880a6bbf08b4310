#!/usr/bin/env bash
# Device call 2: install MLX, then one-layer sweeps (the product's geometry) of HEAD and the
# variants, then HEAD's real step. Logs to $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$OUT/summary.txt
{ echo "load before: $(cat /proc/loadavg)"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv; git log --oneline -1; } > "$S"
bash .devB/install.sh >> "$S" 2>&1 || exit 3
python -c "import mlx.core as mx; print(mx.__version__, mx.default_device())" >> "$S" 2>&1
python scripts/gdn_variants/make_variants.py /tmp/gdv >> "$S" && cp mtpcli/kernels/gated_delta.py /tmp/gdv/gd_head.py
NCU="ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum"
for v in ${VARIANTS:-head plain bulk bulkall}; do
  t0=$(date +%s)
  timeout 150 $NCU -k regex:mtp_gated_delta python -c "
import sys; sys.path.insert(0, 'scripts'); sys.argv = ['bench_gdn_geometry.py', '--module', '/tmp/gdv/gd_$v.py']
import bench_gdn_geometry as b; b.GEOMETRIES = [(8, 2, 3)]; b.main()" > "$OUT/sweep_$v.csv" 2> /tmp/err_$v.txt
  echo "== sweep $v rc=$? $(( $(date +%s) - t0 )) s" >> "$S"; tail -3 /tmp/err_$v.txt >> "$S"
  python scripts/bench_gdn_geometry.py --summary "$OUT/sweep_$v.csv" >> "$S" 2>&1
done
for v in ${STEPS:-head}; do
  t0=$(date +%s)
  timeout ${STEP_LIMIT:-240} $NCU -k regex:gated_delta python scripts/bench_gdn_geometry.py --step 1 3 --module /tmp/gdv/gd_$v.py > "$OUT/steps_$v.csv" 2> /tmp/serr_$v.txt
  echo "== steps $v rc=$? $(( $(date +%s) - t0 )) s" >> "$S"; tail -3 /tmp/serr_$v.txt >> "$S"
  python scripts/bench_gdn_geometry.py --summary "$OUT/steps_$v.csv" >> "$S" 2>&1
done
echo "load after: $(cat /proc/loadavg)" >> "$S"
cat "$S"
