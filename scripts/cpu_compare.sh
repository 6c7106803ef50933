#!/usr/bin/env bash
# The CPU side of "old commit beside new": `tessera bench` (prefill at each depth, dense and a sparse policy, and
# decode) of two builds on both real models, the two binaries alternating round by round so that load on the machine
# falls on both alike. Prints each run's table and a summary of new / old per row (best of the rounds).
#   scripts/cpu_compare.sh OLD_TESSERA NEW_TESSERA [ROUNDS]
# Env: DEPTHS (default 1024,4096,8192), ATTN (default trianglemix), DECODE (tokens, default 16), TESSERA_MODELS.
# Build the old binary from a worktree: git worktree add /tmp/old COMMIT && cmake -S /tmp/old -B /tmp/old/build -G Ninja
#   -DCMAKE_BUILD_TYPE=Release -DTESSERA_CUDA=OFF -DTESSERA_BUILD_TESTS=OFF -DTESSERA_BUILD_BENCH=OFF &&
#   cmake --build /tmp/old/build --target tessera
set -euo pipefail
OLD="$1"
NEW="$2"
ROUNDS="${3:-2}"
MODELS="${TESSERA_MODELS:-$HOME/.cache/tessera/models}"
DEPTHS="${DEPTHS:-1024,4096,8192}"
ATTN="${ATTN:-trianglemix}"
DECODE="${DECODE:-16}"
OUT="$(mktemp -d)"
for model in smollm2-135m-instruct-q4_1.gguf gemma-3-270m-q4_k_m.gguf; do
  for r in $(seq 1 "$ROUNDS"); do
    for side in old new; do
      bin="$OLD"
      [ "$side" = new ] && bin="$NEW"
      "$bin" bench -m "$MODELS/$model" -d "$DEPTHS" --attn "$ATTN" --decode "$DECODE" --format csv \
        > "$OUT/$model.$side.$r.csv" 2> /dev/null
      echo "== $model $side round $r"
      cat "$OUT/$model.$side.$r.csv"
    done
  done
done
python3 - "$OUT" <<'EOF'
import csv, glob, os, sys
out = sys.argv[1]
best = {}
for path in glob.glob(os.path.join(out, "*.csv")):
    model, side, _, _ = os.path.basename(path).rsplit(".", 3)
    for row in csv.DictReader(open(path)):
        key = (model, int(row["depth"]), row["policy"])
        b = best.setdefault(key, {})
        p, d = float(row["prefill_s"]), float(row.get("decode_tok_s") or 0)
        o = b.setdefault(side, [1e30, 0.0])
        o[0] = min(o[0], p)
        o[1] = max(o[1], d)
print("\n| model | depth | policy | prefill old (s) | prefill new (s) | new/old | decode old (tok/s) | decode new (tok/s) |")
print("|---|---:|---|---:|---:|---:|---:|---:|")
for (model, depth, policy), b in sorted(best.items()):
    if "old" not in b or "new" not in b:
        continue
    (po, do), (pn, dn) = b["old"], b["new"]
    dec = f"{do:.1f} | {dn:.1f}" if do > 0 else "- | -"
    print(f"| {model.split('-')[0]} | {depth} | {policy} | {po:.3f} | {pn:.3f} | {pn / po:.3f} | {dec} |")
EOF
