#!/usr/bin/env python3
"""Load figures for an OpenAI-compatible server: throughput, time to first token and inter-token latency.

    bench/server/load.py --url http://127.0.0.1:8080 --model NAME --clients 1,4,16 [--requests 4]
                         [--prompt-words 64] [--max-tokens 32] [--label tessera] [--format md|json]
                         [--deadline S] [--json-out FILE] [--csv-out FILE]

Each client is a thread running a closed loop: it sends --requests streamed /v1/completions one after the
other (each waits for the previous answer) and timestamps every SSE chunk that carries text; the clients' threads
are spread over --procs processes (default half the cores), so that one interpreter parsing many streams does not
stamp chunks late. The workload is the same for any server: greedy sampling, prompts of --prompt-words words
(N, or MIN:MAX: log-uniform lengths, drawn per request from its id) of public-domain-like filler with a
per-request number in front (so that no server can reuse another request's prompt cache wholesale), and a
--max-tokens budget. Tokens are counted as text chunks (both tessera and llama.cpp's server send one chunk per
token). Figures per client count:
  tok/s      generated tokens of all clients / wall time of the run
  req/s      completed requests / wall time
  TTFT       request sent -> first text chunk (queueing in the server included), p50 and p99
  ITL        gap between consecutive text chunks of one answer, p50 and p99
(the JSON/CSV rows also carry p90). --deadline caps each client count's time: clients send no request after it
(counted as "not sent"). The open-loop counterpart (requests arriving over time, mixed prompt lengths) is
bench/server/mixed.py.
Only the Python standard library is used, so it runs in any environment.
"""
import argparse
import http.client
import json
import math
import multiprocessing
import os
import queue
import random
import statistics
import sys
import threading
import time
import urllib.parse

WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls count the silver stars above an old "
         "stone bridge near the river where children sing songs about distant mountains and golden fields").split()


def prompt_text(request_id, words):
    body = " ".join(WORDS[(request_id * 7 + i) % len(WORDS)] for i in range(words))
    return f"Note {request_id}: {body}. Continue the story:"


