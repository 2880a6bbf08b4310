#!/usr/bin/env bash
# Device call 2 (after call 1 copied .devA): install MLX; HEAD's and the cluster variant's
# sweeps at the product's geometry with their outputs dumped and compared bitwise; then their
# real steps, alternating, twice while the call has time. Logs to $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$OUT/summary.txt
start=$(date +%s)
{ echo "load before: $(cat /proc/loadavg)"; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv; git log --oneline -1; } > "$S"
bash .devB/install.sh >> "$S" 2>&1 || exit 3
python scripts/gdn_variants/make_variants.py /tmp/gdv > /dev/null && cp mtpcli/kernels/gated_delta.py /tmp/gdv/gd_head.py
NCU="ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum"
for v in ${VARIANTS:-head cluster}; do
  timeout 150 $NCU -k regex:mtp_gated_delta python -c "
import sys; sys.path.insert(0, 'scripts'); sys.argv = ['bench_gdn_geometry.py', '--module', '/tmp/gdv/gd_$v.py', '--dump', '/tmp/dump_$v.safetensors']
import bench_gdn_geometry as b; b.GEOMETRIES = [(8, 2, 3)]; b.main()" > "$OUT/sweep_$v.csv" 2> /tmp/err_$v.txt
  echo "== sweep $v rc=$? at $(( $(date +%s) - start )) s" >> "$S"; tail -3 /tmp/err_$v.txt >> "$S"
  python scripts/bench_gdn_geometry.py --summary "$OUT/sweep_$v.csv" >> "$S" 2>&1
done
python scripts/bench_gdn_geometry.py --compare /tmp/dump_head.safetensors /tmp/dump_*.safetensors >> "$S" 2>&1
for round in 1 2; do
  for v in ${STEPS:-head cluster}; do
    [ $(( $(date +%s) - start )) -gt ${BUDGET:-430} ] && { echo "== out of time before steps $v $round" >> "$S"; continue; }
    timeout 200 $NCU -k regex:gated_delta python scripts/bench_gdn_geometry.py --step 1 3 --module /tmp/gdv/gd_$v.py > "$OUT/steps_${v}_$round.csv" 2> /tmp/serr_$v.txt
    echo "== steps $v round $round rc=$? at $(( $(date +%s) - start )) s" >> "$S"; tail -3 /tmp/serr_$v.txt >> "$S"
    python scripts/bench_gdn_geometry.py --summary "$OUT/steps_${v}_$round.csv" >> "$S" 2>&1
  done
done
echo "load after: $(cat /proc/loadavg)" >> "$S"
cat "$S"
