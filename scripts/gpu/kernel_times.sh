#!/usr/bin/env bash
# scripts/gpu/kernel_times.sh — GPU time of every kernel one attention_gpu_bench invocation launches, from
# Nsight Compute (gpu__time_duration per launch, summed per kernel name), on a GPU machine after
# scripts/gpu/check.sh has built the bench.
#
#   bash scripts/gpu/kernel_times.sh [bench args...]    (default: VS and BS, model-like inputs, 128K, one rep)
#
# Prints one line per kernel: launches, total and mean microseconds, share of the listed kernels' total; the
# raw CSV goes to $OUT/kernel_times.csv (OUT default build/gpu-kernel-times). Launches before KT_SKIP (default:
# the Hopper kernel's self-check and the bench's warm-up, none by default) are all counted: pass bench args that run
# what you want to see once (--reps 1 --warmup 0).
# KT_SECTIONS_REGEX (e.g. "vs_|bs_"): a second ncu pass over the first launch of each kernel whose name matches,
# with the SpeedOfLight, Occupancy, LaunchStats and MemoryWorkloadAnalysis sections (what limits each kernel:
# compute, L2 / DRAM bandwidth, latency), into $OUT/kernel_sections.txt (its summary lines are printed).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/gpu-kernel-times}
mkdir -p "$OUT"
. scripts/gpu/bench_tools.sh
find_bench_tools kernel_times
if [ $# -eq 0 ]; then
  set -- --inputs model --seq 131072 --patterns vs,bs --reps 1 --warmup 0 --kernel auto
fi
echo "bench: $BENCH $*"
timeout "${KT_TIMEOUT_S:-240}" "$NCU" --metrics gpu__time_duration.sum --csv --page raw --print-units base \
  "$BENCH" "$@" > "$OUT/kernel_times.csv" 2> "$OUT/kernel_times.err"
echo "ncu rc=$?"
python3 - "$OUT/kernel_times.csv" <<'PY'
import csv, sys, collections
# The bench's own stdout lines are mixed in: the table starts at ncu's header row ("ID", ...).
rows = list(csv.reader(open(sys.argv[1])))
start = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
if start is None:
    sys.exit("no ncu table")
rows = [r for r in rows[start:] if len(rows[start]) == len(r)]
hdr = rows[0]
ix = {h: i for i, h in enumerate(hdr)}
name_col = ix.get("Kernel Name", 4)
t_col = ix.get("gpu__time_duration.sum")
if t_col is None:
    sys.exit("no gpu__time_duration column: " + ",".join(hdr))
tot = collections.OrderedDict()
for r in rows[1:]:
    try:
        t = float(r[t_col].replace(",", ""))
    except ValueError:
        continue  # the units row
    # The function's own name: drop the return type, template arguments, parameters and namespaces.
    full, depth, base = r[name_col].split("(")[0], 0, ""
    for ch in full:
        depth += ch == "<"
        if depth == 0:
            base += ch
        depth -= ch == ">"
    name = base.replace("void ", "").split("::")[-1].strip()
    n, s = tot.get(name, (0, 0.0))
    tot[name] = (n + 1, s + t)
total = sum(s for _, s in tot.values()) or 1.0
print(f"{'kernel':60s} {'launches':>8s} {'total us':>12s} {'mean us':>10s} {'share':>7s}")
for name, (n, s) in tot.items():
    print(f"{name[:60]:60s} {n:8d} {s / 1e3:12.1f} {s / 1e3 / n:10.1f} {s / total * 100:6.1f}%")
PY
if [ -n "${KT_SECTIONS_REGEX:-}" ]; then
  timeout "${KT_TIMEOUT_S:-240}" "$NCU" --kernel-name "regex:${KT_SECTIONS_REGEX}" --launch-count "${KT_SECTIONS_COUNT:-12}" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    "$BENCH" "$@" > "$OUT/kernel_sections.txt" 2>&1
  echo "ncu sections rc=$?"
  grep -E "^  [a-z_].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Grid Size|Block Size|Waves Per SM" \
    "$OUT/kernel_sections.txt" | head -300
fi

