#!/usr/bin/env python3
"""tessera beside llama.cpp (llama-cpp-python) on the same GGUF, same threads, llama.cpp with flash attention on.

    build/venv/bin/python bench/llama_cpp_side_by_side.py --tessera build/release/src/tessera \
        --model ~/.cache/tessera/models/smollm2-135m-instruct-q4_1.gguf --depths 1024,4096 --threads 2

For each depth: prefill tokens/s of a prompt of that many tokens, and decode tokens/s of --decode tokens after it;
then the peak RSS of each side's process. Each side runs in a process of its own (the peak RSS is that process's
ru_maxrss), one after the other, so they never share the cores. Prints one table with the ratios tessera / llama.cpp
(> 1: tessera faster; for RSS < 1: tessera smaller). --busy N starts N `yes > /dev/null` processes beside both runs
(decode with a core taken by another process). Needs llama-cpp-python: `bash scripts/setup.sh peers` builds it into
build/venv (llama.cpp from source for this CPU, ~10 minutes on 2 cores).

--kv-types f32,f16 runs tessera once per CPU KV cache type (--kv-type). --rounds N alternates the two sides N times
(tessera, llama.cpp, tessera, ...) and keeps each one's best rate and its largest RSS: on a shared machine the load
then falls on both alike. --perplexity N: the perplexity of the first N tokens of --text (llama.cpp's tokenization,
fed as ids to both) from llama.cpp's own logits (logits_all) and from tessera's at each --kv-types entry, plus
tessera's f32 expansion of the same file with an f32 KV cache (TESSERA_WEIGHTS=f32: the reference), through
bench/perplexity_bench (built beside the tessera binary: build/<dir>/bench/perplexity_bench).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

LLAMA_CHILD = r"""
import json, sys, time
try:
    from llama_cpp import Llama
except ImportError:
    sys.exit("bench/llama_cpp_side_by_side.py: llama-cpp-python is missing; run `bash scripts/setup.sh peers` and "
             "use build/venv/bin/python")
args = json.loads(sys.argv[1])
depths, decode, threads = args["depths"], args["decode"], args["threads"]
llm = Llama(model_path=args["model"], n_ctx=max(depths) + decode + 16, n_threads=threads, n_threads_batch=threads,
            n_batch=2048, n_ubatch=512, flash_attn=True, verbose=False, logits_all=False)
text = open(args["text"], encoding="utf-8", errors="replace").read()
toks = llm.tokenize(text.encode("utf-8"), add_bos=True)
while len(toks) < max(depths) + decode:
    toks = toks + toks[1:]
rows = []
for depth in depths:
    best = 1e30
    for _ in range(args["reps"]):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(toks[:depth])
        best = min(best, time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(decode):
        llm.eval([toks[depth + i]])
    dt = time.perf_counter() - t0
    rows.append({"depth": depth, "prefill_tok_s": depth / best, "decode_tok_s": decode / dt})
print(json.dumps(rows))
"""

LLAMA_PPL_CHILD = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
args = json.loads(sys.argv[1])
n = args["tokens"]
llm = Llama(model_path=args["model"], n_ctx=n + 16, n_threads=args["threads"], n_threads_batch=args["threads"],
            n_batch=2048, n_ubatch=512, flash_attn=True, verbose=False, logits_all=True)
text = open(args["text"], encoding="utf-8", errors="replace").read()
toks = llm.tokenize(text.encode("utf-8"), add_bos=True)
while len(toks) < n:
    toks = toks + toks[1:]
toks = toks[:n]
llm.eval(toks)
logits = np.array(llm.scores[:n], dtype=np.float64)
m = logits.max(axis=1, keepdims=True)
lse = (m[:, 0] + np.log(np.exp(logits - m).sum(axis=1)))
nll = float(np.mean(lse[:-1] - logits[np.arange(n - 1), toks[1:]]))
open(args["ids_out"], "w").write(" ".join(map(str, toks)) + "\n")
print(json.dumps({"tokens": n, "nll": nll, "perplexity": float(np.exp(nll))}))
"""


def measured(cmd, env=None):
    """stdout and peak RSS (MB) of cmd, through os.wait4's rusage of that child alone."""
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, text=True)
        stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)  # reap it ourselves: its own rusage
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            sys.exit(f"{' '.join(cmd[:3])} ... failed ({proc.returncode}):\n{err.read()[-3000:]}")
    return stdout, usage.ru_maxrss / 1024.0


