#!/usr/bin/env bash
# scripts/gpu/profile_prefill.sh — Nsight Compute profile of the sparse prefill kernel on a GPU machine.
#
#   bash scripts/gpu/profile_prefill.sh     (carry build/gpu-debs; reports under $OUT, default build/gpu-profile)
#
# Builds through scripts/gpu/check.sh (BUILD_ONLY=1), then runs ncu on attention_gpu_bench for one pattern and
# length (PROFILE_ARGS, default A-shape at 32K: the Hopper kernel) and keeps the details page of the first kernel
# launch matching PROFILE_KERNEL after PROFILE_SKIP launches (the Hopper kernel's self-check launches it once on a
# tiny problem first).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/gpu-profile}
mkdir -p "$OUT"
BUILD_ONLY=1 OUT=$OUT/check bash scripts/gpu/check.sh > "$OUT/build.log" 2>&1
. scripts/gpu/bench_tools.sh
find_bench_tools profile_prefill "$OUT/build.log"
echo "bench: $BENCH  ncu: $NCU"
ARGS=${PROFILE_ARGS:---seq 32768 --patterns ashape --reps 1 --warmup 0 --kernel auto}
KERNEL=${PROFILE_KERNEL:-$HOPPER_KERNEL_REGEX}
SKIP=${PROFILE_SKIP:-$HOPPER_SELF_CHECK_LAUNCHES}
if [ "${PROFILE_FULL:-1}" = 1 ]; then
  timeout 200 "$NCU" --kernel-name "$KERNEL" --launch-skip "$SKIP" --launch-count 1 --set full \
    --import-source no --page details --print-units base "$BENCH" $ARGS > "$OUT/ncu.txt" 2> "$OUT/ncu.err"
  echo "ncu rc=$?"
fi
# Stall reasons (per issued instruction) and the tensor pipe, then the per-instruction stall samples (SASS).
timeout 120 "$NCU" --kernel-name "$KERNEL" --launch-skip "$SKIP" --launch-count 1 --page raw --csv \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_gmma.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,sm__cycles_elapsed.avg" \
  "$BENCH" $ARGS > "$OUT/ncu_stalls.csv" 2>> "$OUT/ncu.err"
echo "ncu stalls rc=$?"
timeout 200 "$NCU" --kernel-name "$KERNEL" --launch-skip "$SKIP" --launch-count 1 --section SourceCounters \
  --section WarpStateStats --page source --print-source sass --csv "$BENCH" $ARGS > "$OUT/ncu_source.csv" \
  2>> "$OUT/ncu.err"
echo "ncu source rc=$?"
python3 - "$OUT/ncu_stalls.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5 and r[0] != "" and (r[0] == "ID" or r[0].isdigit())]
if len(rows) > 1:  # ncu's header row ("ID", ...) and the kernel's row; the bench's stdout lines are skipped
    hdr, val = rows[0], rows[-1]
    for h, v in sorted(zip(hdr, val), key=lambda x: x[0]):
        if "stalled" in h or "gmma" in h or "inst_executed" in h or "cycles" in h or "issue_active" in h:
            print(f"{h:90s} {v}")
PY
[ -f "$OUT/ncu.txt" ] && grep -E "sparse_prefill|Duration|Throughput|Pipe|Issue Slots|Warp Cycles|Stall|Registers|Achieved|Eligible|Active Warps|Executed Ipc|L2 Hit|Bank" "$OUT/ncu.txt" | head -80
# Per-instruction summary of the source page: the instructions with the most stall samples (share of all
# samples, executions, the main stall reasons), in address order.
python3 - "$OUT/ncu_source.csv" > "$OUT/profile_summary.txt" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hi = next((i for i, r in enumerate(rows) if "Source" in r and "Address" in r), None)
if hi is None:
    sys.exit("no source table")
hdr = rows[hi]
data = [r for r in rows[hi + 1:] if len(r) == len(hdr)]
ix = {h: i for i, h in enumerate(hdr)}
def f(r, k):
    try:
        return float(r[ix[k]].replace(",", ""))
    except (KeyError, ValueError):
        return 0.0
S = "Warp Stall Sampling (All Samples)"
tot = sum(f(r, S) for r in data) or 1.0
reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
print("total samples", tot, "instructions executed", sum(f(r, "Instructions Executed") for r in data))
print("by reason:", ", ".join(f"{h[6:]} {sum(f(r, h) for r in data) / tot * 100:.1f}%" for h in reasons
                               if sum(f(r, h) for r in data) > 0.005 * tot))
for r in data:
    s = f(r, S) / tot * 100
    ins = r[ix["Source"]]
    if s > 0.25 or any(k in ins for k in ("HGMMA", "DEPBAR", "SYNCS", "BAR.", "MEMBAR", "LDGSTS")):
        top = sorted(((f(r, h), h[6:]) for h in reasons), reverse=True)[:3]
        print(f"{r[0][-5:]} {ins[:64]:64s} S={s:5.2f}% I={f(r, 'Instructions Executed') / 1e6:8.2f}M",
              " ".join(f"{n}={v:.0f}" for v, n in top if v > 0))
PY
head -3 "$OUT/profile_summary.txt"
