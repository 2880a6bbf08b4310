#!/usr/bin/env bash
# Device call 2 (after call 1 copied .devA): install MLX, then `ncu --set full` on one launch
# each of the product's gated-delta kernel (profile_full.py); details, the SASS source page
# (gzipped) and raw metrics to $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$OUT/summary.txt
{ echo "load before: $(cat /proc/loadavg)"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv; git log --oneline -1; ncu --version | tail -1; } > "$S"
bash .devB/install.sh >> "$S" 2>&1 || exit 3
t0=$(date +%s)
timeout 300 ncu --profile-from-start off --set full --import-source no -k regex:mtp_gated_delta -o /tmp/gdn python scripts/gdn_variants/profile_full.py >> "$S" 2>&1
echo "== ncu rc=$? $(( $(date +%s) - t0 )) s" >> "$S"
ncu -i /tmp/gdn.ncu-rep --page details --csv > $OUT/details.csv 2>> "$S"
ncu -i /tmp/gdn.ncu-rep --page source --csv --print-source sass > $OUT/source.csv 2>> "$S"
echo "source rc=$? $(wc -c < $OUT/source.csv)" >> "$S"
ncu -i /tmp/gdn.ncu-rep --page raw --csv > $OUT/raw.csv 2>> "$S"
gzip -k $OUT/source.csv $OUT/raw.csv 2>/dev/null; ls -la $OUT >> "$S"
rm -f $OUT/source.csv $OUT/raw.csv
echo "load after: $(cat /proc/loadavg)" >> "$S"
cat "$S" | tail -40
