#!/usr/bin/env bash
# scripts/gpu/ashape_power.sh [BENCH] — what puts A-shape at 128K in its slow mode (issue 35): the same kernel timed
# rep by rep with the SM clock, board power, temperature and NVML's clock event reasons read after each rep
# (attention_gpu_bench --trace-reps), in three situations, five rounds each where it matters:
#   idle   the GPU idle 10 s before the row (--idle-ms 10000), 60 reps (~0.9 s of A-shape)
#   dense  right after dense attention at 128K (20 reps, ~4.6 s at full power), then A-shape, 60 reps
#   rope   the idle case with the bench's rope inputs instead of the model inputs (the operands' values)
# BENCH: the attention_gpu_bench binary (default build/cuda/bench/gpu/attention_gpu_bench). Writes to ${OUT:-.}:
# ashape_power.log (everything), power_limits.txt (nvidia-smi -q -d POWER,CLOCK,PERFORMANCE before the runs).
set -uo pipefail
B=${1:-build/cuda/bench/gpu/attention_gpu_bench}
O=${OUT:-.}
nvidia-smi -q -d POWER,CLOCK,PERFORMANCE,TEMPERATURE > "$O/power_limits.txt" 2>&1
L="$O/ashape_power.log"
: > "$L"
common="--seq 131072 --inputs model --kernel wgmma --warmup 1 --trace-reps"
for r in 1 2 3 4 5; do
  echo "=== round $r idle" | tee -a "$L"
  "$B" $common --patterns ashape --reps 60 --idle-ms 10000 >> "$L" 2>&1
  echo "=== round $r dense" | tee -a "$L"
  "$B" $common --patterns dense,ashape --reps 20 >> "$L" 2>&1
done
for r in 1 2; do
  echo "=== round $r rope idle" | tee -a "$L"
  "$B" --seq 131072 --inputs rope --kernel wgmma --warmup 1 --trace-reps --patterns ashape --reps 60 --idle-ms 10000 >> "$L" 2>&1
done
# A short summary: per section, the kernel ms and MHz of the first 5 and the last 10 A-shape reps.
python3 - "$L" <<'PY' | tee "$O/ashape_power_summary.txt"
import re, sys, statistics as st
sec, rows = None, {}
for line in open(sys.argv[1]):
    if line.startswith("=== "):
        sec = line[4:].strip(); rows[sec] = []; continue
    m = re.match(r"rep (\d+) ashape 131072: kernel ([\d.]+) ms, SM (-?\d+) MHz, ([-\d.]+) W, (-?\d+) C, reasons (0x[0-9a-f]+)", line)
    if m and sec: rows[sec].append((float(m[2]), int(m[3]), float(m[4]), int(m[5]), m[6]))
for s, r in rows.items():
    if not r: print(s, "no reps"); continue
    f, l = r[:5], r[-10:]
    print(f"{s:18s} first5 {st.median(x[0] for x in f):7.3f} ms @ {st.median(x[1] for x in f):5.0f} MHz | last10 "
          f"{st.median(x[0] for x in l):7.3f} ms @ {st.median(x[1] for x in l):5.0f} MHz {st.median(x[2] for x in l):5.0f} W "
          f"{l[-1][3]} C reasons {sorted(set(x[4] for x in l))} | cycles/rep last10 "
          f"{st.median(x[0]*x[1]/1000 for x in l):6.2f} M")
PY
