#!/usr/bin/env python3
"""Where the stored weights' perplexity excess comes from: one tensor class at a time.

    build/venv/bin/python bench/perplexity_classes.py --scorer build/h4-rel/bench/perplexity_bench \
        --model ~/.cache/tessera/models/smollm2-135m-instruct-q4_1.gguf --text README.md --tokens 1024

For each model: llama.cpp's perplexity from its own logits (llama-cpp-python, flash attention on; its tokens are
the ids everything below scores), tessera's f32 expansion (TESSERA_WEIGHTS=f32), the kept types with int8
activations everywhere (TESSERA_QACT_X2=none), then the kept types with ONE class of tensors expanded to f32
(TESSERA_WEIGHTS=f32:CLASS: that class's products take f32 activations, its weights' values unchanged), then with
one class on two-level int8 activations (TESSERA_QACT_X2=CLASS), then the default (no variable), all with the same
KV type (--kv-type, default f32). Prints one table per model: perplexity, vs the f32 expansion, vs llama.cpp, and
the share of the int8 excess that the class removes ((int8 - row) / (int8 - f32 expansion)).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_cpp_side_by_side import LLAMA_PPL_CHILD  # noqa: E402

# Tensor-name parts of each class (GGUF names). SmolLM2's output head is its tied embedding (token_embd).
CLASSES = [("attn_q", "attn_q."), ("attn_k", "attn_k."), ("attn_v", "attn_v."), ("attn_output", "attn_output"),
           ("ffn_gate", "ffn_gate"), ("ffn_up", "ffn_up"), ("ffn_down", "ffn_down"),
           ("output head", "output.weight,token_embd")]


def score(scorer, model, ids, kv, threads, env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("TESSERA_WEIGHTS", "TESSERA_QACT_X2")}
    env.update(env_extra)
    out = subprocess.run([scorer, model, ids, "--kv-type", kv, "--threads", str(threads)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["perplexity"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scorer", required=True, help="build/<dir>/bench/perplexity_bench")
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--text", default="README.md")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--kv-type", default="f32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--x2-rows", action="store_true", help="also one row per class on two-level int8 activations")
    ap.add_argument("--no-classes", action="store_true", help="leave out the per-class f32 rows")
    ap.add_argument("--extra", action="append", default=[],
                    help="LABEL=VAR=VALUE[;VAR=VALUE]: one more row with these environment variables")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    results = []
    for model in a.model:
        name = os.path.basename(model)
        with tempfile.TemporaryDirectory() as tmp:
            ids = os.path.join(tmp, "ids.txt")
            child = {"model": model, "tokens": a.tokens, "threads": a.threads, "text": a.text, "ids_out": ids}
            out = subprocess.run([sys.executable, "-c", LLAMA_PPL_CHILD, json.dumps(child)], check=True,
                                 capture_output=True, text=True).stdout
            ref = json.loads(out.strip().splitlines()[-1])["perplexity"]
            runs = [("f32 expansion", {"TESSERA_WEIGHTS": "f32"}),
                    ("kept, int8 activations", {"TESSERA_QACT_X2": "none"})]
            if not a.no_classes:
                runs += [(f"kept, {c} f32", {"TESSERA_WEIGHTS": "f32:" + parts, "TESSERA_QACT_X2": "none"})
                         for c, parts in CLASSES]
            if a.x2_rows:
                runs += [(f"kept, {c} int8x2", {"TESSERA_QACT_X2": parts}) for c, parts in CLASSES]
                runs += [("kept, all int8x2", {"TESSERA_QACT_X2": ",".join(p for _, p in CLASSES)})]
            for e in a.extra:
                label, _, assigns = e.partition("=")
                runs.append((label, dict(kv.split("=", 1) for kv in assigns.split(";") if kv)))
            runs.append(("kept, default", {}))
            rows = [(label, score(a.scorer, model, ids, a.kv_type, a.threads, env)) for label, env in runs]
        base, int8 = rows[0][1], rows[1][1]
        print(f"\n{name}: perplexity of {a.tokens} tokens of {os.path.basename(a.text)} (llama.cpp's tokens), "
              f"kv {a.kv_type}; llama.cpp (its logits) {ref:.4f} ({100 * (ref / base - 1):+.2f}% vs f32 exp.)")
        print(f"| {'':<32} | {'perplexity':>10} | {'vs f32 exp.':>11} | {'vs llama.cpp':>12} | {'excess removed':>14} |")
        print(f"|{'-' * 34}|{'-' * 12}|{'-' * 13}|{'-' * 14}|{'-' * 16}|")
        for label, p in rows:
            removed = (int8 - p) / (int8 - base) if int8 != base else float("nan")
            print(f"| {label:<32} | {p:10.4f} | {100 * (p / base - 1):+10.2f}% | {100 * (p / ref - 1):+11.2f}% | "
                  f"{100 * removed:13.0f}% |")
            results.append({"model": name, "text": os.path.basename(a.text), "row": label, "perplexity": p,
                            "vs_f32_expansion": p / base, "vs_llama_cpp": p / ref})
        sys.stdout.flush()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
