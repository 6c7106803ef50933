#!/usr/bin/env python3
"""Open-loop mixed workload for an OpenAI-compatible server (issue 17): N requests with prompt lengths drawn from a
range arrive by a Poisson process; each is streamed; TTFT and inter-token latency percentiles, throughput, errors.

    bench/server/mixed.py --url http://127.0.0.1:8080 --model NAME [--requests 64] [--rate 2]
                          [--min-words 1000] [--max-words 6000] [--dist loguniform|uniform] [--seed 17]
                          [--max-tokens 64] [--deadline S [--grace 30]] [--attn SPEC] [--label tessera]
                          [--json-out FILE] [--csv-out FILE] [--requests-csv FILE] [--format md|json]

Unlike load.py's closed loop (a client waits for its answer before sending the next request), arrivals here do
not wait for the server: request i is sent at its arrival time whatever the server is doing, so a server that
falls behind builds a queue and its TTFT grows. Everything is drawn from --seed (random.Random), so two runs and
two servers see the same requests at the same offsets:
  arrivals   exponential gaps of mean 1 / --rate seconds (a Poisson process), the first at 0
  lengths    prompt words between --min-words and --max-words, log-uniform by default (as many short prompts
             as long ones per factor of length; --dist uniform for a flat draw), filler text as in load.py
             (about one token per word with SmolLM2's and Gemma-3's tokenizers; the real prompt_tokens come
             back in the stream's usage and are reported). The defaults (1K-6K words, 64 tokens out) fit an 8K
             context such as SmolLM2-135M's; a 32K/64K/128K-context model takes --max-words up to 64000.
  requests   streamed greedy /v1/completions of --max-tokens tokens; --attn adds "tessera": {"attn": SPEC}
             (tessera's per-request attention policy; leave it out for other servers or the server's default)
Figures (completed requests; an error, a refusal or an HTTP 429 counts as an error, not in the percentiles):
  TTFT       arrival (= send) -> first text chunk, server queueing included: p50, p90, p99, and p50 / p99 per
             third of the length range (short / mid / long prompts)
  ITL        gaps between consecutive text chunks of one answer, over all answers: p50, p90, p99
  tok/s      generated tokens / makespan (first arrival -> last answer's end); also prompt tokens/s and req/s
--deadline S stops sending at S seconds after the first arrival (later requests count as not sent) and waits
at most --grace (30) s more for the answers in flight (those still running count as unfinished). Standard library
only.
"""
import argparse
import json
import math
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import load  # noqa: E402  (bench/server/load.py: the filler prompt, percentiles, one streamed request)


