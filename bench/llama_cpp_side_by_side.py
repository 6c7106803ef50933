#!/usr/bin/env python3
"""tessera beside llama.cpp (llama-cpp-python) on the same GGUF, same threads, llama.cpp with flash attention on.

    build/venv/bin/python bench/llama_cpp_side_by_side.py --tessera build/release/src/tessera \
        --model ~/.cache/tessera/models/smollm2-135m-instruct-q4_1.gguf \
        --model ~/.cache/tessera/models/gemma-3-270m-q4_k_m.gguf \
        --depths 1024,4096,8192,16384 --threads 1,2 --busy-depths 1024 --kv-types f32,f16 --perplexity 1024

One row per (model, thread count, depth): the prefill tokens/s of a prompt of that many tokens and the decode tokens/s
of --decode tokens after it, and each side's peak RSS (its process's ru_maxrss: every row runs each side in a process
of its own, one after the other, so they never share the cores). The sides alternate from row to row (tessera first,
then llama.cpp first, ...), so on a shared machine a change of load falls on both; each row prints the 1-minute load
average over it. A depth past the model's context is skipped; one that leaves no room for the decode tokens is cut
to context - decode on both sides. Ratios are tessera / llama.cpp (> 1: tessera faster; RSS < 1: tessera smaller).

--threads 1,2 runs every row at each thread count (--max-depth-2t D skips depths above D for more than one thread).
--busy-depths 1024 adds rows at those depths with --busy-procs `yes > /dev/null` processes running beside both sides
(a core taken by another process); --busy N keeps N such processes beside every row. --kv-types f32,f16 runs
tessera once per CPU KV cache type (--kv-type). --rounds N runs each row's sides N times (best rate, largest RSS).
--perplexity N: the perplexity of the first N tokens of --text (llama.cpp's tokenization, fed as ids to both) from
llama.cpp's own logits (logits_all) and from tessera's at each --perplexity-kv-types entry (default --kv-types),
plus tessera's f32 expansion of the same file with an f32 KV cache (TESSERA_WEIGHTS=f32: the reference), through
bench/perplexity_bench (built beside the tessera binary: build/<dir>/bench/perplexity_bench). Needs
llama-cpp-python: `bash scripts/setup.sh peers` builds it into build/venv (llama.cpp from source for this CPU).

The tessera binary must be a CPU build (a preset built without nvcc, e.g. build/ci or build/release on this machine): a CUDA-enabled binary maps
cuBLAS/cuBLASLt/cuDNN/NCCL/cudart at start, ~150-180 MB of RSS before the model loads even when it runs on the CPU
(`tessera inspect` of SmolLM2: 237 MB against 59 MB), which is not the CPU engine's and is what made the 4K rows read
1.42-1.58x llama.cpp's at de7b84a. The script refuses such a binary unless --allow-cuda-build is given.
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


def context_length(tessera, model):
    """The model's context, from `tessera inspect` ("..., context 8192")."""
    out = subprocess.run([tessera, "inspect", model], capture_output=True, text=True, check=True).stdout
    for part in out.replace("\n", ",").split(","):
        part = part.strip()
        if part.startswith("context "):
            return int(part.split()[1])
    sys.exit(f"tessera inspect {model}: no context length in its output")


def cuda_libraries(tessera):
    """The CUDA libraries the tessera binary links (from ldd; empty for a CPU build)."""
    try:
        out = subprocess.run(["ldd", tessera], capture_output=True, text=True).stdout
    except OSError:
        return []
    names = ("libcudart", "libcublas", "libcudnn", "libnccl", "libcuda.")
    return sorted({line.split()[0] for line in out.splitlines() if line.strip().startswith(names)})


