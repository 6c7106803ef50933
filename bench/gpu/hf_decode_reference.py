#!/usr/bin/env python3
"""Decode step time of Hugging Face transformers on Llama-3-8B shapes, the reference beside decode_bench.

The model is hf_ttft_reference.py's (Llama-3.1-8B's config, random bf16 weights on the GPU, attn_implementation
"sdpa"; nothing downloaded). Per (context, batch): a prompt of `context` pseudo-random token ids per sequence is
prefilled in one forward pass (not timed) into transformers' own KV cache, then `steps` decode steps are timed: one
forward pass over the batch's B new tokens with the cache, greedy next tokens by argmax on the GPU (no logits copied
to the host: an advantage over decode_bench, which copies them back), synchronised each step. Out of memory is
reported as a row.

  python3 bench/gpu/hf_decode_reference.py [--ctx 8192,32768,131072] [--batch 1,4] [--steps 16] [--layers N] [--csv F]
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_ttft_reference import LLAMA3_8B, build_model  # noqa: E402  (the same model as the TTFT reference)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="8192,32768,131072")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--csv", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("hf_decode_reference: no CUDA device", file=sys.stderr)
        return 1
    dev = torch.cuda.get_device_name(0)
    print(f"device: {dev}", flush=True)
    model = build_model(args.layers)
    vocab = LLAMA3_8B["vocab_size"]
    g = torch.Generator(device="cpu").manual_seed(1)
    rows = []
    print("| context | batch | step ms | tokens/s | peak GB | note |\n|---:|---:|---:|---:|---:|---|", flush=True)
    with torch.inference_mode():
        for S in [int(s) for s in args.ctx.split(",") if s]:
            for B in [int(b) for b in args.batch.split(",") if b]:
                step, peak, note = None, 0.0, ""
                try:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    ids = torch.randint(0, vocab, (B, S), generator=g).cuda()
                    try:
                        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                    except TypeError:
                        out = model(input_ids=ids, use_cache=True, num_logits_to_keep=1)
                    cache = out.past_key_values
                    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                    del out, ids
                    times = []
                    for i in range(args.steps + 2):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                        torch.cuda.synchronize()
                        if i >= 2:  # two warm-up steps
                            times.append(time.perf_counter() - t0)
                        cache = out.past_key_values
                        del out
                    step = sum(times) / len(times)
                    peak = torch.cuda.max_memory_allocated() / 1e9
                    del cache, nxt
                except torch.cuda.OutOfMemoryError as e:
                    note = "out of memory: " + str(e).splitlines()[0][:100]
                except RuntimeError as e:
                    note = "error: " + str(e).splitlines()[0][:100]
                torch.cuda.empty_cache()
                ms = f"{step * 1e3:.2f}" if step else "-"
                tps = f"{B / step:.0f}" if step else "-"
                print(f"| {S} | {B} | {ms} | {tps} | {peak:.1f} | {note} |", flush=True)
                rows.append((S, B, step, peak, note))
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("device,impl,context,batch,step_ms,tokens_per_s,peak_gb,note\n")
            for S, B, step, peak, note in rows:
                f.write(f"\"{dev}\",transformers-sdpa,{S},{B},{'' if not step else f'{step * 1e3:.3f}'},"
                        f"{'' if not step else f'{B / step:.1f}'},{peak:.2f},\"{note}\"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
