#!/usr/bin/env python3
"""Where a later turn's time to first token goes with the prefix cache (issue 34).

    bench/server/ttft_parts.py --tessera BIN --model GGUF [--doc-tokens 6000] [--turns 5] [--device cpu]
                               [--serve-args "..."] [--json-out FILE]

One `tessera serve --parallel 2` (the batched engine, prefix cache on), one client, one conversation as a growing text
through /v1/completions (bench/server/prefix_turns.py's documents): turn 1 prefills the document; every later turn
adds the previous answer and a question, and finds all but its last ~50-100 tokens in the cache. For each later turn
the same prompt is sent four ways, and /metrics is read around each:
  stream, max_tokens 2   request sent -> first streamed token (what prefix_turns.py measures as TTFT)
  stream, max_tokens 1   the same without the decode step: the engine's step that prefills the prompt also decodes
                         the running requests, the new one included, before it returns the first token's event
  /tokenize              the same text through HTTP, JSON and the tokenizer only (the server's request path before
                         the engine), against /tokenize of a one-word text (HTTP and JSON alone)
  engine                 tessera_engine_prefill_seconds_total's growth over the max_tokens 1 request: prefix match,
                         staging the cached blocks (load_prefix), the tail's forward, paging it (finish_prefill),
                         the first token's sampling
Prints a table of the means over the later turns (the first of them dropped as warm-up), and the turn-1 TTFT.
"""
import argparse
import json
import os
import random
import shlex
import statistics
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_process import Server, tokenize_count  # noqa: E402

TOWNS = ("Alder Creek", "Bramblefold", "Cinder Hollow", "Dunmere", "Elmstead", "Fallowby", "Greywater", "Hartwell",
         "Ivybridge", "Juniper Flats", "Kestrel Point", "Lowmoor", "Marrowgate", "Northfield", "Oakhurst", "Pinecrest")
TRADES = ("wool", "salt", "copper", "timber", "cheese", "glass", "rope", "honey", "clay pots", "barley", "ink", "tin")
RIVERS = ("the Sable", "the Wend", "the Corrin", "the Lark", "the Ashby", "the Meade", "the Tolland", "the Brisk")


def paragraph(rng, i):
    return (f"Record {i}. The town of {rng.choice(TOWNS)} was founded in the year {rng.randint(1100, 1900)} on the "
            f"banks of {rng.choice(RIVERS)}. Its people trade mostly in {rng.choice(TRADES)}, and its market opens "
            f"on day {rng.randint(1, 28)} of each month. The town council has {rng.randint(3, 40)} members, the old "
            f"bridge is {rng.randint(10, 300)} meters long, and the harvest festival draws about "
            f"{rng.randint(100, 9000)} visitors every autumn.")


def post(url, body, timeout=3600):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def timed_tokenize(base, text):
    t0 = time.perf_counter()
    count = tokenize_count(base, text, timeout=3600)
    return time.perf_counter() - t0, count


def settled_metrics(srv):
    """/metrics once the scheduler has counted the last step: the engine's counters are published after the answer
    went out, so read until two reads 0.2 s apart agree."""
    keys = ("tessera_engine_prefill_seconds_total", "tessera_engine_decode_seconds_total", "tessera_engine_steps_total")
    last = srv.metrics(timeout=60)
    for _ in range(50):
        time.sleep(0.2)
        now = srv.metrics(timeout=60)
        if all(now.get(k) == last.get(k) for k in keys):
            return now
        last = now
    return last


