#!/usr/bin/env python3
"""The prefix cache on a multi-turn workload (issue 34): a long document, then questions on it, several clients.

    bench/server/prefix_turns.py --tessera BIN --model GGUF [--doc-tokens 6000] [--questions 4] [--clients 3]
                                 [--max-tokens 24] [--kv-budget 2G] [--device cpu] [--serve-args "..."]
                                 [--json-out FILE] [--md-out FILE]

Runs `tessera serve --parallel CLIENTS` twice on the same workload, with the prefix cache (the default) and with
--no-prefix-cache, through OpenAI's official Python client (`openai`), streamed chat completions, greedy:
  workload   every client has its own document (--doc-tokens tokens of numbered facts about made-up towns, sized
             with the server's /tokenize; a different seed per client, so that no client's first turn finds
             another's blocks) and asks --questions questions on it, one chat turn after the other: turn k's
             messages are the document with question 1, the answer, question 2, ... question k. The clients run at
             once (threads), each waiting for its answer before the next turn.
  TTFT       request sent -> first streamed text chunk (queueing in the server included), per turn; first turn
             against the later turns (mean over clients and turns), and their ratio
  cached     usage.prompt_tokens_details.cached_tokens of every turn (streamed usage)
  answers    every turn's answer with the cache equal to the same turn's without it (text)
  memory     /metrics sampled every 0.2 s: the largest tessera_kv_cache_bytes + tessera_prefix_cache_bytes
             (blocks of running requests + blocks only the prefix cache holds) against the KV budget
             (--kv-budget, passed to the server), and the prefix cache's hits, tokens and evictions at the end
Prints a Markdown table (one row per run) and the per-turn figures; --json-out keeps everything.
"""
import argparse
import json
import os
import random
import re
import shlex
import sys
import threading
import time
import urllib.request

try:
    import openai