def load_avg():
    return os.getloadavg()[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tessera", default="build/release/src/tessera")
    ap.add_argument("--model", required=True, action="append", help="GGUF file (repeat for several)")
    ap.add_argument("--depths", default="1024,4096")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--threads", default=str(os.cpu_count()), help="thread counts, comma-separated (each a row set)")
    ap.add_argument("--reps", type=int, default=1, help="prefill repetitions (best of)")
    ap.add_argument("--text", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md"),
                    help="text llama.cpp's prompts are cut from (repeated to length; the content does not change "
                         "the rates)")
    ap.add_argument("--busy", type=int, default=0, help="`yes > /dev/null` processes running beside every row")
    ap.add_argument("--busy-depths", default="", help="extra rows at these depths (each thread count) with "
                    "--busy-procs `yes > /dev/null` processes beside both sides")
    ap.add_argument("--busy-procs", type=int, default=1)
    ap.add_argument("--max-depth-2t", type=int, default=0, help="skip depths above this for thread counts > 1 "
                    "(0: none skipped)")
    ap.add_argument("--kv-types", default="", help="tessera's CPU KV cache types to run (comma-separated; default: "
                    "tessera's default)")
    ap.add_argument("--rounds", type=int, default=1, help="run each row's sides this many times (best of)")
    ap.add_argument("--perplexity", type=int, default=0, help="also the perplexity of this many tokens of --text")
    ap.add_argument("--perplexity-kv-types", default="", help="the KV types of the perplexity rows (default: "
                    "--kv-types)")
    ap.add_argument("--skip-speed", action="store_true", help="only the perplexity")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--allow-cuda-build", action="store_true", help="run a tessera binary that links CUDA (its peak "
                    "RSS then includes the CUDA libraries)")
    a = ap.parse_args()
    cuda = cuda_libraries(a.tessera)
    if cuda and not a.allow_cuda_build:
        sys.exit(f"{a.tessera} links {', '.join(cuda)}: its peak RSS would include ~150-180 MB of CUDA libraries that "
                 f"a CPU run does not use; pass a CPU build (configured without nvcc, e.g. build/ci) or "
                 f"--allow-cuda-build")
    depths = [int(d) for d in a.depths.split(",") if d]
    busy_depths = [int(d) for d in a.busy_depths.split(",") if d]
    thread_counts = [int(t) for t in str(a.threads).split(",") if t]
    a.threads = thread_counts[0]  # the perplexity runs' threads
    kv_types = [k for k in a.kv_types.split(",") if k] or [""]

    busy_all = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(a.busy)]
    results = []
    row_index = 0

    def run_row(model, env, threads, depth, busy):
        """One row: each side in its own process, sides alternating (tessera first on even rows), best of rounds."""
        nonlocal row_index
        procs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(busy)]
        best, rss, loads = {}, {}, [load_avg()]
        try:
            for rnd in range(max(1, a.rounds)):
                sides = [("tessera", kv) for kv in kv_types] + [("llama.cpp", None)]
                if (row_index + rnd) % 2:
                    sides.reverse()
                for side, kv in sides:
                    if side == "tessera":
                        cmd = [a.tessera, "bench", "-m", model, "-d", str(depth), "--decode", str(a.decode),
                               "--reps", str(a.reps), "--threads", str(threads), "--format", "json"]
                        if kv:
                            cmd += ["--kv-type", kv]
                        out, peak = measured(cmd, env)
                        r = [x for x in json.loads(out) if x["policy"] == "dense"][0]
                        name = "tessera" + (f" kv {kv}" if kv else "")
                    else:
                        child = {"model": model, "depths": [depth], "decode": a.decode, "threads": threads,
                                 "reps": a.reps, "text": a.text}
                        out, peak = measured([sys.executable, "-c", LLAMA_CHILD, json.dumps(child)])
                        r = json.loads(out.strip().splitlines()[-1])[0]
                        name = "llama.cpp"
                    b = best.setdefault(name, {"prefill_tok_s": 0.0, "decode_tok_s": 0.0})
                    for key in b:
                        b[key] = max(b[key], r[key])
                    rss[name] = max(rss.get(name, 0), peak)
                    loads.append(load_avg())
        finally:
            for p in procs:
                p.kill()
                p.wait()
        row_index += 1
        lc = best["llama.cpp"]
        rows = []
        for name in best:
            if name == "llama.cpp":
                continue
            t = best[name]
            row = {"model": os.path.basename(model), "side": name, "threads": threads, "busy": busy + a.busy,
                   "tessera_cuda_libraries": cuda,
                   "depth": depth, "load_min": min(loads), "load_max": max(loads)}
            for key in ("prefill_tok_s", "decode_tok_s"):
                row[key] = t[key]
                row["llama_cpp_" + key] = lc[key]
                row[key + "_ratio"] = t[key] / lc[key]
            row["peak_rss_mb"], row["llama_cpp_peak_rss_mb"] = rss[name], rss["llama.cpp"]
            row["peak_rss_ratio"] = rss[name] / rss["llama.cpp"]
            rows.append(row)
            print(f"| {row['model'][:24]:<24} | {name:<13} | {threads:>2} | {row['busy']:>4} | {depth:>6} | "
                  f"{t['prefill_tok_s']:7.1f} | {lc['prefill_tok_s']:7.1f} | {row['prefill_tok_s_ratio']:5.2f} | "
                  f"{t['decode_tok_s']:6.1f} | {lc['decode_tok_s']:6.1f} | {row['decode_tok_s_ratio']:5.2f} | "
                  f"{rss[name]:5.0f} | {rss['llama.cpp']:5.0f} | {row['peak_rss_ratio']:4.2f} | "
                  f"{min(loads):4.1f}-{max(loads):4.1f} |", flush=True)
        return rows

    try:
        for model in a.model:
            name = os.path.basename(model)
            env = dict(os.environ)
            env["OPENBLAS_NUM_THREADS"] = "1"
            if not a.skip_speed:
                ctx = context_length(a.tessera, model)
                print(f"\n{name}: context {ctx}; decode {a.decode} tokens after each prompt; best of "
                      f"{max(1, a.rounds)} round(s), sides alternating; ratio = tessera / llama.cpp (RSS: < 1 is "
                      f"smaller); load = the 1-minute load average over the row")
                print(f"| {'model':<24} | {'side':<13} | th | busy | {'depth':>6} | prefill | llama.c | ratio | "
                      f"decode | llama. | ratio | RSS   | llama | rat. | load      |")
                print("|" + "|".join("-" * w for w in (26, 15, 4, 6, 8, 9, 9, 7, 8, 8, 7, 7, 7, 6, 11)) + "|")
                for threads in thread_counts:
                    for depth in depths:
                        if threads > 1 and a.max_depth_2t and depth > a.max_depth_2t:
                            continue
                        if depth > ctx:
                            print(f"| {name[:24]:<24} | depth {depth} skipped: past the model's context ({ctx}) |")
                            continue
                        # A prompt that leaves no room for the decode tokens is cut to ctx - decode (both sides).
                        results += run_row(model, env, threads, min(depth, ctx - a.decode), 0)
                for threads in thread_counts:
                    for depth in busy_depths:
                        results += run_row(model, env, threads, min(depth, ctx - a.decode), a.busy_procs)
            if a.perplexity:
                ppl_kv = [k for k in a.perplexity_kv_types.split(",") if k] or kv_types
                results += perplexity(a, model, name, ppl_kv, env)
    finally:
        for p in busy_all:
            p.kill()
            p.wait()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