def first_token(base, model, prompt, max_tokens):
    """Streamed completion: seconds to the first text chunk, the whole text, cached tokens (usage)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, cached = None, "", None
    with post(base + "/v1/completions", body) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            for c in chunk.get("choices") or []:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text += c.get("text") or ""
    return ttft, text, cached


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tessera", default="build/ci/src/tessera")
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--doc-tokens", type=int, default=6000)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--serve-args", default="")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    cmd = [args.tessera, "serve", "-m", args.model, "--port", "0", "--device", args.device, "--parallel", "2",
           *shlex.split(args.serve_args)]
    srv = Server(cmd)
    base = srv.url
    try:
        model = json.loads(urllib.request.urlopen(base + "/v1/models", timeout=30).read())["data"][0]["id"]
        rng = random.Random(1000)
        paras = []
        while True:
            paras.extend(paragraph(rng, len(paras) + 1) for _ in range(8))
            if timed_tokenize(base, "\n".join(paras))[1] >= args.doc_tokens:
                break
        prompt = "Read the records below, then answer questions about them.\n\n" + "\n".join(paras) + "\n"
        qrng = random.Random(7)
        rows = []
        first = None
        for turn in range(args.turns):
            prompt += f"\nQuestion: In which year was the town of record {qrng.randint(1, len(paras))} founded?\nAnswer:"
            if turn == 0:
                first, answer, _ = first_token(base, model, prompt, args.answer_tokens)
                prompt += answer + "\n"
                continue
            row = {"turn": turn + 1}
            row["tokenize_s"], row["prompt_tokens"] = timed_tokenize(base, prompt)
            row["tokenize_tiny_s"] = timed_tokenize(base, "hello")[0]
            m0 = settled_metrics(srv)
            row["ttft1_s"], _, row["cached"] = first_token(base, model, prompt, 1)
            m1 = settled_metrics(srv)
            row["engine_prefill_s"] = m1["tessera_engine_prefill_seconds_total"] - m0["tessera_engine_prefill_seconds_total"]
            row["engine_decode_s1"] = m1["tessera_engine_decode_seconds_total"] - m0["tessera_engine_decode_seconds_total"]
            row["ttft2_s"], _, _ = first_token(base, model, prompt, 2)
            m2 = settled_metrics(srv)
            row["engine_decode_s2"] = m2["tessera_engine_decode_seconds_total"] - m1["tessera_engine_decode_seconds_total"]
            # The turn's real answer (the conversation goes on with it; its prefix is cached by now).
            _, answer, _ = first_token(base, model, prompt, args.answer_tokens)
            prompt += answer + "\n"
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        srv.stop()
    use = rows[1:] if len(rows) > 1 else rows
    mean = lambda k: statistics.mean(r[k] for r in use) * 1e3  # noqa: E731
    tok = mean("tokenize_s") - mean("tokenize_tiny_s")
    print(f"\nmodel {args.model.split('/')[-1]}, device {args.device}, document ~{args.doc_tokens} tokens; turn-1 TTFT "
          f"{first * 1e3:.0f} ms; later turns {len(use)} (of {len(rows)}; the first dropped), prompts "
          f"{use[0]['prompt_tokens']}-{use[-1]['prompt_tokens']} tokens, cached {use[0]['cached']}-{use[-1]['cached']}")
    print("| part | ms (mean) |\n|---|---:|")
    print(f"| TTFT, streamed, max_tokens 2 (as prefix_turns.py) | {mean('ttft2_s'):.1f} |")
    print(f"| TTFT, streamed, max_tokens 1 (no decode step) | {mean('ttft1_s'):.1f} |")
    print(f"| of which: HTTP + JSON of a one-word /tokenize | {mean('tokenize_tiny_s'):.1f} |")
    print(f"| of which: tokenizing the prompt + its JSON (/tokenize minus the one-word one) | {tok:.1f} |")
    print(f"| of which: engine prefill step (match, load_prefix, tail forward, finish_prefill, sample) | "
          f"{mean('engine_prefill_s'):.1f} |")
    print(f"| of which: the rest (scheduling, detokenizing, SSE) | "
          f"{mean('ttft1_s') - mean('tokenize_tiny_s') - tok - mean('engine_prefill_s'):.1f} |")
    print(f"| the decode step inside max_tokens 2's TTFT (engine decode seconds) | {mean('engine_decode_s2'):.1f} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "command": " ".join(cmd), "turn1_ttft_s": first, "turns": rows}, f, indent=1)


if __name__ == "__main__":
    main()