except ImportError:  # the bench is about what users of the official client see
    sys.exit("prefix_turns.py needs OpenAI's client: run it with build/venv/bin/python (scripts/setup.sh models)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_process import Server, tokenize_count  # noqa: E402

TOWNS = ("Alder Creek", "Bramblefold", "Cinder Hollow", "Dunmere", "Elmstead", "Fallowby", "Greywater", "Hartwell",
         "Ivybridge", "Juniper Flats", "Kestrel Point", "Lowmoor", "Marrowgate", "Northfield", "Oakhurst", "Pinecrest",
         "Quarry Hill", "Redbrook", "Stonehaven", "Thornbury", "Underwood", "Valeport", "Westmarch", "Yarrowdale")
TRADES = ("wool", "salt", "copper", "timber", "cheese", "glass", "rope", "honey", "clay pots", "barley", "ink", "tin")
RIVERS = ("the Sable", "the Wend", "the Corrin", "the Lark", "the Ashby", "the Meade", "the Tolland", "the Brisk")


def paragraph(rng, i):
    town = rng.choice(TOWNS)
    return (f"Record {i}. The town of {town} was founded in the year {rng.randint(1100, 1900)} on the banks of "
            f"{rng.choice(RIVERS)}. Its people trade mostly in {rng.choice(TRADES)}, and its market opens on day "
            f"{rng.randint(1, 28)} of each month. The town council has {rng.randint(3, 40)} members, the old bridge "
            f"is {rng.randint(10, 300)} meters long, and the harvest festival draws about {rng.randint(100, 9000)} "
            f"visitors every autumn. The oldest inn, the {rng.choice(('Red', 'Blue', 'Green', 'Silver', 'Golden'))} "
            f"{rng.choice(('Lion', 'Stag', 'Swan', 'Boar', 'Heron'))}, serves travellers from the coast.")


def document(base_url, seed, target):
    """Paragraphs of facts until the document holds `target` tokens (by the server's tokenizer), and the records'
    facts for the questions."""
    rng = random.Random(seed)
    paras = []
    while True:
        paras.append(paragraph(rng, len(paras) + 1))
        if len(paras) % 8 == 0 and tokenize_count(base_url, "\n".join(paras)) >= target:
            break
    return "\n".join(paras), len(paras)


def questions(seed, records, n):
    rng = random.Random(seed + 1)
    kinds = ("In which year was the town of record {r} founded?", "What do the people of record {r} trade in?",
             "How long is the old bridge of record {r}?", "On which day does the market of record {r} open?",
             "How many members does the council of record {r} have?", "What is the oldest inn of record {r} called?")
    return [kinds[k % len(kinds)].format(r=rng.randint(1, records)) for k in range(n)]


def first_token_logprobs(api, lp):
    """The answer's first token and its most likely alternatives, [(token, logprob), ...] (chosen first)."""
    if api == "chat":
        if not lp.content:
            return None
        e = lp.content[0]
        return [(e.token, e.logprob)] + [(t.token, t.logprob) for t in (e.top_logprobs or [])]
    if not lp.tokens:
        return None
    top = (lp.top_logprobs or [None])[0] or {}
    return [(lp.tokens[0], lp.token_logprobs[0])] + sorted(top.items(), key=lambda kv: -kv[1])


def start(args, extra):
    return Server([args.tessera, "serve", "-m", args.model, "--port", "0", "--device", args.device, "--parallel",
                   str(args.clients), "--kv-budget", args.kv_budget, "--queue", "64", *shlex.split(args.serve_args),
                   *extra])


def run(args, label, extra, docs=None):
    srv = start(args, extra)
    try:
        model_id = json.loads(urllib.request.urlopen(srv.url + "/v1/models", timeout=30).read())["data"][0]["id"]
        if docs is None:
            docs = []
            for c in range(args.clients):
                text, records = document(srv.url, 1000 + c, args.doc_tokens)
                docs.append((text, questions(1000 + c, records, args.questions)))
        peak = {"bytes": 0.0}
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                try:
                    m = srv.metrics()
                    peak["bytes"] = max(peak["bytes"], m.get("tessera_kv_cache_bytes", 0) +
                                        m.get("tessera_prefix_cache_bytes", 0))
                except OSError:
                    pass
                stop.wait(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        turns = [[None] * args.questions for _ in range(args.clients)]
        errors = []
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=3600, max_retries=0)

        def conversation(c):
            doc, qs = docs[c]
            messages = []
            prompt = f"Read the records below, then answer questions about them.\n\n{doc}\n"  # --api completions
            for k, q in enumerate(qs):
                content = (f"Read the records below, then answer questions about them.\n\n{doc}\n\nQuestion: {q}"
                           if k == 0 else f"Question: {q}")
                messages.append({"role": "user", "content": content})
                prompt += f"\nQuestion: {q}\nAnswer:"
                t0 = time.perf_counter()
                ttft, text, usage, first_lp = None, "", None, None
                try:
                    lp = {"logprobs": True, "top_logprobs": args.logprobs} if args.logprobs else {}
                    if args.api == "chat":
                        stream = client.chat.completions.create(
                            model=model_id, messages=messages, max_tokens=args.max_tokens, temperature=0, stream=True,
                            stream_options={"include_usage": True}, **lp)
                    else:  # a base model (no chat template): the conversation as one growing text
                        stream = client.completions.create(
                            model=model_id, prompt=prompt, max_tokens=args.max_tokens, temperature=0, stream=True,
                            stream_options={"include_usage": True},
                            **({"logprobs": args.logprobs} if args.logprobs else {}))
                    for chunk in stream:
                        if chunk.usage:
                            usage = chunk.usage
                        if first_lp is None and chunk.choices and chunk.choices[0].logprobs:
                            first_lp = first_token_logprobs(args.api, chunk.choices[0].logprobs)
                        piece = (chunk.choices[0].delta.content if args.api == "chat" else chunk.choices[0].text) \
                            if chunk.choices else None
                        if piece:
                            if ttft is None:
                                ttft = time.perf_counter() - t0
                            text += piece
                except Exception as e:  # noqa: BLE001 - reported
                    errors.append(f"client {c} turn {k + 1}: {e!r}")
                    return
                cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else None
                turns[c][k] = {"ttft_s": ttft, "answer": text, "prompt_tokens": usage.prompt_tokens if usage else None,
                               "cached_tokens": cached, "first_token_logprobs": first_lp}
                messages.append({"role": "assistant", "content": text})
                prompt += text + "\n"

        t0 = time.perf_counter()
        threads = [threading.Thread(target=conversation, args=(c,)) for c in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        stop.set()
        sampler.join()
        m = srv.metrics()
        peak["bytes"] = max(peak["bytes"], m.get("tessera_kv_cache_bytes", 0) + m.get("tessera_prefix_cache_bytes", 0))
        startup = next((line for line in srv.lines if "KV " in line), "")
    finally:
        srv.stop()
    first = [t[0]["ttft_s"] for t in turns if t[0] and t[0]["ttft_s"] is not None]
    later = [x["ttft_s"] for t in turns for x in t[1:] if x and x["ttft_s"] is not None]
    mean = (lambda v: sum(v) / len(v) if v else float("nan"))
    return docs, {
        "label": label, "command": " ".join(srv.cmd), "startup": startup, "wall_s": wall, "errors": errors,
        "turns": turns, "first_ttft_s": mean(first), "later_ttft_s": mean(later),
        "ratio": mean(later) / mean(first) if first and later else float("nan"),
        "peak_kv_bytes": peak["bytes"], "prefix_hits": m.get("tessera_prefix_cache_hits_total"),
        "prefix_tokens": m.get("tessera_prefix_cache_tokens_total"),
        "prefix_evictions": m.get("tessera_prefix_cache_evictions_total"),
    }


def parse_bytes(s):
    m = re.fullmatch(r"([0-9.]+)\s*([kKmMgG]?)[bB]?", s)
    if not m:
        sys.exit(f"--kv-budget: not a size: {s!r}")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tessera", default="build/ci/src/tessera")
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/tessera/models/smollm2-135m-instruct-q4_1.gguf"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--doc-tokens", type=int, default=6000)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--kv-budget", default="2G")
    ap.add_argument("--serve-args", default="", help="more `tessera serve` flags for both runs")
    ap.add_argument("--no-uncached", action="store_true", help="skip the --no-prefix-cache run")
    ap.add_argument("--api", choices=["chat", "completions"], default="chat",
                    help="chat completions (a model with a chat template), or completions over the conversation as "
                         "one growing text (a base model, e.g. Gemma-3-270M's GGUF)")
    ap.add_argument("--logprobs", type=int, default=5,
                    help="the first answer token's log-probability and its N most likely alternatives, per turn (0: "
                         "not asked); where the two runs' answers differ, both runs' are printed: a near tie of the "
                         "uncached run's alternatives is rounding, a far one a bug")
    ap.add_argument("--json-out")
    ap.add_argument("--md-out")
    args = ap.parse_args()
    budget = parse_bytes(args.kv_budget)

    docs, cached = run(args, "prefix cache", [])
    runs = [cached]
    if not args.no_uncached:
        runs.append(run(args, "--no-prefix-cache", ["--no-prefix-cache"], docs)[1])
    same = None
    if len(runs) == 2:
        pairs = [(a, b) for ta, tb in zip(runs[0]["turns"], runs[1]["turns"]) for a, b in zip(ta, tb) if a and b]
        same = sum(a["answer"] == b["answer"] for a, b in pairs), len(pairs)
    lines = [f"model {os.path.basename(args.model)}, device {args.device}, {args.clients} clients x {args.questions} "
             f"turns, documents of ~{args.doc_tokens} tokens, {args.max_tokens} tokens per answer, KV budget "
             f"{budget / 1e6:.0f} MB",
             "",
             "| run | turn-1 TTFT | turn 2+ TTFT | ratio | cached tokens (turn 2+) | peak KV held | prefix hits / "
             "evictions | wall |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        cached_later = [x["cached_tokens"] or 0 for t in r["turns"] for x in t[1:] if x]
        prompt_later = [x["prompt_tokens"] or 0 for t in r["turns"] for x in t[1:] if x]
        lines.append(f"| {r['label']} | {r['first_ttft_s'] * 1e3:.0f} ms | {r['later_ttft_s'] * 1e3:.0f} ms | "
                     f"{r['ratio'] * 100:.1f}% | {sum(cached_later)} of {sum(prompt_later)} | "
                     f"{r['peak_kv_bytes'] / 1e6:.0f} MB ({'within' if r['peak_kv_bytes'] <= budget else 'OVER'} "
                     f"{budget / 1e6:.0f} MB) | {r['prefix_hits']:.0f} / {r['prefix_evictions']:.0f} | "
                     f"{r['wall_s']:.1f} s |")
    lines.append("")
    for r in runs:
        per_turn = []
        for k in range(args.questions):
            v = [t[k]["ttft_s"] for t in r["turns"] if t[k] and t[k]["ttft_s"] is not None]
            per_turn.append(f"turn {k + 1} {sum(v) / len(v) * 1e3:.0f} ms" if v else f"turn {k + 1} -")
        lines.append(f"{r['label']}: TTFT mean per turn: {', '.join(per_turn)}"
                     + (f"; errors: {r['errors']}" if r["errors"] else ""))
    if same:
        lines.append(f"answers equal with and without the prefix cache: {same[0]} of {same[1]} turns")
        for c, (ta, tb) in enumerate(zip(runs[0]["turns"], runs[1]["turns"])):
            for k, (a, b) in enumerate(zip(ta, tb)):
                if a and b and a["answer"] != b["answer"] and (k == 0 or ta[k - 1]["answer"] == tb[k - 1]["answer"]):
                    fmt = (lambda v: ", ".join(f"{t!r} {p:.3f}" for t, p in v) if v else "-")
                    lines.append(f"client {c} turn {k + 1} (cached {a['cached_tokens']}): first token with the cache "
                                 f"[{fmt(a.get('first_token_logprobs'))}]; without [{fmt(b.get('first_token_logprobs'))}]")
    first = runs[0]["turns"][0][0]
    if first:
        lines.append(f"client 0, turn 1 answer: {first['answer']!r}")
    text = "\n".join(lines)
    print(text)
    if args.md_out:
        with open(args.md_out, "w") as f:
            f.write(text + "\n")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "answers_equal": same}, f, indent=1)
    failed = any(r["errors"] for r in runs) or (same is not None and same[0] != same[1]) or any(
        r["peak_kv_bytes"] > budget for r in runs)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
