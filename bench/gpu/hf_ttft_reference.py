#!/usr/bin/env python3
"""Time to first token of Hugging Face transformers on Llama-3-8B shapes, for comparison with ttft_bench.

A LlamaForCausalLM is built from Llama-3.1-8B's config (the same values as tessera's synthetic "llama3-8b",
src/runtime/cuda/synthetic_config.cpp) with random weights, in bf16 on the GPU, attn_implementation="sdpa";
nothing is downloaded. TTFT is wall time of one forward pass over the prompt (pseudo-random token ids) with the
KV cache built (use_cache=True) and the LM head on the last position only (logits_to_keep=1), from the ids on
the GPU to the last position's logits copied to the host, after one warm-up pass at the smallest length. Each
length runs in a try block: running out of memory is reported as a row, not a crash.

  python3 bench/gpu/hf_ttft_reference.py [--seq 8192,32768,131072] [--reps 1] [--layers N] [--csv FILE]
"""
import argparse
import sys
import time

import torch

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    attention_bias=False,
    hidden_act="silu",
    hidden_size=4096,
    intermediate_size=14336,
    max_position_embeddings=131072,
    num_attention_heads=32,
    num_hidden_layers=32,
    num_key_value_heads=8,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192, rope_type="llama3"),
    tie_word_embeddings=False,
    vocab_size=128256,
)


def build_model(layers):
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(LLAMA3_8B)
    if layers:
        cfg["num_hidden_layers"] = layers
    config = LlamaConfig(**cfg)
    try:
        config._attn_implementation = "sdpa"
    except Exception:  # noqa: BLE001 - older/newer versions spell it differently; the constructor gets it too
        pass
    torch.manual_seed(0)
    t0 = time.time()
    # Built directly in bf16 on the GPU (default dtype and device), whatever the constructor's dtype keyword is
    # called in this transformers version.
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            try:
                model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
            except TypeError:
                model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    if next(model.parameters()).dtype != torch.bfloat16:
        model = model.to(torch.bfloat16)
    model.eval()
    torch.cuda.synchronize()
    params = sum(p.numel() for p in model.parameters())
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; model {params / 1e9:.2f} B "
          f"parameters, bf16, sdpa ({getattr(model.config, '_attn_implementation', '?')}), built in "
          f"{time.time() - t0:.1f} s", flush=True)
    return model


def forward_last_logits(model, ids):
    try:
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    except TypeError:  # transformers < 4.50 names it num_logits_to_keep
        out = model(input_ids=ids, use_cache=True, num_logits_to_keep=1)
    return out.logits[0, -1].float().cpu()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", default="8192,32768,131072")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--csv", default="")
    args = ap.parse_args()
    seqs = [int(s) for s in args.seq.split(",") if s]
    if not torch.cuda.is_available():
        print("hf_ttft_reference: no CUDA device", file=sys.stderr)
        return 1
    dev = torch.cuda.get_device_name(0)
    print(f"device: {dev}", flush=True)
    model = build_model(args.layers)
    g = torch.Generator(device="cpu").manual_seed(1)
    vocab = LLAMA3_8B["vocab_size"]
    rows = []
    with torch.inference_mode():
        warm = torch.randint(0, vocab, (1, min(seqs)), generator=g).cuda()
        forward_last_logits(model, warm)
        torch.cuda.synchronize()
        print("| seq | TTFT s | peak GB | note |\n|---:|---:|---:|---|", flush=True)
        for S in seqs:
            ids_host = torch.randint(0, vocab, (1, S), generator=g)
            best, peak, note = None, 0.0, ""
            try:
                for _ in range(max(1, args.reps)):
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    ids = ids_host.cuda()
                    logits = forward_last_logits(model, ids)
                    t = time.perf_counter() - t0
                    assert torch.isfinite(logits).all()
                    peak = torch.cuda.max_memory_allocated() / 1e9
                    best = t if best is None else min(best, t)
                    del ids, logits
            except torch.cuda.OutOfMemoryError as e:
                note = "out of memory: " + str(e).splitlines()[0][:120]
            except RuntimeError as e:
                note = "error: " + str(e).splitlines()[0][:120]
            torch.cuda.empty_cache()
            ttft = f"{best:.3f}" if best is not None else "-"
            print(f"| {S} | {ttft} | {peak:.1f} | {note} |", flush=True)
            rows.append((S, best, peak, note))
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("device,impl,layers,seq,ttft_s,peak_gb,note\n")
            for S, best, peak, note in rows:
                f.write(f"\"{dev}\",transformers-sdpa,{args.layers or LLAMA3_8B['num_hidden_layers']},{S},"
                        f"{'' if best is None else f'{best:.4f}'},{peak:.2f},\"{note}\"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
