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
    ap.add_argument("--json", help="also write the rows to this file")
    a = ap.parse_args()
    depths = [int(d) for d in a.depths.split(",")]

    busy = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(a.busy)]
    results = []
    try:
        for model in a.model:
            env = dict(os.environ)
            env["OPENBLAS_NUM_THREADS"] = "1"
            t_out, t_rss = measured([a.tessera, "bench", "-m", model, "-d", ",".join(map(str, depths)), "--decode",
                                     str(a.decode), "--reps", str(a.reps), "--threads", str(a.threads), "--format",
                                     "json"], env)
            t_rows = {r["depth"]: r for r in json.loads(t_out) if r["policy"] == "dense"}
            child = {"model": model, "depths": depths, "decode": a.decode, "threads": a.threads, "reps": a.reps,
                     "text": a.text}
            l_out, l_rss = measured([sys.executable, "-c", LLAMA_CHILD, json.dumps(child)])
            l_rows = {r["depth"]: r for r in json.loads(l_out.strip().splitlines()[-1])}
            name = os.path.basename(model)
            print(f"\n{name}: {a.threads} threads, decode {a.decode} tokens after each prompt"
                  + (f", {a.busy} busy process(es) beside" if a.busy else ""))
            print(f"| {'':<22} | {'tessera':>9} | {'llama.cpp':>9} | {'ratio':>6} |")
            print(f"|{'-' * 24}|{'-' * 11}|{'-' * 11}|{'-' * 8}|")
            for d in depths:
                for key, label in (("prefill_tok_s", f"prefill {d} tok/s"), ("decode_tok_s", f"decode @{d} tok/s")):
                    t, l = t_rows[d][key], l_rows[d][key]
                    print(f"| {label:<22} | {t:9.1f} | {l:9.1f} | {t / l:6.2f} |")
                    results.append({"model": name, "metric": key, "depth": d, "tessera": t, "llama_cpp": l,
                                    "ratio": t / l, "threads": a.threads, "busy": a.busy})
            print(f"| {'peak RSS MB':<22} | {t_rss:9.0f} | {l_rss:9.0f} | {t_rss / l_rss:6.2f} |")
            results.append({"model": name, "metric": "peak_rss_mb", "tessera": t_rss, "llama_cpp": l_rss,
                            "ratio": t_rss / l_rss, "threads": a.threads, "busy": a.busy})
    finally:
        for p in busy:
            p.kill()
            p.wait()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
