#!/usr/bin/env bash
# CI smoke test of `tessera eval` on the real SmolLM2-135M: a small task suite (dense and A-shape on the same
# cases), per-layer attention metrics and perplexity; checks the files written, their contents, --resume and
# --report-only, and the context-limit error.
#   tests/cli/eval_smoke.sh <path to the tessera binary>
set -euo pipefail
TESSERA=$1
MODELS=${TESSERA_MODELS:-$HOME/.cache/tessera/models}
MODEL=$MODELS/smollm2-135m-instruct-q4_1.gguf
if [ ! -f "$MODEL" ]; then
  if [ "${TESSERA_ALLOW_MISSING_MODELS:-0}" = 1 ]; then echo "skip: $MODEL is missing"; exit 77; fi
  echo "FAIL: $MODEL is missing (run scripts/setup.sh models)"; exit 1
fi
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$TESSERA" eval -m "$MODEL" --tasks niah_single,variable_tracking --lengths 1024 --depths 50 \
  --attn "ashape:sink=64,local=256" --answer-tokens 24 --layer-stats 512 --perplexity 512 -o "$OUT" > "$OUT/stdout.txt"

for f in results.json report.md heatmap_niah_single_dense.svg heatmap_niah_single_ashape-sink64-local256.svg \
         layer_stats.json layer_stats.md perplexity.json perplexity.md; do
  [ -s "$OUT/$f" ] || fail "$f was not written"
done
python3 - "$OUT" <<'PY'
import json, math, sys
out = sys.argv[1]
r = json.load(open(f"{out}/results.json"))
assert r["tessera_eval_results"] == 1, r.keys()
res = r["results"]
got = sorted((x["id"], x["policy"]) for x in res)
want = sorted((i, p) for i in ["niah_single/1024/d50/s0", "variable_tracking/1024/s0"]
              for p in ["dense", "ashape:sink=64,local=256"])
assert got == want, got
for x in res:
    assert x["score"] == (1.0 if x["pass"] else x["score"]) and 0 <= x["score"] <= 1, x
    assert x["expected"], x
needle = [x for x in res if x["id"].startswith("niah_single") and x["policy"] == "dense"][0]
assert needle["pass"], f"dense SmolLM2 missed the needle at 1K: {needle['output']!r} vs {needle['expected']}"
assert needle["expected"][0] in needle["output"]
ls = json.load(open(f"{out}/layer_stats.json"))["512"]["ashape:sink=64,local=256"]
assert len(ls) == 30, len(ls)  # SmolLM2-135M has 30 layers
for layer in ls:
    assert len(layer["heads"]) == 9
    for h in layer["heads"]:
        assert 0 < h["recall"] <= 1 + 1e-12 and 0 < h["density"] < 1 and h["rel_error"] >= 0, h
ppl = {x["policy"]: x["perplexity"] for x in json.load(open(f"{out}/perplexity.json"))["results"]}
assert set(ppl) == {"dense", "ashape:sink=64,local=256"}, ppl
assert 1 < ppl["dense"] < 100, ppl
# At 512 tokens a sink-64 + local-256 window drops keys, so its perplexity differs from dense.
assert ppl["ashape:sink=64,local=256"] != ppl["dense"], ppl
print("results, layer stats and perplexity files check out; dense perplexity %.3f" % ppl["dense"])
PY
grep -q "^| niah_single |" "$OUT/report.md" || fail "report.md has no niah_single row"
grep -q "Agreement" "$OUT/report.md" || fail "report.md has no agreement table"
[ "$(grep -c '<rect' "$OUT/heatmap_niah_single_dense.svg")" -ge 1 ] || fail "the heatmap has no cells"

# --resume runs nothing new: the results are kept as they were.
cp "$OUT/results.json" "$OUT/before.json"
"$TESSERA" eval -m "$MODEL" --tasks niah_single,variable_tracking --lengths 1024 --depths 50 \
  --attn "ashape:sink=64,local=256" --answer-tokens 24 -o "$OUT" --resume > /dev/null 2> "$OUT/resume.err"
grep -q "resuming with 4 results" "$OUT/resume.err" || fail "resume did not load the 4 results"
grep -q "\] niah_single" "$OUT/resume.err" && fail "resume re-ran a case"
python3 -c "import json,sys; a=json.load(open(sys.argv[1]))['results']; b=json.load(open(sys.argv[2]))['results']; assert a==b" \
  "$OUT/before.json" "$OUT/results.json" || fail "resume changed the results"
rm "$OUT/report.md"
"$TESSERA" eval -m "$MODEL" -o "$OUT" --report-only > /dev/null
[ -s "$OUT/report.md" ] || fail "--report-only did not rewrite report.md"

# Over the context: a clear error, nothing run.
set +e
msg=$("$TESSERA" eval -m "$MODEL" --lengths 9000 -o "$OUT/over" 2>&1)
rc=$?
set -e
[ $rc -eq 1 ] || fail "expected exit 1 for a length over the context, got $rc"
[ "$msg" = "tessera: error: eval: length 9000 exceeds the context of Smollm2 135M 8k Lc100K Mix1 Ep2 (8192 tokens)" ] ||
  fail "unexpected error: $msg"
# `tessera run --needle` puts the needle at --needle-depth (a fraction of the prompt): with streaming memory the run
# names the evicted block that holds it, whose first position must sit near that depth.
"$TESSERA" run -m "$MODEL" --device cpu --needle 1024 --needle-depth 0.5 --chat -n 1 --stream ltri \
  --stream-sinks 16 --stream-local 128 --stream-block 32 --stream-chunk 64 --stream-top-k 2 --stream-last-chunk 32 \
  > "$OUT/needle.txt"
python3 - "$OUT/needle.txt" <<'PY' || fail "the needle is not at half the prompt: $(grep -E 'prompt:|needle' "$OUT/needle.txt")"
import re, sys
out = open(sys.argv[1]).read()
n = int(re.search(r"^prompt: ([\d,]+) tokens$", out, re.M).group(1).replace(",", ""))
b = int(re.search(r"needle in evicted block (\d+) of \d+", out).group(1))
first = 16 + 32 * b  # sinks + b blocks
assert 0.4 <= first / n <= 0.6, (first, n)
PY
echo "eval smoke: ok"