def draw_workload(n, rate, min_words, max_words, dist, seed):
    """[(arrival offset in s, prompt words)] for n requests: deterministic for a seed."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        if i > 0:
            t += rng.expovariate(rate)
        if dist == "uniform":
            words = rng.randint(min_words, max_words)
        else:
            words = int(round(math.exp(rng.uniform(math.log(min_words), math.log(max_words)))))
        out.append((t, max(1, min(max_words, words))))
    return out


def summarize(args, recs, makespan):
    ok = [r for r in recs if r["status"] == "ok" and r["stamps"]]
    ttft = [r["ttft_s"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["stamps"], r["stamps"][1:])]
    gen = sum(len(r["stamps"]) for r in ok)
    prompt_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    span = max(makespan, 1e-9)
    row = {
        "label": args.label, "requests": len(recs), "completed": len(ok),
        "errors": sum(r["status"] == "error" for r in recs),
        "not_sent": sum(r["status"] == "not sent" for r in recs),
        "unfinished": sum(r["status"] == "unfinished" for r in recs),
        "rate_per_s": args.rate, "min_words": args.min_words, "max_words": args.max_words, "dist": args.dist,
        "seed": args.seed, "max_tokens": args.max_tokens, "attn": args.attn or "",
        "prompt_tokens_mean": prompt_tokens / len(ok) if ok else float("nan"),
        "prompt_tokens_max": max((r["prompt_tokens"] or 0 for r in ok), default=0),
        "gen_tokens": gen, "makespan_s": makespan, "tok_per_s": gen / span,
        "prompt_tok_per_s": prompt_tokens / span, "req_per_s": len(ok) / span,
    }
    for name, vals in (("ttft", ttft), ("itl", itl)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}_s"] = load.percentile(vals, q / 100)
    # TTFT per third of the length range (prompt words): how the long prompts fare against the short ones.
    edges = [args.min_words + (args.max_words - args.min_words) * k / 3 for k in (1, 2)]
    for name, lo, hi in (("short", -1, edges[0]), ("mid", edges[0], edges[1]), ("long", edges[1], math.inf)):
        vals = [r["ttft_s"] for r in ok if lo < r["words"] <= hi]
        row[f"ttft_{name}_n"] = len(vals)
        row[f"ttft_{name}_p50_s"] = load.percentile(vals, 0.5)
        row[f"ttft_{name}_p99_s"] = load.percentile(vals, 0.99)
    errs = [r["error"] for r in recs if r["status"] == "error"]
    row["first_error"] = errs[0] if errs else None
    return row


def run(args):
    work = draw_workload(args.requests, args.rate, args.min_words, args.max_words, args.dist, args.seed)
    extra = dict({"tessera": {"attn": args.attn}} if args.attn else {})
    if args.temperature > 0:  # sampled answers (seeded by the workload seed)
        extra.update({"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed})
    extra = extra or None
    recs = [{"i": i, "arrival_s": a, "words": w, "status": "unfinished", "ttft_s": None, "prompt_tokens": None,
             "stamps": [], "error": None} for i, (a, w) in enumerate(work)]
    start = time.perf_counter()
    # The requests are dealt to --procs processes (load.spread), each sending its own at their arrival times.
    got = load.spread(args.procs or load.default_procs(32), recs, lambda part: run_part(args, part, start, extra))
    snapshot = sorted((r for r, _ in got), key=lambda r: r["i"])
    makespan = max((e for _, e in got if e is not None), default=0.0)
    return snapshot, summarize(args, snapshot, makespan)


def run_part(args, recs, start, extra):
    """Sends `recs` (a thread each, at its arrival offset from `start`): [(record, end offset or None)]."""
    lock = threading.Lock()
    ends = {}

    def one(rec):
        delay = start + rec["arrival_s"] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        if args.deadline and time.perf_counter() - start > args.deadline:
            with lock:
                rec["status"] = "not sent"
            return
        rid = args.seed * 100000 + rec["i"]
        out = {}
        try:
            t0, stamps, usage = load.stream_completion(args.url, args.model, load.prompt_text(rid, rec["words"]),
                                                       args.max_tokens, args.timeout, args.api_key,
                                                       include_usage=True, extra=extra)
            out["stamps"] = [s - t0 for s in stamps]  # relative to this request's send
            out["ttft_s"] = out["stamps"][0] if stamps else None
            out["prompt_tokens"] = (usage or {}).get("prompt_tokens")
            out["status"] = "ok" if stamps else "error"
            if not stamps:
                out["error"] = "no text in the answer"
        except Exception as e:  # noqa: BLE001 - counted and reported
            out = {"status": "error", "error": repr(e)}
        with lock:
            rec.update(out)
            ends[rec["i"]] = time.perf_counter() - start

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in recs]
    for t in threads:
        t.start()
    limit = start + (args.deadline + args.grace if args.deadline else math.inf)
    for t in threads:
        t.join(None if limit == math.inf else max(0.0, limit - time.perf_counter()))
    with lock:  # threads still running leave their record "unfinished"
        return [(dict(r, stamps=list(r["stamps"])), ends.get(r["i"])) for r in recs]


TABLE_HEAD = ("| server | requests | rate/s | prompt tok (mean/max) | tok/s | TTFT p50 | TTFT p90 | TTFT p99 "
              "| TTFT p50 short/mid/long | ITL p50 | ITL p90 | ITL p99 |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def fmt(x, spec):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table_row(r):
    ms = load.ms
    notes = [f"{r[k]} {k.replace('_', ' ')}" for k in ("errors", "not_sent", "unfinished") if r[k]]
    return (f"| {r['label']} | {r['completed']}/{r['requests']}{' (' + ', '.join(notes) + ')' if notes else ''}"
            f" | {r['rate_per_s']:g} | {fmt(r['prompt_tokens_mean'], '.0f')}/{r['prompt_tokens_max']}"
            f" | {r['tok_per_s']:.1f}"
            f" | {ms(r['ttft_p50_s'])} | {ms(r['ttft_p90_s'])} | {ms(r['ttft_p99_s'])}"
            f" | {ms(r['ttft_short_p50_s'])} / {ms(r['ttft_mid_p50_s'])} / {ms(r['ttft_long_p50_s'])}"
            f" | {ms(r['itl_p50_s'], 1)} | {ms(r['itl_p90_s'], 1)} | {ms(r['itl_p99_s'], 1)} |")


def write_outputs(args, recs, row):
    import csv
    if args.json_out:
        old = []
        if os.path.exists(args.json_out):
            with open(args.json_out) as f:
                old = json.load(f)
        with open(args.json_out, "w") as f:
            json.dump(load.no_nan(old + [dict(row, per_request=recs)]), f, indent=1)
    if args.csv_out:
        new = not os.path.exists(args.csv_out)
        with open(args.csv_out, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(row))
            if new:
                w.writeheader()
            w.writerow(row)
    if args.requests_csv:
        new = not os.path.exists(args.requests_csv)
        with open(args.requests_csv, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["label", "i", "arrival_s", "words", "prompt_tokens", "status", "ttft_s", "tokens",
                            "itl_mean_s", "itl_max_s", "end_s", "error"])
            for r in recs:
                s = r["stamps"]
                gaps = [b - a for a, b in zip(s, s[1:])]
                w.writerow([args.label, r["i"], f"{r['arrival_s']:.4f}", r["words"], r["prompt_tokens"], r["status"],
                            "" if r["ttft_s"] is None else f"{r['ttft_s']:.4f}", len(s),
                            f"{sum(gaps) / len(gaps):.5f}" if gaps else "", f"{max(gaps):.5f}" if gaps else "",
                            f"{r['arrival_s'] + s[-1]:.4f}" if s else "", r["error"] or ""])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--min-words", type=int, default=1000)
    p.add_argument("--max-words", type=int, default=6000)
    p.add_argument("--dist", choices=["loguniform", "uniform"], default="loguniform")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0 samples (seeded)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--attn", default="", help='per-request policy: "tessera": {"attn": SPEC} (tessera only)')
    p.add_argument("--api-key", default="")
    p.add_argument("--label", default="server")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one request may take")
    p.add_argument("--deadline", type=float, default=0, help="seconds after which no request is sent (0: none)")
    p.add_argument("--grace", type=float, default=30,
                   help="with --deadline: seconds the answers in flight get after it (then: unfinished)")
    p.add_argument("--warmup", type=int, default=1,
                   help="requests of --max-words words sent one at a time (not counted) before the run")
    p.add_argument("--procs", type=int, default=0,
                   help="client processes the requests are dealt to (0: half the cores, at most 32; 1: threads only)")
    p.add_argument("--format", choices=["md", "json"], default="md")
    p.add_argument("--json-out", help="append the summary (with the per-request records) to this JSON list file")
    p.add_argument("--csv-out", help="append the summary row to this CSV file")
    p.add_argument("--requests-csv", help="append one row per request to this CSV file")
    args = p.parse_args()
    if not (0 < args.min_words <= args.max_words) or args.rate <= 0 or args.requests < 1:
        p.error("need 0 < --min-words <= --max-words, --rate > 0 and --requests >= 1")
    extra = {"tessera": {"attn": args.attn}} if args.attn else None
    for k in range(args.warmup):
        load.stream_completion(args.url, args.model, load.prompt_text(999999 - k, args.max_words), 4, args.timeout,
                               args.api_key, extra=extra)
    recs, row = run(args)
    write_outputs(args, recs, row)
    if args.format == "json":
        json.dump(load.no_nan(row), sys.stdout, indent=1)
        print()
    else:
        print(TABLE_HEAD)
        print(table_row(row))
    if row["first_error"]:
        print(f"{args.label}: first error: {row['first_error']}", file=sys.stderr)


if __name__ == "__main__":
    main()
