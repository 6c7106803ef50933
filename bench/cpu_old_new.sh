#!/usr/bin/env bash
# Old CPU engine beside new, as docs/runtime.md's old-vs-new table measures it (issues 32/38): `tessera bench -m MODEL
# -d DEPTHS --decode 32 --threads 2 --kv-type f32 --attn dense` of two binaries on both real models, old and new
# ALTERNATING (round 1 old then new, round 2 new then old, ...) so that load on a shared machine falls on both alike;
# each run under /usr/bin/time -v (peak RSS), with the load average before it. Prints every run's table, then per
# (model, depth, side) the range (min-max over all rows of all rounds) of prefill and decode tok/s and the peak RSS.
#   bench/cpu_old_new.sh OLD_TESSERA NEW_TESSERA [ROUNDS] > out.txt
# Env: DEPTHS (default 1024,4096,8192), THREADS (2), DECODE (32), MODELS_DIR (~/.cache/tessera/models), MODELS (the
# two gguf file names, space-separated). The old binary of docs/runtime.md is 9c7de93 (build/h1-old/src/tessera).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: bench/cpu_old_new.sh OLD_TESSERA NEW_TESSERA [ROUNDS]" >&2
  exit 2
fi
OLD="$1"
NEW="$2"
ROUNDS="${3:-2}"
DEPTHS="${DEPTHS:-1024,4096,8192}"
THREADS="${THREADS:-2}"
DECODE="${DECODE:-32}"
MODELS_DIR="${MODELS_DIR:-$HOME/.cache/tessera/models}"
MODELS="${MODELS:-smollm2-135m-instruct-q4_1.gguf gemma-3-270m-q4_k_m.gguf}"
for bin in "$OLD" "$NEW"; do
  [ -x "$bin" ] || { echo "cpu_old_new.sh: $bin is not an executable" >&2; exit 2; }
done
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
echo "# old $OLD, new $NEW; $ROUNDS rounds; tessera bench -d $DEPTHS --decode $DECODE --threads $THREADS --kv-type f32 --attn dense"
for r in $(seq 1 "$ROUNDS"); do
  order="old new"
  [ $((r % 2)) -eq 0 ] && order="new old"
  for model in $MODELS; do
    for side in $order; do
      bin="$OLD"
      [ "$side" = new ] && bin="$NEW"
      echo "=== round $r $model $side $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
      /usr/bin/time -v -o "$OUT/time" "$bin" bench -m "$MODELS_DIR/$model" -d "$DEPTHS" --decode "$DECODE" \
        --threads "$THREADS" --kv-type f32 --attn dense --format csv > "$OUT/$model.$side.$r.csv" 2> /dev/null
      cat "$OUT/$model.$side.$r.csv"
      rss=$(awk -F': ' '/Maximum resident set size/ {print $2}' "$OUT/time")
      echo "peak_rss_kb $rss"
      echo "$rss" > "$OUT/$model.$side.$r.rss"
    done
  done
done
python3 - "$OUT" <<'EOF'
import csv, glob, os, sys
out = sys.argv[1]
rows = {}
rss = {}
for path in glob.glob(os.path.join(out, "*.csv")):
    model, side, _, _ = os.path.basename(path).rsplit(".", 3)
    for row in csv.DictReader(open(path)):
        r = rows.setdefault((model, int(row["depth"]), side), {"prefill": [], "decode": []})
        r["prefill"].append(float(row["prefill_tok_s"]))
        r["decode"].append(float(row["decode_tok_s"] or 0))
    rss.setdefault((model, side), []).append(int(open(path[:-4] + ".rss").read().strip() or 0))
print("\n| model | depth | prefill tok/s old | new | decode tok/s old | new | decode new/old (medians) | peak RSS MB old / new |")
print("|---|---:|---:|---:|---:|---:|---:|---|")
rng = lambda v: f"{min(v):.0f}-{max(v):.0f}" if min(v) >= 100 else f"{min(v):.1f}-{max(v):.1f}"
med = lambda v: sorted(v)[len(v) // 2]
for model, depth in sorted({(m, d) for m, d, _ in rows}):
    o, n = rows.get((model, depth, "old")), rows.get((model, depth, "new"))
    if not o or not n:
        continue
    ratio = med(n["decode"]) / med(o["decode"]) if med(o["decode"]) > 0 else float("nan")
    mem = f"{max(rss[(model, 'old')]) / 1024:.0f} / {max(rss[(model, 'new')]) / 1024:.0f}"
    print(f"| {model} | {depth} | {rng(o['prefill'])} | {rng(n['prefill'])} | {rng(o['decode'])} | "
          f"{rng(n['decode'])} | {ratio:.2f}x | {mem} |")
EOF