def default_procs(n):
    """Client processes for n concurrent streams: half the machine's cores (the server needs the rest), at most n."""
    return max(1, min(n, (os.cpu_count() or 2) // 2))


def spread(procs, items, work):
    """work(subset) for `items` dealt round-robin to `procs` forked processes (1: in this process, threads only);
    the lists the calls return, concatenated. Each process's threads timestamp their own chunks, so that 32 streams'
    JSON parsing in one interpreter (one GIL) does not delay the stamps: on a fast server a stamp taken late by a
    busy interpreter reads as inter-token latency. time.perf_counter is CLOCK_MONOTONIC, one clock for all."""
    procs = max(1, min(procs, len(items)))
    if procs == 1:
        return work(items)
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    workers = []
    for k in range(procs):
        sub = items[k::procs]
        workers.append(ctx.Process(target=lambda sub=sub: results.put(work(sub)), daemon=True))
        workers[-1].start()
    out, got = [], 0
    while got < len(workers):
        try:
            out.extend(results.get(timeout=1))
            got += 1
        except queue.Empty:
            if not any(w.is_alive() for w in workers) and results.empty():
                raise RuntimeError(f"{len(workers) - got} of {len(workers)} client processes died without results")
    for w in workers:
        w.join()
    return out


def parse_words(spec):
    """--prompt-words: N, or MIN:MAX for prompts of log-uniform lengths (the same draw for a request id)."""
    lo, _, hi = str(spec).partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 0 < lo <= hi:
        raise ValueError(f"--prompt-words wants N or MIN:MAX with 0 < MIN <= MAX, got {spec!r}")
    return lo, hi


def words_for(request_id, words):
    lo, hi = words
    if lo == hi:
        return lo
    rng = random.Random(request_id)
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def percentile(values, q):
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def stream_completion(url, model, prompt, max_tokens, timeout, api_key="", include_usage=False, extra=None):
    """One streamed greedy /v1/completions request: (t0, [perf_counter of every text chunk], usage or None).
    Raises on an HTTP error or an error event in the stream."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    if extra:
        body.update(extra)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = "Bearer " + api_key
    t0 = time.perf_counter()
    stamps = []
    usage = None
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        while True:
            line = r.fp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                stamps.append(time.perf_counter())
    finally:
        conn.close()
    return t0, stamps, usage


def sampling_fields(args, seed):
    """The request's sampling fields: greedy by default; --temperature T (with --top-p) samples, seeded."""
    t = getattr(args, "temperature", 0.0)
    return {"temperature": t, "top_p": args.top_p, "seed": seed} if t > 0 else None


def one_request(url, model, request_id, args):
    words = words_for(request_id, parse_words(args.prompt_words))
    t0, stamps, _ = stream_completion(url, model, prompt_text(request_id, words), args.max_tokens,
                                      args.timeout, args.api_key, extra=sampling_fields(args, request_id))
    return t0, stamps


def run_level(args, clients):
    start = time.perf_counter()

    def run_clients(ids):  # one process's clients, a thread each: [("ok", (t0, stamps)) | ("error", e) | ("skip", k)]
        out = []
        lock = threading.Lock()

        def client(c):
            for k in range(args.requests):
                if args.deadline and time.perf_counter() - start > args.deadline:
                    with lock:
                        out.append(("skip", k))
                    continue
                rid = clients * 100000 + c * 1000 + k
                try:
                    t0, stamps = one_request(args.url, args.model, rid, args)
                    with lock:
                        out.append(("ok", (t0, stamps)))
                except Exception as e:  # noqa: BLE001 - counted and reported
                    with lock:
                        out.append(("error", repr(e)))

        threads = [threading.Thread(target=client, args=(c,)) for c in ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    got = spread(args.procs or default_procs(clients), list(range(clients)), run_clients)
    wall = time.perf_counter() - start
    results = [v for kind, v in got if kind == "ok"]
    errors = [v for kind, v in got if kind == "error"]
    skipped = [v for kind, v in got if kind == "skip"]
    ttft = [s[0] - t0 for t0, s in results if s]
    itl = [b - a for _, s in results for a, b in zip(s, s[1:])]
    tokens = sum(len(s) for _, s in results)
    return {
        "label": args.label, "clients": clients, "requests": len(results), "errors": len(errors),
        "not_sent": len(skipped), "prompt_words": args.prompt_words, "max_tokens": args.max_tokens,
        "tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall, "req_per_s": len(results) / wall,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9), "ttft_p99_s": percentile(ttft, 0.99),
        "itl_p50_s": percentile(itl, 0.5), "itl_p90_s": percentile(itl, 0.9), "itl_p99_s": percentile(itl, 0.99),
        "mean_tokens": statistics.mean(len(s) for _, s in results) if results else 0,
        "first_error": errors[0] if errors else None,
    }


TABLE_HEAD = ("| server | clients | requests | tokens/req | tok/s | req/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def ms(x, digits=0):
    """Seconds as milliseconds for a table; '-' for a missing figure (None, NaN)."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1e3:.{digits}f} ms"


def no_nan(obj):
    """NaN (a percentile of nothing) as null, so that the JSON files are strict JSON."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: no_nan(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [no_nan(v) for v in obj]
    return obj


def table_row(r):
    notes = []
    if r["errors"]:
        notes.append(f"{r['errors']} errors")
    if r.get("not_sent"):
        notes.append(f"{r['not_sent']} not sent: time cap")
    return (f"| {r['label']} | {r['clients']} | {r['requests']}{' (' + ', '.join(notes) + ')' if notes else ''}"
            f" | {r['mean_tokens'] or 0:.1f} | {r['tok_per_s']:.1f} | {r['req_per_s']:.2f}"
            f" | {ms(r['ttft_p50_s'])} | {ms(r['ttft_p99_s'])} | {ms(r['itl_p50_s'], 1)} | {ms(r['itl_p99_s'], 1)} |")


CSV_FIELDS = ["label", "clients", "requests", "errors", "not_sent", "prompt_words", "max_tokens", "tokens", "wall_s",
              "tok_per_s", "req_per_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p90_s",
              "itl_p99_s", "mean_tokens", "first_error"]


def write_rows(rows, json_path=None, csv_path=None):
    """Appends rows to a JSON list file and / or a CSV file (header written when the file is new)."""
    import csv
    import os
    if json_path:
        old = []
        if os.path.exists(json_path):
            with open(json_path) as f:
                old = json.load(f)
        with open(json_path, "w") as f:
            json.dump(no_nan(old + rows), f, indent=1)
    if csv_path:
        new = not os.path.exists(csv_path)
        with open(csv_path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerows(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--prompt-words", default="64",
                   help="words a prompt: N, or MIN:MAX for log-uniform lengths drawn per request (seeded by its id)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0 samples (seeded per request)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--api-key", default="")
    p.add_argument("--label", default="server")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one request may take")
    p.add_argument("--deadline", type=float, default=0,
                   help="seconds per client count after which clients send no further request (0: none)")
    p.add_argument("--warmup", type=int, default=1, help="requests sent (and not counted) before measuring")
    p.add_argument("--procs", type=int, default=0,
                   help="client processes the streams are spread over (0: half the cores, at most one a client; "
                        "1: all in this process's threads)")
    p.add_argument("--format", choices=["md", "json"], default="md")
    p.add_argument("--json-out", help="append the rows to this JSON list file")
    p.add_argument("--csv-out", help="append the rows to this CSV file")
    args = p.parse_args()
    try:
        parse_words(args.prompt_words)
    except ValueError as e:
        p.error(str(e))
    for k in range(args.warmup):
        one_request(args.url, args.model, 999999 - k, args)
    rows = [run_level(args, int(c)) for c in args.clients.split(",")]
    write_rows(rows, args.json_out, args.csv_out)
    if args.format == "json":
        json.dump(no_nan(rows), sys.stdout, indent=1)
        print()
        return
    print(TABLE_HEAD)
    for r in rows:
        print(table_row(r))
    for r in rows:
        if r["first_error"]:
            print(f"{r['label']} x{r['clients']}: first error: {r['first_error']}", file=sys.stderr)


if __name__ == "__main__":
    main()
