#!/usr/bin/env python3
"""Inter-token latency of decoding clients while a long prompt arrives, with and without a token budget per step.

    bench/server/step_budget.py --tessera BIN --model GGUF [--budgets 0,256] [--decoders 2] [--long-tokens 4000]
                                [--decode-tokens 400] [--device cpu] [--serve-args "..."] [--json-out FILE]

For each budget (0: none, `serve` as before: one --chunk prefill chunk beside every decode step; N: `serve
--step-tokens N`), `tessera serve --parallel DECODERS+1` and, through OpenAI's client (streamed completions, greedy):
  decoders     --decoders clients each stream --decode-tokens tokens from a short prompt
  long prompt  once every decoder has its first tokens, one more client sends a prompt of ~--long-tokens tokens
               (max_tokens 1)
Figures per budget: the decoders' inter-token gaps while the long prompt prefills (its send -> its first token):
p50, p99 and max; the same outside that window (the decode step alone); the long prompt's TTFT.
"""
import argparse
import json
import os
import shlex
import sys
import threading
import time

try:
    import openai
except ImportError:
    sys.exit("step_budget.py needs OpenAI's client: run it with build/venv/bin/python (scripts/setup.sh models)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load import percentile  # noqa: E402
from server_process import Server  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls count the silver stars above an old "
         "stone bridge near the river where children sing songs about distant mountains and golden fields").split()


def start(args, budget):
    cmd = [args.tessera, "serve", "-m", args.model, "--port", "0", "--device", args.device, "--parallel",
           str(args.decoders + 1), "--no-prefix-cache", *shlex.split(args.serve_args)]
    if budget:
        cmd += ["--step-tokens", str(budget)]
    return Server(cmd)


def one_budget(args, budget):
    srv = start(args, budget)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=3600, max_retries=0)
        model = client.models.list().data[0].id
        stamps = [[] for _ in range(args.decoders)]
        window = {}

        def decoder(i):
            for chunk in client.completions.create(model=model, prompt=f"Story {i}: once upon a time",
                                                   max_tokens=args.decode_tokens, temperature=0, stream=True):
                if chunk.choices and chunk.choices[0].text:
                    stamps[i].append(time.perf_counter())

        def long_prompt():
            text = " ".join(WORDS[i % len(WORDS)] for i in range(args.long_tokens))
            window["t0"] = time.perf_counter()
            for chunk in client.completions.create(model=model, prompt=text, max_tokens=1, temperature=0,
                                                   stream=True):
                if chunk.choices and chunk.choices[0].text and "t1" not in window:
                    window["t1"] = time.perf_counter()
            window.setdefault("t1", time.perf_counter())

        threads = [threading.Thread(target=decoder, args=(i,)) for i in range(args.decoders)]
        for t in threads:
            t.start()
        while min(len(s) for s in stamps) < 8:
            time.sleep(0.05)
        lt = threading.Thread(target=long_prompt)
        lt.start()
        lt.join()
        for t in threads:
            t.join()
    finally:
        srv.stop()
    inside, outside = [], []
    for s in stamps:
        for a, b in zip(s, s[1:]):
            (inside if b > window["t0"] and a < window["t1"] else outside).append(b - a)
    return {"budget": budget, "command": " ".join(srv.cmd), "long_ttft_s": window["t1"] - window["t0"],
            "itl_during_p50_s": percentile(inside, 0.5), "itl_during_p99_s": percentile(inside, 0.99),
            "itl_during_max_s": max(inside) if inside else float("nan"), "gaps_during": len(inside),
            "itl_outside_p50_s": percentile(outside, 0.5), "tokens": [len(s) for s in stamps]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tessera", default="build/ci/src/tessera")
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/tessera/models/smollm2-135m-instruct-q4_1.gguf"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--budgets", default="0,256")
    ap.add_argument("--decoders", type=int, default=2)
    ap.add_argument("--long-tokens", type=int, default=4000, help="words of the long prompt (~1 token each)")
    ap.add_argument("--decode-tokens", type=int, default=400)
    ap.add_argument("--serve-args", default="")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    rows = [one_budget(args, int(b)) for b in args.budgets.split(",")]
    print(f"model {os.path.basename(args.model)}, device {args.device}, {args.decoders} decoding clients, a prompt "
          f"of ~{args.long_tokens} tokens arriving")
    print("| --step-tokens | long prompt TTFT | ITL during its prefill p50 / p99 / max | ITL otherwise p50 |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['budget'] or 'none (--chunk 2048)'} | {r['long_ttft_s']:.2f} s | "
              f"{r['itl_during_p50_s'] * 1e3:.0f} / {r['itl_during_p99_s'] * 1e3:.0f} / "
              f"{r['itl_during_max_s'] * 1e3:.0f} ms ({r['gaps_during']} gaps) | {r['itl_outside_p50_s'] * 1e3:.0f} ms |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
