#!/usr/bin/env bash
# scripts/gpu/prefill_limits.sh — what limits the sparse prefill kernel on a GPU machine: the SM clock and power
# while the bench runs, and one Nsight Compute pass per pattern with the throughput sections (tensor pipe, L2,
# DRAM, shared memory) and the tensor-pipe metrics this ncu knows.
#
#   bash scripts/gpu/prefill_limits.sh      (carry build/gpu-debs; everything under $OUT, packed as limits.tgz)
#
# LIMITS_SEQ (default 131072) and LIMITS_PATTERNS (default "ashape dense") choose the ncu runs; LIMITS_BENCH_ARGS
# the timed bench run (default: those patterns at that length, RoPE inputs, 5 reps) that nvidia-smi samples.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/gpu-limits}
mkdir -p "$OUT"
SEQ=${LIMITS_SEQ:-131072}
PATTERNS=${LIMITS_PATTERNS:-ashape dense}
BUILD_ONLY=1 OUT=$OUT/check bash scripts/gpu/check.sh > "$OUT/build.log" 2>&1
. scripts/gpu/bench_tools.sh
find_bench_tools prefill_limits "$OUT/build.log"
echo "bench: $BENCH  ncu: $NCU"

# Which tensor-pipe metrics this ncu has for the device (names differ between ncu versions).
timeout 60 "$NCU" --query-metrics --chip gh100 > "$OUT/query_metrics.txt" 2>&1
echo "tensor metrics known: $(grep -ciE "gmma|pipe_tensor|tensor_op" "$OUT/query_metrics.txt")"

# The timed run with the SM clock, power and temperature sampled every 50 ms.
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 50 > "$OUT/smi.csv" 2>&1 &
SMI=$!
# shellcheck disable=SC2086
timeout 200 "$BENCH" --seq "$SEQ" --patterns "$(echo $PATTERNS | tr ' ' ',')" --inputs rope --reps 5 \
  ${LIMITS_BENCH_ARGS:-} --csv "$OUT/bench.csv" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
kill $SMI 2>/dev/null
grep -E "^\s+seq|^\|" "$OUT/bench.log" | head -20
python3 - "$OUT/smi.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) >= 7 and r[1].strip()[:1].isdigit()]
if rows:
    mhz = [float(r[1].split()[0]) for r in rows]
    w = [float(r[3].split()[0]) for r in rows if r[3].strip() not in ("[N/A]",)]
    busy = [m for m, r in zip(mhz, rows) if float(r[3].split()[0]) > 300]
    print(f"nvidia-smi: {len(rows)} samples, SM MHz min {min(mhz):.0f} max {max(mhz):.0f}; under load (> 300 W): "
          f"{len(busy)} samples, mean {sum(busy) / max(1, len(busy)):.0f} MHz; max power {max(w):.0f} W; "
          f"throttle reasons seen: {sorted(set(r[6].strip() for r in rows))}")
PY

# One ncu pass per pattern: the first Hopper prefill launch after the self-check's.
for pat in $PATTERNS; do
  timeout 240 "$NCU" --kernel-name "$HOPPER_KERNEL_REGEX" --launch-skip "${LAUNCH_SKIP:-$HOPPER_SELF_CHECK_LAUNCHES}" --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --metrics "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_gmma.sum,sm__cycles_elapsed.avg,smsp__issue_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum" \
    --print-units base "$BENCH" --seq "$SEQ" --patterns "$pat" --inputs rope --reps 1 --warmup 0 \
    > "$OUT/ncu_$pat.txt" 2>&1
  echo "ncu $pat rc=$?"
  grep -E "Duration|SM Frequency|Elapsed Cycles|Throughput|Pipe|gmma|tensor|L2 Hit|Mem Busy|Max Bandwidth|lts__t_bytes|dram__bytes|issue_active|cycles_elapsed" \
    "$OUT/ncu_$pat.txt" | head -40
done
tar czf /tmp/limits.tgz -C "$OUT" . && mv /tmp/limits.tgz "$OUT/limits.tgz"
