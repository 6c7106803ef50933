#!/usr/bin/env python3
"""Timings of the Python module on a GPU (`scripts/gpu/run.sh python` runs both parts).

  python3 scripts/gpu/python_bench.py ops  [--seq 32768,131072] [--reps 5] [--cpp-csv FILE] [--md FILE] [--csv FILE]
      Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16, batch 1), inputs N(0, 1) as
      attention_gpu_bench --inputs random draws them, the bench's five patterns: per row the median of --reps
      CUDA-event timings (after two warm-ups) of tessera.ops.sparse_attention (the torch custom op: dispatch,
      DLPack, output allocation) and of the raw binding tessera._tessera.ops_attention (into a preallocated out),
      and, from the C++ bench's CSV (same shapes and patterns), its total ms (estimate + index + kernel) and path.
      Ratio = Python / C++ (goal: <= 1.03). VS and BS estimates depend on the data: their indexes are statistically,
      not exactly, alike (the density columns say how close).
  python3 scripts/gpu/python_bench.py ttft [--seq 32768,131072] [--attn dense,vs,trianglemix] [--layers N]
      A LlamaForCausalLM with Llama-3.1-8B's config and random bf16 weights (bench/gpu/hf_ttft_reference.py builds
      it), time to first token (one forward over the prompt with the KV cache, logits of the last position, to the
      host) unpatched (SDPA) and under tessera.hf.patch(model, attn=A) for each A, in the same process; one warm-up
      pass per configuration at the smallest length; best of --reps.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SPECS = {  # attention_gpu_bench's patterns (make_pattern) as --attn specs
    "dense": "dense",
    "ashape": "ashape:sink=128,local=4096",
    "triangle": "triangle:sink=8,local=512,last=128",
    "vs": "vs:v=1000,s=6096,last_q=64",
    "bs": "bs:top_k=100,block=64",
}


def cuda_ms(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def read_cpp(path: str) -> dict:
    rows = {}
    if path and Path(path).exists():
        with open(path) as f:
            for r in csv.DictReader(f):
                rows[(int(r["seq"]), r["pattern"])] = r
    return rows


def ops_bench(args) -> int:
    import tessera
    from tessera import _tessera, ops

    cpp = read_cpp(args.cpp_csv)
    dev = torch.cuda.get_device_name(0)
    lines = [f"device: {dev}; torch {torch.__version__}; C++ rows from {args.cpp_csv or '-'}", "",
             "| seq | pattern | C++ total ms | path | Python op ms | raw binding ms | op / C++ | binding / C++ |",
             "|---:|---|---:|---|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    out_rows = []
    for S in [int(s) for s in args.seq.split(",") if s]:
        g = torch.Generator(device="cuda").manual_seed(S)
        q = torch.randn(1, 32, S, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, 8, S, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, 8, S, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        out = torch.empty_like(q)
        stream = torch.cuda.current_stream().cuda_stream
        for name, spec in SPECS.items():
            op_ms = cuda_ms(lambda: ops.sparse_attention(q, k, v, spec), args.reps)
            raw_ms = cuda_ms(lambda: _tessera.ops_attention(q, k, v, out, spec, 0.0, 0, 0, 0, stream), args.reps)
            c = cpp.get((S, name))
            c_ms = float(c["total_ms"]) if c else float("nan")
            path = c["path"] if c else "-"
            row = (S, name, c_ms, path, op_ms, raw_ms, op_ms / c_ms, raw_ms / c_ms)
            out_rows.append(row)
            line = (f"| {S} | {name} | {c_ms:.3f} | {path} | {op_ms:.3f} | {raw_ms:.3f} | {op_ms / c_ms:.3f} | "
                    f"{raw_ms / c_ms:.3f} |")
            lines.append(line)
            print(line, flush=True)
        del q, k, v, out
        torch.cuda.empty_cache()
    if args.md:
        Path(args.md).write_text("\n".join(lines) + "\n")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("device,seq,pattern,cpp_total_ms,cpp_path,python_op_ms,raw_binding_ms,op_over_cpp,binding_over_cpp\n")
            for r in out_rows:
                f.write(f"\"{dev}\"," + ",".join(str(x) for x in r) + "\n")
    return 0


def ttft_bench(args) -> int:
    sys.path.insert(0, str(ROOT / "bench" / "gpu"))
    from hf_ttft_reference import LLAMA3_8B, build_model, forward_last_logits

    import tessera
    import tessera.hf

    seqs = [int(s) for s in args.seq.split(",") if s]
    configs = ["sdpa (unpatched)"] + [a for a in args.attn.split(",") if a]
    dev = torch.cuda.get_device_name(0)
    model = build_model(args.layers)
    vocab = LLAMA3_8B["vocab_size"]
    g = torch.Generator().manual_seed(1)
    prompts = {S: torch.randint(0, vocab, (1, S), generator=g) for S in seqs}
    lines = [f"device: {dev}; layers {args.layers or LLAMA3_8B['num_hidden_layers']}; best of {args.reps}", "",
             "| config | " + " | ".join(f"TTFT {S // 1024}K s" for S in seqs) + " | " +
             " | ".join(f"vs SDPA {S // 1024}K" for S in seqs) + " | peak GB |",
             "|---|" + "---:|" * (2 * len(seqs) + 1)]
    print("\n".join(lines), flush=True)
    results = {}
    with torch.inference_mode():
        for cfg in configs:
            if cfg.startswith("sdpa"):
                tessera.hf.unpatch(model)
            else:
                tessera.hf.patch(model, attn=cfg)
            warm = prompts[min(seqs)].cuda()
            forward_last_logits(model, warm)
            torch.cuda.synchronize()
            peak = 0.0
            for S in seqs:
                best = None
                try:
                    for _ in range(max(1, args.reps)):
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        logits = forward_last_logits(model, prompts[S].cuda())
                        t = time.perf_counter() - t0
                        assert torch.isfinite(logits).all(), "non-finite logits"
                        best = t if best is None else min(best, t)
                        peak = max(peak, torch.cuda.max_memory_allocated() / 1e9)
                except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
                    print(f"{cfg} at {S}: {str(e).splitlines()[0][:160]}", flush=True)
                results[(cfg, S)] = best
            base = [results.get((configs[0], S)) for S in seqs]
            mine = [results.get((cfg, S)) for S in seqs]
            fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            ratio = ["-" if (b is None or m is None) else f"{b / m:.2f}x" for b, m in zip(base, mine)]
            line = f"| {cfg} | " + " | ".join(fmt(m) for m in mine) + " | " + " | ".join(ratio) + f" | {peak:.1f} |"
            lines.append(line)
            print(line, flush=True)
    tessera.hf.unpatch(model)
    if args.md:
        Path(args.md).write_text("\n".join(lines) + "\n")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("device,config,seq,ttft_s\n")
            for (cfg, S), t in results.items():
                f.write(f"\"{dev}\",\"{cfg}\",{S},{'' if t is None else f'{t:.4f}'}\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["ops", "ttft"])
    ap.add_argument("--seq", default="32768,131072")
    ap.add_argument("--reps", type=int, default=0, help="ops: 5, ttft: 1")
    ap.add_argument("--cpp-csv", default="")
    ap.add_argument("--attn", default="dense,vs,trianglemix")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--md", default="")
    ap.add_argument("--csv", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("python_bench: no CUDA device", file=sys.stderr)
        return 1
    if args.what == "ops":
        args.reps = args.reps or 5
        return ops_bench(args)
    args.reps = args.reps or 1
    return ttft_bench(args)


if __name__ == "__main__":
    sys.exit(main())
