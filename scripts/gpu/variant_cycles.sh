#!/usr/bin/env bash
# scripts/gpu/variant_cycles.sh — clock-locked cycles (Nsight Compute) and wall time of chosen wgmma variants of
# the sparse prefill kernel on chosen bench rows, after scripts/gpu/check.sh built the bench on this machine.
#
#   VARIANTS="0 2 4" ROWS="ashape:131072 dense:32768 vs:131072:model" bash scripts/gpu/variant_cycles.sh
#
# A row is pattern:seq[:inputs] (the bench's --inputs, default rope).
# Each (variant, row) runs attention_gpu_bench once under ncu with TESSERA_WGMMA_VARIANT=<variant> (the first
# prefill launch after the self-check's LAUNCH_SKIP, default 13 = one per wgmma variant: sm__cycles_elapsed, the
# tensor pipe's active share, issue-slot use),
# then once without ncu (--reps 5, median wall time and the bench's SM clock). Wall times move with the GPU's
# clock under its power cap; the cycle counts are the comparison. Output: one line per (variant, row) and
# $OUT/variant_cycles.txt (OUT default build/gpu-variant-cycles).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/gpu-variant-cycles}
mkdir -p "$OUT"
. scripts/gpu/bench_tools.sh
find_bench_tools variant_cycles
VARIANTS=${VARIANTS:-0}
ROWS=${ROWS:-ashape:131072}
METRICS=sm__cycles_elapsed.avg,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum
: > "$OUT/variant_cycles.txt"
for row in $ROWS; do
  IFS=: read -r pat seq inputs <<< "$row"
  inputs=${inputs:-rope}
  for v in $VARIANTS; do
    TESSERA_WGMMA_VARIANT=$v timeout 120 "$NCU" --kernel-name regex:sparse_prefill_wgmma --launch-skip "${LAUNCH_SKIP:-13}" \
      --launch-count 1 --metrics "$METRICS" --csv --page raw --print-units base "$BENCH" --seq "$seq" \
      --patterns "$pat" --inputs "$inputs" --reps 1 --warmup 0 --variants off > "$OUT/ncu_${pat}_${seq}_${inputs}_$v.csv" 2>&1
    ncu_line=$(python3 - "$OUT/ncu_${pat}_${seq}_${inputs}_$v.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
start = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
if start is None:
    print("ncu: no table")
    sys.exit()
hdr = rows[start]
val = [r for r in rows[start + 1:] if len(r) == len(hdr) and r[0].isdigit()]
if not val:
    print("ncu: no row")
    sys.exit()
v = dict(zip(hdr, val[-1]))
g = lambda k: float(v.get(k, "nan").replace(",", ""))
print(f"cycles {g('sm__cycles_elapsed.avg') / 1e6:8.3f} M  tensor {g('sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active'):5.1f}%  "
      f"issue {g('smsp__issue_active.avg.pct_of_peak_sustained_active'):5.1f}%  ncu {g('gpu__time_duration.sum') / 1e6:7.3f} ms")
PY
)
    TESSERA_WGMMA_VARIANT=$v timeout 120 "$BENCH" --seq "$seq" --patterns "$pat" --inputs "$inputs" --reps 5 \
      --variants off > "$OUT/bench_${pat}_${seq}_${inputs}_$v.log" 2>&1
    wall=$(grep -E "^\s+seq" "$OUT/bench_${pat}_${seq}_${inputs}_$v.log" | head -1 | sed -E 's/.*kernel +([0-9.]+) ms.*/\1/')
    line="variant $v  $pat $seq $inputs: $ncu_line  wall kernel ${wall:-?} ms"
    echo "$line" | tee -a "$OUT/variant_cycles.txt"
  done
done
