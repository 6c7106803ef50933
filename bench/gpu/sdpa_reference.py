#!/usr/bin/env python3
"""Torch SDPA timings on the shapes of attention_gpu_bench, for comparison with tessera's dense kernel.

Llama-3-8B attention: one sequence, 32 query heads, 8 KV heads, head_dim 128, bf16, causal. Each available
backend (cuDNN, FlashAttention, memory-efficient) is timed with CUDA events after a warm-up; the median of
--reps is reported with TFLOP/s over the causal cells (4 * d * S (S + 1) / 2 per head), the same count as the
"TFLOP/s mask" column of attention_gpu_bench's dense rows. GQA goes through enable_gqa where the backend takes
it, else K/V are expanded to 32 heads first (marked "expanded", outside the timed region).

  python3 bench/gpu/sdpa_reference.py [--seq 8192,32768,131072] [--reps 5] [--csv FILE]
"""
import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HQ, HKV, D = 32, 8, 128


def time_ms(fn, reps, warmup=1):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", default="8192,32768,131072")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--csv", default="")
    args = ap.parse_args()
    seqs = [int(s) for s in args.seq.split(",") if s]
    dev = torch.cuda.get_device_name(0)
    print(f"device: {dev}; torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    backends = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    rows = []
    for S in seqs:
        g = torch.Generator(device="cuda").manual_seed(S)
        q = torch.randn(1, HQ, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, HKV, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, HKV, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
        flops = 4.0 * D * S * (S + 1) / 2 * HQ
        for name, backend in backends:
            note = "enable_gqa"
            try:
                with sdpa_kernel(backend):
                    fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    ms = time_ms(fn, args.reps)
            except Exception as e1:  # noqa: BLE001 - any backend refusal
                try:
                    ke = k.repeat_interleave(HQ // HKV, dim=1)
                    ve = v.repeat_interleave(HQ // HKV, dim=1)
                    note = "expanded"
                    with sdpa_kernel(backend):
                        fn = lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
                        ms = time_ms(fn, args.reps)
                    del ke, ve
                except Exception as e2:  # noqa: BLE001
                    print(f"  seq {S:6d} {name:9s} unavailable: {str(e1).splitlines()[0][:100]} / "
                          f"{str(e2).splitlines()[0][:100]}")
                    torch.cuda.empty_cache()
                    continue
            tf = flops / (ms * 1e-3) / 1e12
            rows.append((S, name, ms, tf, note))
            print(f"  seq {S:6d} {name:9s} {ms:10.3f} ms  {tf:6.1f} TFLOP/s  ({note})", flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    print("\n| seq | torch SDPA backend | ms | TFLOP/s (causal cells) | GQA |\n|---|---|---|---|---|")
    for S, name, ms, tf, note in rows:
        print(f"| {S} | {name} | {ms:.3f} | {tf:.1f} | {note} |")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("seq,backend,ms,tflops,gqa\n")
            for S, name, ms, tf, note in rows:
                f.write(f"{S},{name},{ms},{tf},{note}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
