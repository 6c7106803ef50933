#!/usr/bin/env bash
# lm-evaluation-harness (PyPI lm-eval[api]) on the committed log-likelihood task tests/data/lm_eval (40 multiple-
# choice sentences), twice with the same weights: its `local-completions` model against `tessera serve` (echo +
# logprobs, the server's tokenizer through /tokenizer_info, /tokenize, /detokenize), and its `hf` model on the same
# GGUF through transformers (dequantized to f32). Prints both accuracies and the per-choice log-likelihood
# differences.
#   tests/server/lm_eval_compare.sh BUILD/src/tessera [PYTHON]
# PYTHON: one with lm-eval[api], gguf, accelerate, torch and transformers (scripts/setup.sh models puts them in
# ~/.cache/tessera/pyenv, the default).
# WEIGHTS=f32 (default): the server expands the GGUF's quantized blocks to f32 (TESSERA_WEIGHTS=f32), the weights
# transformers computes with, and keeps its KV cache in f32 (TESSERA_KV_TYPE=f32; the CPU default is f16);
# WEIGHTS=stored: it multiplies the stored Q4_1 blocks (a different model, ~2.5 points apart on this task).
# PARALLEL=N (default 2): the server runs the batched engine (--parallel N, the prompts' log-probabilities from its
# prefill) and lm-eval sends N requests at once (num_concurrent); PARALLEL=1: the single-sequence engine.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=$1
PY=${2:-$HOME/.cache/tessera/pyenv/bin/python}
PARALLEL=${PARALLEL:-2}
WEIGHTS=${WEIGHTS:-f32}
case $WEIGHTS in f32) SERVE_ENV=(TESSERA_WEIGHTS=f32 TESSERA_KV_TYPE=f32) ;; stored) SERVE_ENV=() ;; *) echo "WEIGHTS must be f32 or stored, got $WEIGHTS" >&2; exit 2 ;; esac
MODELS=${TESSERA_MODELS:-$HOME/.cache/tessera/models}
GGUF=smollm2-135m-instruct-q4_1.gguf
OUT=$(mktemp -d)
PORT=${PORT:-18799}
cd "$ROOT"
echo "lm_eval_compare: logs in $OUT (WEIGHTS=$WEIGHTS PARALLEL=$PARALLEL)"
LM_EVAL=("$PY" -m lm_eval --tasks tessera_tiny_mc --include_path tests/data/lm_eval --log_samples)
"${LM_EVAL[@]}" --model hf --model_args "pretrained=$MODELS,gguf_file=$GGUF,dtype=float32" --device cpu \
  --batch_size 8 --output_path "$OUT/hf" > "$OUT/hf.log" 2>&1 || { tail -20 "$OUT/hf.log"; exit 1; }
env "${SERVE_ENV[@]}" "$BIN" serve -m "$MODELS/$GGUF" --port "$PORT" --device cpu --parallel "$PARALLEL" --quiet \
  > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 60); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
"${LM_EVAL[@]}" --model local-completions \
  --model_args "base_url=http://127.0.0.1:$PORT/v1/completions,model=${GGUF%.gguf},num_concurrent=$PARALLEL" \
  --output_path "$OUT/tessera" > "$OUT/tessera.log" 2>&1 || { tail -20 "$OUT/tessera.log"; exit 1; }
"$PY" - "$OUT" "$WEIGHTS" "$PARALLEL" <<'PY'
import glob, json, sys
out, weights, parallel = sys.argv[1:4]
def load(d):
    return {s["doc_id"]: s for s in map(json.loads, open(glob.glob(f"{out}/{d}/*/samples_*.jsonl")[0]))}
hf, ts = load("hf"), load("tessera")
acc = lambda r: 100 * sum(s["acc"] for s in r.values()) / len(r)
d = sorted(abs(float(a[0]) - float(b[0])) for k in hf
           for a, b in zip(hf[k]["filtered_resps"], ts[k]["filtered_resps"]))
print(f"lm-eval tessera_tiny_mc: hf (transformers, f32) acc {acc(hf):.1f}, tessera serve --parallel {parallel} "
      f"({'f32' if weights == 'f32' else 'stored Q4_1'} weights) acc {acc(ts):.1f}; "
      f"|log-likelihood difference| median {d[len(d) // 2]:.4f}, max {d[-1]:.4f} over {len(d)} choices")
for k in sorted(hf):
    if hf[k]["acc"] != ts[k]["acc"]:
        print(f"  differs: {hf[k]['doc']['question']!r}: hf {[round(float(r[0]), 2) for r in hf[k]['filtered_resps']]}"
              f" tessera {[round(float(r[0]), 2) for r in ts[k]['filtered_resps']]}")
PY