def perplexity(a, model, name, kv_types, env):
    """llama.cpp's perplexity from its own logits, then tessera's on the same ids (each KV type; the f32 expansion)."""
    scorer = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(a.tessera))), "bench", "perplexity_bench")
    if not os.path.exists(scorer):
        sys.exit(f"--perplexity needs {scorer} (cmake --build <dir> --target perplexity_bench)")
    with tempfile.TemporaryDirectory() as tmp:
        ids = os.path.join(tmp, "ids.txt")
        child = {"model": model, "tokens": a.perplexity, "threads": a.threads, "text": a.text, "ids_out": ids}
        out, _ = measured([sys.executable, "-c", LLAMA_PPL_CHILD, json.dumps(child)])
        ref = json.loads(out.strip().splitlines()[-1])
        rows = [("llama.cpp (its logits)", ref["perplexity"])]
        runs = [(f"tessera f32 expansion, kv f32", "f32", True)]
        runs += [(f"tessera as stored, kv {kv or 'default'}", kv, False) for kv in kv_types]
        for label, kv, expand in runs:
            e = dict(env)
            if expand:
                e["TESSERA_WEIGHTS"] = "f32"
            cmd = [scorer, model, ids, "--threads", str(a.threads)] + (["--kv-type", kv] if kv else [])
            o, _ = measured(cmd, e)
            rows.append((label, json.loads(o.strip().splitlines()[-1])["perplexity"]))
    base = rows[1][1]
    print(f"\n{name}: perplexity of {a.perplexity} tokens of {os.path.basename(a.text)} (llama.cpp's tokens)")
    print(f"| {'':<34} | {'perplexity':>10} | {'vs llama.cpp':>12} | {'vs f32 exp.':>11} |")
    print(f"|{'-' * 36}|{'-' * 12}|{'-' * 14}|{'-' * 13}|")
    out_rows = []
    for label, p in rows:
        print(f"| {label:<34} | {p:10.4f} | {100 * (p / ref['perplexity'] - 1):+11.2f}% | {100 * (p / base - 1):+10.2f}% |")
        out_rows.append({"model": name, "metric": "perplexity", "side": label, "tokens": a.perplexity, "value": p,
                         "vs_llama_cpp": p / ref["perplexity"], "vs_f32_expansion": p / base})
    return out_rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tessera", default="build/release/src/tessera")
    ap.add_argument("--model", required=True, action="append", help="GGUF file (repeat for several)")
    ap.add_argument("--depths", default="1024,4096")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=1, help="prefill repetitions (best of)")
    ap.add_argument("--text", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md"),
                    help="text llama.cpp's prompts are cut from (repeated to length; the content does not change "
                         "the rates)")
    ap.add_argument("--busy", type=int, default=0, help="`yes > /dev/null` processes running beside both")
    ap.add_argument("--kv-types", default="", help="tessera's CPU KV cache types to run (comma-separated; default: "
                    "tessera's default)")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the two sides this many times (best of)")
    ap.add_argument("--perplexity", type=int, default=0, help="also the perplexity of this many tokens of --text")
    ap.add_argument("--skip-speed", action="store_true", help="only the perplexity")
    ap.add_argument("--json", help="also write the rows to this file")
    a = ap.parse_args()
    depths = [int(d) for d in a.depths.split(",")]
    kv_types = [k for k in a.kv_types.split(",") if k] or [""]

    busy = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(a.busy)]
    results = []
    try:
        for model in a.model:
            name = os.path.basename(model)
            env = dict(os.environ)
            env["OPENBLAS_NUM_THREADS"] = "1"
            if not a.skip_speed:
                best = {}  # side -> {depth: row}, rss
                rss = {}

                def keep(side, rows, peak):
                    b = best.setdefault(side, {})
                    for r in rows:
                        d = r["depth"]
                        if d not in b:
                            b[d] = dict(r)
                        else:
                            for key in ("prefill_tok_s", "decode_tok_s"):
                                b[d][key] = max(b[d][key], r[key])
                    rss[side] = max(rss.get(side, 0), peak)

                for _ in range(max(1, a.rounds)):
                    for kv in kv_types:
                        cmd = [a.tessera, "bench", "-m", model, "-d", ",".join(map(str, depths)), "--decode",
                               str(a.decode), "--reps", str(a.reps), "--threads", str(a.threads), "--format", "json"]
                        if kv:
                            cmd += ["--kv-type", kv]
                        t_out, t_rss = measured(cmd, env)
                        keep("tessera" + (f" kv {kv}" if kv else ""),
                             [r for r in json.loads(t_out) if r["policy"] == "dense"], t_rss)
                    child = {"model": model, "depths": depths, "decode": a.decode, "threads": a.threads,
                             "reps": a.reps, "text": a.text}
                    l_out, l_rss = measured([sys.executable, "-c", LLAMA_CHILD, json.dumps(child)])
                    keep("llama.cpp", json.loads(l_out.strip().splitlines()[-1]), l_rss)
                sides = [k for k in best if k != "llama.cpp"]
                print(f"\n{name}: {a.threads} threads, decode {a.decode} tokens after each prompt, best of "
                      f"{max(1, a.rounds)} alternating round(s)" + (f", {a.busy} busy process(es) beside" if a.busy else ""))
                for side in sides:
                    print(f"\n{side}:")
                    print(f"| {'':<22} | {'tessera':>9} | {'llama.cpp':>9} | {'ratio':>6} |")
                    print(f"|{'-' * 24}|{'-' * 11}|{'-' * 11}|{'-' * 8}|")
                    for d in depths:
                        for key, label in (("prefill_tok_s", f"prefill {d} tok/s"), ("decode_tok_s", f"decode @{d} tok/s")):
                            t, l = best[side][d][key], best["llama.cpp"][d][key]
                            print(f"| {label:<22} | {t:9.1f} | {l:9.1f} | {t / l:6.2f} |")
                            results.append({"model": name, "side": side, "metric": key, "depth": d, "tessera": t,
                                            "llama_cpp": l, "ratio": t / l, "threads": a.threads, "busy": a.busy})
                    t_rss, l_rss = rss[side], rss["llama.cpp"]
                    print(f"| {'peak RSS MB':<22} | {t_rss:9.0f} | {l_rss:9.0f} | {t_rss / l_rss:6.2f} |")
                    results.append({"model": name, "side": side, "metric": "peak_rss_mb", "tessera": t_rss,
                                    "llama_cpp": l_rss, "ratio": t_rss / l_rss, "threads": a.threads, "busy": a.busy})
            if a.perplexity:
                results += perplexity(a, model, name, kv_types, env)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
